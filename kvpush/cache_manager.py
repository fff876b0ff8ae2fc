"""CacheManager: the registry calls (synchronous, no I/O) and the transfer coroutines.

Every transfer runs the same way: validate everything (``validate``, SPEC order) -> compute the
merged runs once (``layout``, numpy) -> per layer one request on the link, at most ``WINDOW``
layers in flight -> each layer bounded by ``sync_kv_timeout`` from the moment it is the oldest
one outstanding -> return when the peer confirmed every layer (remote completion).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import validate as v
from .layout import Runs, block_runs, contiguous_runs, pack_runs, scatter_vector
from .link import Link
from .memory import CacheEntry, CacheRegistry, allocate_regions, region_of
from .pipeline import LayerPusher
from .protocol import Kind
from .remote import PendingOp, RemoteCache
from .status import LLMException, LLMStatusCode, param_invalid
from .types import BlocksCacheKey, Cache, CacheDesc, CacheKeyByIdAndIndex, KvCacheExtParam, check_int

if TYPE_CHECKING:
    from .datadist import LLMDataDist

log = logging.getLogger(__name__)

WINDOW = 2  # layers in flight per transfer: keeps the wire busy across the per-layer round trip


class _TableMiss(Exception):
    """The peer's table as known here lacks the cache; a refresh may find it."""

    def __init__(self, link: Link) -> None:
        super().__init__("cache not in the peer's table")
        self.link = link


@dataclass(frozen=True)
class _Plan:
    """A validated transfer: what moves where, computed once per call."""

    api: str
    kind: Kind  # WRITE (push) or READ (pull)
    link: Link
    local: CacheEntry
    remote: RemoteCache
    local_offset: np.ndarray[Any, Any]
    remote_offset: np.ndarray[Any, Any]
    remote_wire: bytes
    length: np.ndarray[Any, Any]
    steps: list[v.LayerStep]


class CacheManager:
    """Registers caches and moves their blocks. Obtain it from ``LLMDataDist.cache_manager``."""

    def __init__(self, engine: LLMDataDist) -> None:
        self._engine = engine
        self.registry: CacheRegistry = engine.registry

    # -- registration (synchronous) ---------------------------------------------------------------
    def _register(self, api: str, desc: object, addrs: object, is_blocks: bool, model_id: int | None) -> Cache:
        self._engine._require_init(api)
        v.check_type(api, "cache_desc", desc, CacheDesc)
        assert isinstance(desc, CacheDesc)
        v.check_type(api, "addrs", addrs, (list, tuple))
        assert isinstance(addrs, (list, tuple))
        if len(addrs) != desc.num_tensors:
            raise param_invalid(f"{api}: {len(addrs)} addresses given for {desc.num_tensors} tensors")
        regions = [region_of(item, f"addrs[{i}]", desc) for i, item in enumerate(addrs)]
        cache = self.registry.add(desc, regions, is_blocks, model_id)
        self._engine._registry_changed()
        return cache

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                              blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        """Register caller-owned paged memory. ``blocks_cache_key.model_id`` names it for peers."""
        if blocks_cache_key is not None:
            v.check_type("register_blocks_cache", "blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        return self._register("register_blocks_cache", cache_desc, addrs, True, model_id)

    def register_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any], cache_keys: Sequence[Any] = ()) -> Cache:
        """Register caller-owned contiguous memory (``shape[0]`` is the batch dimension)."""
        v.check_type("register_cache", "cache_keys", cache_keys, (list, tuple))
        return self._register("register_cache", cache_desc, addrs, False, None)

    def _allocate(self, api: str, desc: object, is_blocks: bool, model_id: int | None) -> Cache:
        self._engine._require_init(api)
        v.check_type(api, "cache_desc", desc, CacheDesc)
        assert isinstance(desc, CacheDesc)
        if desc.num_tensors < 1 or not desc.shape or min(desc.shape) < 1:
            raise param_invalid(f"{api}: {desc!r} describes no memory")
        mapping, regions = allocate_regions(desc)
        cache = self.registry.add(desc, regions, is_blocks, model_id, mapping)  # on error the mapping is dropped
        self._engine._registry_changed()
        return cache

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        """kvpush-owned, page-aligned, prefaulted paged memory; ``cache.tensors`` are numpy views."""
        if blocks_cache_key is not None:
            v.check_type("allocate_blocks_cache", "blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        return self._allocate("allocate_blocks_cache", cache_desc, True, model_id)

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[Any] = ()) -> Cache:
        """kvpush-owned contiguous memory (``shape[0]`` is the batch dimension), page-aligned and prefaulted."""
        v.check_type("allocate_cache", "cache_keys", cache_keys, (list, tuple))
        return self._allocate("allocate_cache", cache_desc, False, None)

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a cache. Transfers addressing it afterwards fail with LLM_KV_CACHE_NOT_EXIST; memory
        kvpush allocated is released once no transfer in flight still uses it."""
        self._engine._require_init("unregister_cache")
        cache_id = check_int("cache_id", cache_id)
        if self.registry.remove(cache_id) is None:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"unregister_cache: no cache {cache_id}")
        self._engine._registry_changed()

    def deallocate_cache(self, cache: Cache) -> None:
        """Release a cache (allocated or registered); like ``unregister_cache(cache.cache_id)``."""
        v.check_type("deallocate_cache", "cache", cache, Cache)
        self.unregister_cache(cache.cache_id)

    deallocate_blocks_cache = deallocate_cache

    def _local(self, api: str, name: str, cache: Cache) -> CacheEntry:
        entry = self.registry.get(cache.cache_id)
        if entry is None or entry.cache is not cache:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                               f"{api}: {name} (cache {cache.cache_id}) is not registered here")
        return entry

    # -- transfers --------------------------------------------------------------------------------
    async def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache, src_blocks: Sequence[int] = (),
                          dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                          dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """Write local blocks into the peer's blocks cache named by ``dst_cache_key``.

        Returns once every byte of every requested layer is in the peer's memory. Raises before any
        byte moves for bad arguments (TypeError / ValueError / LLMException, SPEC §6 order).

        Timeout: each layer must complete within ``sync_kv_timeout`` of becoming the oldest layer in
        flight, else ``LLMException(LLM_TIMEOUT)`` with ``completed_layers``; layers not yet sent are
        never sent, and bytes of a layer already partly on the wire finish landing in their own
        destination blocks (ordered before any later transfer on the link). The link stays usable.

        Cancellation: no further layer is issued; the task's ``CancelledError`` propagates once no
        byte of this request can still land (a started layer is drained; if it cannot be drained
        within ``sync_kv_timeout`` the link is closed instead).
        """
        api = "push_blocks"
        plan = await self._block_plan(api, Kind.WRITE, dst_cache_key, src_cache, src_blocks, dst_blocks,
                                      src_layer_range, dst_layer_range, tensor_num_per_layer)
        await self._execute(plan)

    async def pull_blocks(self, src_cache_key: BlocksCacheKey, dst_cache: Cache, src_blocks: Sequence[int] = (),
                          dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                          dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """Read the peer's blocks into local ones (one-sided from the caller's view).

        Same checks, timeout and cancellation rules as ``push_blocks``; on timeout or cancellation
        the rest of a layer's incoming bytes is discarded, never written after the exception.
        """
        api = "pull_blocks"
        plan = await self._block_plan(api, Kind.READ, src_cache_key, dst_cache, src_blocks, dst_blocks,
                                      src_layer_range, dst_layer_range, tensor_num_per_layer)
        await self._execute(plan)

    async def _block_plan(self, api: str, kind: Kind, remote_key: object, local_cache: object,
                          src_blocks: object, dst_blocks: object, src_range_arg: object, dst_range_arg: object,
                          n_arg: object, remote_cache_id: int | None = None) -> _Plan:
        """Validate (SPEC order) and plan; one bounded refresh of the peer's table if it lacks the cache."""
        args = (api, kind, remote_key, local_cache, src_blocks, dst_blocks, src_range_arg, dst_range_arg, n_arg,
                remote_cache_id)
        try:
            return self._block_plan_now(*args, final=False)
        except _TableMiss as miss:
            await self._refresh(api, miss.link)
        return self._block_plan_now(*args, final=True)

    def _block_plan_now(self, api: str, kind: Kind, remote_key: object, local_cache: object,
                        src_blocks: object, dst_blocks: object, src_range_arg: object, dst_range_arg: object,
                        n_arg: object, remote_cache_id: int | None = None, final: bool = True) -> _Plan:
        """The synchronous plan from the peer's table as known now (``final``: a miss is
        LLM_KV_CACHE_NOT_EXIST, else ``_TableMiss`` so the caller may refresh and retry)."""
        push = kind == Kind.WRITE
        local_name, remote_name = ("src_cache", "dst_cache_key") if push else ("dst_cache", "src_cache_key")
        self._engine._require_init(api)
        # 1. types
        if remote_cache_id is None:
            v.check_type(api, remote_name, remote_key, BlocksCacheKey)
        v.check_type(api, local_name, local_cache, Cache)
        assert isinstance(local_cache, Cache)
        src = v.check_blocks(api, "src_blocks", src_blocks)
        dst = v.check_blocks(api, "dst_blocks", dst_blocks)
        src_range = v.check_layer_range(api, "src_layer_range", src_range_arg)
        dst_range = v.check_layer_range(api, "dst_layer_range", dst_range_arg)
        n = v.check_tensor_num_type(api, n_arg)
        # 2. the local cache is a blocks cache; 3. block lists
        v.check_blocks_cache(api, local_name, local_cache)
        v.check_block_counts(api, src, dst)
        # 4. N; 5. ranges (the local side now, the remote side once its table is known)
        ranges_given = src_range is not None or dst_range is not None
        local_tensors = local_cache.cache_desc.num_tensors
        v.check_tensor_num(api, n, local_tensors, ranges_given)
        v.check_layer_range_values(api, "src_layer_range", src_range)
        v.check_layer_range_values(api, "dst_layer_range", dst_range)
        local_range = src_range if push else dst_range
        v.check_range_bounds(api, "src_layer_range" if push else "dst_layer_range", local_range, local_tensors, n)
        v.check_range_lengths(api, src_range, dst_range)
        # 6. link; 7. caches
        assert isinstance(remote_key, (BlocksCacheKey, CacheKeyByIdAndIndex))
        link = self._engine._link_for(api, remote_key.cluster_id)
        local = self._local(api, local_name, local_cache)
        if remote_cache_id is None:
            assert isinstance(remote_key, BlocksCacheKey)
            remote = self._lookup(api, link, final, model_id=remote_key.model_id)
        else:
            remote = self._lookup(api, link, final, cache_id=remote_cache_id)
        if not remote.is_blocks_cache:
            raise param_invalid(f"{api}: remote cache {remote.cache_id} is not a blocks cache")
        # 8. block bounds
        local_blocks, remote_blocks = (src, dst) if push else (dst, src)
        local_desc = local.desc
        v.check_block_bounds(api, "src_blocks" if push else "dst_blocks", local_blocks, local_desc.num_blocks, "local")
        v.check_block_bounds(api, "dst_blocks" if push else "src_blocks", remote_blocks, remote.num_blocks, "remote")
        # 9. compatibility (block bytes, dtype, layers) and the remote side of the ranges
        v.check_compatible(api, local_desc.block_bytes, local_desc.data_type, remote.block_bytes,
                           remote.data_type, "block size")
        if ranges_given and remote.num_tensors % n:
            raise param_invalid(f"{api}: tensor_num_per_layer={n} does not divide the remote cache's "
                                f"{remote.num_tensors} tensors")
        remote_range = dst_range if push else src_range
        v.check_range_bounds(api, "dst_layer_range" if push else "src_layer_range", remote_range,
                             remote.num_tensors, n)
        src_tensors, dst_tensors = (local_tensors, remote.num_tensors) if push else (remote.num_tensors, local_tensors)
        steps = v.layer_steps(api, src_tensors, dst_tensors, n, src_range, dst_range)
        # 10. no destination block twice
        v.check_no_duplicates(api, "dst_blocks", dst)
        runs = block_runs(src, dst, local_desc.block_bytes)
        return self._plan(api, kind, link, local, remote, runs, steps)

    @staticmethod
    def _plan(api: str, kind: Kind, link: Link, local: CacheEntry, remote: RemoteCache, runs: Runs,
              steps: list[v.LayerStep]) -> _Plan:
        if kind == Kind.WRITE:
            local_offset, remote_offset = runs.src_offset, runs.dst_offset
        else:
            local_offset, remote_offset = runs.dst_offset, runs.src_offset
        return _Plan(api, kind, link, local, remote, local_offset, remote_offset,
                     pack_runs(remote_offset, runs.length), runs.length, steps)

    def _lookup(self, api: str, link: Link, final: bool, *, model_id: int | None = None,
                cache_id: int | None = None) -> RemoteCache:
        wanted = link.remote_by_model.get(model_id) if model_id is not None else cache_id
        found = None if wanted is None else link.remote_caches.get(wanted)
        if found is not None:
            return found
        if not final:
            raise _TableMiss(link)
        what = f"model_id={model_id}" if model_id is not None else f"cache_id={cache_id}"
        raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                           f"{api}: cluster {link.peer_cluster_id} has no cache with {what}")

    async def _refresh(self, api: str, link: Link) -> None:
        """One round trip for the peer's current table, bounded by ``sync_kv_timeout``."""
        try:
            await asyncio.wait_for(link.refresh_table(), self._engine.options.sync_kv_timeout_ms / 1000)
        except TimeoutError:
            raise LLMException(LLMStatusCode.LLM_TIMEOUT,
                               f"{api}: the peer's cache table did not arrive in time") from None

    async def _remote_cache(self, api: str, link: Link, *, model_id: int | None = None,
                            cache_id: int | None = None) -> RemoteCache:
        """The peer's cache from its table; one bounded refresh round trip when it is not there."""
        try:
            return self._lookup(api, link, False, model_id=model_id, cache_id=cache_id)
        except _TableMiss:
            await self._refresh(api, link)
        return self._lookup(api, link, True, model_id=model_id, cache_id=cache_id)

    def _start(self, plan: _Plan, step: v.LayerStep, budget_ms: int, held: bool = False) -> PendingOp:
        local_first = step.src_first if plan.kind == Kind.WRITE else step.dst_first
        remote_first = step.dst_first if plan.kind == Kind.WRITE else step.src_first
        iov = scatter_vector(plan.local.addrs[local_first:local_first + step.count], plan.local_offset, plan.length)
        if plan.kind == Kind.WRITE:
            return plan.link.start_write(plan.remote, remote_first, step.count, plan.remote_wire, plan.remote_offset,
                                         plan.length, iov, plan.local, budget_ms, held)
        return plan.link.start_read(plan.remote, remote_first, step.count, plan.remote_wire, plan.remote_offset,
                                    plan.length, iov, plan.local, budget_ms)

    async def _execute(self, plan: _Plan) -> None:
        timeout_ms = self._engine.options.sync_kv_timeout_ms
        timeout = timeout_ms / 1000
        completed: list[int] = []
        inflight: collections.deque[tuple[v.LayerStep, PendingOp]] = collections.deque()
        steps = plan.steps
        next_step = 0
        local = plan.local
        if local.removed:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                               f"{plan.api}: local cache {local.cache.cache_id} was released")
        local.pin()  # its memory stays mapped until this call is over, whatever the caller frees meanwhile
        released: int | None = None  # the first layer not issued because the local cache was released
        try:
            while (next_step < len(steps) and released is None) or inflight:
                while next_step < len(steps) and len(inflight) < WINDOW and released is None:
                    step = steps[next_step]
                    if local.removed:  # stop issuing; layers already in flight still finish
                        released = step.dst_layer
                        break
                    try:
                        inflight.append((step, self._start(plan, step, timeout_ms)))
                    except LLMException as refused:
                        raise LLMException(refused.status_code, f"{plan.api}: layer {step.dst_layer}: {refused}",
                                           completed) from None
                    next_step += 1
                if not inflight:
                    break
                step, op = inflight[0]
                done = op.future.done() or bool((await asyncio.wait((op.future,), timeout=timeout))[0])
                if not done:
                    timed_out = LLMException(LLMStatusCode.LLM_TIMEOUT,
                                             f"{plan.api}: layer {step.dst_layer} not done within {timeout_ms} ms",
                                             completed)
                    plan.link.note_failure(timed_out)
                    raise timed_out
                error = op.future.exception()
                if isinstance(error, LLMException):
                    raise LLMException(error.status_code, f"{plan.api}: layer {step.dst_layer}: {error}", completed)
                if error is not None:
                    raise error
                inflight.popleft()
                completed.append(step.dst_layer)
            if released is not None:
                raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                                   f"{plan.api}: local cache {local.cache.cache_id} was released before layer "
                                   f"{released}", completed)
        except asyncio.CancelledError:
            await self._drain(plan.link, [op for _, op in inflight], timeout)
            raise
        except BaseException:
            ops = [op for _, op in inflight]
            for op in ops:
                plan.link.abandon(op)
            # Clean up before reporting: running copies end and started frames finish leaving the
            # source memory (or the link is closed), so nothing reads or writes it after we raise.
            await plan.link.settle(ops, timeout)
            raise
        finally:
            local.unpin()

    @staticmethod
    async def _drain(link: Link, ops: list[PendingOp], timeout: float) -> None:
        """After cancellation: drop what has not started; wait (bounded) for started writes to be
        confirmed so none of their bytes can land later; close the link if that is impossible."""
        landing = [op for op in ops if op.bytes_may_land and not op.future.done()]
        for op in ops:
            if op not in landing:
                link.abandon(op)
        if not landing:
            return
        try:
            _, pending = await asyncio.wait([op.future for op in landing], timeout=timeout)
        except asyncio.CancelledError:
            pending = {op.future for op in landing}
        if pending:
            link.close("a cancelled transfer could not be drained in time", abort=True)
        for op in landing:
            link.abandon(op)
        await link.settle(landing, timeout)

    # -- layer-pipelined pushing ---------------------------------------------------------------------
    def layer_pusher(self, dst_cache_key: BlocksCacheKey, src_cache: Cache, src_blocks: Sequence[int],
                     dst_blocks: Sequence[int], tensor_num_per_layer: int = 2) -> LayerPusher:
        """A pusher bound to one request: ``push_layer(l)`` starts layer ``l`` (source layer l into
        destination layer l) as soon as prefill has computed it. Validates everything now, against the
        peer's cache table as this engine knows it (SPEC order; no round trip), and raises like
        ``push_blocks`` for bad arguments. See ``kvpush.pipeline.LayerPusher``."""
        plan = self._block_plan_now("layer_pusher", Kind.WRITE, dst_cache_key, src_cache, src_blocks, dst_blocks,
                                    None, None, tensor_num_per_layer, final=True)
        return LayerPusher(self, plan)

    # -- contiguous caches --------------------------------------------------------------------------
    async def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                         src_layer_range: range | None = None, dst_layer_range: range | None = None,
                         size: int = -1, tensor_num_per_layer: int = 2) -> None:
        """Write one batch slot per tensor per layer into the peer's cache ``dst_cache_key.cache_id``
        at slot ``dst_cache_key.batch_index``. ``size`` bytes per tensor (-1: the whole slot).
        Timeout and cancellation as in ``push_blocks``."""
        plan = await self._cache_plan("push_cache", Kind.WRITE, dst_cache_key, src_cache, src_batch_index,
                                      dst_layer_range, src_layer_range, size, tensor_num_per_layer)
        await self._execute(plan)

    async def pull_cache(self, src_cache_key: CacheKeyByIdAndIndex, dst_cache: Cache, batch_index: int = 0,
                         size: int = -1, src_layer_range: range | None = None,
                         dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """Read slot ``src_cache_key.batch_index`` of the peer's cache into local slot ``batch_index``.
        Timeout and cancellation as in ``pull_blocks``."""
        plan = await self._cache_plan("pull_cache", Kind.READ, src_cache_key, dst_cache, batch_index,
                                      src_layer_range, dst_layer_range, size, tensor_num_per_layer)
        await self._execute(plan)

    async def _cache_plan(self, api: str, kind: Kind, remote_key: object, local_cache: object, local_index: object,
                          remote_range_arg: object, local_range_arg: object, size: object, n_arg: object) -> _Plan:
        push = kind == Kind.WRITE
        self._engine._require_init(api)
        v.check_type(api, "dst_cache_key" if push else "src_cache_key", remote_key, CacheKeyByIdAndIndex)
        assert isinstance(remote_key, CacheKeyByIdAndIndex)
        v.check_type(api, "src_cache" if push else "dst_cache", local_cache, Cache)
        assert isinstance(local_cache, Cache)
        local_slot = check_int("src_batch_index" if push else "batch_index", local_index)
        size_value = check_int("size", size, -1)
        local_range = v.check_layer_range(api, "local layer range", local_range_arg)
        remote_range = v.check_layer_range(api, "remote layer range", remote_range_arg)
        n = v.check_tensor_num_type(api, n_arg)
        ranges_given = local_range is not None or remote_range is not None
        local_desc = local_cache.cache_desc
        v.check_tensor_num(api, n, local_desc.num_tensors, ranges_given)
        v.check_layer_range_values(api, "local layer range", local_range)
        v.check_layer_range_values(api, "remote layer range", remote_range)
        v.check_range_bounds(api, "local layer range", local_range, local_desc.num_tensors, n)
        v.check_range_lengths(api, local_range, remote_range)
        if size_value == 0:
            raise param_invalid(f"{api}: size must be > 0 or -1")
        link = self._engine._link_for(api, remote_key.cluster_id)
        local = self._local(api, "src_cache" if push else "dst_cache", local_cache)
        remote = await self._remote_cache(api, link, cache_id=remote_key.cache_id)
        local_slot_bytes = local_desc.block_bytes
        remote_slot_bytes = remote.block_bytes
        if local_desc.data_type != remote.data_type:
            raise param_invalid(f"{api}: local dtype {local_desc.data_type.name} differs from remote "
                                f"{remote.data_type.name}")
        length = min(local_slot_bytes, remote_slot_bytes) if size_value == -1 else size_value
        if size_value == -1 and local_slot_bytes != remote_slot_bytes:
            raise param_invalid(f"{api}: slot sizes differ (local {local_slot_bytes}, remote {remote_slot_bytes}); "
                                f"give size")
        if length > local_slot_bytes or length > remote_slot_bytes:
            raise param_invalid(f"{api}: size={length} exceeds a slot (local {local_slot_bytes}, remote "
                                f"{remote_slot_bytes} bytes)")
        if local_slot >= local_desc.num_blocks:
            raise param_invalid(f"{api}: local batch index {local_slot} is out of range: "
                                f"{local_desc.num_blocks} slots")
        if remote_key.batch_index >= remote.num_blocks:
            raise param_invalid(f"{api}: remote batch_index {remote_key.batch_index} is out of range: "
                                f"{remote.num_blocks} slots")
        v.check_range_bounds(api, "remote layer range", remote_range, remote.num_tensors, n)
        src_range, dst_range = (local_range, remote_range) if push else (remote_range, local_range)
        src_tensors, dst_tensors = ((local_desc.num_tensors, remote.num_tensors) if push
                                    else (remote.num_tensors, local_desc.num_tensors))
        steps = v.layer_steps(api, src_tensors, dst_tensors, n, src_range, dst_range)
        local_offset, remote_offset = local_slot * local_slot_bytes, remote_key.batch_index * remote_slot_bytes
        if push:
            runs = contiguous_runs(local_offset, remote_offset, length)
        else:
            runs = contiguous_runs(remote_offset, local_offset, length)
        return self._plan(api, kind, link, local, remote, runs, steps)

    # -- local copy ----------------------------------------------------------------------------------
    async def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, Sequence[int]]) -> None:
        """Copy blocks inside one local cache: ``{src_block: [dst_block, ...]}``, every tensor.
        All sources are read before any destination is written, so chains like {0: [1], 1: [2]} copy
        the original contents."""
        api = "copy_blocks"
        self._engine._require_init(api)
        v.check_type(api, "cache", cache, Cache)
        v.check_type(api, "copy_block_info", copy_block_info, Mapping)
        entry = self._local(api, "cache", cache)
        v.check_blocks_cache(api, "cache", cache)
        pairs_src: list[int] = []
        pairs_dst: list[int] = []
        for src_block, dst_list in copy_block_info.items():
            dsts = v.check_blocks(api, f"copy_block_info[{src_block}]", dst_list)
            pairs_src += [int(src_block)] * len(dsts)
            pairs_dst += [int(d) for d in dsts]
        src = v.check_blocks(api, "source blocks", pairs_src)
        dst = v.check_blocks(api, "destination blocks", pairs_dst)
        if dst.shape[0] == 0:
            raise param_invalid(f"{api}: copy_block_info names no destination block")
        desc = entry.desc
        v.check_block_bounds(api, "source blocks", src, desc.num_blocks, "the")
        v.check_block_bounds(api, "destination blocks", dst, desc.num_blocks, "the")
        v.check_no_duplicates(api, "destination blocks", dst)
        src_index, dst_index = src.astype(np.intp), dst.astype(np.intp)
        entry.pin()
        try:
            for tensor in entry.cache.tensors:
                blocks = tensor.reshape(desc.num_blocks, -1)
                blocks[dst_index] = blocks[src_index]
        finally:
            entry.unpin()

    # -- status-returning forms (C++ PushKvBlocks / PullKvBlocks) ------------------------------------
    async def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheKeyByIdAndIndex,
                             src_blocks: Sequence[int], dst_blocks: Sequence[int],
                             ext_param: KvCacheExtParam | None = None) -> LLMStatusCode:
        """``PushKvBlocks``: like ``push_blocks`` addressed by cache id, returning a status code
        instead of raising. Cancellation still raises ``CancelledError``."""
        return await self._kv_blocks("push_kv_blocks", Kind.WRITE, src_cache, dst_cache_index, src_blocks,
                                     dst_blocks, ext_param)

    async def pull_kv_blocks(self, src_cache_index: CacheKeyByIdAndIndex, dst_cache: Cache,
                             src_blocks: Sequence[int], dst_blocks: Sequence[int],
                             ext_param: KvCacheExtParam | None = None) -> LLMStatusCode:
        """``PullKvBlocks``: like ``pull_blocks`` addressed by cache id, returning a status code."""
        return await self._kv_blocks("pull_kv_blocks", Kind.READ, dst_cache, src_cache_index, src_blocks,
                                     dst_blocks, ext_param)

    async def _kv_blocks(self, api: str, kind: Kind, local_cache: object, remote_index: object,
                         src_blocks: object, dst_blocks: object, ext_param: object) -> LLMStatusCode:
        try:
            ext = KvCacheExtParam() if ext_param is None else ext_param
            v.check_type(api, "ext_param", ext, KvCacheExtParam)
            assert isinstance(ext, KvCacheExtParam)
            v.check_type(api, "cache index", remote_index, CacheKeyByIdAndIndex)
            assert isinstance(remote_index, CacheKeyByIdAndIndex)
            v.check_type(api, "cache", local_cache, Cache)
            assert isinstance(local_cache, Cache)
            if remote_index.batch_index != 0:
                raise param_invalid(f"{api}: cache index batch_index must be 0")
            if len(v.check_blocks(api, "src_blocks", src_blocks)) == 0:
                raise param_invalid(f"{api}: src_blocks is empty")
            n = ext.tensor_num_per_layer
            local_tensors = local_cache.cache_desc.num_tensors
            v.check_tensor_num(api, n, local_tensors, ext.src_layer_range != (-1, -1)
                               or ext.dst_layer_range != (-1, -1))
            local_pair = ext.src_layer_range if kind == Kind.WRITE else ext.dst_layer_range
            remote_pair = ext.dst_layer_range if kind == Kind.WRITE else ext.src_layer_range
            local_range = v.ext_param_range(api, "local layer range", local_pair, local_tensors, n)
            if (remote_pair == (-1, -1)) != (local_pair == (-1, -1)):
                raise param_invalid(f"{api}: give both layer ranges or neither")
            remote_range = None if remote_pair == (-1, -1) else range(remote_pair[0], remote_pair[1] + 1)
            if remote_pair != (-1, -1) and remote_pair[0] > remote_pair[1]:
                raise param_invalid(f"{api}: remote layer range {remote_pair} has first > second")
            src_range, dst_range = (local_range, remote_range) if kind == Kind.WRITE else (remote_range, local_range)
            plan = await self._block_plan(api, kind, remote_index, local_cache, src_blocks, dst_blocks, src_range,
                                          dst_range, n, remote_cache_id=remote_index.cache_id)
            await self._execute(plan)
        except LLMException as error:
            log.info("%s failed: %s", api, error)
            return error.status_code
        except (TypeError, ValueError) as error:
            log.info("%s: bad argument: %s", api, error)
            return LLMStatusCode.LLM_PARAM_INVALID
        return LLMStatusCode.LLM_SUCCESS
