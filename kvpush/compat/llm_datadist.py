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

How it works: each ``LLMDataDist`` here owns one ``kvpush.LLMDataDist`` and one ``Portal`` (a private
event loop on one daemon thread, started by ``init``, closed by ``finalize``) on which the engine
lives. Every method runs the matching engine call there and waits for it, so the engine's guarantees
hold unchanged:

- **Same exceptions**: whatever the engine raises comes out of the blocking call as the same object
  (same class, same ``status_code``, same ``completed_layers``).
- **Same timeouts**: transfers are bounded by ``sync_kv_timeout`` per layer and links by the
  ``timeout`` argument, enforced by the engine; this layer adds no deadline of its own, and never waits
  forever on a dead loop: a call whose loop thread stopped raises ``RuntimeError`` (after ``finalize``:
  ``LLMException(LLM_ENGINE_FINALIZED)``).
- **Interrupts**: ``KeyboardInterrupt`` while a call waits cancels the engine's coroutine, waits until
  it finished (for a transfer: no byte of it can still land), then re-raises.
- **Threads**: any number of threads may call one instance at once (e.g. one push per thread).
- **Exit**: an instance still initialised when the interpreter exits is finalized then (as LLM-DataDist
  does), cleanly: links closed, memory released, no asyncio noise.

It must not be used from inside a running asyncio event loop: every method raises ``RuntimeError``
there, pointing to the async API, ``kvpush.LLMDataDist``. Where kvpush differs from LLM-DataDist
(several instances per process, block-size checks, links that survive a timeout, IPv6, ...) the async
engine's behaviour applies; see the README.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import kvpush
from kvpush import (
    Cache,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LLMConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

from ..portal import Portal, PortalClosedError, at_exit
from . import rank_table as ranks
from .cache_manager import CacheManager
from .rank_table import Comm, LinkWaiter
from .runner import Runner, refuse_blocking_in_loop
from .transfer_async import CacheTask, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig
from .types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    KvCache,
    MemInfo,
    Memtype,
    RegisterMemStatus,
    Status,
    check_uint,
)

log = logging.getLogger(__name__)

LlmConfig = LLMConfig  # llm_datadist exports both spellings

__all__ = [
    "BlocksCacheKey", "Cache", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "CacheManager", "CacheTask",
    "DataType", "KvCache", "KvCacheExtParam", "LLMClusterInfo", "LLMConfig", "LLMDataDist", "LLMException",
    "LLMRole", "LLMStatusCode", "LayerSynchronizer", "LlmConfig", "MemInfo", "Memtype", "Placement",
    "RegisterMemStatus", "Status", "TransferConfig", "TransferWithCacheKeyConfig",
]

# finalize(): after the engine was finalized, how long (beyond sync_kv_timeout) calls still running on
# the loop get to end with the engine's own error before the portal cancels them.
_STOP_GRACE_S = 2.0
_UNLINK_TIMEOUT_MS = 3000

_live: set[LLMDataDist] = set()  # initialised, not yet finalized


def _finalize_at_exit() -> None:
    """Like llm_datadist: instances still initialised at interpreter exit are finalized."""
    for datadist in list(_live):
        try:
            datadist.finalize()
        except Exception as error:  # exiting anyway; say why this one could not finalize cleanly
            log.warning("kvpush compat: finalize at exit failed for cluster %s: %s", datadist.cluster_id, error)


at_exit(_finalize_at_exit)


def _host_port(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class LLMDataDist:
    """LLM-DataDist's engine with its blocking API: ``LLMDataDist(role, cluster_id)``, then
    ``init(options)``, ``link_clusters`` (or the rank-table ``link``), ``cache_manager...``, ``finalize()``.

    Several instances may live in one process (each has its own loop thread).
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._engine = kvpush.LLMDataDist(role, cluster_id)  # checks role / cluster_id types
        self._runner: Runner | None = None
        self._state = threading.Lock()
        self._finalized = False
        self._cache_manager = CacheManager(self.runner)
        self._waiter = LinkWaiter()
        self._comms: dict[int, Comm] = {}  # rank-table links by comm id (touched on the loop thread)
        self._comm_peers: dict[int, int] = {}  # peer cluster id -> how many comms link to it
        self._next_comm_id = 1

    def __repr__(self) -> str:
        state = "finalized" if self._finalized else "running" if self._runner is not None else "not initialised"
        return f"<kvpush.compat LLMDataDist cluster={self.cluster_id} role={self.role.name} {state}>"

    def runner(self, api: str) -> Runner:
        """The way onto the engine's loop (for this facade's parts). RuntimeError before ``init`` and from
        inside a running event loop, LLMException(LLM_ENGINE_FINALIZED) after ``finalize``."""
        refuse_blocking_in_loop(api)
        return self._running(api)

    def _running(self, api: str) -> Runner:
        runner = self._runner
        if runner is None:
            if self._finalized:
                raise LLMException(LLMStatusCode.LLM_ENGINE_FINALIZED, f"{api}: the engine was finalized")
            raise RuntimeError(f"{api}: call init() first")
        return runner

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
        self._running("cache_manager")
        return self._cache_manager

    @property
    def engine(self) -> kvpush.LLMDataDist:
        """kvpush extra: the async engine underneath. Use it only from this instance's loop thread."""
        return self._engine

    def link_stats(self) -> dict[int, dict[str, Any]]:
        """kvpush extra: per-link counters, keyed by peer cluster id."""
        return self.runner("link_stats").call_sync("link_stats", self._engine.link_stats)

    # -- lifecycle ------------------------------------------------------------------------------------
    def init(self, options: Mapping[str, str] | LLMConfig | None = None) -> None:
        """Start the private loop thread and initialise the engine with ``options`` (a dict of str, as
        ``LLMConfig.generate_options()`` makes, or the ``LLMConfig`` itself). With ``llm.listenIpInfo``
        it listens there. A second call is a no-op. A bad option raises LLMException(LLM_PARAM_INVALID)
        naming the key; the instance then stays uninitialised and ``init`` may be called again."""
        api = "init"
        refuse_blocking_in_loop(api)
        with self._state:
            if self._finalized:
                raise LLMException(LLMStatusCode.LLM_ENGINE_FINALIZED, "init: this instance was finalized")
            if self._runner is not None:
                return
            parsed = dict(options) if isinstance(options, Mapping) else options
            runner = Runner(self._engine, Portal(f"kvpush-compat-{self.cluster_id}"), lambda: self._finalized)

            async def start() -> None:
                await self._engine.init(parsed)
                self._engine.add_link_listener(lambda link, reason: self._waiter.on_link(link.peer_cluster_id,
                                                                                         reason))

            try:
                runner.call(api, start)
            except BaseException:
                runner.portal.close(_STOP_GRACE_S)
                raise
            self._runner = runner
            _live.add(self)

    def finalize(self) -> None:
        """Finalize the engine (force-unlinks every peer; transfers in flight on other threads end
        promptly with LLMException), then stop and join the loop thread. Idempotent; after it every
        call raises LLMException(LLM_ENGINE_FINALIZED)."""
        refuse_blocking_in_loop("finalize")
        with self._state:
            if self._finalized:
                return
            runner, self._runner = self._runner, None
            self._finalized = True
            _live.discard(self)
            if runner is None:  # never initialised: nothing runs; the engine only records the state
                asyncio.run(self._engine.finalize())
                return
            grace = self._engine.options.sync_kv_timeout_ms / 1000 + _STOP_GRACE_S
            try:
                if runner.portal.alive:
                    runner.portal.run(self._finalize_on_loop())
            except PortalClosedError:
                pass  # the loop thread died under it: nothing left to run there
            finally:
                runner.portal.close(grace)

    async def _finalize_on_loop(self) -> None:
        for comm in list(self._comms.values()):
            await self._stop_linking(comm)
        self._comms.clear()
        await self._engine.finalize()

    # -- links ----------------------------------------------------------------------------------------
    def link_clusters(self, clusters: Sequence[LLMClusterInfo],
                      timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to every cluster (concurrently); blocks until each linked or failed within ``timeout``
        ms. Returns (overall code, one code per cluster): LLM_SUCCESS, LLM_LINK_FAILED, LLM_ALREADY_LINK,
        ... — a link that failed does not raise; bad arguments do. Ctrl-C closes half-made connections."""
        api = "link_clusters"
        return self.runner(api).call(api, lambda: self._engine.link_clusters(clusters, timeout))

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000,
                        force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink (non-force: tell the peer and wait up to ``timeout`` ms for its answer; force: close
        only the local end). Returns (overall code, one code per cluster)."""
        api = "unlink_clusters"
        return self.runner(api).call(api, lambda: self._engine.unlink_clusters(clusters, timeout, force))

    def switch_role(self, role: LLMRole, options: Mapping[str, str] | None = None, *,
                    switch_options: Mapping[str, str] | None = None) -> None:
        """Change the role. With ``llm.listenIpInfo`` in ``options`` (llm_datadist calls the argument
        ``switch_options``; both names work) the listener starts or moves there, without it the
        listener stops. LLMException(LLM_EXIST_LINK) while any link exists."""
        if options is not None and switch_options is not None:
            raise TypeError("switch_role: give options or switch_options, not both")
        chosen = options if options is not None else switch_options
        parsed = dict(chosen) if isinstance(chosen, Mapping) else chosen
        self.runner("switch_role").call("switch_role", lambda: self._engine.switch_role(role, parsed))

    def check_link_status(self, remote_cluster_id: int) -> None:
        """Returns when a live link to ``remote_cluster_id`` exists; LLMException(LLM_NOT_YET_LINK)
        otherwise (never linked, unlinked, or dropped because the peer died or went silent)."""
        api = "check_link_status"
        check_uint("remote_cluster_id", remote_cluster_id, 64)
        if remote_cluster_id not in self.runner(api).call_sync(api, lambda: self._engine.links):
            raise LLMException(LLMStatusCode.LLM_NOT_YET_LINK, f"{api}: no link to cluster {remote_cluster_id}")
        log.info("[check_link_status] success")

    # -- rank-table links (see rank_table) ------------------------------------------------------------
    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """LLM-DataDist's rank-table link: returns a comm id at once; the links are made in the
        background (``query_register_mem_status`` says when they are up). See ``rank_table``."""
        api = "link"
        runner = self.runner(api)
        ranks.check_link_args(comm_name, cluster_rank_info, rank_table)
        with self._state:
            comm_id, self._next_comm_id = self._next_comm_id, self._next_comm_id + 1
        comm, listen_at = ranks.plan_comm(comm_id, comm_name, self.cluster_id, cluster_rank_info,
                                               rank_table)
        total_ms = self._engine.options.link_total_time_ms or ranks.DEFAULT_LINK_TOTAL_TIME_MS

        async def start() -> int:
            if listen_at is not None:
                await self._listen_at(api, listen_at)
            for peer in comm.peers:
                self._comm_peers[peer] = self._comm_peers.get(peer, 0) + 1
            comm.task = asyncio.create_task(ranks.establish(self._engine, comm, self._waiter, total_ms),
                                            name=f"kvpush-comm-{comm_id}")
            self._comms[comm_id] = comm
            return comm_id

        return runner.call(api, start)

    async def _listen_at(self, api: str, address: tuple[str, int]) -> None:
        current = self._engine.listen_address
        if current is not None:
            if current[1] == address[1] and current[0] in (address[0], "0.0.0.0", "::"):
                return
            raise LLMException(LLMStatusCode.LLM_PARAM_INVALID,
                               f"{api}: the rank table places this engine at {_host_port(address)}, but it listens "
                               f"on {_host_port(current)}")
        await self._engine.listen(*address)  # existing links (e.g. of another comm) stay as they are

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """PREPARING while the comm's links are being made, OK once all are up, FAILED when one was not
        up within ``llm.LinkTotalTime``."""
        api = "query_register_mem_status"
        check_uint("comm_id", comm_id, 64)
        return self.runner(api).call_sync(api, lambda: self._comm(api, comm_id).status)

    def _comm(self, api: str, comm_id: int) -> Comm:
        comm = self._comms.get(comm_id)
        if comm is None:
            raise LLMException(LLMStatusCode.LLM_PARAM_INVALID, f"{api}: no comm {comm_id}")
        return comm

    def unlink(self, comm_id: int) -> None:
        """Tear down a rank-table link: stop making its links and unlink its peers (those no other comm
        still links to). LLMException(LLM_PARAM_INVALID) for an unknown comm id."""
        api = "unlink"
        check_uint("comm_id", comm_id, 64)

        async def unlink() -> None:
            comm = self._comm(api, comm_id)
            del self._comms[comm_id]
            await self._stop_linking(comm)
            last = []
            for peer in comm.peers:
                self._comm_peers[peer] -= 1
                if self._comm_peers[peer] == 0:
                    del self._comm_peers[peer]
                    last.append(peer)
            if last:
                _, codes = await self._engine.unlink_clusters([ranks.cluster_info(peer) for peer in last],
                                                              _UNLINK_TIMEOUT_MS)
                for peer, code in zip(last, codes):
                    if code != LLMStatusCode.LLM_SUCCESS:  # the local end is closed anyway
                        log.info("%s: comm %d: cluster %d did not confirm the unlink (%s)", api, comm_id, peer,
                                 code.name)

        self.runner(api).call(api, unlink)

    @staticmethod
    async def _stop_linking(comm: Comm) -> None:
        task = comm.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
