"""One peer: handshake, keepalive, the peer's cache table, request/response matching, and the
receiver side of transfers (re-validating every request against the local registry).

A link owns one frame stream. Request ids are per link, start at 1 and are never reused, so a
late reply to an abandoned request can never complete a later one: it finds no pending entry
and is dropped. When the stream closes, every pending request fails at once and the owner drops
the link; ``link_clusters`` to that peer then builds a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections import Counter
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from transports import cma, tcp
from transports.base import PayloadSink

from . import handshake, serving
from .handshake import HANDSHAKE_KINDS
from .layout import IoVec, scatter_vector
from .memory import CacheEntry, CacheRegistry
from .onesided import OneSidedReceiver, OneSidedSender
from .options import EngineOptions
from .protocol import (
    FrameHeader,
    Kind,
    ProtocolError,
    decode_json,
    decode_status,
    encode_json,
    encode_status,
    encode_transfer,
)
from .remote import PendingOp, RemoteCache
from .status import LLMException, LLMStatusCode
from .types import LLMRole

if TYPE_CHECKING:
    from transports.ucx import UcxService

log = logging.getLogger(__name__)



class LinkState(Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    CLOSED = "closed"


class LinkOwner(Protocol):
    cluster_id: int
    role: LLMRole
    instance: str
    options: EngineOptions
    registry: CacheRegistry
    ucx: UcxService | None

    def link_closed(self, link: Link, reason: str) -> None: ...


class Link:
    """A linked peer. Create with ``await Link.establish(...)``."""

    def __init__(self, owner: LinkOwner, sock: socket.socket, *, dialer: bool) -> None:
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.dialer = dialer
        self.state = LinkState.HANDSHAKE
        self.peer_cluster_id: int | None = None
        self.peer_role: int | None = None
        self.peer_instance = ""
        self.close_reason = ""
        self.remote_caches: dict[int, RemoteCache] = {}
        self.remote_by_model: dict[int, int] = {}
        self._request_ids = itertools.count(1)
        self._pending: dict[int, PendingOp] = {}
        self._handshake_inbox: asyncio.Queue[tuple[Kind, dict[str, Any]]] = asyncio.Queue()
        self.inbound_pins: dict[int, CacheEntry] = {}
        self._keepalive: asyncio.Task[None] | None = None
        self._bye: asyncio.Future[None] = self.loop.create_future()
        self._auth_sent = False
        self._probe: cma.Probe | None = None
        self._peer_offers: dict[str, Any] = {}
        self._first_table: asyncio.Future[None] = self.loop.create_future()
        self._share_addresses = False
        self._share_rkeys = False
        self.onesided: OneSidedSender | None = None
        self.receiver = OneSidedReceiver(self)
        self.fallback_reason = ""
        self.rtt_ms: float | None = None
        self.counters: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.last_error = ""
        self.stream = tcp.TcpFrameStream(sock, self, self.loop)

    def __repr__(self) -> str:
        return (f"<Link peer_cluster={self.peer_cluster_id} transport={self.transport} "
                f"{self.state.value}{' dialer' if self.dialer else ''}>")

    @property
    def transport(self) -> str:
        """How this side's transfers move bytes on this link."""
        return self.onesided.mover.capabilities.name if self.onesided else self.stream.capabilities.name

    @property
    def ready(self) -> bool:
        return self.state == LinkState.READY

    # -- establishment -----------------------------------------------------------------------------
    @classmethod
    async def establish(cls, owner: LinkOwner, sock: socket.socket, *, dialer: bool,
                        expect_cluster_id: int | None = None) -> Link:
        """Run the handshake on a connected socket. Raises LLMException(LLM_LINK_FAILED) with the
        reason; cancelling (e.g. by the caller's timeout) closes the socket."""
        link = cls(owner, sock, dialer=dialer)
        try:
            if dialer:
                await handshake.dial(link, expect_cluster_id)
            else:
                await handshake.accept(link)
            handshake.choose_data_path(link)
            link.state = LinkState.READY
            link.send_table()
            if dialer:  # linked means the peer's caches are known: no round trip on the first push
                await link._first_table
        except LLMException as error:
            link.close(str(error))
            raise
        except BaseException:
            link.close("handshake interrupted")
            raise
        link._keepalive = asyncio.create_task(link._keepalive_loop(), name=f"kvpush-keepalive-{link.peer_cluster_id}")
        log.info("link to cluster %s ready over %s (%s)%s", link.peer_cluster_id, link.transport,
                 "dialed" if dialer else "accepted",
                 f"; same-host path not used: {link.fallback_reason}" if link.fallback_reason else "")
        return link

    # -- keepalive ------------------------------------------------------------------------------
    async def _keepalive_loop(self) -> None:
        interval = self.owner.options.keepalive_interval_ms / 1000
        limit = self.owner.options.keepalive_timeout_ms / 1000
        while self.state != LinkState.CLOSED:
            await asyncio.sleep(interval)
            silent = time.monotonic() - self.stream.last_receive
            if silent > limit:
                self.close(f"keepalive: nothing heard from the peer for {silent * 1000:.0f} ms")
                return
            self.stream.send(encode_json(Kind.PING, 0, {"t": time.monotonic()}))

    # -- cache table ----------------------------------------------------------------------------
    def send_table(self, request_id: int = 0) -> None:
        if self.state == LinkState.READY:
            registry = self.owner.registry
            caches = registry.table(self._share_addresses or self._share_rkeys, self._share_rkeys)
            self.stream.send(encode_json(Kind.TABLE, request_id, {"version": registry.version, "caches": caches}))

    def _apply_table(self, body: dict[str, Any]) -> None:
        caches = body.get("caches")
        if not isinstance(caches, list):
            raise ProtocolError("TABLE without a cache list")
        entries = [RemoteCache.from_wire(item) for item in caches]
        self.remote_caches = {c.cache_id: c for c in entries}
        self.remote_by_model = {c.model_id: c.cache_id for c in entries if c.model_id is not None}
        if not self._first_table.done():
            self._first_table.set_result(None)

    async def refresh_table(self) -> None:
        """One round trip for the peer's current cache table (callers bound it with their deadline)."""
        op = self._new_op(Kind.TABLE_REQUEST)
        self.stream.send(encode_json(Kind.TABLE_REQUEST, op.request_id, {}))
        try:
            await asyncio.shield(op.future)
        finally:
            self._pending.pop(op.request_id, None)

    # -- requests (local side) ------------------------------------------------------------------
    def _new_op(self, kind: Kind) -> PendingOp:
        if self.state != LinkState.READY:
            raise LLMException(LLMStatusCode.LLM_NOT_YET_LINK,
                               f"link to cluster {self.peer_cluster_id} is {self.state.value}: {self.close_reason}")
        request_id = next(self._request_ids)
        op = PendingOp(request_id, kind, self.loop.create_future())
        self._pending[request_id] = op
        return op

    def start_write(self, remote: RemoteCache, first_tensor: int, num_tensors: int, runs_wire: bytes,
                    remote_offset: np.ndarray[Any, Any], length: np.ndarray[Any, Any], source: IoVec,
                    source_entry: CacheEntry, budget_ms: int, held: bool = False) -> PendingOp:
        """Start one layer's write: one-sided when this link can, else a WRITE frame carrying the
        bytes. The source cache stays pinned until its bytes left. ``held``: prepare everything (a
        one-sided request is even granted) but move no byte until ``release_held``."""
        payload_len = int(source[:, 1].sum())
        self.counters["write_requests"] += 1
        self.counters["bytes_pushed"] += payload_len
        if self._onesided_reaches(remote):
            assert self.onesided is not None
            leased = self.onesided.lease_active(remote.cache_id)
            op = self._start_onesided(Kind.WRITE_INTENT, remote, first_tensor, num_tensors, runs_wire,
                                      remote_offset, length, source, source_entry, budget_ms, held, leased)
            return op
        op = self._new_op(Kind.WRITE)
        head = encode_transfer(Kind.WRITE, op.request_id, remote.cache_id, first_tensor, num_tensors, runs_wire,
                               payload_len, budget_ms)
        source_entry.pin()
        op.hold(source_entry.unpin)
        op.frame = self.stream.prepare(head, source)
        op.held = held
        if not held:
            self._enqueue(op)
        return op

    def _enqueue(self, op: PendingOp) -> None:
        """Queue a prepared frame; from now on its ``sent`` future (not ``abandon``) unpins."""
        assert op.frame is not None
        release, op._release = op._release, None
        self.stream.enqueue(op.frame)
        if release is not None:
            op.frame.sent.add_done_callback(lambda _: release())

    def release_held(self, op: PendingOp) -> None:
        """Let a ``held`` request move its bytes now (microseconds: everything was prepared)."""
        if not op.held:
            return
        op.held = False
        if op.kind == Kind.WRITE:
            self._enqueue(op)
        elif op.notice is not None and self.onesided is not None:
            self.loop.call_soon(self._begin_leased, op)
        elif op.granted and self.onesided is not None:
            self.loop.call_soon(self._begin_granted, op)  # posting the copy is the loop's work, not the caller's

    def _begin_leased(self, op: PendingOp) -> None:
        if self.onesided is not None and op.request_id in self._pending:
            self.onesided.begin_leased(op)

    def _begin_granted(self, op: PendingOp) -> None:
        if op.granted and self.onesided is not None and op.request_id in self._pending:
            self.onesided.begin(op)

    def start_read(self, remote: RemoteCache, first_tensor: int, num_tensors: int, runs_wire: bytes,
                   remote_offset: np.ndarray[Any, Any], length: np.ndarray[Any, Any], destination: IoVec,
                   destination_entry: CacheEntry, budget_ms: int) -> PendingOp:
        """Start one layer's read: one-sided when this link can, else a READ whose reply's payload
        lands straight in ``destination``."""
        expected = int(destination[:, 1].sum())
        self.counters["read_requests"] += 1
        self.counters["bytes_pulled"] += expected
        if self._onesided_reaches(remote):
            return self._start_onesided(Kind.READ_INTENT, remote, first_tensor, num_tensors, runs_wire,
                                        remote_offset, length, destination, destination_entry, budget_ms)
        op = self._new_op(Kind.READ)
        op.expected = expected
        destination_entry.pin()
        op.future.add_done_callback(lambda _: destination_entry.unpin())
        op.sink = PayloadSink(destination, lambda: self.complete(op, None))
        head = encode_transfer(Kind.READ, op.request_id, remote.cache_id, first_tensor, num_tensors, runs_wire,
                               0, budget_ms)
        op.frame = self.stream.send(head)
        return op

    def _onesided_reaches(self, remote: RemoteCache) -> bool:
        if self.onesided is None or remote.addrs is None:
            return False
        return self.onesided.mover.capabilities.name != "ucx" or remote.rkeys is not None

    def _start_onesided(self, kind: Kind, remote: RemoteCache, first_tensor: int, num_tensors: int,
                        runs_wire: bytes, remote_offset: np.ndarray[Any, Any], length: np.ndarray[Any, Any],
                        local: IoVec, entry: CacheEntry, budget_ms: int, held: bool = False,
                        leased: bool = False) -> PendingOp:
        """A one-sided request: ask for a grant (intent), or under a lease copy at once and notify."""
        assert remote.addrs is not None
        op = self._new_op(kind)
        op.held = held
        op.local_iov = local
        op.remote_iov = scatter_vector(remote.addrs[first_tensor:first_tensor + num_tensors], remote_offset, length)
        op.move_args = (remote.cache_id, first_tensor, remote.rkeys, int(length.shape[0]))
        entry.pin()
        op.hold(entry.unpin)
        if leased:
            op.notice = encode_transfer(Kind.WRITE_NOTICE, op.request_id, remote.cache_id, first_tensor,
                                        num_tensors, runs_wire, 0, budget_ms)
            if not held:
                assert self.onesided is not None
                self.onesided.begin_leased(op)
            return op
        op.frame = self.stream.send(encode_transfer(kind, op.request_id, remote.cache_id, first_tensor, num_tensors,
                                                    runs_wire, 0, budget_ms))
        return op

    @property
    def own_probe(self) -> cma.Probe | None:
        """The in-memory probe this side offered for same-host access (None if it offered none)."""
        return self._probe

    @property
    def shares_addresses_same_host(self) -> bool:
        """True when the peer is on this host and may copy one-sided into this process."""
        return self._share_addresses

    def peer_offer(self, name: str) -> Any:
        """What the peer offered at the handshake for one-sided transfers (``cma``, ``ucx``), or None."""
        return self._peer_offers.get(name)

    def pending(self, request_id: int) -> PendingOp | None:
        return self._pending.get(request_id)

    def abandon(self, op: PendingOp) -> None:
        """Stop waiting for ``op``: an unsent frame is dropped, an incoming payload is discarded
        from now on, and a late reply is ignored. Bytes of a WRITE already on the wire, or of a
        one-sided copy already running, still land (see ``settle``)."""
        self._pending.pop(op.request_id, None)
        if op.frame is not None:
            op.frame.abandon()
        if op.sink is not None:
            op.sink.cancel()
        if op.copy is None:
            op.release()
            if op.granted:  # granted but never moved: let the peer unpin
                self.stream.send(encode_status(Kind.LANDED, op.request_id, 1))
                op.granted = False
        if not op.future.done():
            op.future.cancel()

    async def settle(self, ops: list[PendingOp], grace: float) -> None:
        """After abandoning ``ops``: wait until none still reads or writes local memory. One-sided
        copies run to their end (memory copies, bounded); frames already started get ``grace``
        seconds to finish leaving, after which the link is closed abortively (never half a frame
        in the stream, never a read of the source memory after the caller was told)."""
        if self.onesided is not None and not await self.onesided.settle(ops, grace):
            self.close("a one-sided transfer did not end in time after its request ended", abort=True)
        leaving = [op.frame.sent for op in ops
                   if op.frame is not None and op.frame.started and not op.frame.sent.done()]
        if leaving:
            _, pending = await asyncio.wait(leaving, timeout=grace)
            if pending:
                self.close("a layer could not finish leaving after its transfer ended", abort=True)

    def note_failure(self, error: LLMException) -> None:
        """Count a failure the engine raised itself (e.g. a layer's deadline passed)."""
        self.failures[error.status_code.name] += 1
        self.last_error = str(error)

    def complete(self, op: PendingOp, error: LLMException | None) -> None:
        self._pending.pop(op.request_id, None)
        if op.future.done():
            return
        if error is None:
            op.future.set_result(None)
        else:
            self.note_failure(error)
            op.future.set_exception(error)
            op.future.exception()  # retrieved by whoever awaits; never "never retrieved" noise

    # -- frames from the peer (StreamHandler) ---------------------------------------------------
    def on_frame(self, header: FrameHeader, meta: bytes) -> PayloadSink | None:
        kind = header.kind
        if self.state == LinkState.HANDSHAKE:
            if kind not in HANDSHAKE_KINDS:
                raise ProtocolError(f"{kind.name} before the handshake completed")
            body = decode_json(kind, meta)
            if kind == Kind.READY:
                if not (self.dialer and self._auth_sent):
                    raise ProtocolError("READY before authentication")
                # The acceptor's next frames (its cache table) may arrive in this same read.
                self.state = LinkState.READY
            self._handshake_inbox.put_nowait((kind, body))
            return None
        if self.state == LinkState.CLOSED:
            return None
        if kind == Kind.WRITE:
            return serving.serve_write(self, header, meta)
        if kind == Kind.DONE:
            self._on_done(header, meta)
        elif kind == Kind.READ_DATA:
            return self._on_read_data(header, meta)
        elif kind == Kind.READ:
            serving.serve_read(self, header, meta)
        elif kind == Kind.PING:
            self.stream.send(encode_json(Kind.PONG, 0, decode_json(kind, meta)))
        elif kind == Kind.PONG:
            sent = decode_json(kind, meta).get("t")
            if isinstance(sent, (int, float)):
                self.rtt_ms = (time.monotonic() - sent) * 1000
        elif kind == Kind.TABLE:
            self._apply_table(decode_json(kind, meta))
            op = self._pending.get(header.request_id)
            if op is not None and op.kind == Kind.TABLE_REQUEST:
                self.complete(op, None)
        elif kind == Kind.TABLE_REQUEST:
            self.send_table(header.request_id)
        elif kind in (Kind.WRITE_INTENT, Kind.READ_INTENT):
            self.receiver.on_intent(header, meta)
        elif kind == Kind.GRANT:
            if self.onesided is None:
                raise ProtocolError("GRANT on a link that sent no one-sided request")
            self.onesided.on_grant(header, meta)
        elif kind == Kind.LANDED:
            self.receiver.on_landed(header, meta)
        elif kind == Kind.WRITE_NOTICE:
            self.receiver.on_notice(header, meta)
        elif kind == Kind.LEASE:
            body = decode_json(kind, meta)
            if body.get("op") in ("request", "revoked"):
                self.receiver.on_lease(body)
            elif self.onesided is None:
                raise ProtocolError("LEASE answer on a link that asked for none")
            else:
                self.onesided.on_lease(body)
        elif kind == Kind.BYE:
            self._on_bye(decode_json(kind, meta))
        else:
            raise ProtocolError(f"unexpected {kind.name} on a ready link")
        return None

    def _on_done(self, header: FrameHeader, meta: bytes) -> None:
        status, message = decode_status(header, meta)
        op = self._pending.get(header.request_id)
        if op is None or op.kind != Kind.WRITE:
            log.debug("ignoring DONE for request %d (abandoned or unknown)", header.request_id)
            return
        if status == 0:
            self.complete(op, None)
        else:
            self.complete(op, LLMException(LLMStatusCode.from_wire(status), f"peer refused the write: {message}"))

    def _on_read_data(self, header: FrameHeader, meta: bytes) -> PayloadSink | None:
        status, message = decode_status(header, meta)
        op = self._pending.get(header.request_id)
        if op is None or op.kind != Kind.READ or op.sink is None:
            return None  # abandoned: the payload is discarded
        if status != 0:
            if header.payload_len:
                raise ProtocolError("READ_DATA carries both an error and a payload")
            self.complete(op, LLMException(LLMStatusCode.from_wire(status), f"peer refused the read: {message}"))
            return None
        if header.payload_len != op.expected:
            raise ProtocolError(f"READ_DATA of {header.payload_len} bytes for a request of {op.expected}")
        return op.sink

    # -- closing --------------------------------------------------------------------------------
    def _on_bye(self, body: dict[str, Any]) -> None:
        """A graceful unlink. ``leases_done``: the sender of the BYE has no same-host copy into this
        process running any more, so the caches it held standing grants on can be let go now."""
        if body.get("leases_done"):
            self.receiver.end_leases()
        if body.get("ack"):
            if not self._bye.done():
                self._bye.set_result(None)
            self.close("unlinked")
            return
        if self.onesided is not None:
            self.onesided.close_leases()  # nothing new starts; what runs is drained before the ack
            if not self.onesided.leases_idle():
                asyncio.ensure_future(self._ack_when_idle())
                return
        self._ack_bye()

    def _ack_bye(self, leases_done: bool = True) -> None:
        ack = self.stream.send(encode_json(Kind.BYE, 0, {"ack": True, "leases_done": leases_done}))
        ack.sent.add_done_callback(lambda _: self.close("peer unlinked"))

    async def _ack_when_idle(self) -> None:
        done = True
        if self.onesided is not None:
            done = await self.onesided.drain_leases(self.owner.options.sync_kv_timeout_ms / 1000)
        self._ack_bye(done)

    async def unlink(self, timeout: float) -> bool:
        """Tell the peer and wait for its acknowledgement (bounded); always closes locally."""
        try:
            if self.state == LinkState.READY:
                if self.onesided is not None:
                    self.onesided.close_leases()  # nothing new starts, so the drain below is final
                done = self.onesided is None or await self.onesided.drain_leases(timeout)
                self.stream.send(encode_json(Kind.BYE, 0, {"leases_done": done}))
                await asyncio.wait_for(asyncio.shield(self._bye), timeout)
                return True
            return False
        except (TimeoutError, ConnectionError, LLMException):
            return False
        finally:
            self.close("unlinked")

    def close(self, reason: str, abort: bool = False) -> None:
        """Close now. Every pending request fails with LLM_TIMEOUT (it was in flight when the
        link broke); later calls see LLM_NOT_YET_LINK. ``abort`` resets the connection so bytes
        still queued in this host's kernel are discarded instead of delivered. Idempotent."""
        if self.state == LinkState.CLOSED:
            return
        was_ready = self.state == LinkState.READY
        self.state = LinkState.CLOSED
        self.close_reason = reason
        self.stream.close(reason, abort)
        if self._keepalive is not None and self._keepalive is not asyncio.current_task():
            self._keepalive.cancel()
        error_text = f"link to cluster {self.peer_cluster_id} broke during the transfer: {reason}"
        for op in list(self._pending.values()):
            if op.sink is not None:
                op.sink.cancel()
            if op.copy is None:
                op.release()
            self.complete(op, LLMException(LLMStatusCode.LLM_TIMEOUT, error_text))
        for entry in self.inbound_pins.values():
            entry.unpin()
        self.inbound_pins.clear()
        self.receiver.close()
        if self.onesided is not None:
            self.onesided.close()
        for waiter in (self._bye, self._first_table):
            if not waiter.done():
                waiter.set_exception(LLMException(LLMStatusCode.LLM_LINK_FAILED, reason))
                waiter.exception()
        if was_ready:
            log.info("link to cluster %s closed: %s", self.peer_cluster_id, reason)
        self.owner.link_closed(self, reason)

    def on_close(self, reason: str) -> None:
        """The stream went away under us."""
        if self.state != LinkState.CLOSED:
            if self.state == LinkState.HANDSHAKE:
                self._handshake_inbox.put_nowait((Kind.BYE, {"reason": reason}))
            self.close(reason)

    def stats(self) -> dict[str, Any]:
        return {
            "peer_cluster_id": self.peer_cluster_id,
            "transport": self.transport,
            "state": self.state.value,
            "dialer": self.dialer,
            "bytes_in": self.stream.bytes_in,
            "bytes_out": self.stream.bytes_out,
            "rtt_ms": self.rtt_ms,
            "pending": len(self._pending),
            **dict(self.counters),
            "failures": dict(self.failures),
            "last_error": self.last_error,
            "close_reason": self.close_reason,
        }
