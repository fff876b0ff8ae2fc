"""CacheManager: the registry calls (synchronous, no I/O) and the transfer coroutines.

A thin facade: every transfer is planned (``kvpush.plan``: validate in SPEC order, then the layout,
once) and run (``kvpush.transfer``: per layer one request on the link, at most ``WINDOW`` layers in
flight, each bounded by ``sync_kv_timeout`` from the moment it is the oldest one outstanding, return
when the peer confirmed every layer). What it needs of its engine is handed in (``EngineServices``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from . import plan as planning
from . import transfer
from . import validate as v
from .access import BlockAccess
from .link import Link
from .memory import CacheEntry, CacheRegistry, allocate_regions, region_of
from .notify import NOTIFICATION, check_notify
from .options import EngineOptions
from .peer import RemoteCache
from .pipeline import LayerPusher
from .protocol import KeyRelease, Kind
from .status import LLMException, LLMStatusCode, param_invalid
from .types import (
    REQUEST_KEY,
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCacheExtParam,
    RemoteAccess,
    check_int,
)

log = logging.getLogger(__name__)

# bound once: this runs on every transfer, and an attribute of an enum class is looked up anew on each use
_WRITE, _READ = Kind.WRITE, Kind.READ


class EngineServices(Protocol):
    """What a CacheManager needs of its engine (``kvpush.datadist.LLMDataDist`` provides it)."""

    registry: CacheRegistry

    @property
    def options(self) -> EngineOptions: ...

    def require_init(self, api: str) -> None:
        """RuntimeError before ``init``; LLM_ENGINE_FINALIZED after ``finalize``."""

    def link_for(self, api: str, cluster_id: int) -> Link:
        """The ready link to ``cluster_id``, else LLMException(LLM_NOT_YET_LINK)."""

    def registry_changed(self) -> None:
        """The registry changed: tell every peer."""


class CacheManager:
    """Registers caches and moves their blocks. Obtain it from ``LLMDataDist.cache_manager``."""

    def __init__(self, engine: EngineServices) -> None:
        self._engine = engine
        self.registry: CacheRegistry = engine.registry

    # -- registration (synchronous) ---------------------------------------------------------------
    def _register(self, api: str, desc: object, addrs: object, is_blocks: bool, model_id: int | None,
                  cache_keys: Sequence[CacheKey] = (), access: object = RemoteAccess.OPEN) -> Cache:
        self._engine.require_init(api)
        v.check_type(api, "remote_access", access, RemoteAccess)
        assert isinstance(access, RemoteAccess)
        v.check_type(api, "cache_desc", desc, CacheDesc)
        assert isinstance(desc, CacheDesc)
        v.check_type(api, "addrs", addrs, (list, tuple))
        assert isinstance(addrs, (list, tuple))
        v.check_batch_dim(api, desc)
        if len(addrs) != desc.num_tensors:
            raise param_invalid(f"{api}: {len(addrs)} addresses given for {desc.num_tensors} tensors")
        regions = [region_of(item, f"addrs[{i}]", desc) for i, item in enumerate(addrs)]
        cache = self.registry.add(desc, regions, is_blocks, model_id, cache_keys=cache_keys, access=access)
        self._engine.registry_changed()
        return cache

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                              blocks_cache_key: BlocksCacheKey | None = None, *,
                              remote_access: RemoteAccess = RemoteAccess.OPEN) -> Cache:
        """Register caller-owned paged memory. ``blocks_cache_key.model_id`` names it for peers;
        ``remote_access`` says what they may do with it (see ``RemoteAccess``; ``allow`` grants blocks)."""
        if blocks_cache_key is not None:
            v.check_type("register_blocks_cache", "blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        return self._register("register_blocks_cache", cache_desc, addrs, True, model_id, access=remote_access)

    def register_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                       cache_keys: Sequence[CacheKey] = (), *,
                       remote_access: RemoteAccess = RemoteAccess.OPEN) -> Cache:
        """Register caller-owned contiguous memory (``shape[0]`` is the batch dimension). ``cache_keys[i]``
        names batch slot i for peers (``pull_cache`` / ``pull_blocks`` by ``CacheKey``); see
        ``allocate_cache``. The keys of caller-owned memory stay until ``remove_cache_key``."""
        v.check_type("register_cache", "cache_keys", cache_keys, (list, tuple))
        return self._register("register_cache", cache_desc, addrs, False, None, cache_keys, remote_access)

    def _allocate(self, api: str, desc: object, is_blocks: bool, model_id: int | None,
                  cache_keys: Sequence[CacheKey] = (), access: object = RemoteAccess.OPEN) -> Cache:
        self._engine.require_init(api)
        v.check_type(api, "remote_access", access, RemoteAccess)
        assert isinstance(access, RemoteAccess)
        v.check_type(api, "cache_desc", desc, CacheDesc)
        assert isinstance(desc, CacheDesc)
        v.check_batch_dim(api, desc)
        if desc.num_tensors < 1 or not desc.shape or min(desc.shape) < 1:
            raise param_invalid(f"{api}: {desc!r} describes no memory")
        mapping, regions = allocate_regions(desc)
        cache = self.registry.add(desc, regions, is_blocks, model_id, mapping,  # on error the mapping is dropped
                                  cache_keys=cache_keys, access=access)
        self._engine.registry_changed()
        return cache

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None, *,
                              remote_access: RemoteAccess = RemoteAccess.OPEN) -> Cache:
        """kvpush-owned, page-aligned, prefaulted paged memory; ``cache.tensors`` are numpy views."""
        if blocks_cache_key is not None:
            v.check_type("allocate_blocks_cache", "blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        return self._allocate("allocate_blocks_cache", cache_desc, True, model_id, access=remote_access)

    def allow(self, cache: Cache, peer_cluster_id: int, blocks: Sequence[int] | np.ndarray[Any, Any], *,
              write: bool = True,
              read: bool = False) -> BlockAccess:
        """Grant the linked peer ``peer_cluster_id`` access to ``blocks`` of ``cache`` (registered with
        ``RemoteAccess.GRANTED``): to write them (``write``), read them (``read``), or both, every tensor of
        those blocks. Synchronous: requests the peer makes from now on are checked against it on arrival.
        The grant ends with ``BlockAccess.revoke()``, the link to that peer closing, or the cache going.
        TypeError / ValueError / LLM_PARAM_INVALID for a bad argument (nothing is granted then)."""
        api = "allow"
        self._engine.require_init(api)
        v.check_type(api, "cache", cache, Cache)
        peer = check_int("peer_cluster_id", peer_cluster_id)
        ids = v.check_blocks(api, "blocks", list(blocks) if isinstance(blocks, range) else blocks)
        entry = self.registry.get(cache.cache_id)
        if entry is None or entry.cache is not cache:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"{api}: cache {cache.cache_id} is not registered")
        if entry.access is not RemoteAccess.GRANTED:
            raise param_invalid(f"{api}: cache {cache.cache_id} was registered with remote_access="
                                f"{entry.access.name}; grants apply to RemoteAccess.GRANTED caches only")
        if not (write or read):
            raise param_invalid(f"{api}: grants neither writing nor reading")
        if not len(ids):
            raise param_invalid(f"{api}: blocks is empty")
        v.check_block_bounds(api, "blocks", ids, entry.num_blocks, "the")
        return BlockAccess(entry.grants, entry.cache.cache_id, peer, ids.array().astype(np.int64), (write, read),
                           lambda: entry.removed)

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """kvpush-owned contiguous memory (``shape[0]`` is the batch dimension), page-aligned and prefaulted.

        ``cache_keys[i]`` names batch slot i for peers, as in LLM-DataDist: at most one key per slot, a
        placeholder key (neither req_id nor prefix_id) leaves its slot unnamed, a key already naming a
        slot here is LLM_PARAM_INVALID. A peer's successful pull of a whole slot by its request key (or
        by ``CacheKeyByIdAndIndex`` at that slot) releases the key; ``remove_cache_key`` releases it
        here. ``deallocate_cache`` while keys still name slots lets go of the cache id at once and of the
        memory when the last key goes (peers may still pull those slots until then)."""
        v.check_type("allocate_cache", "cache_keys", cache_keys, (list, tuple))
        return self._allocate("allocate_cache", cache_desc, False, None, cache_keys)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """The slot ``cache_key`` names (its cluster id is ignored) is no longer named by it; peers see it
        in this engine's next cache table. A no-op when the key names nothing (already pulled or removed),
        as in LLM-DataDist. A cache ``deallocate_cache`` let go of goes with its last key."""
        api = "remove_cache_key"
        self._engine.require_init(api)
        v.check_type(api, "cache_key", cache_key, CacheKey)
        if self.registry.remove_key(cache_key.name()):
            self._engine.registry_changed()

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a cache (and the cache keys naming its slots). Transfers addressing it afterwards fail
        with LLM_KV_CACHE_NOT_EXIST; memory kvpush allocated is released once no transfer in flight still
        uses it."""
        self._engine.require_init("unregister_cache")
        cache_id = check_int("cache_id", cache_id)
        if self.registry.remove(cache_id) is None:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"unregister_cache: no cache {cache_id}")
        self._engine.registry_changed()

    def deallocate_cache(self, cache: Cache) -> None:
        """Release a cache (allocated or registered), like ``unregister_cache(cache.cache_id)`` - except
        memory kvpush allocated whose slots cache keys still name: this engine can no longer use it, and
        the memory goes with its last key (pulled by a peer or removed), as in LLM-DataDist."""
        api = "deallocate_cache"
        v.check_type(api, "cache", cache, Cache)
        self._engine.require_init(api)
        entry = self.registry.get(cache.cache_id)
        if entry is None or entry.deallocated:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"{api}: no cache {cache.cache_id}")
        if self.registry.deallocate(cache.cache_id):  # (kept for its keys: nothing changed for peers)
            self._engine.registry_changed()

    deallocate_blocks_cache = deallocate_cache

    def _local(self, api: str, name: str, cache: Cache) -> CacheEntry:
        entry = self.registry.get(cache.cache_id)
        if entry is None or entry.cache is not cache or entry.deallocated:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                               f"{api}: {name} (cache {cache.cache_id}) is not registered here")
        return entry

    # -- transfers --------------------------------------------------------------------------------
    async def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,  # noqa: PLR0913 (LLM-DataDist's)
                          src_blocks: Sequence[int] = (), dst_blocks: Sequence[int] = (),
                          src_layer_range: range | None = None, dst_layer_range: range | None = None,
                          tensor_num_per_layer: int = 2, notify: bytes | None = None, *,
                          src_batch_index: int | None = None) -> None:
        """Write local blocks into the peer's blocks cache named by ``dst_cache_key``.

        ``src_batch_index``: the source is that batch slot of the contiguous ``src_cache`` instead
        (``src_blocks`` empty), cut into blocks of the peer's block size: block i of the slot goes to
        ``dst_blocks[i]``, the last one partly filled if the slot is not a whole number of blocks
        (LLM-DataDist's transfer from a cache to blocks).

        Returns once every byte of every requested layer is in the peer's memory. Raises before any
        byte moves for bad arguments (TypeError / ValueError / LLMException, SPEC §6 order).

        Timeout: each layer must complete within ``sync_kv_timeout`` of becoming the oldest layer in
        flight, else ``LLMException(LLM_TIMEOUT)`` with ``completed_layers``; layers not yet sent are
        never sent, and bytes of a layer already partly on the wire finish landing in their own
        destination blocks (ordered before any later transfer on the link). The link stays usable.

        Cancellation: no further layer is issued; the task's ``CancelledError`` propagates once no
        byte of this request can still land (a started layer is drained; if it cannot be drained
        within ``sync_kv_timeout`` the link is closed instead).

        ``notify`` (kvpush, SPEC 10): after every layer landed, these bytes arrive on the peer's
        ``notifications`` inbox (never for a failed or cancelled push); the call returns once the peer
        queued them.
        """
        api = "push_blocks"
        if notify is not None:
            check_notify(api, notify)
        self._engine.require_init(api)
        request = planning.check_block_args(api, _WRITE, dst_cache_key, src_cache, src_blocks, dst_blocks,
                                            src_layer_range, dst_layer_range, tensor_num_per_layer,
                                            local_slot=src_batch_index)
        if notify is not None:
            request.notify = bytes(notify)
        await self._move(request)

    async def pull_blocks(self, src_cache_key: BlocksCacheKey | CacheKey | CacheKeyByIdAndIndex, dst_cache: Cache,
                          src_blocks: Sequence[int] = (), dst_blocks: Sequence[int] = (),
                          src_layer_range: range | None = None, dst_layer_range: range | None = None,
                          tensor_num_per_layer: int = 2) -> None:
        """Read the peer's blocks into local ones (one-sided from the caller's view).

        The source may also be one batch slot of the peer's contiguous cache, named by a ``CacheKey``
        or a ``CacheKeyByIdAndIndex`` (``src_blocks`` empty): the slot is cut into blocks of the local
        block size and block i of it lands in ``dst_blocks[i]`` (the last one partly filled if the slot
        is not a whole number of blocks; LLM-DataDist's pull from a cache to blocks). A cache key naming
        that slot is then released on the peer as by ``pull_cache``.

        Same checks, timeout and cancellation rules as ``push_blocks``; on timeout or cancellation
        the rest of a layer's incoming bytes is discarded, never written after the exception.
        """
        api = "pull_blocks"
        self._engine.require_init(api)
        await self._move(planning.check_block_args(api, _READ, src_cache_key, dst_cache, src_blocks, dst_blocks,
                                                   src_layer_range, dst_layer_range, tensor_num_per_layer))

    async def _move(self, request: planning.Request) -> None:
        """The one route of every transfer call once its arguments are checked: the link, both caches,
        the plan, the run; then what the call asks for after its last byte landed."""
        link, plan = self._planned(request) or await self._planned_after_refresh(request)
        await transfer.run(link, plan, self._engine.options)
        if plan.remote_slot is not None:
            self._pulled_slot(link, plan)
        if request.notify is not None:
            await link.send_message(NOTIFICATION, request.notify)

    def _planned(self, request: planning.Request) -> tuple[Link, planning.Plan] | None:
        """The link and the plan, against the peer's cache table as this engine knows it; None when the
        table lacks the peer's cache (``_planned_after_refresh`` then asks for it once). Raises what is
        wrong, in SPEC order (no link, no local cache, then the checks against the peer's cache)."""
        link = self._engine.link_for(request.api, request.cluster_id)
        local = self._local(request.api, request.local_name, request.local_cache)
        found = self._lookup(link, request)
        return None if found is None else (link, planning.plan(request, local, *found))

    async def _planned_after_refresh(self, request: planning.Request) -> tuple[Link, planning.Plan]:
        """``_planned`` after one round trip for the peer's table, bounded by ``sync_kv_timeout``."""
        api = request.api
        link = self._engine.link_for(api, request.cluster_id)
        local = self._local(api, request.local_name, request.local_cache)
        try:
            async with asyncio.timeout(self._engine.options.sync_kv_timeout_ms / 1000):
                await link.refresh_table()
        except TimeoutError:
            raise LLMException(LLMStatusCode.LLM_TIMEOUT,
                               f"{api}: the peer's cache table did not arrive in time") from None
        found = self._lookup(link, request)
        if found is None:
            raise self._not_there(link, request)
        return link, planning.plan(request, local, *found)

    @staticmethod
    def _lookup(link: Link, request: planning.Request) -> tuple[RemoteCache, int | None] | None:
        """The peer's cache by cache key (then with the slot the key names), model id or cache id."""
        if request.key is not None:
            found = link.peer.by_key(request.key)
            return None if found is None else (found[0], found[1].slot)
        if request.model_id is not None:
            cache = link.peer.by_model(request.model_id)
        else:
            cache = link.peer.by_id(request.cache_id or 0)
        return None if cache is None else (cache, None)

    @staticmethod
    def _not_there(link: Link, request: planning.Request) -> LLMException:
        key = request.key
        if key is not None:
            kind = "req_id" if key[0] == REQUEST_KEY else "prefix_id"
            what = f"a slot named by {kind}={key[1]}, model_id={key[2]}"
        elif request.model_id is not None:
            what = f"a cache with model_id={request.model_id}"
        else:
            what = f"a cache with cache_id={request.cache_id}"
        return LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                            f"{request.api}: cluster {link.peer_cluster_id} has no {what}")

    @staticmethod
    def _pulled_slot(link: Link, plan: planning.Plan) -> None:
        """Every byte of a pull from the peer's batch slot is here: if a cache key the peer's table
        marks as released by a pull names that slot, tell the peer which tensors were pulled (it drops
        the key once all of them were; LLM-DataDist drops it after the pull too)."""
        slot = plan.remote_slot
        assert slot is not None
        key = link.peer.key_at(plan.remote.cache_id, slot)
        if key is None or not key.released_on_pull:
            return
        first = min(step.src_first for step in plan.steps)
        link.release_key(KeyRelease(key.name, plan.remote.cache_id, slot, first, sum(s.count for s in plan.steps)))

    # -- layer-pipelined pushing ---------------------------------------------------------------------
    def layer_pusher(self, dst_cache_key: BlocksCacheKey, src_cache: Cache, src_blocks: Sequence[int],
                     dst_blocks: Sequence[int], tensor_num_per_layer: int = 2,
                     notify: bytes | None = None, *, src_batch_index: int | None = None) -> LayerPusher:
        """A pusher bound to one request: ``push_layer(l)`` starts layer ``l`` (source layer l into
        destination layer l) as soon as prefill has computed it. Validates everything now, against the
        peer's cache table as this engine knows it (SPEC order; no round trip), and raises like
        ``push_blocks`` for bad arguments. ``notify``: delivered to the peer's ``notifications`` inbox
        once every layer of the request landed (sent by ``wait()``). ``src_batch_index``: the source is
        that batch slot of a contiguous ``src_cache``, as in ``push_blocks``. See
        ``kvpush.pipeline.LayerPusher``."""
        api = "layer_pusher"
        check_notify(api, notify)
        self._engine.require_init(api)
        request = planning.check_block_args(api, Kind.WRITE, dst_cache_key, src_cache, src_blocks, dst_blocks, None,
                                            None, tensor_num_per_layer, local_slot=src_batch_index)
        planned = self._planned(request)
        if planned is None:
            link = self._engine.link_for(api, request.cluster_id)
            raise self._not_there(link, request)
        link, plan = planned
        return LayerPusher(link, plan, self._engine.options.sync_kv_timeout_ms, notify)

    # -- contiguous caches --------------------------------------------------------------------------
    async def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                         src_layer_range: range | None = None, dst_layer_range: range | None = None,
                         size: int = -1, tensor_num_per_layer: int = 2) -> None:
        """Write one batch slot per tensor per layer into the peer's cache ``dst_cache_key.cache_id``
        at slot ``dst_cache_key.batch_index``. ``size`` bytes per tensor (-1: the whole slot).
        Timeout and cancellation as in ``push_blocks``."""
        api = "push_cache"
        self._engine.require_init(api)
        await self._move(planning.check_cache_args(api, Kind.WRITE, dst_cache_key, src_cache, src_batch_index,
                                                   dst_layer_range, src_layer_range, size, tensor_num_per_layer))

    async def pull_cache(self, src_cache_key: CacheKeyByIdAndIndex | CacheKey, dst_cache: Cache, batch_index: int = 0,
                         size: int = -1, src_layer_range: range | None = None,
                         dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """Read a slot of the peer's contiguous cache - ``src_cache_key.batch_index`` of cache
        ``src_cache_key.cache_id``, or the slot a ``CacheKey`` names (looked up in the peer's table, one
        bounded refresh when it is not there; exactly one of its req_id and prefix_id must be an id) -
        into local slot ``batch_index``.

        When every byte is here and the slot is named by a request key of memory the peer allocated,
        the key is released on the peer once all of the slot's tensors were pulled (LLM-DataDist's
        ``pull_cache`` consumes the key): a later pull by that key fails with LLM_KV_CACHE_NOT_EXIST.
        The release is sent behind the pull without waiting for an answer; if the link breaks first,
        the key stays. Timeout and cancellation as in ``pull_blocks`` (a failed or cancelled pull
        releases nothing)."""
        api = "pull_cache"
        self._engine.require_init(api)
        await self._move(planning.check_cache_args(api, Kind.READ, src_cache_key, dst_cache, batch_index,
                                                   src_layer_range, dst_layer_range, size, tensor_num_per_layer))

    # -- local copy ----------------------------------------------------------------------------------
    async def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, Sequence[int]]) -> None:
        """Copy blocks inside one local cache: ``{src_block: [dst_block, ...]}``, every tensor.
        All sources are read before any destination is written, so chains like {0: [1], 1: [2]} copy
        the original contents."""
        api = "copy_blocks"
        self._engine.require_init(api)
        v.check_type(api, "cache", cache, Cache)
        v.check_type(api, "copy_block_info", copy_block_info, Mapping)
        entry = self._local(api, "cache", cache)
        v.check_blocks_cache(api, "cache", cache)
        pairs_src: list[int] = []
        pairs_dst: list[int] = []
        for src_block, dst_list in copy_block_info.items():
            dsts = v.check_blocks(api, f"copy_block_info[{src_block}]", dst_list)
            pairs_src += [int(src_block)] * len(dsts)
            pairs_dst += dsts.tolist()
        src = v.check_blocks(api, "source blocks", pairs_src)
        dst = v.check_blocks(api, "destination blocks", pairs_dst)
        if not len(dst):
            raise param_invalid(f"{api}: copy_block_info names no destination block")
        desc = entry.desc
        v.check_block_bounds(api, "source blocks", src, desc.num_blocks, "the")
        v.check_block_bounds(api, "destination blocks", dst, desc.num_blocks, "the")
        v.check_no_duplicates(api, "destination blocks", dst)
        src_index, dst_index = src.array().astype(np.intp), dst.array().astype(np.intp)
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
        return await self._kv_blocks("push_kv_blocks", Kind.WRITE, src_cache, dst_cache_index,
                                     (src_blocks, dst_blocks), ext_param)

    async def pull_kv_blocks(self, src_cache_index: CacheKeyByIdAndIndex, dst_cache: Cache,
                             src_blocks: Sequence[int], dst_blocks: Sequence[int],
                             ext_param: KvCacheExtParam | None = None) -> LLMStatusCode:
        """``PullKvBlocks``: like ``pull_blocks`` addressed by cache id, returning a status code."""
        return await self._kv_blocks("pull_kv_blocks", Kind.READ, dst_cache, src_cache_index,
                                     (src_blocks, dst_blocks), ext_param)

    async def _kv_blocks(self, api: str, kind: Kind, local_cache: object, remote_index: object,
                         blocks: tuple[object, object], ext_param: object) -> LLMStatusCode:
        try:
            self._engine.require_init(api)
            await self._move(planning.check_kv_block_args(api, kind, local_cache, remote_index, blocks, ext_param))
        except LLMException as error:
            log.info("%s failed: %s", api, error)
            return error.status_code
        except (TypeError, ValueError) as error:
            log.info("%s: bad argument: %s", api, error)
            return LLMStatusCode.LLM_PARAM_INVALID
        return LLMStatusCode.LLM_SUCCESS
