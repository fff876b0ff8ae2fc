"""The decode side of kvpush's SGLang transfer backend (``sglang_backend.KvpushKVManager`` is both sides):
before a room's pages go to its prefill ranks the decode opens to each the blocks it writes, until the room
ends; a prefill rank's success counts only once its last byte landed and its aux row came with it (kvpush's
notification); a prefill whose kvpush link closes fails its rooms at once.

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

from . import sglang_core as core
from .vllm_bridge import describe_error
from .vllm_core import dst_ids

log = logging.getLogger(__name__)

_GRANT_TIMEOUT_S = 30.0


class DecodeSide(CommonKVManager):
    """The decode rank's part of ``KvpushKVManager`` (its engine, pool, portal and task scope come from there)."""

    # set by KvpushKVManager.__init__ before this side's state (the rest of ``self`` is SGLang's CommonKVManager)
    portal: Portal
    dd: LLMDataDist
    cache: Cache | None
    layout: core.PoolLayout
    _stopped: bool

    def _init_decode_side(self) -> None:
        """The decode side's state, on the loop thread (a prefill rank has it too, empty)."""
        self._grants: dict[int, list[BlockAccess]] = {}  # a room's grants
        self._room_aux: dict[int, int] = {}  # a room's aux slot
        self._room_prefills: dict[int, set[int]] = {}  # a room's prefill clusters

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

    def grant(self, room: int, bootstrap_infos: list[dict[str, Any]], kv_indices: np.ndarray[Any, Any],
              aux_index: int | None) -> str | None:
        """Before a room's pages are sent to its prefill ranks: open to each one the blocks it writes, and
        remember the room's aux slot. Returns why it could not, or None. Scheduler thread."""
        grants = []
        for info in bootstrap_infos:
            if info.get("is_dummy"):
                continue
            grants.append((core.cluster_id_of(str(info["rank_ip"]), int(info["rank_port"])),
                           int(info.get("attn_tp_rank", info.get("tp_rank", 0))),
                           int(info.get("attn_tp_size", self.layout.tp_size))))
        pages = np.asarray(kv_indices, dtype=np.int64).copy()

        async def open_blocks() -> str | None:
            return self._open(room, grants, pages, aux_index)
        try:
            return self.portal.run(open_blocks(), timeout=_GRANT_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - reported as the room's failure
            return describe_error(error)

    def _open(self, room: int, grants: list[tuple[int, int, int]], pages: np.ndarray[Any, Any],
              aux_index: int | None) -> str | None:
        assert self.cache is not None
        self._revoke(room)
        self._room_prefills[room] = {cluster for cluster, _, _ in grants}
        if aux_index is not None:
            self._room_aux[room] = aux_index
        accesses = self._grants[room] = []
        if not len(pages):
            return None
        tokens = (pages[:, None] * self.layout.page_size + np.arange(self.layout.page_size)).ravel()
        for cluster, tp_rank, tp_size in grants:
            prefill = self._peer_layout(tp_rank, tp_size)
            leg = core.overlap(prefill, self.layout)
            if leg is None:
                continue
            try:
                accesses.append(self.dd.cache_manager.allow(self.cache, cluster, dst_ids(leg, tokens,
                                                                                         self.layout.local_heads)))
            except (LLMException, TypeError, ValueError) as error:
                return f"kvpush: cannot open room {room}'s pages to cluster {cluster}: {describe_error(error)}"
        return None

    def _peer_layout(self, tp_rank: int, tp_size: int) -> core.PoolLayout:
        """A prefill rank's pool as this decode rank assumes it (the prefill checks the assumption at
        registration and fails every room it cannot serve)."""
        mine = self.layout
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

    def _on_link(self, link: Any, reason: str | None) -> None:
        """A prefill's link closed: fail, now, every room still waiting on that prefill rank."""
        peer = getattr(link, "peer_cluster_id", None)
        if reason is None or peer is None:
            return
        for room, clusters in list(self._room_prefills.items()):
            if peer in clusters and self.request_status.get(room) not in (None, KVPoll.Success):
                self.record_failure(room, f"kvpush: the link to the prefill (cluster {peer}) closed: {reason}")
                self.update_status(room, KVPoll.Failed)
                self._revoke(room)
