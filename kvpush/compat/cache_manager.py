"""LLM-DataDist's ``CacheManager`` with its blocking signatures, over kvpush's async ``CacheManager``.

Each method checks its arguments as LLM-DataDist does (same error classes), adapts what LLM-DataDist's
defaults mean (below), and runs the engine's call on the engine's loop thread (see ``runner``).
Transfers return when the peer holds every byte (remote completion) or raise; each layer is bounded by
``sync_kv_timeout`` (LLMException(LLM_TIMEOUT) with ``completed_layers``; the link stays usable), and
Ctrl-C stops issuing layers and returns once no byte of the transfer can still land.

LLM-DataDist's defaults, kept:

- ``push_blocks`` / ``push_cache`` without layer ranges move layers ``0 .. num_tensors // N - 1`` of
  ``N = tensor_num_per_layer`` tensors each: a 1-tensor cache with the default N=2 moves nothing, as
  there. ``pull_blocks`` / ``pull_cache`` without layer ranges move every tensor, whatever N.
- ``pull_blocks`` from a ``CacheKey`` or ``CacheKeyByIdAndIndex`` (a batch slot of the peer's contiguous
  cache) into ``dst_blocks`` needs ``src_blocks=[]``: the slot is cut into blocks of the local block
  size, block i into ``dst_blocks[i]``; ``pull_cache`` takes a contiguous local cache.
- cache keys (``allocate_cache`` / ``register_cache``): ``cache_keys[i]`` names batch slot i and reaches
  peers in the engine's cache table; a successful pull of a slot of allocated memory releases its
  request key on the owner, ``remove_cache_key`` releases it there, and ``deallocate_cache`` while keys
  still name slots frees the memory when the last key goes.
- ``deallocate_cache`` refuses a blocks cache and ``deallocate_blocks_cache`` a contiguous one.

Refused by the engine (LLM_FEATURE_NOT_ENABLED, saying so): descriptors whose ``batch_dim_index`` is
not 0 (their slots would be strided).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import kvpush
from kvpush import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    KvCacheExtParam,
    LLMException,
    LLMStatusCode,
)

from . import local_copy
from .checks import (
    block_list,
    check_desc,
    check_n,
    note_remote_accessible,
    pull_layers,
    push_layers,
)
from .transfer_async import (
    TENSORS_PER_LAYER,
    CacheTask,
    LayerSynchronizer,
    TransferConfig,
    TransferWithCacheKeyConfig,
    plan_transfer,
    run_transfer,
)
from .types import CacheKey, MemInfo, Memtype, check_one_id, check_uint, require

if TYPE_CHECKING:
    from .runner import Runner

log = logging.getLogger(__name__)

T = TypeVar("T")


class CacheManager:
    """LLM-DataDist's ``CacheManager``; get it from ``LLMDataDist.cache_manager``."""

    def __init__(self, runner: Callable[[str], Runner]) -> None:
        self._runner = runner
        self._live: dict[int, Cache] = {}  # caches registered through this facade (loop thread only)

    def _call(self, api: str, call: Callable[[kvpush.CacheManager], Coroutine[Any, Any, T]]) -> T:
        runner = self._runner(api)
        return runner.call(api, lambda: call(runner.engine.cache_manager))

    def _sync(self, api: str, call: Callable[[kvpush.CacheManager], T]) -> T:
        runner = self._runner(api)
        return runner.call_sync(api, lambda: call(runner.engine.cache_manager))

    # -- registration -----------------------------------------------------------------------------------
    def _keep(self, cache: Cache) -> Cache:
        self._live[cache.cache_id] = cache
        return cache

    def _forget(self, cache_id: int) -> None:
        self._live.pop(cache_id, None)

    @staticmethod
    def _cache_keys(cache_keys: object) -> list[kvpush.CacheKey]:
        if not isinstance(cache_keys, (list, tuple)):
            raise TypeError(f"cache_keys only support ['tuple', 'list'], but got {type(cache_keys)}.")
        for key in cache_keys:
            if not isinstance(key, kvpush.CacheKey):
                raise TypeError(f"cache_keys inner type only support [{CacheKey}], but got {type(key)}.")
        return list(cache_keys)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """Register caller-owned paged memory: ``addrs`` are int addresses (``tensor.data_ptr()``; the
        caller keeps that memory alive and large enough) or CPU arrays/tensors. ``blocks_cache_key``'s
        ``model_id`` names it for peers. ``remote_accessible``: see ``register_cache``."""
        api = "register_blocks_cache"
        self._runner(api)  # before any check: not inside an event loop, initialised
        check_desc(api, cache_desc)
        note_remote_accessible(api, remote_accessible)
        return self._sync(api, lambda cm: self._keep(cm.register_blocks_cache(cache_desc, addrs, blocks_cache_key)))

    def register_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any], cache_keys: Sequence[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache:
        """Register caller-owned contiguous memory (``shape[0]`` is the batch dimension); ``cache_keys[i]``
        names batch slot i. ``remote_accessible`` is accepted for compatibility: in kvpush every
        registered cache can be addressed by linked peers (``llm.EnableRemoteCacheAccessible=0`` turns
        that off per engine)."""
        api = "register_cache"
        self._runner(api)  # before any check: not inside an event loop, initialised
        check_desc(api, cache_desc)
        keys = self._cache_keys(cache_keys)
        note_remote_accessible(api, remote_accessible)
        return self._sync(api, lambda cm: self._keep(cm.register_cache(cache_desc, addrs, keys)))

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        """kvpush-owned page-aligned paged memory; ``cache.tensors`` are numpy views of it."""
        api = "allocate_blocks_cache"
        self._runner(api)  # before any check: not inside an event loop, initialised
        check_desc(api, cache_desc)
        return self._sync(api, lambda cm: self._keep(cm.allocate_blocks_cache(cache_desc, blocks_cache_key)))

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """kvpush-owned contiguous memory; ``cache_keys[i]`` names batch slot i for peers (a placeholder key,
        ``req_id=2**64-1``, leaves its slot unnamed); ``cache.tensors`` are numpy views of it. As in
        LLM-DataDist a peer's successful pull of a slot releases its request key, and ``deallocate_cache``
        while keys still name slots frees the memory only when the last key goes."""
        api = "allocate_cache"
        self._runner(api)  # before any check: not inside an event loop, initialised
        check_desc(api, cache_desc)
        keys = self._cache_keys(cache_keys)
        return self._sync(api, lambda cm: self._keep(cm.allocate_cache(cache_desc, keys)))

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a cache; transfers addressing it afterwards fail with LLM_KV_CACHE_NOT_EXIST."""
        def unregister(cm: kvpush.CacheManager) -> None:
            cm.unregister_cache(cache_id)
            self._forget(cache_id)

        self._sync("unregister_cache", unregister)

    def _release(self, api: str, cache: Cache, blocks: bool) -> None:
        self._runner(api)
        if not isinstance(cache, Cache):
            raise TypeError(f"cache only support ['Cache'], but got {type(cache)}.")
        require(cache.is_blocks_cache == blocks, f"param check failed, cache {'should' if blocks else 'can not'} "
                                                 f"be blocks cache.")

        def release(cm: kvpush.CacheManager) -> None:
            cm.deallocate_cache(cache)
            self._forget(cache.cache_id)

        self._sync(api, release)

    def deallocate_cache(self, cache: Cache) -> None:
        """Release a contiguous cache (and its cache keys); kvpush-owned memory is unmapped once no
        transfer uses it."""
        self._release("deallocate_cache", cache, blocks=False)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Release a blocks cache."""
        self._release("deallocate_blocks_cache", cache, blocks=True)

    def remove_cache_key(self, cache_key: kvpush.CacheKey) -> None:
        """The slot ``cache_key`` named is no longer named by it, here and (with this engine's next cache
        table) for peers; a no-op when it no longer was (pulled, or removed before)."""
        self._runner("remove_cache_key")
        if not isinstance(cache_key, kvpush.CacheKey):
            raise TypeError(f"cache_key only support ['CacheKey'], but got {type(cache_key)}.")
        self._sync("remove_cache_key", lambda cm: cm.remove_cache_key(cache_key))

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """After a device memory fault LLM-DataDist re-registers the physical pages with the NIC. Host
        memory registered with kvpush stays mapped, so there is nothing to redo: the ranges are checked
        (as LLM-DataDist checks them, and that they lie in memory registered here) and the call returns."""
        self._runner("remap_registered_memory")
        require(isinstance(mem_infos, (list, MemInfo)),
                f"mem_infos type only support list of MemInfo or MemInfo, but got {type(mem_infos)}.")
        infos = mem_infos if isinstance(mem_infos, list) else [mem_infos]
        for i, info in enumerate(infos):
            require(isinstance(info, MemInfo), f"mem_infos[{i}] type only support MemInfo, but got {type(info)}.")
            require(info.mem_type == Memtype.MEM_TYPE_DEVICE,
                    f"check mem_info.mem_type failed, only support Memtype.MEM_TYPE_DEVICE, index={i}.")
            require(info.addr != 0, f"check mem_info.addr failed, addr can not be zero, index={i}.")
            require(info.size > 0, f"check mem_info.size failed, size must be > 0, index={i}.")

        def check(cm: kvpush.CacheManager) -> None:
            spans = [(addr, addr + cache.cache_desc.size) for cache in self._live.values()
                     for addr in cache.tensor_addrs]
            for i, info in enumerate(infos):
                require(any(start <= info.addr and info.addr + info.size <= end for start, end in spans),
                        f"remap_registered_memory: mem_infos[{i}] ({info.addr:#x}, {info.size} bytes) is not in "
                        f"memory registered with this engine")
            log.info("remap_registered_memory: %d range(s) checked; host memory stays mapped, nothing to remap",
                     len(infos))

        self._sync("remap_registered_memory", check)

    # -- local copies -----------------------------------------------------------------------------------
    def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, Sequence[int]]) -> None:
        """Copy blocks inside one local cache: ``{src_block: [dst_block, ...]}``, every tensor. All
        sources are read before any destination is written. No I/O, no timeout."""
        self._call("copy_blocks", lambda cm: cm.copy_blocks(cache, copy_block_info))

    def _local(self, api: str, name: str, cache: object) -> Cache:
        """A cache this facade registered and has not released, or one from ``Cache.create_cpu_cache``."""
        if not isinstance(cache, Cache):
            raise TypeError(f"{name} only support ['Cache'], but got {type(cache)}.")
        if cache.cache_id >= 0 and self._live.get(cache.cache_id) is not cache:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"{api}: {name} (cache {cache.cache_id}) is "
                                                                     f"not registered here")
        return cache

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """Copy blocks between a DEVICE and a HOST blocks cache (swap out or in): ``{src_block: dst_block}``,
        every tensor. On this host both are host memory: one vectorised copy per tensor."""
        api = "swap_blocks"
        self._runner(api)  # before any check: not inside an event loop, initialised
        plan = local_copy.swap_plan(self._local(api, "src", src_cache), self._local(api, "dst", dst_cache),
                                    src_to_dst)
        self._sync(api, lambda cm: local_copy.run(api, self._still_local(api, plan)))

    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: int | None = None) -> None:
        """Copy ``size`` bytes (-1: the rest of the slot) at ``offset`` of batch slot ``src_batch_index`` of
        every tensor of ``src`` into slot ``dst_batch_index`` of ``dst`` (both local contiguous caches).
        ``req_id`` only labels the log line."""
        api = "copy_cache"
        self._runner(api)  # before any check: not inside an event loop, initialised
        plan = local_copy.copy_cache_plan(self._local(api, "dst", dst), self._local(api, "src", src),
                                          dst_batch_index, src_batch_index, offset, size, req_id)
        self._sync(api, lambda cm: local_copy.run(api, self._still_local(api, plan)))

    def _still_local(self, api: str, plan: local_copy.CopyPlan) -> local_copy.CopyPlan:
        """On the loop thread, right before copying: neither cache was released meanwhile."""
        self._local(api, "src", plan.src)
        self._local(api, "dst", plan.dst)
        return plan

    # -- transfers --------------------------------------------------------------------------------------
    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache, src_blocks: Sequence[int] = (),
                    dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = TENSORS_PER_LAYER) -> None:
        """Write local ``src_blocks`` into the peer's ``dst_blocks``; returns when the peer holds every
        byte. Layers as in LLM-DataDist (module docstring); checks before any byte moves."""
        api = "push_blocks"
        self._runner(api)  # before any check: not inside an event loop, initialised
        n = check_n(api, tensor_num_per_layer)
        if not isinstance(src_cache, Cache):
            raise TypeError(f"src_cache only support ['Cache'], but got {type(src_cache)}.")
        layers = push_layers(api, src_cache.cache_desc.num_tensors, src_layer_range, dst_layer_range, n)
        if layers is None:
            return
        src_range, dst_range, n = layers
        self._call(api, lambda cm: cm.push_blocks(dst_cache_key, src_cache, src_blocks, dst_blocks, src_range,
                                                  dst_range, n))

    def pull_blocks(self, src_cache_key: BlocksCacheKey | CacheKeyByIdAndIndex | CacheKey, dst_cache: Cache,
                    src_blocks: Sequence[int] = (), dst_blocks: Sequence[int] = (),
                    src_layer_range: range | None = None, dst_layer_range: range | None = None,
                    tensor_num_per_layer: int = TENSORS_PER_LAYER) -> None:
        """Read the peer's ``src_blocks`` (a blocks cache) or one batch slot of its contiguous cache
        (``CacheKey`` or ``CacheKeyByIdAndIndex``, ``src_blocks=[]``: block i of the slot into
        ``dst_blocks[i]``) into local ``dst_blocks``; returns when every byte is here (a slot's request key
        is then released on the peer, as by ``pull_cache``). After a timeout or an interrupt the rest of
        the incoming bytes is discarded."""
        api = "pull_blocks"
        self._runner(api)  # before any check: not inside an event loop, initialised
        if not isinstance(src_cache_key, (kvpush.CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)):
            raise TypeError(f"src_cache_key only support ['CacheKey', 'CacheKeyByIdAndIndex', 'BlocksCacheKey'], "
                            f"but got {type(src_cache_key)}.")
        if not isinstance(dst_cache, Cache):
            raise TypeError(f"dst_cache only support ['Cache'], but got {type(dst_cache)}.")
        sources, targets = block_list("src_blocks", src_blocks), block_list("dst_blocks", dst_blocks)
        require(dst_cache.is_blocks_cache, "param check failed, dst_cache should be blocks cache.")
        require(len(targets) > 0, "dst_blocks can not be empty.")
        n = check_n(api, tensor_num_per_layer)
        src_range, dst_range, n = pull_layers(dst_cache.cache_desc.num_tensors, src_layer_range, dst_layer_range, n)
        if isinstance(src_cache_key, BlocksCacheKey):
            require(len(sources) > 0, "src_blocks can not be empty.")
        else:
            if isinstance(src_cache_key, kvpush.CacheKey):
                check_one_id(src_cache_key)
            require(len(sources) == 0,
                    "src_blocks should be empty when src_cache_key is not instance of BlocksCacheKey.")
        self._call(api, lambda cm: cm.pull_blocks(src_cache_key, dst_cache, sources, targets, src_range, dst_range,
                                                  n))

    def pull_cache(self, cache_key: CacheKeyByIdAndIndex | CacheKey, cache: Cache, batch_index: int = 0,
                   size: int = -1, src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   tensor_num_per_layer: int = TENSORS_PER_LAYER) -> None:
        """Contiguous caches: read the peer's slot (``cache_key``) into local slot ``batch_index``
        (``size`` bytes per tensor, -1: all). Timeout and Ctrl-C as in ``pull_blocks``."""
        api = "pull_cache"
        self._runner(api)  # before any check: not inside an event loop, initialised
        if not isinstance(cache_key, (kvpush.CacheKey, CacheKeyByIdAndIndex)):
            raise TypeError(f"cache_key only support ['CacheKey', 'CacheKeyByIdAndIndex'], but got {type(cache_key)}.")
        if not isinstance(cache, Cache):
            raise TypeError(f"cache only support ['Cache'], but got {type(cache)}.")
        check_uint("batch_index", batch_index, 32)
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size only support ['int'], but got {type(size)}.")
        require(not cache.is_blocks_cache, "param check failed, cache can not be blocks cache.")
        require(size == -1 or size > 0, f"[pull_cache] param check failed, size ({size}) is invalid, should be = -1 "
                                        f"or > 0")
        n = check_n(api, tensor_num_per_layer)
        src_range, dst_range, n = pull_layers(cache.cache_desc.num_tensors, src_layer_range, dst_layer_range, n)
        if isinstance(cache_key, kvpush.CacheKey):
            check_one_id(cache_key)
        self._call(api, lambda cm: cm.pull_cache(cache_key, cache, batch_index, size, src_range, dst_range, n))

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None, size: int = -1,
                   tensor_num_per_layer: int = TENSORS_PER_LAYER) -> None:
        """Contiguous caches: write local slot ``src_batch_index`` into the peer's slot ``dst_cache_key``.
        Layers as in LLM-DataDist; ``size`` must be -1 (the whole slot), as there."""
        api = "push_cache"
        self._runner(api)  # before any check: not inside an event loop, initialised
        if not isinstance(dst_cache_key, CacheKeyByIdAndIndex):
            raise TypeError(f"dst_cache_key only support ['CacheKeyByIdAndIndex'], but got {type(dst_cache_key)}.")
        if not isinstance(src_cache, Cache):
            raise TypeError(f"src_cache only support ['Cache'], but got {type(src_cache)}.")
        check_uint("src_batch_index", src_batch_index, 32)
        require(not src_cache.is_blocks_cache, "param check failed, cache can not be blocks cache.")
        n = check_n(api, tensor_num_per_layer)
        layers = push_layers(api, src_cache.cache_desc.num_tensors, src_layer_range, dst_layer_range, n)
        require(size == -1, f"[push_cache] param check failed, size ({size}) is invalid, should be = -1.")
        if layers is None:
            return
        src_range, dst_range, n = layers
        self._call(api, lambda cm: cm.push_cache(dst_cache_key, src_cache, src_batch_index, src_range, dst_range,
                                                 -1, n))

    def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheKeyByIdAndIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> LLMStatusCode:
        """The C++ ``PushKvBlocks``: like ``push_blocks`` addressed by the peer's cache id, returning a
        status code instead of raising; Ctrl-C still raises."""
        return self._call("push_kv_blocks", lambda cm: cm.push_kv_blocks(src_cache, dst_cache_index, src_blocks,
                                                                          dst_blocks, ext_param))

    def pull_kv_blocks(self, src_cache_index: CacheKeyByIdAndIndex, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> LLMStatusCode:
        """The C++ ``PullKvBlocks``: like ``pull_blocks`` addressed by cache id, returning a status code."""
        return self._call("pull_kv_blocks", lambda cm: cm.pull_kv_blocks(src_cache_index, dst_cache, src_blocks,
                                                                          dst_blocks, ext_param))

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferWithCacheKeyConfig | TransferConfig],
                             src_block_indices: Sequence[int] | None = None,
                             dst_block_indices: Sequence[int] | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """LLM-DataDist's layer-synchronised transfer (see ``transfer_async``): layer l of every config
        starts the moment ``layer_synchronizer`` says layer l is computed. Checks the arguments as
        LLM-DataDist does, then returns at once; transfer failures arrive as status codes in the task."""
        api = "transfer_cache_async"
        runner = self._runner(api)
        plan = plan_transfer(src_cache, layer_synchronizer, transfer_configs, src_block_indices, dst_block_indices,
                             dst_block_memory_size)
        future = runner.submit(api, run_transfer(lambda: runner.engine.cache_manager, plan))
        return CacheTask(future, [config.dst_cluster_id for config in plan.configs])


