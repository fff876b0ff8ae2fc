"""kvpush as an SGLang PD-disaggregation transfer backend: ``KvpushKVManager``, ``KvpushKVSender``,
``KvpushKVReceiver`` and ``KvpushKVBootstrapServer``, subclasses of SGLang's ``Common*`` classes
(``sglang.srt.disaggregation.common.conn``) that replace only the data movement.

SGLang keeps its meaning for everything else: the bootstrap server (HTTP registration, rank mapping, the
per-request ``bootstrap_room``), its ZMQ control messages (a decode rank registers once with each prefill
rank it pairs with, then sends each room's destination pages and aux slot; a prefill reports failures),
the aux (metadata) buffers and the ``KVPoll`` states. What moves differs:

- Pages: the prefill pushes them with kvpush's ``push_blocks`` over a kvpush link it opens to the decode
  rank's engine (cma on one host; TCP or UCX between hosts; ``KVPUSH_TRANSPORT``), one push per prefill
  chunk, each buffer one kvpush "layer" (see ``sglang_core`` for the blocks of a buffer).
- Least privilege, as in the vLLM connector: the decode registers its pool ``RemoteAccess.GRANTED`` and, before
  it sends a room's pages to a prefill rank, grants that rank's cluster the blocks of those pages only, until
  the room ends (success, failure, abort); the prefill registers its pool ``PRIVATE``. Every link proves
  ``KVPUSH_AUTH_TOKEN``; a decode refuses to listen off loopback without one (``KVPUSH_INSECURE=1`` to allow).
- Completion: the last push carries the room's aux row as kvpush's ``notify``, delivered after every byte
  landed; the decode writes it into the aux slot it chose for the room itself and only then reports
  ``KVPoll.Success`` for that prefill rank. Failures travel as SGLang's status messages.
- Failure detection: a kvpush link that closes fails, at once, every room still waiting on that prefill rank
  (SGLang's heartbeat also runs); kvpush bounds every layer by ``KVPUSH_SYNC_KV_TIMEOUT_MS``.

Threads: SGLang calls these classes on its scheduler thread and runs one ZMQ control thread per manager;
every kvpush call runs on the manager's own event-loop thread (a ``kvpush.portal.Portal``).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_ACK_TAG,
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress

from kvpush import (
    BlockAccess,
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    Delivery,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    RemoteAccess,
)
from kvpush.portal import Portal
from kvpush.scope import TaskScope

from . import sglang_core as core
from .vllm_bridge import describe_error
from .vllm_core import dst_ids

log = logging.getLogger(__name__)

MODEL_ID = 0  # the one blocks cache of a rank: BlocksCacheKey(cluster_id, MODEL_ID)
REGISTER_ROOM = b"None"  # SGLang's first frame of a decode rank's registration (its other messages carry a room)
_START_TIMEOUT_S = 30.0


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

    @classmethod
    def from_zmq(cls, msg: list[bytes]) -> TransferInfo:
        is_dummy = msg[4] == b"" and msg[5] == b""
        return cls(room=int(msg[0]), endpoint=msg[1].decode("ascii"), dst_port=int(msg[2]),
                   session=msg[3].decode("ascii"),
                   dst_kv_indices=np.frombuffer(msg[4], dtype=np.int32) if not is_dummy else np.empty(0, np.int32),
                   dst_aux_index=None if is_dummy else int(msg[5]), required_dst_info_num=int(msg[6]),
                   is_dummy=is_dummy, decode_prefix_len=int(msg[7]) if len(msg) > 7 and msg[7] else None)


@dataclass
class DecodePeer:
    """A decode rank that registered with this prefill rank: its kvpush engine, pool and aux sizes, and why
    KV cannot go to it (``refusal``), if it cannot."""

    session: str
    registration: core.Registration
    refusal: str | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class KvpushKVManager(CommonKVManager):
    """One SGLang rank's kvpush engine and every transfer of that rank (see the module docstring).

    Aborts follow SGLang's deferred KV release (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``, on by
    default): a decode that aborts a room keeps its pages until each prefill rank acknowledges that no byte of
    the room can still land; the prefill counts a room's pushes in ``_staging_outstanding`` (SGLang's counter
    for this) and acknowledges once the cancelled ones drained.
    """

    supports_deferred_decode_kv_release = True
    kv_status_msg_carries_reason = True  # a decode learns why a prefill failed a room (a refused link, ...)

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if any(types for types in (getattr(args, "state_types", None) or [])):
            raise NotImplementedError("kvpush SGLang backend: this model keeps state beside its KV (mamba, SWA or "
                                      f"DSA pools: {args.state_types}); only full-attention KV pools move so far")
        self.settings = core.BackendSettings.from_env()
        if not is_mla_backend and getattr(args, "kv_head_num", None) is None:
            # SGLang 0.5.23's decode does not fill in KVArgs' head counts (its prefill does): read the model's
            args.total_kv_head_num = _total_kv_heads(server_args)
            args.kv_head_num = max(1, args.total_kv_head_num // self.attn_tp_size)
        self.layout = core.PoolLayout.of(args, self.attn_tp_size, self.attn_tp_rank, bool(is_mla_backend))
        self.cluster_id = core.cluster_id_of(self.local_ip, self.rank_port)
        self.is_decode = disaggregation_mode == DisaggregationMode.DECODE
        self._stopped = False
        self._worker_threads: list[threading.Thread] = []
        self.portal = Portal(f"kvpush-sglang-{self.rank_port}")
        self.dd = LLMDataDist(LLMRole.DECODER if self.is_decode else LLMRole.PROMPT, self.cluster_id)
        self._tasks = TaskScope(f"kvpush-sglang-{self.cluster_id}")
        self.cache: Cache | None = None
        # prefill side, on the loop thread: decode ranks by session; a room's pushes per decode session
        self.peers: dict[str, DecodePeer] = {}
        self._pushes: dict[tuple[int, str], list[asyncio.Task[None]]] = {}
        self._room_waiting: dict[int, set[str]] = {}
        # rooms aborted before the other side's part came (any thread): see ``sglang_core.AbortedRooms``
        self._aborted_here = core.AbortedRooms()  # by this prefill, before the decode's destination came
        self._aborted_by_decode = core.AbortedRooms()  # by a decode, before this prefill's request came
        self._aborted_lock = threading.Lock()  # the two above, from SGLang's threads and the loop thread
        # decode side, on the loop thread: a room's grants, aux slot and prefill clusters
        self._grants: dict[int, list[BlockAccess]] = {}
        self._room_aux: dict[int, int] = {}
        self._room_prefills: dict[int, set[int]] = {}
        listen = (self.local_ip, 0) if self.is_decode else None
        if listen is not None:
            self.settings.check_listener(listen[0])
        self.portal.run(self._start(listen), timeout=_START_TIMEOUT_S)
        self.listen_address = self.dd.listen_address
        if self.is_decode:
            thread = threading.Thread(target=self._decode_thread, name="kvpush-sglang-decode", daemon=True)
            thread.start()
            self._worker_threads += [thread, self._start_heartbeat_checker_thread()]
        else:
            thread = threading.Thread(target=self._prefill_thread, name="kvpush-sglang-prefill", daemon=True)
            thread.start()
            self._worker_threads.append(thread)
        log.info("kvpush SGLang backend: %s rank %d of %d, cluster %d, %d KV buffers of %d pages (%d tokens x %d "
                 "heads x %d bytes per page)%s", "decode" if self.is_decode else "prefill", self.layout.tp_rank,
                 self.layout.tp_size, self.cluster_id, self.layout.buffers, self.layout.pages, self.layout.page_size,
                 self.layout.local_heads, self.layout.slab_bytes,
                 f", listening on {self.listen_address}" if self.listen_address else "")

    async def _start(self, listen: tuple[str, int] | None) -> None:
        await self.dd.init(self.settings.engine_options(listen))
        desc = CacheDesc(self.layout.buffers, (self.layout.blocks, self.layout.slab_bytes), DataType.DT_UINT8)
        access = RemoteAccess.GRANTED if self.is_decode else RemoteAccess.PRIVATE
        self.cache = self.dd.cache_manager.register_blocks_cache(desc, list(self.kv_args.kv_data_ptrs),
                                                                 BlocksCacheKey(self.cluster_id, MODEL_ID),
                                                                 remote_access=access)
        if self.is_decode:
            self.dd.add_link_listener(self._on_link)
            self._tasks.spawn(self._read_done(self.dd.notifications))

    def teardown(self) -> None:
        """Stop the control threads and the engine (SGLang calls it on a role switch; also at exit)."""
        self._stopped = True
        if getattr(self, "_heartbeat_shutdown", None) is not None:
            self._heartbeat_shutdown.set()

        async def finalize() -> None:
            self._tasks.cancel()
            await self.dd.finalize()
        try:
            self.portal.run(finalize(), timeout=10)
        except Exception as error:  # noqa: BLE001 - shutting down: log, never raise into SGLang's shutdown
            log.warning("kvpush SGLang backend: finalize: %s", describe_error(error))
        self.portal.close()

    # -- the messages both sides exchange over SGLang's ZMQ control sockets ------------------------
    def _registration(self) -> core.Registration:
        host, port = self.listen_address or (self.local_ip, 0)
        return core.Registration(host, port, self.cluster_id, self.layout, tuple(self.kv_args.aux_item_lens))

    def build_receiver_registration_message(self) -> list[bytes]:
        return [REGISTER_ROOM, self.local_ip.encode("ascii"), str(self.rank_port).encode("ascii"),
                self._session().encode("ascii"), self._registration().encode()]

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,  # noqa: PLR0913
                                        kv_indices: np.ndarray[Any, Any], aux_index: int | None,
                                        state_indices: list[Any] | None, decode_prefix_len: int | None,
                                        is_dummy: bool, device_kv_indices: Any = None) -> list[bytes]:
        return [str(bootstrap_room).encode("ascii"), self.local_ip.encode("ascii"),
                str(self.rank_port).encode("ascii"), self._session().encode("ascii"),
                b"" if is_dummy else np.asarray(kv_indices, dtype=np.int32).tobytes(),
                b"" if is_dummy else str(aux_index).encode("ascii"),
                str(required_dst_info_num).encode("ascii"), str(decode_prefix_len or 0).encode("ascii")]

    def _session(self) -> str:
        return str(NetworkAddress(self.local_ip, self.rank_port).to_host_port_str())

    # -- prefill side ------------------------------------------------------------------------------
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
        elif msg[0] == REGISTER_ROOM:
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
            refusal = core.incompatibility(self.layout, registration.layout)
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
        if state_indices and any(indices is not None and len(indices) for indices in state_indices):
            self.conclude_failure(bootstrap_room=bootstrap_room,
                                  failure_reason="kvpush SGLang backend: state pages (mamba/SWA/DSA) do not move yet")
            return
        for event in (indices_event, wait_event):  # CPU pools have none; a device event would be waited for here
            if event is not None and hasattr(event, "synchronize"):
                event.synchronize()
        targets = [info for info in infos.values() if not info.is_dummy]
        src_pages = np.asarray(kv_indices, dtype=np.int64).copy()
        self.portal.call_soon(self._queue_pushes, bootstrap_room, targets, src_pages, index_slice, is_last_chunk,
                              aux_index)

    def _queue_pushes(self, room: int, targets: list[TransferInfo], src_pages: np.ndarray[Any, Any],
                      index_slice: slice, last: bool, aux_index: int | None) -> None:
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
            task = self._tasks.spawn(self._push(info, src_pages, index_slice, last, aux_index, list(earlier)))
            earlier.append(task)

    async def _push(self, info: TransferInfo, src_pages: np.ndarray[Any, Any], index_slice: slice, last: bool,
                    aux_index: int | None, earlier: list[asyncio.Task[None]]) -> None:
        """One chunk of a room to one decode rank, after the room's earlier chunks to it; the last one carries
        the aux row, delivered once every byte landed. Bounded per buffer by kvpush's ``sync_kv_timeout``.
        Any failure, or cancellation (an abort), fails the room on both sides."""
        room = info.room
        try:
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
            notify = self._done(room, aux_index, len(peer.registration.aux_item_lens)) if last else None
            leg = core.overlap(self.layout, decode_layout)
            key = BlocksCacheKey(peer.registration.cluster_id, MODEL_ID)
            if leg is not None and len(src_pages):
                assert self.cache is not None
                src, dst = core.slab_ids(leg, src_pages, dst_pages, self.layout, decode_layout)
                # int64 arrays: kvpush validates and lays them out as they are
                await self.dd.cache_manager.push_blocks(key, self.cache, cast(Any, src), cast(Any, dst),
                                                        tensor_num_per_layer=1, notify=notify)
            elif notify is not None:
                await self.dd.send_notification(peer.registration.cluster_id, notify)
        except BaseException as error:
            # kvpush returns (or raises) once no byte of the push can still land: the room's pages are idle
            self._settled(room)
            reason = "aborted" if isinstance(error, asyncio.CancelledError) else describe_error(error)
            # this push's decode rank is told even if the sender was cleared meanwhile (its ``transfer_infos`` gone)
            targets = self._room_notify_targets(room)
            if (info.endpoint, info.dst_port) not in targets:
                targets.append((info.endpoint, info.dst_port))
            self.conclude_failure(bootstrap_room=room, failure_reason=f"kvpush: {reason}", targets=targets)
            self._forget_pushes(room)
            self._maybe_ack_drained_abort(room)
            raise
        self._settled(room)
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
        rank once it drained, ``_push``)."""
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
        if idle:
            self.conclude_failure(bootstrap_room=room, failure_reason="Aborted on the prefill", targets=idle)

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

    # -- decode side -------------------------------------------------------------------------------
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
            return self.portal.run(open_blocks(), timeout=_START_TIMEOUT_S)
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


def _total_kv_heads(server_args: Any) -> int:
    """The model's KV heads, from its Hugging Face config (as SGLang's ModelConfig reads them)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(server_args.model_path,
                                        trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    if not heads:
        raise NotImplementedError(f"kvpush SGLang backend: no KV head count in {server_args.model_path}'s config")
    return int(heads)


class KvpushKVSender(CommonKVSender):
    """SGLang's sender; an abort on the prefill also stops the room's pushes and tells the decode."""

    supports_host_tensor_indices = False
    kv_mgr: KvpushKVManager

    def __init__(self, mgr: KvpushKVManager, bootstrap_addr: str, bootstrap_room: int, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        mgr.fail_if_aborted_by_decode(bootstrap_room)

    def abort(self) -> None:
        succeeded = self.kv_mgr.request_status.get(self.bootstrap_room) == KVPoll.Success
        super().abort()
        if not succeeded:  # a room the decode already has needs no word
            self.kv_mgr.abort_own_room(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_room(self.bootstrap_room)


class KvpushKVReceiver(CommonKVReceiver):
    """SGLang's receiver; grants a room's pages before sending them, revokes them when the room ends."""

    kv_mgr: KvpushKVManager
    conclude_state: KVPoll | None

    def send_metadata(self, kv_indices: np.ndarray[Any, Any], aux_index: int | None = None,  # noqa: PLR0913 (SGLang's)
                      state_indices: list[Any] | None = None, decode_prefix_len: int | None = None,
                      *args: Any, **kwargs: Any) -> None:
        if self.bootstrap_infos is not None and self.conclude_state is None:
            problem = self.kv_mgr.grant(self.bootstrap_room, self.bootstrap_infos, kv_indices, aux_index)
            if problem is not None:
                self.kv_mgr.record_failure(self.bootstrap_room, problem)
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.conclude_state = KVPoll.Failed
                return
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, *args, **kwargs)

    def abort(self) -> None:
        self.kv_mgr.release(self.bootstrap_room)
        super().abort()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.release(self.bootstrap_room)


class KvpushKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap server, unchanged."""
