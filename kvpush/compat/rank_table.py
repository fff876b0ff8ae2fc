"""LLM-DataDist's rank-table links (``LLMDataDist.link(comm_name, cluster_rank_info, rank_table)``) on
kvpush's ``link_clusters``.

A rank table (HCCL's JSON: ``server_list[].device[]`` entries with ``rank_id`` and ``device_ip``) says
where each rank is; ``cluster_rank_info`` maps each cluster id of the comm to its rank. On kvpush a comm
is the set of links between its clusters, one per pair, made in one direction so the two ends never
cross: **the higher rank dials the lower rank**, which listens. Where:

- a rank's address is its device entry's ``device_ip`` (else its server's ``host_ip``, else its
  ``server_id``) and ``device_port`` (kvpush's reading of the rank table; 26000, the port the
  LLM-DataDist samples listen on, when the entry has none);
- a rank that some higher rank dials must listen there: if its engine is not listening yet, ``link``
  starts the listener at that address (``kvpush.LLMDataDist.listen``: links the engine already has stay);
  if it listens elsewhere, ``link`` raises LLM_PARAM_INVALID.

``link`` returns at once with a comm id (1, 2, ... per instance). The links are made in the background:
the dialing side retries until the peer listens, the listening side waits for the peer's link, both
within ``llm.LinkTotalTime`` ms (default 120 000, HCCL's default connect timeout).
``query_register_mem_status(comm_id)`` says PREPARING until every link of the comm is up, then OK, or
FAILED when that did not happen in time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from kvpush import LLMClusterInfo, LLMException, LLMStatusCode

from .types import RegisterMemStatus, check_uint, require

log = logging.getLogger(__name__)

DEFAULT_PORT = 26000
DEFAULT_LINK_TOTAL_TIME_MS = 120_000
MAX_COMM_NAME = 128
MAX_NODES = 4
_DIAL_TIMEOUT_MS = 3000
_RETRY_FIRST_S, _RETRY_MAX_S = 0.05, 1.0  # a peer that does not listen yet is retried, backing off to 1 s


def check_link_args(comm_name: object, cluster_rank_info: object, rank_table: object) -> None:
    """LLM-DataDist's argument checks for ``link``, in its order."""
    if not isinstance(comm_name, str):
        raise TypeError(f"comm_name only support ['str'], but got {type(comm_name)}.")
    require(len(comm_name) != 0, "comm_name can not be empty")
    require(len(comm_name) < MAX_COMM_NAME, "comm_name length should be smaller than 128.")
    if not isinstance(cluster_rank_info, dict):
        raise TypeError(f"cluster_rank_info only support ['dict'], but got {type(cluster_rank_info)}.")
    for key, value in cluster_rank_info.items():
        for what, item in (("key", key), ("value", value)):
            if isinstance(item, bool) or not isinstance(item, int):
                raise TypeError(f"cluster_rank_info dict {what} only support {int}, but got {type(item)}.")
    require(len(cluster_rank_info) <= MAX_NODES, "cluster_rank_info size can not be greater than 4.")
    for key, value in cluster_rank_info.items():
        check_uint("cluster_rank_info key", key, 64)
        check_uint("cluster_rank_info value", value, 32)
    if not isinstance(rank_table, str):
        raise TypeError(f"rank_table only support ['str'], but got {type(rank_table)}.")
    ranks = list(cluster_rank_info.values())
    require(len(ranks) > 1, "cluster num must be bigger than 1.")
    require(ranks == sorted(ranks), "rank in cluster_rank_info must be ordered")
    require(len(set(ranks)) == len(ranks), "rank in cluster_rank_info can not be duplicated.")


def rank_addresses(rank_table: str, ranks: list[int]) -> dict[int, tuple[str, int]]:
    """Each rank's (ip, port) from the rank table. LLM_PARAM_INVALID when it is not there."""
    try:
        table = json.loads(rank_table)
    except ValueError as error:
        raise LLMException(f"rank_table is not JSON: {error}", status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    servers = table.get("server_list") if isinstance(table, dict) else None
    require(isinstance(servers, list), "rank_table has no server_list")
    found: dict[int, tuple[str, int]] = {}
    for server in servers:  # type: ignore[union-attr]
        if not isinstance(server, dict):
            continue
        for device in server.get("device") or []:
            if not isinstance(device, dict) or "rank_id" not in device:
                continue
            try:
                rank = int(device["rank_id"])
            except (TypeError, ValueError):
                raise LLMException(f"rank_table: rank_id {device['rank_id']!r} is not an integer",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
            ip = device.get("device_ip") or server.get("host_ip") or server.get("server_id")
            require(isinstance(ip, str) and bool(ip), f"rank_table: rank {rank} has no device_ip, host_ip or server_id")
            try:
                port = int(device.get("device_port", DEFAULT_PORT))
            except (TypeError, ValueError):
                raise LLMException(f"rank_table: rank {rank} has device_port {device.get('device_port')!r}",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
            require(0 < port < 65536, f"rank_table: rank {rank} has device_port {port}")
            found[rank] = (str(ip), port)
    missing = [rank for rank in ranks if rank not in found]
    require(not missing, f"rank_table has no device entry with rank_id {missing}")
    return {rank: found[rank] for rank in ranks}


@dataclass
class Comm:
    """One rank-table link: which peers this engine dials, which it waits for, and the task doing it."""

    comm_id: int
    name: str
    peers: dict[int, tuple[str, int]]  # peer cluster id -> its address
    dial: list[int]  # peers of lower rank (this engine dials them)
    await_: list[int]  # peers of higher rank (they dial this engine)
    task: asyncio.Task[None] | None = None  # establish(), on the engine's loop
    failure: str | None = None
    linked: set[int] = field(default_factory=set)

    @property
    def status(self) -> RegisterMemStatus:
        if self.task is None or not self.task.done():
            return RegisterMemStatus.PREPARING
        if self.task.cancelled() or self.task.exception() is not None or self.failure is not None:
            return RegisterMemStatus.FAILED
        return RegisterMemStatus.OK


def plan_comm(comm_id: int, name: str, cluster_id: int, cluster_rank_info: dict[int, int],
              rank_table: str) -> tuple[Comm, tuple[str, int] | None]:
    """The comm and, when some higher rank dials this engine, the address it must listen on."""
    require(cluster_id in cluster_rank_info, f"cluster_rank_info has no entry for this engine's cluster {cluster_id}")
    ranks = list(cluster_rank_info.values())
    addresses = rank_addresses(rank_table, ranks)
    own_rank = cluster_rank_info[cluster_id]
    peers = {peer: addresses[rank] for peer, rank in cluster_rank_info.items() if peer != cluster_id}
    dial = [peer for peer, rank in cluster_rank_info.items() if peer != cluster_id and rank < own_rank]
    await_ = [peer for peer, rank in cluster_rank_info.items() if peer != cluster_id and rank > own_rank]
    return Comm(comm_id, name, peers, dial, await_), addresses[own_rank] if await_ else None


def cluster_info(cluster_id: int, address: tuple[str, int] | None = None) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    if address is not None:
        info.append_remote_ip_info(*address)
    return info


class LinkWaiter:
    """Futures waiting for "the engine has a link to cluster X", resolved by the engine's link listener."""

    def __init__(self) -> None:
        self._waiting: dict[int, list[asyncio.Future[None]]] = {}

    def on_link(self, cluster_id: int | None, reason: str | None) -> None:
        """The engine's link listener (on the loop): a link became ready (reason None) or closed."""
        if reason is None and cluster_id is not None:
            for waiter in self._waiting.pop(cluster_id, []):
                if not waiter.done():
                    waiter.set_result(None)

    async def wait(self, cluster_id: int, linked: dict[int, Any], seconds: float) -> bool:
        if cluster_id in linked:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(cluster_id, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, seconds)
        except TimeoutError:
            return False
        finally:
            waiters = self._waiting.get(cluster_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
        return True


async def establish(engine: Any, comm: Comm, waiter: LinkWaiter, total_ms: int) -> None:
    """Make every link of ``comm`` (see the module docstring); sets ``comm.failure`` when one is not up
    within ``total_ms``. Cancelling it stops dialing and waiting (links already made stay)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total_ms / 1000

    async def dial(peer: int) -> None:
        info = cluster_info(peer, comm.peers[peer])
        pause = _RETRY_FIRST_S
        while True:
            remaining_ms = int((deadline - loop.time()) * 1000)
            if remaining_ms <= 0:
                raise TimeoutError(f"cluster {peer} at {comm.peers[peer]} did not accept a link in {total_ms} ms")
            _, codes = await engine.link_clusters([info], timeout=min(remaining_ms, _DIAL_TIMEOUT_MS))
            if codes[0] in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
                comm.linked.add(peer)
                return
            log.debug("link %s: cluster %d not reachable yet (%s); retrying", comm.name, peer, codes[0].name)
            await asyncio.sleep(min(pause, max(deadline - loop.time(), 0.0)))
            pause = min(pause * 2, _RETRY_MAX_S)

    async def accept(peer: int) -> None:
        if not await waiter.wait(peer, engine.links, max(deadline - loop.time(), 0.0)):
            raise TimeoutError(f"cluster {peer} did not link within {total_ms} ms")
        comm.linked.add(peer)

    try:
        async with asyncio.TaskGroup() as group:
            for peer in comm.dial:
                group.create_task(dial(peer), name=f"kvpush-comm-{comm.comm_id}-dial-{peer}")
            for peer in comm.await_:
                group.create_task(accept(peer), name=f"kvpush-comm-{comm.comm_id}-accept-{peer}")
    except* Exception as failed:  # a peer that never came, or an engine error: the comm FAILED, and why
        comm.failure = "; ".join(str(error) for error in failed.exceptions)
        log.warning("link %s (comm %d) failed: %s", comm.name, comm.comm_id, comm.failure)
    else:
        log.info("link %s (comm %d): linked to clusters %s", comm.name, comm.comm_id, sorted(comm.linked))
