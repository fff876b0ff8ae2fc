"""The decode side of kvpush's SGLang transfer backend (``backend.KvpushKVManager`` is both sides):
before a room's pages go to its prefill ranks the decode opens to each the blocks it writes, until the room
ends; a prefill rank's success counts only once its last byte landed and its aux row came with it (kvpush's
notification).

A prefill that dies strands nothing, whatever stage its rooms are in. Its kvpush link closing fails, at once, the
rooms it was writing; the decode then asks whether the rank's process still listens (``liveness``), and while it
does and a room or an armed abort waits on it, asks again until it links again (a dying process closes its sockets
one after another, and a slow shutdown can keep its address open for longer; a prefill granted a room before it
ever linked is watched the same way). Once nothing listens, the prefill is gone in SGLang's own terms
(``_handle_node_failure``, what its heartbeat does seconds later): every room from it fails, waiting for a slot or
bootstrapped included, and its cached bootstrap is dropped, so the next request bootstraps afresh, against a
restarted prefill too. Once nothing of the closed link can land (``LLMDataDist.settled``), the decode acknowledges
the gone ranks' share of the rooms' aborts itself, so their pages and slots are released at once rather than after
SGLang's deferred-release timeout. A room that meets a gone prefill later fails as soon as it does: at its
bootstrap (nothing listens at the prefill's bootstrap server) or before its pages are sent to a rank it has no
link to. The watch lasts at most twice SGLang's own waiting timeout.

Threads: SGLang's scheduler calls ``grant`` and the receiver's hooks, SGLang's ZMQ control thread
(``_decode_thread``) reads the prefills' statuses; every kvpush call runs on the manager's event-loop thread
(``portal``).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager

from kvpush import BlockAccess, Cache, Delivery, LLMDataDist, LLMException
from kvpush.portal import Portal

from ..errors import describe_error
from ..liveness import WAIT_S, WATCH_S, Watches, gone, gone_after_close, split_host_port
from ..topology import dst_ids
from . import core

log = logging.getLogger(__name__)

_GRANT_TIMEOUT_S = 30.0


class DecodeSide(CommonKVManager):
    """The decode rank's part of ``KvpushKVManager`` (its engine, pool, portal and task scope come from there)."""

    # set by KvpushKVManager.__init__ before this side's state (the rest of ``self`` is SGLang's CommonKVManager)
    portal: Portal
    dd: LLMDataDist
    cache: Cache | None
    state_caches: list[list[Cache]]
    states: tuple[core.StatePool, ...]
    layout: core.PoolLayout
    _stopped: bool

    def _init_decode_side(self) -> None:
        """The decode side's state, on the loop thread (a prefill rank has it too, empty)."""
        self._grants: dict[int, list[BlockAccess]] = {}  # a room's grants
        self._room_aux: dict[int, int] = {}  # a room's aux slot
        self._room_prefills: dict[int, set[int]] = {}  # a room's prefill clusters (loop thread)
        # every prefill rank known from SGLang's bootstrap, and the ranks of each room whose abort SGLang armed
        # (scheduler thread writes, the loop thread reads copies)
        self._prefill_ranks: dict[int, core.PrefillRank] = {}
        self._armed: dict[int, dict[int, core.PrefillRank]] = {}
        self._gone: set[int] = set()  # prefill clusters whose process is gone and of which nothing can land
        self._prefill_watches = Watches(self._tasks.spawn)  # prefill clusters watched until gone or linked

    def _decode_thread(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            msg = recv()
            if msg is None or self.handle_abort_ack_message(msg):
                continue
            parsed = self.parse_kv_status_message(msg)
            if parsed is None:
                continue
            room, status, prefill_rank, reason = parsed
            # a success counts only with its aux row, which comes over kvpush after the last byte (``_on_done``);
            # this channel carries failures (and, with --disaggregation-decode-allocation-policy prefill_complete,
            # SGLang's readiness notice)
            if status == KVPoll.Success:
                continue
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=prefill_rank,
                                      failure_reason=reason)
            if status == KVPoll.Failed:
                self.release(room)

    # -- what a room is waiting on (scheduler thread) -----------------------------------------------
    def track_prefill(self, bootstrap_addr: str, bootstrap_infos: list[dict[str, Any]]) -> None:
        """A room was bootstrapped to these prefill ranks: know them (until they are gone)."""
        self._prefill_ranks.update(core.prefill_ranks(bootstrap_addr, bootstrap_infos))

    def armed(self, room: int, generation: int | None, bootstrap_addr: str,
              bootstrap_infos: list[dict[str, Any]]) -> None:
        """SGLang armed ``generation`` of the room's abort and sent it to the room's prefill ranks: remember
        them until the room is released (``clear_deferred_abort_state``), and acknowledge now for the gone ones,
        which never will and of which nothing can land any more."""
        if generation is None:
            return
        ranks = self._armed[room] = core.prefill_ranks(bootstrap_addr, bootstrap_infos)
        for cluster, rank in ranks.items():
            if cluster in self._gone:
                self.note_abort_ack(room, rank.rank, generation)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        super().clear_deferred_abort_state(bootstrap_room)
        self._armed.pop(bootstrap_room, None)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's bootstrap of a prefill it knows nothing of yet, which it retries once a second for 15 s
        while the bootstrap server does not answer; when nothing listens there at all, the rooms waiting on it
        fail now instead."""
        if bootstrap_addr not in self.prefill_info_table:
            try:
                reason = gone(*split_host_port(bootstrap_addr))
            except ValueError:
                reason = None  # SGLang reports an address it cannot use itself
            if reason is not None:
                log.info("kvpush SGLang backend: prefill bootstrap server %s: %s; its requests fail now",
                         bootstrap_addr, reason)
                self._handle_node_failure(bootstrap_addr)
                return False
        ensured: bool = super().try_ensure_parallel_info(bootstrap_addr)
        return ensured

    def grant(self, room: int, bootstrap_infos: list[dict[str, Any]], kv_indices: np.ndarray[Any, Any],
              aux_index: int | None, state_indices: list[Any] | None = None) -> str | None:
        """Before a room's pages (and its state's, ``state_indices``: per state pool) are sent to its prefill
        ranks: open to each one the blocks it writes, and remember the room's aux slot. Returns why it could not,
        or None: a rank with no kvpush link to this decode whose process is gone is one reason. Scheduler
        thread."""
        grants = []
        links = self.dd.links
        for info in bootstrap_infos:
            if info.get("is_dummy"):
                continue
            host, port = str(info["rank_ip"]), int(info["rank_port"])
            cluster = core.cluster_id_of(host, port)
            if cluster not in links:
                reason = gone(host, port)
                if reason is not None:
                    self.portal.call_soon(self._prefill_lost, cluster, reason)
                    return f"kvpush: the prefill rank at {host}:{port} is gone: {reason}"
                # it listens, with no link yet (or its link just closed): watched until it links or is gone,
                # so that a prefill that dies before it links strands nothing either
                self.portal.call_soon(self._watch_prefill, cluster, None)
            grants.append((cluster, int(info.get("attn_tp_rank", info.get("tp_rank", 0))),
                           int(info.get("attn_tp_size", self.layout.tp_size))))
        pages = np.asarray(kv_indices, dtype=np.int64).copy()
        states = [None if part is None else np.asarray(part, np.int64).copy() for part in state_indices or []]

        async def open_blocks() -> str | None:
            return self._open(room, grants, pages, aux_index, states)
        try:
            return self.portal.run(open_blocks(), timeout=_GRANT_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - reported as the room's failure
            return describe_error(error)

    def _open(self, room: int, grants: list[tuple[int, int, int]], pages: np.ndarray[Any, Any],  # noqa: PLR0913
              aux_index: int | None, states: list[np.ndarray[Any, Any] | None] | None = None) -> str | None:
        assert self.cache is not None
        self._revoke(room)
        self._room_prefills[room] = {cluster for cluster, _, _ in grants}
        if aux_index is not None:
            self._room_aux[room] = aux_index
        accesses = self._grants[room] = []
        opened: list[tuple[Cache, core.PoolLayout | None, np.ndarray[Any, Any]]] = \
            [(self.cache, self.layout, pages)] if len(pages) else []
        for pool, caches, part in zip(self.states, self.state_caches, states or []):
            if part is None or not len(part):
                continue
            if pool.window is not None:
                opened.append((caches[0], pool.window, part))
            else:  # a recurrent state: its slot in every slot size
                opened += [(cache, None, part) for cache in caches]
        for cluster, tp_rank, tp_size in grants:
            for cache, layout, ids in opened:
                if layout is None:
                    blocks = ids
                else:
                    leg = core.overlap(self._peer_layout(tp_rank, tp_size, layout), layout)
                    if leg is None:
                        continue
                    tokens = (ids[:, None] * layout.page_size + np.arange(layout.page_size)).ravel()
                    blocks = dst_ids(leg, tokens, layout.local_heads)
                try:
                    accesses.append(self.dd.cache_manager.allow(cache, cluster, blocks))
                except (LLMException, TypeError, ValueError) as error:
                    return f"kvpush: cannot open room {room}'s pages to cluster {cluster}: {describe_error(error)}"
        return None

    def _peer_layout(self, tp_rank: int, tp_size: int, mine: core.PoolLayout | None = None) -> core.PoolLayout:
        """A prefill rank's pool (``mine``'s counterpart: the KV pool's by default) as this decode rank assumes it
        (the prefill checks the assumption at registration and fails every room it cannot serve)."""
        mine = mine or self.layout
        local = 1 if mine.mla else max(1, mine.total_heads // tp_size)
        return core.PoolLayout(mine.buffers, mine.pages, mine.page_size, local,
                               mine.slab_bytes, mine.total_heads, tp_size, tp_rank, mine.mla)

    def release(self, room: int) -> None:
        """The room ended (any thread): revoke its grants; nothing of it lands from now on."""
        self.portal.call_soon(self._revoke, room)

    def _revoke(self, room: int) -> None:
        for access in self._grants.pop(room, []):
            access.revoke()
        self._room_aux.pop(room, None)
        self._room_prefills.pop(room, None)

    async def _read_done(self, inbox: Any) -> None:
        try:
            async for delivery in inbox:
                self._on_done(delivery)
        except LLMException:
            return  # finalized

    def _on_done(self, delivery: Delivery) -> None:
        """A prefill rank's last byte of a room landed: write its aux row into the room's own slot, then
        count that rank's success. A room this rank did not grant that cluster is ignored."""
        try:
            done = core.decode_done(delivery.data)
        except core.LayoutError as error:
            log.warning("kvpush SGLang backend: notification from cluster %d ignored: %s",
                        delivery.peer_cluster_id, error)
            return
        if delivery.peer_cluster_id not in self._room_prefills.get(done.room, ()):
            log.info("kvpush SGLang backend: done for room %d from cluster %d, which is not its prefill (ended?)",
                     done.room, delivery.peer_cluster_id)
            return
        aux_index = self._room_aux.get(done.room)
        if aux_index is not None:
            for ptr, size, row in zip(self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens, done.aux):
                ctypes.memmove(ptr + aux_index * size, row, min(size, len(row)))
        self.apply_prefill_status(bootstrap_room=done.room, status=KVPoll.Success, prefill_rank=done.prefill_rank)

    # -- a prefill that is gone (loop thread) ------------------------------------------------------
    def _on_link(self, link: Any, reason: str | None) -> None:
        """A prefill's link closed: fail, now, every room it was writing, and find out whether it is gone.
        A link that comes up makes its cluster a live one again (a prefill restarted at the same address)."""
        peer = getattr(link, "peer_cluster_id", None)
        if peer is None:
            return
        if reason is None:
            self._gone.discard(peer)
            return
        for room, clusters in list(self._room_prefills.items()):
            if peer in clusters and self.request_status.get(room) not in (None, KVPoll.Success):
                self.record_failure(room, f"kvpush: the link to the prefill (cluster {peer}) closed: {reason}")
                self.update_status(room, KVPoll.Failed)
                self._revoke(room)
        self._watch_prefill(peer, reason)

    def _watch_prefill(self, cluster: int, reason: str | None) -> None:
        """Find out whether prefill rank ``cluster`` is gone: its link closed for ``reason``, or (None) a room
        was granted to it while it has no link. One watch per rank at a time."""
        rank = self._prefill_ranks.get(cluster)
        if rank is not None:
            self._prefill_watches.start(cluster, lambda: self._check_prefill(cluster, rank, reason))

    async def _check_prefill(self, cluster: int, rank: core.PrefillRank, reason: str | None) -> None:
        """If the rank's process is gone, so is the prefill. A live one keeps its rooms: its next push links
        (again). One that still listens is asked again until it links (``liveness.gone_after_close``): after its
        link closed, for ``liveness.WATCH_S`` and then while a room or an armed abort waits on it; one granted a
        room with no link (``grant`` saw it accept), while such a room waits. At most twice SGLang's waiting
        timeout (what ends those rooms otherwise)."""
        def waiting() -> bool:
            return bool(self.addr_to_rooms_tracker.get(rank.bootstrap_addr)) or any(
                cluster in ranks for ranks in list(self._armed.values()))
        closed = reason is not None
        verdict = await gone_after_close(rank.host, rank.port, lambda: cluster in self.dd.links, waiting,
                                         within=WATCH_S if closed else 0.0, accepted=not closed,
                                         until=2 * float(getattr(self, "waiting_timeout", WAIT_S)))
        if verdict is not None:
            self._prefill_lost(cluster, verdict if reason is None else f"the link closed ({reason}) and {verdict}")

    def _prefill_lost(self, cluster: int, reason: str) -> None:
        """Prefill rank ``cluster`` is gone: SGLang's node failure for its bootstrap address, now (every room
        from it fails, its bootstrap is dropped); its share of the rooms' aborts is acknowledged once nothing
        of its links can land (``_acknowledge_when_settled``)."""
        rank = self._prefill_ranks.pop(cluster, None)
        if rank is None:
            return
        log.warning("kvpush SGLang backend: prefill rank at %s:%d (bootstrap %s) is gone: %s; its requests fail now",
                    rank.host, rank.port, rank.bootstrap_addr, reason)
        self._handle_node_failure(rank.bootstrap_addr)
        self._tasks.spawn(self._acknowledge_when_settled(cluster))

    async def _acknowledge_when_settled(self, cluster: int) -> None:
        """Once nothing of ``cluster``'s closed links can land: it counts as gone, and its share of every abort
        SGLang armed is acknowledged (later ones by ``armed``). Cancelling it (teardown) leaves
        them to SGLang's deferred-release timeout."""
        await self.dd.settled(cluster)
        self._gone.add(cluster)
        for room, ranks in list(self._armed.items()):
            state = self._deferred_abort_ack_tracker.get(room)
            if cluster in ranks and state is not None:
                self.note_abort_ack(room, ranks[cluster].rank, state.generation)
