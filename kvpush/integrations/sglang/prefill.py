"""The prefill side of kvpush's SGLang transfer backend (``backend.KvpushKVManager`` is both sides):
decode ranks register here and the prefill links to their kvpush engines; each chunk of a room becomes one
``push_blocks`` per decode rank, in order, the last one carrying the room's aux row; aborts from either side
end the other side's part of the room at once, whenever it comes, and never before the last byte that may land
did.

Threads: SGLang's scheduler calls ``add_transfer_request`` and the sender's hooks, SGLang's ZMQ control thread
(``_prefill_thread``) reads registrations, destinations and aborts; every kvpush call runs on the manager's
event-loop thread (``portal``).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG, ABORT_TAG, AbortNotification, CommonKVManager
from sglang.srt.utils.network import NetworkAddress

from kvpush import BlocksCacheKey, Cache, LLMClusterInfo, LLMDataDist, LLMException, LLMStatusCode
from kvpush.portal import Portal
from kvpush.scope import TaskScope

from ..errors import describe_error
from ..liveness import WAIT_S, Watches, gone_after_close, split_host_port
from . import core

log = logging.getLogger(__name__)


@dataclass
class TransferInfo:
    """A decode rank's destination for one room, as the prefill rank keeps it (SGLang's fields: Common's
    helpers read ``endpoint``, ``dst_port``, ``is_dummy`` and ``required_dst_info_num``)."""

    room: int
    endpoint: str
    dst_port: int
    session: str
    dst_kv_indices: np.ndarray[Any, Any]
    dst_aux_index: int | None
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: int | None = None
    dst_state_indices: list[np.ndarray[Any, Any] | None] | None = None  # per state pool (``core.StatePool``)

    @classmethod
    def from_zmq(cls, msg: list[bytes]) -> TransferInfo:
        is_dummy = msg[4] == b"" and msg[5] == b""
        return cls(room=int(msg[0]), endpoint=msg[1].decode("ascii"), dst_port=int(msg[2]),
                   session=msg[3].decode("ascii"),
                   dst_kv_indices=np.frombuffer(msg[4], dtype=np.int32) if not is_dummy else np.empty(0, np.int32),
                   dst_aux_index=None if is_dummy else int(msg[5]), required_dst_info_num=int(msg[6]),
                   is_dummy=is_dummy, decode_prefix_len=int(msg[7]) if len(msg) > 7 and msg[7] else None,
                   dst_state_indices=core.decode_state_indices(msg[8]) if len(msg) > 8 and msg[8] else None)


@dataclass
class DecodePeer:
    """A decode rank that registered with this prefill rank: its kvpush engine, pool and aux sizes, and why
    KV cannot go to it (``refusal``), if it cannot."""

    session: str
    registration: core.Registration
    refusal: str | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class PrefillSide(CommonKVManager):
    """The prefill rank's part of ``KvpushKVManager`` (its engine, pool, portal and task scope come from there)."""

    # set by KvpushKVManager.__init__ before this side's state (the rest of ``self`` is SGLang's CommonKVManager)
    portal: Portal
    dd: LLMDataDist
    cache: Cache | None
    state_caches: list[list[Cache]]
    states: tuple[core.StatePool, ...]
    layout: core.PoolLayout
    settings: core.BackendSettings
    _tasks: TaskScope
    _stopped: bool

    def _init_prefill_side(self) -> None:
        """The prefill side's state (a decode rank has it too, empty): on the loop thread, but the aborted rooms
        (any thread, locked)."""
        self.peers: dict[str, DecodePeer] = {}  # decode ranks by session
        self._pushes: dict[tuple[int, str], list[asyncio.Task[None]]] = {}  # a room's pushes per decode session
        self._room_waiting: dict[int, set[str]] = {}
        self._decode_watches = Watches(self._tasks.spawn)  # decode sessions watched until gone or linked again
        # rooms aborted before the other side's part came: see ``core.AbortedRooms``
        self._aborted_here = core.AbortedRooms()  # by this prefill, before the decode's destination came
        self._aborted_by_decode = core.AbortedRooms()  # by a decode, before this prefill's request came
        self._aborted_lock = threading.Lock()  # the two above, from SGLang's threads and the loop thread

    def _prefill_thread(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            msg = recv()
            if msg is None:
                continue
            try:
                self._on_prefill_message(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the control thread
                log.exception("kvpush SGLang backend: control message %r dropped", msg[:1])

    def _on_prefill_message(self, msg: list[bytes]) -> None:
        if msg[0] == ABORT_TAG:
            self._on_abort(msg)
        elif msg[0] == core.REGISTER_ROOM:
            self._on_registration(msg)
        else:
            info = TransferInfo.from_zmq(msg)
            infos = self.transfer_infos.setdefault(info.room, {})
            infos[info.session] = info
            with self._aborted_lock:  # checked after registering: see ``abort_own_room``
                reason = self._aborted_here.reason(info.room)
            if reason is not None:
                # this prefill aborted the room before the decode's destination came: end the decode's side now
                # (nothing of the room was pushed), rather than after SGLang's waiting timeout
                infos.pop(info.session, None)
                if not infos:
                    self.transfer_infos.pop(info.room, None)
                if not info.is_dummy:
                    self.send_kv_status_message(targets=[(info.endpoint, info.dst_port)], bootstrap_room=info.room,
                                                status=KVPoll.Failed, failure_reason=reason)
                return
            if len(infos) == info.required_dst_info_num:
                self.resolve_kv_replica_factor(infos)
                self.req_to_decode_prefix_len[info.room] = next(
                    (i.decode_prefix_len for i in infos.values() if i.decode_prefix_len is not None), 0)
                self.update_status(info.room, KVPoll.WaitingForInput)

    def _on_registration(self, msg: list[bytes]) -> None:
        session = msg[3].decode("ascii")
        try:
            registration = core.Registration.decode(msg[4])
            refusal = core.incompatibility(self.layout, registration.layout, self.states, registration.states)
        except (core.LayoutError, IndexError) as error:
            log.error("kvpush SGLang backend: decode %s registered what this prefill cannot read: %s", session, error)
            return
        self.check_peer_aux_buffer_count(session, len(registration.aux_item_lens))
        if refusal is None and registration.aux_item_lens[:len(self.kv_args.aux_item_lens)] != tuple(
                self.kv_args.aux_item_lens[:len(registration.aux_item_lens)]):
            refusal = (f"aux (metadata) buffers: prefill {list(self.kv_args.aux_item_lens)} bytes per row, decode "
                       f"{list(registration.aux_item_lens)}")
        if refusal is not None:
            log.error("kvpush SGLang backend: refuses to send KV to decode %s: %s", session, refusal)
        self.portal.call_soon(self._add_peer, DecodePeer(session, registration, refusal))

    def _add_peer(self, peer: DecodePeer) -> None:
        self.peers[peer.session] = peer
        self._tasks.spawn(self._link(peer))  # early, so the first room does not wait for it

    async def _link(self, peer: DecodePeer) -> None:
        """Link to ``peer``'s engine unless linked. Raises LLMException (the link's status) if it cannot be.
        Bounded by ``KVPUSH_LINK_TIMEOUT_MS``; cancelling it abandons the attempt."""
        registration = peer.registration
        async with peer.lock:
            if registration.cluster_id in self.dd.links:
                return
            info = LLMClusterInfo()
            info.remote_cluster_id = registration.cluster_id
            info.append_remote_ip_info(registration.host, registration.port)
            _, codes = await self.dd.link_clusters([info], timeout=self.settings.link_timeout_ms)
            if codes[0] not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
                raise LLMException(codes[0], f"link to decode {peer.session}'s kvpush engine at "
                                             f"{registration.host}:{registration.port}: {codes[0].name}")

    def _on_decode_link(self, link: Any, reason: str | None) -> None:
        """A link to a decode rank closed (loop thread): find out whether that rank is gone."""
        cluster = getattr(link, "peer_cluster_id", None)
        if reason is None or cluster is None:
            return
        for peer in list(self.peers.values()):
            if peer.registration.cluster_id == cluster:
                self._decode_watches.start(peer.session, functools.partial(self._check_decode, peer, reason))

    async def _check_decode(self, peer: DecodePeer, reason: str) -> None:
        """``peer``'s link closed for ``reason``: if its process is gone (nothing listens at its control
        address), every room it was to receive fails now, its pushes cancelled, and it is forgotten (a restarted
        decode registers again). A live one keeps its rooms: the next push links again. One that still listens
        is asked again until it links again (``liveness.gone_after_close``): for ``liveness.WATCH_S``, then while a
        room waits on it, at most twice SGLang's bootstrap timeout (what ends those rooms otherwise)."""
        cluster = peer.registration.cluster_id

        def waiting() -> bool:
            return any(peer.session in infos for infos in list(self.transfer_infos.values()))
        verdict = await gone_after_close(*split_host_port(peer.session), lambda: cluster in self.dd.links, waiting,
                                         until=2 * float(getattr(self, "bootstrap_timeout", WAIT_S)))
        if verdict is None or self.peers.get(peer.session) is not peer:
            return
        del self.peers[peer.session]
        # a copy: SGLang's control thread adds rooms meanwhile
        rooms = [room for room, infos in list(self.transfer_infos.items()) if peer.session in infos]
        log.warning("kvpush SGLang backend: decode %s is gone (the link closed: %s; %s): %d of its requests fail now",
                    peer.session, reason, verdict, len(rooms))
        for room in rooms:
            self._cancel_room(room)
            if self.request_status.get(room) not in (None, KVPoll.Success):
                self._fail_room(room, f"kvpush: the decode {peer.session} is gone: {verdict}", [])

    def add_transfer_request(self, bootstrap_room: int, kv_indices: np.ndarray[Any, Any],  # noqa: PLR0913 (SGLang's)
                             index_slice: slice,
                             is_last_chunk: bool, aux_index: int | None = None, state_indices: list[Any] | None = None,
                             num_kv_tokens: int | None = None, *, wait_event: Any = None, indices_event: Any = None,
                             trace_ctx: Any = None) -> None:
        """Queue one chunk of a room's pages (SGLang's scheduler thread; never blocks on the network)."""
        if bootstrap_room not in self.request_status or self.check_status(bootstrap_room) == KVPoll.Failed:
            return
        infos = self.transfer_infos.get(bootstrap_room)
        if infos is None:
            return  # a dummy rank of this room: SGLang already settled it
        states = None
        if is_last_chunk and state_indices and any(part is not None for part in state_indices):
            states = [None if part is None else np.asarray(part, np.int64).copy() for part in state_indices]
        for event in (indices_event, wait_event):  # CPU pools have none; a device event would be waited for here
            if event is not None and hasattr(event, "synchronize"):
                event.synchronize()
        targets = [info for info in infos.values() if not info.is_dummy]
        src_pages = np.asarray(kv_indices, dtype=np.int64).copy()
        self.portal.call_soon(self._queue_pushes, bootstrap_room, targets, src_pages, index_slice, is_last_chunk,
                              aux_index, states)

    def _queue_pushes(self, room: int, targets: list[TransferInfo], src_pages: np.ndarray[Any, Any],  # noqa: PLR0913
                      index_slice: slice, last: bool, aux_index: int | None,
                      states: list[np.ndarray[Any, Any] | None] | None = None) -> None:
        # on the loop thread, as aborts are (``_abort_room``): a room failed before its chunk got here never
        # starts it, and one that did not is counted before an abort can look
        if self.request_status.get(room) in (None, KVPoll.Failed):
            return
        if not targets:
            if last:
                self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success, targets=[])
            return
        self._room_waiting.setdefault(room, {info.session for info in targets})
        for info in targets:
            earlier = self._pushes.setdefault((room, info.session), [])
            self._staging_outstanding[room] += 1
            task = self._tasks.spawn(self._push(info, src_pages, index_slice, last, aux_index, list(earlier), states))
            task.add_done_callback(functools.partial(self._pushed, info, last))
            earlier.append(task)

    async def _push(self, info: TransferInfo, src_pages: np.ndarray[Any, Any], index_slice: slice,  # noqa: PLR0913
                    last: bool, aux_index: int | None, earlier: list[asyncio.Task[None]],
                    states: list[np.ndarray[Any, Any] | None] | None = None) -> None:
        """One chunk of a room to one decode rank, after the room's earlier chunks to it; the last one moves the
        room's state (``states``: this side's indices per state pool) first and carries the aux row, delivered
        once every byte landed. Bounded per buffer by kvpush's ``sync_kv_timeout``.
        Raises what failed it; cancelling it (an abort) ends it once no byte of it can still land. ``_pushed``
        settles it, however it ended."""
        room = info.room
        peer = self.peers.get(info.session)
        if peer is None:
            raise LLMException(LLMStatusCode.LLM_NOT_YET_LINK, f"decode {info.session} never registered")
        if peer.refusal is not None:
            raise LLMException(LLMStatusCode.LLM_PARAM_INVALID, peer.refusal)
        await self._link(peer)
        if earlier:
            await asyncio.gather(*earlier)
        decode_layout = peer.registration.layout
        dst_pages = info.dst_kv_indices[index_slice]
        if len(dst_pages) != len(src_pages):
            raise LLMException(LLMStatusCode.LLM_PARAM_INVALID, f"room {room}: {len(src_pages)} prefill pages, "
                                                                f"{len(dst_pages)} decode pages")
        if last and (states is not None or any(part is not None for part in info.dst_state_indices or [])):
            await self._push_states(peer, info, states or [])
        notify = self._done(room, aux_index, len(peer.registration.aux_item_lens)) if last else None
        leg = core.overlap(self.layout, decode_layout)
        key = BlocksCacheKey(peer.registration.cluster_id, core.MODEL_ID)
        if leg is not None and len(src_pages):
            assert self.cache is not None
            src, dst = core.slab_ids(leg, src_pages, dst_pages, self.layout, decode_layout)
            # int64 arrays: kvpush validates and lays them out as they are
            await self.dd.cache_manager.push_blocks(key, self.cache, cast(Any, src), cast(Any, dst),
                                                    tensor_num_per_layer=1, notify=notify)
        elif notify is not None:
            await self.dd.send_notification(peer.registration.cluster_id, notify)

    async def _push_states(self, peer: DecodePeer, info: TransferInfo,
                           states: list[np.ndarray[Any, Any] | None]) -> None:
        """The room's state into the decode's, pool by pool: a window's pages paired from the end, a recurrent
        state's slot (``core.state_pushes``). A pool one side names indices for and the other does not fails the
        room (never a decode left with a state it did not get)."""
        theirs = info.dst_state_indices or []
        ids = core.state_model_ids(peer.registration.states)
        for index, (mine, pool) in enumerate(zip(self.states, peer.registration.states)):
            src = states[index] if index < len(states) else None
            dst = theirs[index] if index < len(theirs) else None
            if src is None and dst is None:
                continue
            if src is None or dst is None:
                raise LLMException(LLMStatusCode.LLM_PARAM_INVALID, f"room {info.room}: state pool {index} "
                                   f"({mine.kind}): only the {'decode' if src is None else 'prefill'} names indices")
            leg = core.overlap(mine.window, pool.window) if mine.window and pool.window else None
            try:
                pushes = core.state_pushes(mine, pool, src, dst, leg)
            except core.LayoutError as error:
                raise LLMException(LLMStatusCode.LLM_PARAM_INVALID, f"room {info.room}: {error}") from None
            for cache_index, src_ids, dst_ids in pushes:
                key = BlocksCacheKey(peer.registration.cluster_id, ids[index][cache_index])
                await self.dd.cache_manager.push_blocks(key, self.state_caches[index][cache_index], cast(Any, src_ids),
                                                        cast(Any, dst_ids), tensor_num_per_layer=1)

    def _pushed(self, info: TransferInfo, last: bool, task: asyncio.Task[None]) -> None:
        """A push ended (loop thread) - done, failed, or cancelled, even before it started (its body never ran
        then): the room's count of pushes in flight goes down; a failure or a cancellation (an abort) fails the
        room on both sides, this push's decode rank told even if the sender was cleared meanwhile; the room's
        last push to its last decode rank concludes it."""
        room = info.room
        self._settled(room)
        error: BaseException | None = asyncio.CancelledError() if task.cancelled() else task.exception()
        if error is not None:
            reason = "aborted" if isinstance(error, asyncio.CancelledError) else describe_error(error)
            targets = self._room_notify_targets(room)
            if (info.endpoint, info.dst_port) not in targets:
                targets.append((info.endpoint, info.dst_port))
            log.info("kvpush SGLang backend: room %d: push to decode %s ended: %s; the decode is told", room,
                     info.session, reason)
            self._fail_room(room, f"kvpush: {reason}", targets)
            self._forget_pushes(room)
            self._maybe_ack_drained_abort(room)
            return
        if last:
            waiting = self._room_waiting.get(room, set())
            waiting.discard(info.session)
            if not waiting:
                self._forget_pushes(room)
                self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success, targets=[])

    def _settled(self, room: int) -> None:
        """One of the room's pushes ended; the room's count goes once none is left (SGLang's sender reads a
        count, even a zero one, as work still in flight)."""
        left = self._staging_outstanding.get(room, 0) - 1
        if left > 0:
            self._staging_outstanding[room] = left
        else:
            self._staging_outstanding.pop(room, None)

    def _done(self, room: int, aux_index: int | None, count: int) -> bytes:
        """The room's aux row, read now (the last chunk's forward wrote it), as the ``Done`` notification."""
        rows: tuple[bytes, ...] = ()
        if aux_index is not None:
            rows = tuple(ctypes.string_at(ptr + aux_index * size, size) for ptr, size in
                         zip(self.kv_args.aux_data_ptrs[:count], self.kv_args.aux_item_lens[:count]))
        return core.encode_done(core.Done(room, self._prefill_unique_rank(), rows))

    def _forget_pushes(self, room: int) -> None:
        self._room_waiting.pop(room, None)
        for key in [key for key in self._pushes if key[0] == room]:
            del self._pushes[key]

    def _cancel_room(self, room: int) -> set[str]:
        """Cancel the room's pushes; returns the decode sessions that had one running (each tells its decode
        rank once it drained, ``_pushed``)."""
        running = set()
        for key, tasks in list(self._pushes.items()):
            if key[0] == room:
                for task in tasks:
                    if not task.done():
                        running.add(key[1])
                    task.cancel()
        return running

    def abort_own_room(self, room: int) -> None:
        """This prefill aborted the room (SGLang's scheduler thread): stop its pushes and end the decode's side
        promptly, never before the last byte that may land did. A decode rank with a push running is told by that
        push once it drained; one without is told now; one whose destination has not come yet is told when it
        comes (the room is remembered before ``transfer_infos`` is read, and read after it is written, so one of
        the two threads sees the other)."""
        with self._aborted_lock:
            self._aborted_here.add(room, "Aborted on the prefill")
        infos = [info for info in self.transfer_infos.get(room, {}).values() if not info.is_dummy]
        self.portal.call_soon(self._abort_own_room, room, infos)

    def _abort_own_room(self, room: int, infos: list[TransferInfo]) -> None:
        running = self._cancel_room(room)
        idle = [(info.endpoint, info.dst_port) for info in infos if info.session not in running]
        log.info("kvpush SGLang backend: room %d aborted on the prefill: %d push(es) cancelled, %d decode rank(s) "
                 "told now%s", room, len(running), len(idle), "" if infos else ", the decode's when it comes")
        if idle:
            self._fail_room(room, "Aborted on the prefill", idle)

    def _fail_room(self, room: int, reason: str, targets: list[tuple[str, int]]) -> None:
        """Fail the room here and tell ``targets`` (decode ranks): SGLang's ``conclude_failure``, which records
        and sends nothing for a room whose sender SGLang already cleared (an aborted request's is cleared at
        once, often before its cancelled push drained): then the status message alone."""
        if self.conclude_failure(bootstrap_room=room, failure_reason=reason, targets=targets) is None:
            self.send_kv_status_message(targets=targets, bootstrap_room=room, status=KVPoll.Failed,
                                        failure_reason=reason)

    def fail_if_aborted_by_decode(self, room: int) -> None:
        """A sender for ``room`` was just made (scheduler thread): if a decode aborted the room before, fail it
        now rather than wait for SGLang's bootstrap timeout for a destination that will never come."""
        with self._aborted_lock:
            reason = self._aborted_by_decode.reason(room)
        if reason is not None:
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)

    def forget_room(self, room: int) -> None:
        """The room's sender was cleared (any thread): cancel what is left of it and drop its bookkeeping."""
        def forget() -> None:
            self._cancel_room(room)
            self._forget_pushes(room)
        self.portal.call_soon(forget)

    def _on_abort(self, msg: list[bytes]) -> None:
        notification = AbortNotification.from_zmq(msg)
        if notification is not None:
            self.portal.call_soon(self._abort_room, notification)

    def _abort_room(self, notification: AbortNotification) -> None:
        """A decode aborted a room (loop thread): fail it, cancel its pushes, and acknowledge: with deferred
        release once they drained (``_push``), else at once, as SGLang's legacy abort does."""
        room = notification.room
        # remembered before the status is read, as a new sender sets it before it checks (``fail_if_aborted_by_decode``)
        with self._aborted_lock:
            self._aborted_by_decode.add(room, "Aborted by the decode")
        status = self.request_status.get(room)
        if status is not None and status != KVPoll.Success:
            self.record_failure(room, "Aborted by the decode")
            self.update_status(room, KVPoll.Failed)
        self._cancel_room(room)
        if self.enable_deferred_decode_kv_release:
            target = notification.deferred_ack_target()
            if target is not None:
                self.register_deferred_ack_target(room, target)
                self._maybe_ack_drained_abort(room)
            return
        if notification.decode_ip is not None and notification.decode_port is not None:
            address = NetworkAddress(notification.decode_ip, notification.decode_port)
            try:
                self._send_multipart_locked(address.to_tcp(), [ABORT_ACK_TAG, str(room).encode("ascii")],
                                            is_ipv6=address.is_ipv6)
            except Exception as error:  # noqa: BLE001 - best effort, as SGLang's
                log.debug("ABORT_ACK for room %s not sent: %s", room, error)
