"""LLM-DataDist's blocking API over kvpush's async engine (SPEC §8).

Code written for Huawei's ``llm_datadist`` package (CacheManager mode) runs after changing only its
import::

    from kvpush.compat.llm_datadist import (LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType,
                                            BlocksCacheKey, LLMClusterInfo, LLMStatusCode)

    datadist = LLMDataDist(LLMRole.DECODER, cluster_id=1)
    datadist.init(config.generate_options())
    cache = datadist.cache_manager.register_blocks_cache(desc, [int(t.data_ptr()) for t in kv], key)
    ret, rets = datadist.link_clusters([cluster], 5000)
    datadist.cache_manager.push_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])

How it works: each ``LLMDataDist`` of this module owns one private asyncio event loop running on
one daemon thread (started by ``init``, stopped by ``finalize``) and one ``kvpush.LLMDataDist`` living
on that loop. Every method submits the matching coroutine (or, for registration, the synchronous
call) to that loop and waits for it, so the calling thread blocks and the engine's own guarantees
hold unchanged:

- **Same exceptions**: whatever the engine raises comes out of the blocking call as the same object
  (same class, same ``status_code``, same ``completed_layers``).
- **Same timeouts**: transfers are bounded by ``sync_kv_timeout`` (``llm.SyncKvCacheWaitTime``) per
  layer and links by the ``timeout`` argument, enforced by the engine; this layer adds no deadline
  of its own. It never waits forever on a dead loop either: if the loop thread stops, a waiting
  call raises ``RuntimeError`` (or ``LLMException(LLM_ENGINE_FINALIZED)`` when ``finalize`` stopped it).
- **Interrupts**: ``KeyboardInterrupt`` (Ctrl-C) while a call waits cancels the engine's coroutine,
  waits until the engine reports the cancellation finished (for a transfer: no byte of it can still
  land, bounded by ``sync_kv_timeout``), then re-raises. A second interrupt stops that wait.
- **Threads**: any number of threads may call one instance at once; their calls run concurrently on
  the engine's loop (e.g. one push per thread).

It must not be used from inside a running asyncio event loop: a blocking call there would stall the
loop, so every method raises ``RuntimeError`` pointing to the async API, ``kvpush.LLMDataDist``.

Where kvpush differs from LLM-DataDist (several instances per process, block-size checks, links that
survive a timeout, IPv6, ...) the async engine's behaviour applies; see the README.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from .. import datadist as _async_datadist
from ..cache_manager import CacheManager as _AsyncCacheManager
from ..options import LLMConfig
from ..status import LLMException, LLMStatusCode
from ..types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LLMRole,
    Placement,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

LlmConfig = LLMConfig  # llm_datadist exports both spellings

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "DataType",
    "KvCacheExtParam",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LlmConfig",
    "Placement",
]

# How often a waiting call checks that the loop thread is still alive. Only a liveness probe: a
# result is returned the moment it exists, and no call is ever given up because of this interval.
_LIVENESS_POLL_S = 0.5
# finalize(): after the engine was finalized, how long (beyond sync_kv_timeout) calls still running
# on the loop get to finish with the engine's own error before the loop is stopped under them.
_STOP_GRACE_S = 2.0


def _refuse_in_event_loop(api: str) -> None:
    """Raise RuntimeError when called from a thread that is running an asyncio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"kvpush.compat.llm_datadist: {api}() blocks until it is done and cannot be called from inside a "
        f"running asyncio event loop (it would stall that loop). In async code use the async API instead: "
        f"`from kvpush import LLMDataDist` and `await` its methods (e.g. `await dd.cache_manager.push_blocks(...)`)."
    )


class _EngineLoop:
    """One private event loop on one daemon thread, and the calls submitted to it.

    ``gone(api)`` builds the exception a call gets when the loop stops before the call finished.
    """

    def __init__(self, name: str, gone: Callable[[str], BaseException],
                 on_crash: Callable[[], Awaitable[None]]) -> None:
        self._gone = gone
        self._on_crash = on_crash
        self._loop = asyncio.new_event_loop()
        self._stopping = False
        self._lock = threading.Lock()
        self._outstanding: dict[concurrent.futures.Future[Any], str] = {}
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The loop runs and accepts calls."""
        return self._thread.is_alive() and not self._stopping

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        crashed = False
        try:
            self._loop.run_forever()
        except BaseException:
            crashed = True
            log.exception("kvpush compat: the engine's event loop thread %s stopped on an error", self._thread.name)
        finally:
            self._stopping = True
            try:
                self._cancel_leftovers()
                if crashed:  # release the engine's sockets and memory while its loop can still run them
                    self._loop.run_until_complete(self._on_crash())
            except BaseException:
                log.exception("kvpush compat: cleaning up after the loop thread %s stopped failed", self._thread.name)
            finally:
                self._loop.close()
                self._fail_outstanding()

    def _cancel_leftovers(self) -> None:
        """Cancel what still runs on the loop and let it unwind (the engine's cleanup is bounded)."""
        tasks = [task for task in asyncio.all_tasks(self._loop) if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    def _fail_outstanding(self) -> None:
        """Calls whose coroutine never got to run (submitted while the loop stopped) fail now."""
        with self._lock:
            leftovers = list(self._outstanding.items())
            self._outstanding.clear()
        for future, api in leftovers:
            if not future.done():
                future.set_exception(self._gone(api))

    def call(self, api: str, factory: Callable[[], Awaitable[T]]) -> T:
        """Run ``factory()`` on the loop and block until it is done; see the module docstring."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        started: list[asyncio.Task[T]] = []

        def settle(task: asyncio.Task[T]) -> None:
            with self._lock:
                self._outstanding.pop(future, None)
            if task.cancelled():
                future.set_exception(self._gone(api) if self._stopping else asyncio.CancelledError())
            elif (error := task.exception()) is not None:
                future.set_exception(error)
            else:
                future.set_result(task.result())

        async def run() -> T:
            return await factory()

        def start() -> None:
            if not future.set_running_or_notify_cancel():
                with self._lock:
                    self._outstanding.pop(future, None)
                return
            task = self._loop.create_task(run(), name=f"kvpush-compat-{api}")
            started.append(task)
            task.add_done_callback(settle)

        with self._lock:
            if self._stopping:
                raise self._gone(api)
            self._outstanding[future] = api
        try:
            self._loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop closed meanwhile
            with self._lock:
                self._outstanding.pop(future, None)
            raise self._gone(api) from None
        try:
            return self._result(api, future)
        except BaseException:
            if not future.done():  # interrupted (KeyboardInterrupt): cancel the coroutine, wait for it
                self._cancel(future, started)
                self._wait_done(future)
            raise

    def _result(self, api: str, future: concurrent.futures.Future[T]) -> T:
        while True:
            done, _ = concurrent.futures.wait([future], timeout=_LIVENESS_POLL_S)
            if done:
                return future.result()  # the engine's result, or its exception as raised
            if not self._thread.is_alive() and not future.done():
                raise self._gone(api)

    def _cancel(self, future: concurrent.futures.Future[T], started: list[asyncio.Task[T]]) -> None:
        if future.cancel():  # not started yet: it never will be
            return

        def cancel_task() -> None:
            for task in started:
                task.cancel()

        try:
            self._loop.call_soon_threadsafe(cancel_task)
        except RuntimeError:
            pass  # the loop is gone; so is the task

    def _wait_done(self, future: concurrent.futures.Future[T]) -> None:
        while not future.done() and self._thread.is_alive():
            concurrent.futures.wait([future], timeout=_LIVENESS_POLL_S)

    def stop(self, join_timeout: float) -> None:
        """Stop the loop (calls still on it are cancelled and unwind) and join the thread."""
        with self._lock:
            self._stopping = True
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:
            pass  # already closed
        if self._thread is not threading.current_thread():
            self._thread.join(join_timeout)
            if self._thread.is_alive():
                log.warning("kvpush compat: event loop thread %s did not stop within %.1f s",
                            self._thread.name, join_timeout)


_live: set[LLMDataDist] = set()  # initialised, not yet finalized


@atexit.register
def _finalize_at_exit() -> None:
    """Like llm_datadist: instances still initialised at interpreter exit are finalized."""
    for datadist in list(_live):
        try:
            datadist.finalize()
        except Exception as error:  # exiting anyway; say why this one could not finalize cleanly
            log.warning("kvpush compat: finalize at exit failed for cluster %s: %s", datadist.cluster_id, error)


class LLMDataDist:
    """LLM-DataDist's engine with its blocking API: ``LLMDataDist(role, cluster_id)``, then
    ``init(options)``, ``link_clusters``, ``cache_manager...``, ``finalize()``.

    Several instances may live in one process (each has its own loop thread). All methods block the
    calling thread and raise ``RuntimeError`` if that thread is running an asyncio event loop.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._engine = _async_datadist.LLMDataDist(role, cluster_id)  # checks role / cluster_id types
        self._loop: _EngineLoop | None = None
        self._state = threading.Lock()
        self._finalized = False
        self._cache_manager = CacheManager(self)

    def __repr__(self) -> str:
        state = "finalized" if self._finalized else "running" if self._loop is not None else "not initialised"
        return f"<kvpush.compat LLMDataDist cluster={self.cluster_id} role={self.role.name} {state}>"

    # -- plumbing -------------------------------------------------------------------------------------
    def _gone(self, api: str) -> BaseException:
        if self._finalized:
            return LLMException(LLMStatusCode.LLM_ENGINE_FINALIZED, f"{api}: the engine was finalized")
        return RuntimeError(f"{api}: the engine's event loop thread has stopped; the call cannot complete")

    def _not_running(self, api: str) -> BaseException:
        if self._finalized:
            return self._gone(api)
        return RuntimeError(f"{api}: call init() first")

    def _run(self, api: str, factory: Callable[[], Awaitable[T]]) -> T:
        _refuse_in_event_loop(api)
        loop = self._loop
        if loop is None:
            raise self._not_running(api)
        return loop.call(api, factory)

    def _run_sync(self, api: str, function: Callable[[], T]) -> T:
        """A synchronous engine call (registration) made on the loop thread, where engine state lives."""
        async def call() -> T:
            return function()

        return self._run(api, call)

    # -- properties -----------------------------------------------------------------------------------
    @property
    def cluster_id(self) -> int:
        return self._engine.cluster_id

    @property
    def role(self) -> LLMRole:
        return self._engine.role

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """kvpush extra: the (host, port) actually listened on (useful with port 0), or None."""
        return self._engine.listen_address

    @property
    def cache_manager(self) -> CacheManager:
        """The blocking ``CacheManager``. RuntimeError before ``init``; LLMException
        (LLM_ENGINE_FINALIZED) after ``finalize``."""
        if self._loop is None:
            raise self._not_running("cache_manager")
        return self._cache_manager

    @property
    def engine(self) -> _async_datadist.LLMDataDist:
        """kvpush extra: the async engine underneath. Use it only from this instance's loop thread."""
        return self._engine

    def link_stats(self) -> dict[int, dict[str, Any]]:
        """kvpush extra: per-link counters, keyed by peer cluster id."""
        return self._run_sync("link_stats", self._engine.link_stats)

    # -- lifecycle ------------------------------------------------------------------------------------
    def init(self, options: Mapping[str, str] | LLMConfig | None = None) -> None:
        """Start the private loop thread and initialise the engine with ``options`` (a dict of str, as
        ``LLMConfig.generate_options()`` makes, or the ``LLMConfig`` itself). With ``llm.listenIpInfo``
        it listens there. A second call is a no-op. A bad option raises LLMException(LLM_PARAM_INVALID)
        naming the key; the instance then stays uninitialised and ``init`` may be called again."""
        api = "init"
        _refuse_in_event_loop(api)
        with self._state:
            if self._finalized:
                raise LLMException(LLMStatusCode.LLM_ENGINE_FINALIZED, "init: this instance was finalized")
            if self._loop is not None:
                return
            parsed = dict(options) if isinstance(options, Mapping) else options
            loop = _EngineLoop(f"kvpush-compat-{self.cluster_id}", self._gone, self._engine.finalize)
            try:
                loop.call(api, lambda: self._engine.init(parsed))
            except BaseException:
                loop.stop(_STOP_GRACE_S)
                raise
            self._loop = loop
            _live.add(self)

    def finalize(self) -> None:
        """Finalize the engine (force-unlinks every peer; transfers in flight on other threads end
        promptly with LLMException), then stop and join the loop thread. Idempotent; after it every
        call raises LLMException(LLM_ENGINE_FINALIZED)."""
        api = "finalize"
        _refuse_in_event_loop(api)
        with self._state:
            if self._finalized:
                return
            loop, self._loop = self._loop, None
            self._finalized = True
            _live.discard(self)
            if loop is None:  # never initialised: nothing runs; the engine only records the state
                asyncio.run(self._engine.finalize())
                return
            grace = self._engine.options.sync_kv_timeout_ms / 1000 + _STOP_GRACE_S
            if not loop.alive:  # it died (and finalized the engine on its way out): nothing left to do
                loop.stop(grace)
                return
            try:
                loop.call(api, lambda: self._finalize_on_loop(grace))
            finally:
                loop.stop(grace + _STOP_GRACE_S)

    async def _finalize_on_loop(self, grace: float) -> None:
        await self._engine.finalize()
        current = asyncio.current_task()
        others = [task for task in asyncio.all_tasks() if task is not current and task.get_name().startswith(
            "kvpush-compat-")]
        if others:  # calls from other threads: let them end with the engine's own error
            await asyncio.wait(others, timeout=grace)

    # -- links ----------------------------------------------------------------------------------------
    def link_clusters(self, clusters: Sequence[LLMClusterInfo],
                      timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to every cluster (concurrently); blocks until each linked or failed within ``timeout``
        ms. Returns (overall code, one code per cluster): LLM_SUCCESS, LLM_LINK_FAILED, LLM_ALREADY_LINK,
        ... — a link that failed does not raise; bad arguments do. Ctrl-C closes half-made connections."""
        return self._run("link_clusters", lambda: self._engine.link_clusters(clusters, timeout))

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000,
                        force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink (non-force: tell the peer and wait up to ``timeout`` ms for its answer; force: close
        only the local end). Returns (overall code, one code per cluster)."""
        return self._run("unlink_clusters", lambda: self._engine.unlink_clusters(clusters, timeout, force))

    def switch_role(self, role: LLMRole, options: Mapping[str, str] | None = None, *,
                    switch_options: Mapping[str, str] | None = None) -> None:
        """Change the role. With ``llm.listenIpInfo`` in ``options`` (llm_datadist calls the argument
        ``switch_options``; both names work) the listener starts or moves there, without it the
        listener stops. LLMException(LLM_EXIST_LINK) while any link exists."""
        if options is not None and switch_options is not None:
            raise TypeError("switch_role: give options or switch_options, not both")
        chosen = options if options is not None else switch_options
        parsed = dict(chosen) if isinstance(chosen, Mapping) else chosen
        self._run("switch_role", lambda: self._engine.switch_role(role, parsed))


class CacheManager:
    """LLM-DataDist's ``CacheManager`` with blocking calls; get it from ``LLMDataDist.cache_manager``.

    Transfers return when the peer holds every byte (remote completion) or raise; each layer is bounded
    by ``sync_kv_timeout`` (LLMException(LLM_TIMEOUT) with ``completed_layers``; the link stays usable).
    """

    def __init__(self, owner: LLMDataDist) -> None:
        self._owner = owner

    @property
    def _async(self) -> _AsyncCacheManager:
        return self._owner.engine.cache_manager

    def _sync(self, api: str, call: Callable[[_AsyncCacheManager], T]) -> T:
        return self._owner._run_sync(api, lambda: call(self._async))

    def _await(self, api: str, call: Callable[[_AsyncCacheManager], Awaitable[T]]) -> T:
        return self._owner._run(api, lambda: call(self._async))

    # -- registration -----------------------------------------------------------------------------------
    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """Register caller-owned paged memory: ``addrs`` are int addresses (``tensor.data_ptr()``; the
        caller keeps that memory alive and large enough) or CPU arrays/tensors. ``blocks_cache_key``'s
        ``model_id`` names it for peers. ``remote_accessible``: see ``register_cache``."""
        _note_remote_accessible("register_blocks_cache", remote_accessible)
        return self._sync("register_blocks_cache",
                          lambda cm: cm.register_blocks_cache(cache_desc, addrs, blocks_cache_key))

    def register_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any], cache_keys: Sequence[Any] = (),
                       remote_accessible: bool | None = None) -> Cache:
        """Register caller-owned contiguous memory (``shape[0]`` is the batch dimension).
        ``remote_accessible`` is accepted for compatibility: in kvpush every registered cache can be
        addressed by linked peers (``llm.EnableRemoteCacheAccessible=0`` turns that off per engine)."""
        _note_remote_accessible("register_cache", remote_accessible)
        return self._sync("register_cache", lambda cm: cm.register_cache(cache_desc, addrs, cache_keys))

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        """kvpush-owned page-aligned paged memory; ``cache.tensors`` are numpy views of it."""
        return self._sync("allocate_blocks_cache", lambda cm: cm.allocate_blocks_cache(cache_desc, blocks_cache_key))

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[Any] = ()) -> Cache:
        """kvpush-owned contiguous memory; ``cache.tensors`` are numpy views of it."""
        return self._sync("allocate_cache", lambda cm: cm.allocate_cache(cache_desc, cache_keys))

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a cache; transfers addressing it afterwards fail with LLM_KV_CACHE_NOT_EXIST."""
        self._sync("unregister_cache", lambda cm: cm.unregister_cache(cache_id))

    def deallocate_cache(self, cache: Cache) -> None:
        """Release a cache (kvpush-owned memory is unmapped once no transfer uses it)."""
        self._sync("deallocate_cache", lambda cm: cm.deallocate_cache(cache))

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Release a blocks cache; the same as ``deallocate_cache``."""
        self._sync("deallocate_blocks_cache", lambda cm: cm.deallocate_cache(cache))

    # -- transfers --------------------------------------------------------------------------------------
    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache, src_blocks: Sequence[int] = (),
                    dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """Write local ``src_blocks`` into the peer's ``dst_blocks`` (every layer, or the given layer
        ranges of ``tensor_num_per_layer`` tensors each). Returns when the peer holds every byte.

        Arguments are checked before any byte moves (TypeError / ValueError / LLMException). Each layer
        must finish within ``sync_kv_timeout``, else LLMException(LLM_TIMEOUT) naming the layers that
        landed (``completed_layers``); the link stays usable. Ctrl-C stops issuing layers and returns
        (re-raising KeyboardInterrupt) once no byte of this push can still land."""
        self._await("push_blocks", lambda cm: cm.push_blocks(dst_cache_key, src_cache, src_blocks, dst_blocks,
                                                             src_layer_range, dst_layer_range, tensor_num_per_layer))

    def pull_blocks(self, src_cache_key: BlocksCacheKey, dst_cache: Cache, src_blocks: Sequence[int] = (),
                    dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """Read the peer's ``src_blocks`` into local ``dst_blocks``; returns when every byte is here.
        Checks, ``sync_kv_timeout`` and Ctrl-C as in ``push_blocks``; after a timeout or an interrupt the
        rest of the incoming bytes is discarded, never written later."""
        self._await("pull_blocks", lambda cm: cm.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks,
                                                             src_layer_range, dst_layer_range, tensor_num_per_layer))

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None, size: int = -1,
                   tensor_num_per_layer: int = 2) -> None:
        """Contiguous caches: write batch slot ``src_batch_index`` into the peer's cache
        ``dst_cache_key.cache_id`` at slot ``dst_cache_key.batch_index`` (``size`` bytes per tensor, -1: all).
        Timeout and Ctrl-C as in ``push_blocks``."""
        self._await("push_cache", lambda cm: cm.push_cache(dst_cache_key, src_cache, src_batch_index,
                                                           src_layer_range, dst_layer_range, size,
                                                           tensor_num_per_layer))

    def pull_cache(self, cache_key: CacheKeyByIdAndIndex, cache: Cache, batch_index: int = 0, size: int = -1,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   tensor_num_per_layer: int = 2) -> None:
        """Contiguous caches: read slot ``cache_key.batch_index`` of the peer's cache ``cache_key.cache_id``
        into local slot ``batch_index``. Timeout and Ctrl-C as in ``pull_blocks``."""
        self._await("pull_cache", lambda cm: cm.pull_cache(cache_key, cache, batch_index, size, src_layer_range,
                                                           dst_layer_range, tensor_num_per_layer))

    def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, Sequence[int]]) -> None:
        """Copy blocks inside one local cache: ``{src_block: [dst_block, ...]}``, every tensor. All
        sources are read before any destination is written. No I/O, no timeout."""
        self._await("copy_blocks", lambda cm: cm.copy_blocks(cache, copy_block_info))

    def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheKeyByIdAndIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> LLMStatusCode:
        """The C++ ``PushKvBlocks``: like ``push_blocks`` addressed by the peer's cache id, returning a
        status code (LLM_SUCCESS, LLM_PARAM_INVALID, LLM_NOT_YET_LINK, LLM_TIMEOUT, ...) instead of raising.
        ``sync_kv_timeout`` applies per layer as in ``push_blocks`` (LLM_TIMEOUT); Ctrl-C still raises."""
        return self._await("push_kv_blocks", lambda cm: cm.push_kv_blocks(src_cache, dst_cache_index, src_blocks,
                                                                          dst_blocks, ext_param))

    def pull_kv_blocks(self, src_cache_index: CacheKeyByIdAndIndex, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> LLMStatusCode:
        """The C++ ``PullKvBlocks``: like ``pull_blocks`` addressed by the peer's cache id, returning a
        status code instead of raising."""
        return self._await("pull_kv_blocks", lambda cm: cm.pull_kv_blocks(src_cache_index, dst_cache, src_blocks,
                                                                          dst_blocks, ext_param))


def _note_remote_accessible(api: str, remote_accessible: object) -> None:
    if remote_accessible is None:
        return
    if not isinstance(remote_accessible, bool):
        raise TypeError(f"{api}: remote_accessible must be a bool or None, got {type(remote_accessible).__name__}")
    if remote_accessible:
        log.debug("%s: remote_accessible=True is kvpush's behaviour for every cache", api)
    else:
        log.warning("%s: remote_accessible=False is not enforced per cache in kvpush: linked peers can address "
                    "this cache; set llm.EnableRemoteCacheAccessible=0 to refuse all peer access", api)
