"""LLM-DataDist's ``transfer_cache_async``: layer-synchronised pushing, on kvpush's layer pusher.

The caller's ``LayerSynchronizer.synchronize_layer(l, timeout)`` blocks until its model has computed
layer ``l``; as soon as it returns True, layer ``l`` of every transfer config that covers it starts on
the wire (``LayerPusher.push_layer``: microseconds), so layer l moves while layer l+1 is computed.
``CacheTask.synchronize()`` waits for every layer to be in the peers' memory; ``get_results()`` gives
one status per config. As in LLM-DataDist:

- layers are synchronised in order, once each, only those some config covers;
  ``synchronize_layer`` returning False (or raising) stops the task: the configs covering that layer
  get LLM_PARAM_INVALID, no further layer starts;
- a layer that fails stops the task too: its config gets the failure's status code; configs whose last
  layer never landed report None;
- ``synchronize(timeout_in_millis)`` / ``get_results(timeout_in_millis)`` give LLM_TIMEOUT while the
  task is still running.

A contiguous source into a peer's blocks cache (``dst_block_indices`` and ``dst_block_memory_size``
given, no ``src_block_indices``) moves slot ``src_batch_index`` cut into blocks: block i of the slot
into ``dst_block_indices[i]`` (the engine's ``push_blocks(..., src_batch_index=)``); the peer's own
block size is used (``dst_block_memory_size`` is checked as LLM-DataDist checks it: > 0 and below the
tensor size).

Where kvpush differs: a HOST source is accepted (kvpush moves host memory; LLM-DataDist refuses it),
``TransferWithCacheKeyConfig`` is checked for equal range lengths (LLM-DataDist compares the wrong
ends), and ``TransferConfig`` (raw peer addresses, LLM-DataDist's mode without remote cache access) is
refused with LLM_FEATURE_NOT_ENABLED: kvpush peers address each other's memory by cache only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import kvpush
from kvpush import BlocksCacheKey, Cache, CacheKeyByIdAndIndex, LLMException, LLMStatusCode

from .types import check_uint, require

log = logging.getLogger(__name__)

TENSORS_PER_LAYER = 2  # LLM-DataDist's transfer_cache_async moves K and V per layer, always


class LayerSynchronizer(ABC):
    """Implemented by the caller: ``synchronize_layer(layer_index, timeout_in_millis)`` blocks until
    layer ``layer_index`` is computed and returns True (False: it will not be)."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Wait until layer ``layer_index`` is computed; True on success."""


def check_layer_range(name: str, layer_range: object, allow_none: bool = True) -> None:
    if allow_none and layer_range is None:
        return
    if not isinstance(layer_range, range):
        raise TypeError(f"{name} only support ['range'], but got {type(layer_range)}.")
    require(layer_range.step == 1, f"check {name}.step == 1 failed")
    require(0 <= layer_range.start < layer_range.stop,
            f"check 0 <= range.start < range.stop failed, {name} = {layer_range}")


class TransferWithCacheKeyConfig:
    """One destination: a peer's blocks cache (``BlocksCacheKey``) or a batch slot of its contiguous
    cache (``CacheKeyByIdAndIndex``); source layers ``src_layer_range`` go to ``dst_layer_range``."""

    def __init__(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex, src_layer_range: range | None = None,
                 dst_layer_range: range | None = None, src_batch_index: int = 0) -> None:
        if not isinstance(cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex)):
            raise TypeError(f"cache_key only support ['BlocksCacheKey', 'CacheKeyByIdAndIndex'], "
                            f"but got {type(cache_key)}.")
        check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        assert src_layer_range is not None and dst_layer_range is not None
        require(len(src_layer_range) == len(dst_layer_range),
                "src_layer_range size should be equal to dst_layer_range size")
        check_uint("src_batch_index", src_batch_index, 32)
        require(not (isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0),
                "src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        self.cache_key = cache_key
        self.src_layer_range: range = src_layer_range
        self.dst_layer_range: range = dst_layer_range
        self.src_batch_index = src_batch_index

    @property
    def dst_cluster_id(self) -> int:
        return self.cache_key.cluster_id

    def __repr__(self) -> str:
        return (f"TransferWithCacheKeyConfig(cache_key={self.cache_key}, src_layer_range={self.src_layer_range}, "
                f"dst_layer_range={self.dst_layer_range}, src_batch_index={self.src_batch_index})")


class TransferConfig:
    """LLM-DataDist's raw-address destination (``dst_addrs``: the peer's tensor addresses). Accepted as a
    value; ``transfer_cache_async`` refuses it (see the module docstring)."""

    def __init__(self, dst_cluster_id: int, dst_addrs: list[int], src_layer_range: range | None = None,
                 src_batch_index: int = 0) -> None:
        check_uint("dst_cluster_id", dst_cluster_id, 64)
        if not isinstance(dst_addrs, (list, tuple)):
            raise TypeError(f"dst_addrs only support ['list', 'tuple'], but got {type(dst_addrs)}.")
        for addr in dst_addrs:
            check_uint("dst_addrs", addr, 64)
        check_layer_range("src_layer_range", src_layer_range)
        check_uint("src_batch_index", src_batch_index, 32)
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = list(dst_addrs)
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    def __repr__(self) -> str:
        return (f"TransferConfig(dst_cluster_id={self.dst_cluster_id}, dst_addrs={self.dst_addrs}, "
                f"src_layer_range={self.src_layer_range}, src_batch_index={self.src_batch_index})")


class CacheTask:
    """The running transfer of ``transfer_cache_async``."""

    def __init__(self, future: concurrent.futures.Future[dict[int, LLMStatusCode]], clusters: list[int]) -> None:
        self._future = future
        self._clusters = clusters

    def _outcome(self, timeout_in_millis: int | None) -> dict[int, LLMStatusCode] | None:
        timeout = None if timeout_in_millis is None else check_uint("timeout_in_millis", timeout_in_millis, 32) / 1000
        done, _ = concurrent.futures.wait([self._future], timeout=timeout)
        if not done:
            return None
        try:
            return self._future.result()
        except Exception as error:  # the portal closed under it, or a bug: LLM-DataDist's default code
            log.warning("transfer_cache_async ended without results: %s", error)
            return None

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait until every layer landed: the first failure's code, LLM_SUCCESS, or LLM_TIMEOUT when the
        task is still running after ``timeout_in_millis`` (None: wait as long as it takes)."""
        results = self._outcome(timeout_in_millis)
        if results is None:
            return LLMStatusCode.LLM_TIMEOUT
        return next((code for code in results.values() if code != LLMStatusCode.LLM_SUCCESS),
                    LLMStatusCode.LLM_SUCCESS)

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One status per transfer config, in order (None: its last layer never started)."""
        results = self._outcome(timeout_in_millis)
        if results is None:
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._clusters)
        return [results.get(cluster) for cluster in self._clusters]


@dataclass
class TransferPlan:
    """A checked ``transfer_cache_async`` call."""

    src_cache: Cache
    synchronizer: LayerSynchronizer
    configs: list[TransferWithCacheKeyConfig]
    layers: list[int]  # source layers some config covers, in order
    src_blocks: list[int]
    dst_blocks: list[int]
    dst_block_memory_size: int | None = None

    @property
    def from_slot(self) -> bool:
        """A contiguous source into blocks: its batch slot, cut into the destination's blocks."""
        return not self.src_cache.is_blocks_cache and bool(self.dst_blocks)


def _indices(name: str, value: object) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} only support ['list', 'tuple'], but got {type(value)}.")
    return [check_uint(name, item, 64) for item in value]


def plan_transfer(src_cache: object, synchronizer: object, configs: object, src_block_indices: object,
                  dst_block_indices: object, dst_block_memory_size: object) -> TransferPlan:
    """LLM-DataDist's checks, in its order, then kvpush's (which configs it can move)."""
    if not isinstance(src_cache, Cache):
        raise TypeError(f"src_cache only support ['Cache'], but got {type(src_cache)}.")
    dst_blocks = _indices("dst_block_indices", dst_block_indices)
    src_blocks = _indices("src_block_indices", src_block_indices)
    memory_size = None if dst_block_memory_size is None else check_uint("dst_block_memory_size",
                                                                        dst_block_memory_size, 64)
    if src_blocks:
        require(bool(dst_blocks), "transfer from blocks to cache is not supported")
        require(len(src_blocks) == len(dst_blocks or []), f"num_block_indices mismatches, src_num = "
                                                          f"{len(src_blocks)}, dst_num = {len(dst_blocks or [])}")
    elif dst_blocks:
        require(dst_block_memory_size is not None, "dst_block_memory_size must be set when transfer from cache to "
                                                   "blocks")
    if not isinstance(synchronizer, LayerSynchronizer):
        raise TypeError(f"layer_synchronizer only support ['LayerSynchronizer'], but got {type(synchronizer)}.")
    if not isinstance(configs, (list, tuple)) or not all(
            isinstance(config, (TransferWithCacheKeyConfig, TransferConfig)) for config in configs):
        raise TypeError("transfer_configs only support a list or tuple of TransferWithCacheKeyConfig")
    require(bool(dst_blocks) or dst_block_memory_size in (None, 0),
            f"dst_block_memory_size ({dst_block_memory_size}) is neither None nor 0 while dst is not blocks")
    desc = src_cache.cache_desc
    require(desc.num_tensors % TENSORS_PER_LAYER == 0, f"cache_desc.num_tensors ({desc.num_tensors}) is not even")
    num_layers = desc.num_tensors // TENSORS_PER_LAYER
    for config in configs:
        if isinstance(config, TransferConfig):
            raise LLMException(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                               "transfer_cache_async: TransferConfig names raw peer addresses; kvpush peers address "
                               "each other's registered caches only: use TransferWithCacheKeyConfig")
        if src_blocks:
            require(config.src_batch_index == 0, f"Invalid TransferConfig, src_batch_index ({config.src_batch_index}) "
                                                 f"!= 0 while src is blocks")
        src_range = config.src_layer_range
        require(0 <= src_range.start < src_range.stop <= num_layers,
                f"src_layer_range: {src_range} out of range, src_layer_num = {num_layers}")
        if isinstance(config.cache_key, BlocksCacheKey):
            require(src_cache.is_blocks_cache or bool(dst_blocks),
                    "transfer_cache_async: a contiguous source into a peer's blocks cache needs dst_block_indices")
        else:
            require(not src_cache.is_blocks_cache and not src_blocks and not dst_blocks,
                    "transfer_cache_async: a CacheKeyByIdAndIndex destination takes a contiguous source cache and "
                    "no block indices")
    if src_cache.is_blocks_cache and not src_blocks:  # no indices: every block, to the same blocks
        src_blocks = dst_blocks = list(range(desc.num_blocks))
    checked = [config for config in configs if isinstance(config, TransferWithCacheKeyConfig)]
    layers = sorted({layer for config in checked for layer in config.src_layer_range})
    return TransferPlan(src_cache, synchronizer, checked, layers, src_blocks or [], dst_blocks or [], memory_size)


class Route:
    """How one config's layers move: a layer pusher (blocks to blocks, same layer on both sides) or one
    push per layer (other layer mappings, contiguous destinations). Made on the engine's loop."""

    def __init__(self, cm: kvpush.CacheManager, plan: TransferPlan, config: TransferWithCacheKeyConfig) -> None:
        self.config = config
        self.cluster = config.dst_cluster_id
        self._cm = cm
        self._plan = plan
        self._tasks: list[asyncio.Task[None]] = []
        key = config.cache_key
        self._pusher: Any = None  # kvpush's LayerPusher
        # a contiguous source into blocks: its slot src_batch_index, cut into blocks of the peer's block size
        self._slot = config.src_batch_index if plan.from_slot else None
        if plan.from_slot:
            size, tensor_bytes = plan.dst_block_memory_size or 0, plan.src_cache.cache_desc.size
            require(0 < size < tensor_bytes, f"block_mem_size[{size}] must > 0 and < tensor size[{tensor_bytes}] when "
                                             f"transfer from continuous cache to blocks")
        if isinstance(key, BlocksCacheKey) and config.src_layer_range == config.dst_layer_range:
            self._pusher = cm.layer_pusher(key, plan.src_cache, plan.src_blocks, plan.dst_blocks, TENSORS_PER_LAYER,
                                           src_batch_index=self._slot)

    def _layer(self, layer: int, dst_layer: int) -> Coroutine[Any, Any, None]:
        key, plan, one, other = self.config.cache_key, self._plan, range(layer, layer + 1), range(dst_layer,
                                                                                                 dst_layer + 1)
        if isinstance(key, BlocksCacheKey):
            return self._cm.push_blocks(key, plan.src_cache, plan.src_blocks, plan.dst_blocks, one, other,
                                        TENSORS_PER_LAYER, src_batch_index=self._slot)
        return self._cm.push_cache(key, plan.src_cache, self.config.src_batch_index, one, other, -1,
                                   TENSORS_PER_LAYER)

    def covers(self, layer: int) -> bool:
        return layer in self.config.src_layer_range

    def push(self, layer: int) -> None:
        """Start ``layer`` now (it lands later; ``finish`` waits)."""
        if self._pusher is not None:
            self._tasks.append(self._pusher.push_layer(layer))
            return
        dst_layer = self.config.dst_layer_range[layer - self.config.src_layer_range.start]
        self._tasks.append(asyncio.get_running_loop().create_task(self._layer(layer, dst_layer),
                                                                  name=f"kvpush-transfer-layer-{layer}"))

    def failed(self) -> bool:
        return any(task.done() and not task.cancelled() and task.exception() is not None for task in self._tasks)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def finish(self) -> LLMStatusCode | None:
        """Wait for every started layer: LLM_SUCCESS when all of the config's layers landed, the first
        failure's code, or None when the task stopped before its last layer."""
        error: BaseException | None = None
        if self._pusher is not None:
            try:
                await self._pusher.wait()
            except LLMException as failure:
                error = failure
        else:
            outcomes = await asyncio.gather(*self._tasks, return_exceptions=True)
            error = next((item for item in outcomes if isinstance(item, BaseException)), None)
        if isinstance(error, LLMException):
            return error.status_code
        if error is not None:
            raise error
        return LLMStatusCode.LLM_SUCCESS if len(self._tasks) == len(self.config.src_layer_range) else None


async def run_transfer(cache_manager: Callable[[], kvpush.CacheManager],
                       plan: TransferPlan) -> dict[int, LLMStatusCode]:
    """Drive the transfer on the engine's loop: synchronise each layer (on a thread of its own, so a
    synchronizer that blocks never blocks the loop), start it on every route that covers it, then wait
    for all. Results are keyed by destination cluster, as LLM-DataDist keys them.

    The synchronizer's thread is told to stop when the transfer ends and does at its next layer; one
    blocked in the caller's ``synchronize_layer`` stays blocked (a daemon thread, as LLM-DataDist's own
    transfer thread is), but nothing it returns afterwards starts a layer. Cancelling this coroutine
    (``finalize``) cancels the layers in flight, each cleaning up as a cancelled push does."""
    results: dict[int, LLMStatusCode] = {}
    routes: list[Route] = []
    cm = cache_manager()
    try:
        for config in plan.configs:
            routes.append(Route(cm, plan, config))
    except LLMException as error:  # e.g. no link to that cluster, or no such cache there
        results[config.dst_cluster_id] = error.status_code
        await asyncio.gather(*(route.finish() for route in routes), return_exceptions=True)
        return results
    loop = asyncio.get_running_loop()
    ready: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
    stop = threading.Event()
    worker = threading.Thread(target=_synchronize, args=(plan.synchronizer, plan.layers, loop, ready, stop),
                              name="kvpush-layer-synchronizer", daemon=True)
    worker.start()
    try:
        await _push_layers(plan, routes, ready, results)
    except BaseException:
        for route in routes:
            route.cancel()
        raise
    finally:
        stop.set()
        outcomes = await asyncio.gather(*(route.finish() for route in routes), return_exceptions=True)
    for route, outcome in zip(routes, outcomes):
        if isinstance(outcome, BaseException):
            log.error("transfer_cache_async: a layer to cluster %d failed unexpectedly: %r", route.cluster, outcome)
            results.setdefault(route.cluster, LLMStatusCode.LLM_FAILED)
        elif outcome is not None and results.get(route.cluster) in (None, LLMStatusCode.LLM_SUCCESS):
            results[route.cluster] = outcome
    return results


async def _push_layers(plan: TransferPlan, routes: list[Route], ready: asyncio.Queue[tuple[int, bool]],
                       results: dict[int, LLMStatusCode]) -> None:
    """Each layer, once synchronised, on every route that covers it; stop at a layer that failed to
    synchronise (its routes fail with LLM_PARAM_INVALID) or once a route failed."""
    for layer in plan.layers:
        _, ok = await ready.get()
        covering = [route for route in routes if route.covers(layer)]
        if not ok:
            log.error("transfer_cache_async: failed to synchronize layer %d", layer)
            for route in covering:
                results[route.cluster] = LLMStatusCode.LLM_PARAM_INVALID
            return
        if any(route.failed() for route in routes):
            return
        for route in covering:
            route.push(layer)


def _synchronize(synchronizer: LayerSynchronizer, layers: list[int], loop: asyncio.AbstractEventLoop,
                 ready: asyncio.Queue[tuple[int, bool]], stop: threading.Event) -> None:
    """The synchronizer's thread: one ``synchronize_layer`` call per layer, in order, each result handed
    to the loop. Ends at the first False, when the transfer stops, or when the loop is gone."""
    for layer in layers:
        if stop.is_set():
            return
        try:
            ok = bool(synchronizer.synchronize_layer(layer, None))
        except Exception as error:
            log.error("transfer_cache_async: synchronize_layer(%d) raised %r", layer, error)
            ok = False
        try:
            loop.call_soon_threadsafe(ready.put_nowait, (layer, ok))
        except RuntimeError:
            return  # the engine's loop closed
        if not ok:
            return
