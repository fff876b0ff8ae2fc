"""One peer: the link's state, its handshake, keepalive, the peer's cache table, outbound requests,
and a Kind -> handler table for every frame the peer sends.

A link owns one frame stream (``transports.base.FrameStream``), a ``RequestTable`` of its outstanding
requests, the ``PeerTable`` of the peer's caches, the ``Inbound`` side that serves the peer's
requests, and - when this side moves bytes one-sided - a ``OneSidedSender``. When the stream closes,
every pending request fails at once and the owner drops the link; ``link_clusters`` to that peer
then builds a new one.

Longer than most modules (about 660 lines) and still one idea, one peer: half of it is the outbound
side of a request (write, read, one-sided, held, abandon, settle), which shares the link's state,
stream and request table with the frame handlers; splitting it would hand those back and forth.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from enum import Enum
from typing import Any, Protocol

import numpy as np

from transports.base import Connection, OutgoingFrame, PayloadSink

from .datapath import DataPaths
from .handshake import HANDSHAKE_META_LIMIT, Handshake, Identity
from .layout import FlatIoVec, IoVec, as_iovec, iovec_bytes, runs_at, scatter_vector
from .memory import CacheEntry, CacheRegistry
from .onesided import LeaseState, OneSidedSender
from .options import EngineOptions
from .peer import PeerTable, RemoteCache
from .protocol import (
    FrameHeader,
    KeyRelease,
    Kind,
    ProtocolError,
    decode_json,
    decode_message,
    decode_status,
    encode_json,
    encode_message,
    encode_release_key,
    encode_status,
    encode_transfer,
)
from .requests import PendingOp, RequestTable
from .serving import LANDED_ABORTED, HeldGrants, Inbound
from .status import LLMException, LLMStatusCode


class RunLayout(Protocol):
    """Where a transfer's runs lie within each remote tensor (a ``plan.Plan``): read only by the
    one-sided paths, which address the peer's memory themselves (a plan lays them out on first use)."""

    @property
    def remote_offset(self) -> np.ndarray[Any, Any]: ...

    @property
    def length(self) -> np.ndarray[Any, Any]: ...

    #: the runs as ints ((local offset, remote offset, length), ...) when there are a few, else None
    small: tuple[tuple[int, int, int], ...] | None

log = logging.getLogger(__name__)

Handler = Callable[[FrameHeader, bytes], PayloadSink | None]


class LinkState(Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    CLOSED = "closed"


class LinkOwner(Protocol):
    """What a link needs from its engine."""

    registry: CacheRegistry

    @property
    def identity(self) -> Identity: ...

    @property
    def options(self) -> EngineOptions: ...

    def link_closed(self, link: Link, reason: str, held: HeldGrants | None) -> None:
        """The link closed; ``held``: caches the peer may still be writing into (release when safe)."""

    def deliver(self, link: Link, channel: int, data: bytes) -> bool:
        """A message or notification arrived; False when it cannot be queued (the sender is told)."""

    def registry_changed(self) -> None:
        """The registry changed because of a peer (it released a cache key): tell every peer."""


class Link:
    """A linked peer. Create with ``await Link.establish(...)``."""

    def __init__(self, owner: LinkOwner, connection: Connection, paths: DataPaths, *, dialer: bool) -> None:
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.dialer = dialer
        self.state = LinkState.HANDSHAKE
        self.peer_cluster_id: int | None = None
        self.peer_instance = ""
        self.close_reason = ""
        self.fallback_reason = ""
        self.rtt_ms: float | None = None
        self.counters: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.last_error = ""
        self.peer = PeerTable()
        self.paths = paths
        self.requests = RequestTable(self.loop, self.note_failure)
        self.onesided: OneSidedSender | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # owned: cancelled when the link closes
        self._bye: asyncio.Future[None] = self.loop.create_future()
        self._unlinking = False  # this side sent BYE and waits for the answer
        self._agreed = False  # a BYE came from the peer: it unlinks too (graceful, whoever closes first)
        self._first_table: asyncio.Future[None] = self.loop.create_future()
        self.handshake = Handshake(owner.identity, self._send_control, paths.make_offers, dialer=dialer)
        options = owner.options  # parsed at init, before any link: read live, through C-level getters
        self.inbound = Inbound(owner.registry, functools.partial(getattr, options, "enable_remote_cache_accessible"),
                               self._send_frame, self.counters, paths.proves_reach, "?", self.loop, self.close,
                               functools.partial(getattr, options, "sync_kv_timeout_ms"), owner.registry_changed)
        self._handlers: dict[Kind, Handler] = {
            Kind.WRITE: self.inbound.serve_write,
            Kind.READ: self._on_read,
            Kind.DONE: self._on_done,
            Kind.READ_DATA: self._on_read_data,
            Kind.PING: self._on_ping,
            Kind.PONG: self._on_pong,
            Kind.TABLE: self._on_table,
            Kind.TABLE_REQUEST: self._on_table_request,
            Kind.WRITE_INTENT: self._on_intent,
            Kind.READ_INTENT: self._on_intent,
            Kind.GRANT: self._on_grant,
            Kind.LANDED: self._on_landed,
            Kind.WRITE_NOTICE: self._on_notice,
            Kind.LEASE: self._on_lease,
            Kind.BYE: self._on_bye,
            Kind.MESSAGE: self._on_message,
            Kind.MESSAGE_ACK: self._on_message_ack,
            Kind.RELEASE_KEY: self._on_release_key,
        }
        self.stream = connection.open(self, self.loop)
        self.stream.meta_limit = HANDSHAKE_META_LIMIT  # lifted once the link is ready

    def __repr__(self) -> str:
        return (f"<Link peer_cluster={self.peer_cluster_id} transport={self.transport} "
                f"{self.state.value}{' dialer' if self.dialer else ''}>")

    def _send_control(self, head: bytes) -> OutgoingFrame:
        return self.stream.send(head)

    def _send_frame(self, head: bytes, payload: IoVec | None = None) -> Any:
        return self.stream.send(head, payload)

    @property
    def transport(self) -> str:
        """How this side's transfers move bytes on this link."""
        return self.onesided.mover.capabilities.name if self.onesided else self.stream.capabilities.name

    @property
    def ready(self) -> bool:
        return self.state == LinkState.READY

    # -- establishment -----------------------------------------------------------------------------
    @classmethod
    async def establish(cls, owner: LinkOwner, connection: Connection, paths: DataPaths, *, dialer: bool,
                        expect_cluster_id: int | None = None) -> Link:
        """Run the handshake on a connected channel. Raises LLMException(LLM_LINK_FAILED) with the
        reason (LLM_FEATURE_NOT_ENABLED when an explicit transport cannot reach the peer);
        cancelling (e.g. by the caller's timeout) closes the connection."""
        link = cls(owner, connection, paths, dialer=dialer)
        try:
            if dialer:
                result = await link.handshake.dial(expect_cluster_id)
            else:
                result = await link.handshake.accept()
            link.peer_cluster_id, link.peer_instance = result.peer_cluster_id, result.peer_instance
            link.inbound.rename(result.peer_cluster_id)
            paths.take_peer_offers(result.peer_offers)
            mover, link.fallback_reason = paths.choose(owner.options.transport, result.peer_cluster_id, link.close)
            if mover is not None:
                link.onesided = OneSidedSender(mover, link._send_control, link.requests, link.close, link.loop)
            link._become_ready()
            link.send_table()
            if dialer:  # linked means the peer's caches are known: no round trip on the first push
                await link._first_table
        except LLMException as error:
            link.close(str(error))
            raise
        except BaseException:
            link.close("handshake interrupted")
            raise
        link._own(link._keepalive_loop(), f"kvpush-keepalive-{link.peer_cluster_id}")
        log.info("link to cluster %s ready over %s (%s%s)%s", link.peer_cluster_id, link.transport,
                 "dialed" if dialer else "accepted", ", authenticated" if owner.options.auth_token else "",
                 f"; same-host path not used: {link.fallback_reason}" if link.fallback_reason else "")
        return link

    def _become_ready(self) -> None:
        if self.state == LinkState.HANDSHAKE:
            self.state = LinkState.READY
            self.stream.meta_limit = None
            self.stream.trusted()

    def _own(self, coroutine: Any, name: str) -> None:
        task = self.loop.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

    # -- cache tables ---------------------------------------------------------------------------
    def send_table(self, request_id: int = 0) -> None:
        if self.state == LinkState.READY:
            registry = self.owner.registry
            descriptors = self.paths.share_descriptors
            caches = registry.table(self.paths.share_addresses or descriptors, descriptors)
            self.stream.send(encode_json(Kind.TABLE, request_id, {"version": registry.version, "caches": caches}))

    def registry_changed(self) -> None:
        """This engine's registry changed: the peer gets the new table; released caches lose leases."""
        self.send_table()
        self.inbound.revoke_released()

    def release_key(self, release: KeyRelease) -> None:
        """This side pulled a slot a cache key of the peer names: tell the peer (which drops the key once
        its whole slot was pulled), after everything sent so far, without waiting for an answer; until
        the peer's next table, lookups of that key here miss (and so ask the peer). A link that is not
        ready sends nothing: the key stays until the peer removes it."""
        self.peer.forget_key(release.name)
        if self.state == LinkState.READY:
            self.stream.send(encode_release_key(release))

    async def refresh_table(self) -> None:
        """One round trip for the peer's current cache table (callers bound it with their deadline)."""
        op = self._new_op(Kind.TABLE_REQUEST)
        self.stream.send(encode_json(Kind.TABLE_REQUEST, op.request_id, {}))
        try:
            await asyncio.shield(op.future)
        finally:
            self.requests.forget(op)

    # -- outbound requests ----------------------------------------------------------------------
    def _new_op(self, kind: Kind) -> PendingOp:
        if self.state != LinkState.READY:
            raise self._not_ready()
        return self.requests.new(kind)

    def _not_ready(self) -> LLMException:
        return LLMException(LLMStatusCode.LLM_NOT_YET_LINK,
                            f"link to cluster {self.peer_cluster_id} is {self.state.value}: {self.close_reason}")

    def _broke(self) -> str:
        return f"link to cluster {self.peer_cluster_id} broke during the transfer: {self.close_reason}"

    def start_write(self, remote: RemoteCache, first_tensor: int, num_tensors: int, runs_wire: bytes,
                    layout: RunLayout, source: IoVec | FlatIoVec, source_entry: CacheEntry, budget_ms: int,
                    held: bool = False, payload_len: int | None = None) -> PendingOp:
        """Start one layer's write: one-sided when this link can, else a WRITE frame carrying the
        bytes. The source cache stays pinned until its bytes left. ``held``: prepare everything (a
        one-sided request is even granted) but move no byte until ``release_held``. ``payload_len``:
        the layer's bytes, when the caller knows them."""
        if payload_len is None:
            payload_len = iovec_bytes(source)
        self.counters["write_requests"] += 1
        self.counters["bytes_pushed"] += payload_len
        if self._onesided_reaches(remote):
            assert self.onesided is not None
            leased = self.onesided.lease_active(remote.cache_id)
            return self._start_onesided(Kind.WRITE_INTENT, remote, first_tensor, num_tensors, runs_wire, layout,
                                        source, source_entry, budget_ms, held, leased)
        if held:
            op = self._new_op(Kind.WRITE)
            head = encode_transfer(Kind.WRITE, op.request_id, remote.cache_id, first_tensor, num_tensors, runs_wire,
                                   payload_len, budget_ms)
            source_entry.pin()
            op.hold(source_entry.unpin)
            op.frame = self.stream.prepare(head, source, payload_len)
            op.held = True
            return op
        # The frame goes first and the request is booked behind it (a small frame on an idle stream
        # leaves within ``enqueue``: the bookkeeping is then off the round trip's path). Nothing can
        # answer it in between: replies are handled by this loop, after this call returns.
        if self.state != LinkState.READY:
            raise self._not_ready()
        request_id = self.requests.reserve()
        frame = self.stream.prepare(encode_transfer(Kind.WRITE, request_id, remote.cache_id, first_tensor,
                                                    num_tensors, runs_wire, payload_len, budget_ms),
                                    source, payload_len)
        self.stream.enqueue(frame)
        op = self.requests.new(Kind.WRITE, request_id)
        op.frame = frame
        if not frame.left:  # the source stays pinned until its bytes left (or the stream failed them)
            source_entry.pin()
            frame.sent.add_done_callback(lambda _: source_entry.unpin())
            if self.stream.closed:  # the send closed the link before the request was booked
                self.requests.complete(op, LLMException(LLMStatusCode.LLM_TIMEOUT, self._broke()))
        return op

    def _enqueue(self, op: PendingOp) -> None:
        """Queue a prepared frame; from now on its ``sent`` future (not ``abandon``) unpins."""
        assert op.frame is not None
        release = op.take_release()
        self.stream.enqueue(op.frame)
        if release is None:
            return
        if op.frame.left:  # it left at once (small frames do): no future, no callback round through the loop
            release()
        else:
            op.frame.sent.add_done_callback(lambda _: release())

    def release_held(self, op: PendingOp) -> None:
        """Let a ``held`` request move its bytes now (microseconds: everything was prepared)."""
        if not op.held:
            return
        op.held = False
        if op.kind == Kind.WRITE:
            self._enqueue(op)
        elif self.onesided is not None:
            self.onesided.release_held(op)

    def start_read(self, remote: RemoteCache, first_tensor: int, num_tensors: int, runs_wire: bytes,
                   layout: RunLayout, destination: IoVec | FlatIoVec, destination_entry: CacheEntry,
                   budget_ms: int) -> PendingOp:
        """Start one layer's read: one-sided when this link can, else a READ whose reply's payload
        lands straight in ``destination``."""
        expected = iovec_bytes(destination)
        self.counters["read_requests"] += 1
        self.counters["bytes_pulled"] += expected
        if self._onesided_reaches(remote):
            return self._start_onesided(Kind.READ_INTENT, remote, first_tensor, num_tensors, runs_wire, layout,
                                        destination, destination_entry, budget_ms)
        op = self._new_op(Kind.READ)
        op.expected = expected
        destination_entry.pin()
        op.future.add_done_callback(lambda _: destination_entry.unpin())
        op.sink = PayloadSink(destination, lambda: self.requests.complete(op, None))
        head = encode_transfer(Kind.READ, op.request_id, remote.cache_id, first_tensor, num_tensors, runs_wire,
                               0, budget_ms)
        op.frame = self.stream.send(head)
        return op

    def writes_alone(self, remote: RemoteCache) -> bool:
        """True when a write to ``remote`` goes under a standing grant over a same-host mover: the copy
        completes here and needs nothing from the peer (``transfer.run`` may then merge layers)."""
        onesided = self.onesided
        return (onesided is not None and onesided.mover.capabilities.same_host_only
                and self._onesided_reaches(remote) and onesided.leases.get(remote.cache_id) == LeaseState.ACTIVE)

    def _onesided_reaches(self, remote: RemoteCache) -> bool:
        if self.onesided is None or remote.addrs is None:
            return False
        return not self.onesided.mover.capabilities.needs_registration or remote.rkeys is not None

    def _start_onesided(self, kind: Kind, remote: RemoteCache, first_tensor: int, num_tensors: int,
                        runs_wire: bytes, layout: RunLayout, local: IoVec | FlatIoVec, entry: CacheEntry,
                        budget_ms: int, held: bool = False, leased: bool = False) -> PendingOp:
        """A one-sided request: ask for a grant (intent), or under a lease copy at once and notify.
        A few runs go to a mover that takes them (``flat_vectors``) as ints on both sides."""
        assert remote.addrs is not None and self.onesided is not None
        op = self._new_op(kind)
        op.held = held
        bases = remote.addrs[first_tensor:first_tensor + num_tensors]
        small = layout.small
        if small is not None and type(local) is tuple and self.onesided.mover.capabilities.flat_vectors:
            op.local_iov = local
            op.remote_iov = runs_at(bases, small, 1)
            runs = len(small)
        else:
            op.local_iov = as_iovec(local)
            op.remote_iov = scatter_vector(bases, layout.remote_offset, layout.length)
            runs = int(layout.length.shape[0])
        op.move_args = (remote.cache_id, first_tensor, remote.rkeys, runs)
        entry.pin()
        op.hold(entry.unpin)
        if leased:
            op.notice = encode_transfer(Kind.WRITE_NOTICE, op.request_id, remote.cache_id, first_tensor,
                                        num_tensors, runs_wire, 0, budget_ms)
            if not held:
                self.onesided.begin_leased(op)
            return op
        op.frame = self.stream.send(encode_transfer(kind, op.request_id, remote.cache_id, first_tensor, num_tensors,
                                                    runs_wire, 0, budget_ms))
        return op

    async def send_message(self, channel: int, data: bytes) -> None:
        """Send a message (or a notification) to the peer, in order behind everything sent so far;
        returns when the peer queued it. LLM_LINK_BUSY when its inbox is full; LLM_TIMEOUT when the
        link breaks first. Cancellation stops waiting for the answer (the message may still arrive)."""
        op = self._new_op(Kind.MESSAGE)
        if self.onesided is not None:
            self.onesided.flush_notices()  # what this link's writes landed goes first
        self.stream.send(encode_message(op.request_id, channel, data))
        try:
            await op.future
        finally:
            self.requests.forget(op)

    def _on_message(self, header: FrameHeader, meta: bytes) -> None:
        channel, data = decode_message(meta)
        if self.owner.deliver(self, channel, data):
            self.stream.send(encode_status(Kind.MESSAGE_ACK, header.request_id, 0))
        else:
            self.stream.send(encode_status(Kind.MESSAGE_ACK, header.request_id, int(LLMStatusCode.LLM_LINK_BUSY),
                                           "the receiver's inbox is full"))

    def _on_message_ack(self, header: FrameHeader, meta: bytes) -> None:
        status, message = decode_status(header, meta)
        op = self.requests.get(header.request_id, Kind.MESSAGE)
        if op is None:
            return
        self.requests.complete(op, None if status == 0 else LLMException(LLMStatusCode.from_wire(status),
                                                                          f"peer refused the message: {message}"))

    def abandon(self, op: PendingOp) -> None:
        """Stop waiting for ``op``: an unsent frame is dropped, an incoming payload is discarded
        from now on, and a late reply is ignored. Bytes of a WRITE already on the wire, or of a
        one-sided copy already running, still land (see ``settle``)."""
        self.requests.forget(op)
        if op.frame is not None:
            op.frame.abandon()
        if op.sink is not None:
            op.sink.cancel()
        if op.copy is None:
            op.release()
            if op.granted:  # granted but never moved: let the peer unpin
                self.stream.send(encode_status(Kind.LANDED, op.request_id, LANDED_ABORTED))
                op.granted = False
        self.requests.abandon(op)

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
        """Count a failure (a request's, or one the engine raised itself, e.g. a layer's deadline)."""
        self.failures[error.status_code.name] += 1
        self.last_error = str(error)

    # -- frames from the peer (StreamHandler) ---------------------------------------------------
    def on_frame(self, header: FrameHeader, meta: bytes, in_hand: bool = False) -> PayloadSink | None:
        if self.state == LinkState.HANDSHAKE:
            if self.handshake.deliver(header.kind, decode_json(header.kind, meta)):
                self._become_ready()  # the acceptor's next frames (its cache table) may be in this same read
            return None
        if self.state == LinkState.CLOSED:
            return None
        if in_hand and header.kind == Kind.WRITE:  # a small write, its bytes already here
            return self.inbound.serve_write(header, meta, True)
        handler = self._handlers.get(header.kind)
        if handler is None:
            raise ProtocolError(f"unexpected {header.kind.name} on a ready link")
        return handler(header, meta)

    def _on_read(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.serve_read(header, meta)

    def _on_intent(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.on_intent(header, meta)

    def _on_landed(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.on_landed(header, meta)

    def _on_notice(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.on_notice(header, meta)

    def _on_release_key(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.on_release_key(header, meta)

    def _on_ping(self, header: FrameHeader, meta: bytes) -> None:
        self.stream.send(encode_json(Kind.PONG, 0, decode_json(header.kind, meta)))

    def _on_pong(self, header: FrameHeader, meta: bytes) -> None:
        sent = decode_json(header.kind, meta).get("t")
        if isinstance(sent, (int, float)):
            self.rtt_ms = (time.monotonic() - sent) * 1000

    def _on_table(self, header: FrameHeader, meta: bytes) -> None:
        self.peer.apply(decode_json(header.kind, meta))
        if not self._first_table.done():
            self._first_table.set_result(None)
        op = self.requests.get(header.request_id, Kind.TABLE_REQUEST)
        if op is not None:
            self.requests.complete(op, None)

    def _on_table_request(self, header: FrameHeader, meta: bytes) -> None:
        self.send_table(header.request_id)

    def _on_grant(self, header: FrameHeader, meta: bytes) -> None:
        if self.onesided is None:
            raise ProtocolError("GRANT on a link that sent no one-sided request")
        self.onesided.on_grant(header, meta)

    def _on_lease(self, header: FrameHeader, meta: bytes) -> None:
        body = decode_json(header.kind, meta)
        if body.get("op") in ("request", "revoked"):
            self.inbound.on_lease(body)
        elif self.onesided is None:
            raise ProtocolError("LEASE answer on a link that asked for none")
        else:
            self.onesided.on_lease(body)

    def _on_done(self, header: FrameHeader, meta: bytes) -> None:
        status, message = decode_status(header, meta)
        op = self.requests.get(header.request_id, Kind.WRITE)
        if op is None:
            log.debug("ignoring DONE for request %d (abandoned or unknown)", header.request_id)
            return
        if status == 0:
            self.requests.complete(op, None)
        else:
            self.requests.complete(op, LLMException(LLMStatusCode.from_wire(status),
                                                    f"peer refused the write: {message}"))

    def _on_read_data(self, header: FrameHeader, meta: bytes) -> PayloadSink | None:
        status, message = decode_status(header, meta)
        op = self.requests.get(header.request_id, Kind.READ)
        if op is None or op.sink is None:
            return None  # abandoned: the payload is discarded
        if status != 0:
            if header.payload_len:
                raise ProtocolError("READ_DATA carries both an error and a payload")
            self.requests.complete(op, LLMException(LLMStatusCode.from_wire(status),
                                                    f"peer refused the read: {message}"))
            return None
        if header.payload_len != op.expected:
            raise ProtocolError(f"READ_DATA of {header.payload_len} bytes for a request of {op.expected}")
        return op.sink

    # -- closing --------------------------------------------------------------------------------
    def _on_bye(self, header: FrameHeader, meta: bytes) -> None:
        """A graceful unlink. ``leases_done``: the sender of the BYE has no same-host copy into this
        process running any more, so the caches it held standing grants on can be let go now."""
        body = decode_json(header.kind, meta)
        self._agreed = True
        if body.get("leases_done"):
            self.inbound.end_leases()
        if body.get("ack"):
            if not self._bye.done():
                self._bye.set_result(None)
            self.close("unlinked")
            return
        if self._unlinking:  # both ends unlink at once: the peer's BYE answers ours (our leases are drained)
            if not self._bye.done():
                self._bye.set_result(None)
            self.stream.send(encode_json(Kind.BYE, 0, {"ack": True, "leases_done": True}))
            return
        if self.onesided is not None:
            self.onesided.close_leases()  # nothing new starts; what runs is drained before the ack
            if not self.onesided.leases_idle():
                self._own(self._ack_when_idle(), f"kvpush-bye-{self.peer_cluster_id}")
                return
        self.ack_bye()

    def ack_bye(self, leases_done: bool = True) -> None:
        """Answer the peer's graceful unlink; the link closes once the answer is out."""
        ack = self.stream.send(encode_json(Kind.BYE, 0, {"ack": True, "leases_done": leases_done}))
        ack.sent.add_done_callback(lambda _: self.close("peer unlinked"))

    async def _ack_when_idle(self) -> None:
        assert self.onesided is not None
        done = await self.onesided.drain_leases(self.owner.options.sync_kv_timeout_ms / 1000)
        self.ack_bye(done)

    async def unlink(self, timeout: float) -> bool:
        """Tell the peer and wait for its acknowledgement (bounded); always closes locally. True when
        both ends agreed: the peer acknowledged, or sent its own BYE (it unlinks too, and whichever end
        closes first ends the link: a crossing unlink is never a failure).

        Cancellation closes the link at once (force)."""
        try:
            if self.state == LinkState.READY:
                self._unlinking = True  # from now on a BYE from the peer answers ours (both ends unlink)
                if self.onesided is not None:
                    self.onesided.close_leases()  # nothing new starts, so the drain below is final
                done = self.onesided is None or await self.onesided.drain_leases(timeout)
                if self._bye.done() and self._bye.exception() is None:
                    return True  # the peer's own unlink crossed ours while we drained: both ends agreed
                if self.state != LinkState.READY:
                    return self._agreed
                self.stream.send(encode_json(Kind.BYE, 0, {"leases_done": done}))
                await asyncio.wait_for(asyncio.shield(self._bye), timeout)
                return True
            return self._agreed
        except (TimeoutError, ConnectionError, LLMException):
            return self._agreed
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
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        self.requests.fail_all(LLMStatusCode.LLM_TIMEOUT, self._broke())
        held = self.inbound.close(self.paths.watch_writer)
        if self.onesided is not None:
            self.onesided.close()
        for waiter in (self._bye, self._first_table):
            if not waiter.done():
                waiter.set_exception(LLMException(LLMStatusCode.LLM_LINK_FAILED, reason))
                waiter.exception()
        if was_ready:
            log.info("link to cluster %s closed: %s", self.peer_cluster_id, reason)
        self.owner.link_closed(self, reason, held)

    def on_close(self, reason: str) -> None:
        """The stream went away under us."""
        if self.state != LinkState.CLOSED:
            if self.state == LinkState.HANDSHAKE:
                self.handshake.stream_closed(reason)
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
            "pending": len(self.requests),
            **dict(self.counters),
            "failures": dict(self.failures),
            "last_error": self.last_error,
            "close_reason": self.close_reason,
        }
