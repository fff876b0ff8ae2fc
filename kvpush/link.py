"""One peer: the asyncio side of a link - its stream, its tasks, its waits.

A link's protocol state and its handling of every frame from the peer are the sans-I/O core,
``kvpush.link_protocol.LinkProtocol``; this module drives it: it opens the stream (the core is its
handler), runs the handshake, keeps the link alive, waits for the answers an unlink or a table request
needs, and closes. A link owns its frame stream (``transports.base.FrameStream``), a ``RequestTable``
of its outstanding requests, the ``PeerTable`` of the peer's caches, the ``Inbound`` side that serves
the peer's requests, the ``Outbound`` side that starts this engine's, and - when this side moves bytes
one-sided - a ``OneSidedSender``. When the stream closes, every pending request fails at once and the
owner drops the link; ``link_clusters`` to that peer then builds a new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Protocol

from transports.base import Connection, Mover, OutgoingFrame

from .datapath import DataPaths
from .handshake import HANDSHAKE_META_LIMIT, Handshake, Identity
from .lag import LoopLag
from .layout import IoVec
from .link_protocol import LinkProtocol, LinkState
from .memory import CacheRegistry
from .onesided import OneSidedSender
from .options import EngineOptions
from .outbound import Outbound
from .peer import PeerTable
from .protocol import KeyRelease, Kind, encode_json, encode_message, encode_release_key
from .read_offers import LinkPorts
from .requests import PendingOp, RequestTable
from .scope import TaskScope
from .serving import HeldGrants, Inbound
from .status import LLMException, LLMStatusCode

log = logging.getLogger(__name__)

# bound once: this runs on every transfer, and an attribute of an enum class is looked up anew on each use
_READY = LinkState.READY

__all__ = ["Link", "LinkOwner", "LinkState"]


class LinkOwner(Protocol):
    """What a link needs from its engine."""

    registry: CacheRegistry
    loop_lag: LoopLag

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
    """A linked peer. Create with ``await Link.establish(...)``; the ``LinkDriver`` of its protocol core."""

    def __init__(self, owner: LinkOwner, connection: Connection, paths: DataPaths, *, dialer: bool) -> None:
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.dialer = dialer
        self.peer_cluster_id: int | None = None
        self.peer_instance = ""
        self.close_reason = ""
        self.fallback_reason = ""
        self.counters: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.last_error = ""
        self.paths = paths
        self.peer = PeerTable()
        self.requests = RequestTable(self.loop, self.note_failure)
        self.tasks = TaskScope("kvpush-link")  # cancelled when the link closes; its owner awaits them
        self._bye: asyncio.Future[None] = self.loop.create_future()
        self._first_table: asyncio.Future[None] = self.loop.create_future()
        self.inbound = Inbound(owner, LinkPorts(self.send, self.counters, self.loop, self.close, paths.proves_reach,
                                                self._reader))
        self.handshake = Handshake(owner.identity, self.send, paths.make_offers, dialer=dialer)
        self.protocol = LinkProtocol(self, self.handshake, self.requests, self.peer, self.inbound)
        self.stream = connection.open(self.protocol, self.loop)
        self.stream.meta_limit = HANDSHAKE_META_LIMIT  # lifted once the link is ready
        self.outbound = Outbound(self)

    def __repr__(self) -> str:
        return (f"<Link peer_cluster={self.peer_cluster_id} transport={self.transport} "
                f"{self.state.value}{' dialer' if self.dialer else ''}>")

    @property
    def state(self) -> LinkState:
        return self.protocol.state

    @property
    def ready(self) -> bool:
        return self.protocol.state is _READY

    @property
    def onesided(self) -> OneSidedSender | None:
        return self.protocol.onesided

    @property
    def rtt_ms(self) -> float | None:
        return self.protocol.rtt_ms

    @property
    def transport(self) -> str:
        """How this side's transfers move bytes on this link."""
        onesided = self.protocol.onesided
        return onesided.mover.capabilities.name if onesided else self.stream.capabilities.name

    # -- establishment -----------------------------------------------------------------------------
    @classmethod
    async def establish(cls, owner: LinkOwner, connection: Connection, paths: DataPaths, *, dialer: bool,
                        expect_cluster_id: int | None = None) -> Link:
        """Run the handshake on a connected channel. Raises LLMException(LLM_LINK_FAILED) with the
        reason (LLM_FEATURE_NOT_ENABLED when an explicit transport cannot reach the peer);
        cancelling (e.g. by the caller's timeout) closes the connection."""
        link = cls(owner, connection, paths, dialer=dialer)
        await link.open(expect_cluster_id)
        return link

    async def open(self, expect_cluster_id: int | None = None) -> None:
        """The handshake, the data path chosen from both sides' offers, the first cache tables; then the
        keepalive. Closes the link on any failure (see ``establish``)."""
        try:
            if self.dialer:
                result = await self.handshake.dial(expect_cluster_id)
            else:
                result = await self.handshake.accept()
            self.peer_cluster_id, self.peer_instance = result.peer_cluster_id, result.peer_instance
            self.tasks.name = f"kvpush-link-{result.peer_cluster_id}"
            self.inbound.rename(result.peer_cluster_id)
            self.paths.take_peer_offers(result.peer_offers)
            mover, self.fallback_reason = self.paths.choose(self.owner.options.transport, result.peer_cluster_id,
                                                            self.close)
            if mover is not None:
                self.protocol.onesided = OneSidedSender(mover, self.send, self.requests, self.close, self.loop)
            self.protocol.become_ready()
            self.send_table()
            if self.dialer:  # linked means the peer's caches are known: no round trip on the first push
                await self._first_table
        except LLMException as error:
            self.close(str(error))
            raise
        except BaseException:
            self.close("handshake interrupted")
            raise
        if not self.ready:  # a send of the table failed and closed it: the owner sees a closed link
            return
        self.tasks.spawn(self._keepalive_loop(), f"kvpush-keepalive-{self.peer_cluster_id}")
        log.info("link to cluster %s ready over %s (%s%s)%s", self.peer_cluster_id, self.transport,
                 "dialed" if self.dialer else "accepted", ", authenticated" if self.owner.options.auth_token else "",
                 f"; same-host path not used: {self.fallback_reason}" if self.fallback_reason else "")

    def _reader(self) -> Mover | None:
        """The mover through which this side reads the peer's memory for a READ_OFFER: a same-host one."""
        onesided = self.protocol.onesided
        if onesided is None or not onesided.mover.capabilities.same_host_only:
            return None
        return onesided.mover

    # -- LinkDriver: what the protocol core needs done ---------------------------------------------
    def send(self, head: bytes, payload: IoVec | None = None) -> OutgoingFrame:
        return self.stream.send(head, payload)

    def became_ready(self) -> None:
        self.stream.meta_limit = None
        self.stream.trusted()

    def table_arrived(self) -> None:
        if not self._first_table.done():
            self._first_table.set_result(None)

    def deliver(self, channel: int, data: bytes) -> bool:
        return self.owner.deliver(self, channel, data)

    def bye_answered(self) -> None:
        if not self._bye.done():
            self._bye.set_result(None)

    def ack_bye(self, leases_done: bool = True) -> None:
        """Answer the peer's graceful unlink; the link closes once the answer is out."""
        ack = self.stream.send(encode_json(Kind.BYE, 0, {"ack": True, "leases_done": leases_done}))
        ack.sent.add_done_callback(lambda _: self.close("peer unlinked"))

    def ack_bye_when_idle(self) -> None:
        self.tasks.spawn(self._ack_when_idle(), f"kvpush-bye-{self.peer_cluster_id}")

    async def _ack_when_idle(self) -> None:
        onesided = self.protocol.onesided
        assert onesided is not None
        done = await onesided.drain_leases(self.owner.options.sync_kv_timeout_ms / 1000)
        self.ack_bye(done)

    def stream_closed(self, reason: str) -> None:
        self.close(reason)

    # -- keepalive ------------------------------------------------------------------------------
    def nudge(self) -> None:
        """Have the peer send now what it holds back for this side (the answers to layers offered with
        more to follow, ``read_offers.HOLD_S``): a PING, before which the peer sends them."""
        if self.ready:
            self.stream.send(encode_json(Kind.PING, 0, {"t": time.monotonic()}))

    async def _keepalive_loop(self) -> None:
        """A PING every ``keepalive_interval_ms``; a peer silent for ``keepalive_timeout_ms`` is *gone* - and
        the link closed - only when its host stopped acknowledging what this side sent (the transport's own
        acknowledgements, which the peer's kernel sends whether or not its process runs), or its process
        exited. A peer whose host still acknowledges is *late*: alive and behind (its cores taken, say), its
        link kept, its transfers bounded by their own deadlines. Silence is counted from the end of this
        side's own last stall (``kvpush.lag``), never across it."""
        options = self.owner.options
        interval, limit = options.keepalive_interval_ms / 1000, options.keepalive_timeout_ms / 1000
        late_since: float | None = None
        while self.state is not LinkState.CLOSED:
            await asyncio.sleep(interval)
            heard = self.owner.loop_lag.heard(self.stream.last_receive)
            silent = time.monotonic() - heard
            if silent > limit:
                gone = self._peer_gone(limit)
                if gone is not None:
                    self.close(f"keepalive: nothing heard from the peer for {silent * 1000:.0f} ms and {gone}")
                    return
                if late_since is None:
                    late_since = heard
                    self.counters["late"] += 1
                    log.warning("link to cluster %s: nothing heard from the peer for %.0f ms, but its host "
                                "acknowledges: it is late, not gone; the link stays and its transfers keep their "
                                "own deadlines", self.peer_cluster_id, silent * 1000)
            elif late_since is not None:
                log.info("link to cluster %s: the peer answers again after %.0f ms of silence", self.peer_cluster_id,
                         (heard - late_since) * 1000)
                late_since = None
            self.stream.send(encode_json(Kind.PING, 0, {"t": time.monotonic()}))

    def _peer_gone(self, limit: float) -> str | None:
        """Why the silent peer is gone (its process exited; its host acknowledged nothing for ``limit``, or
        the transport cannot tell), or None: it is only late."""
        watch = self.paths.watch_writer()
        if watch is not None:
            try:
                if not watch.alive():
                    return "its process exited"
            finally:
                watch.close()
        acknowledges = self.stream.peer_acknowledges(limit)
        if acknowledges is None:
            return "the transport cannot tell whether its host is up"
        return None if acknowledges else "its host acknowledged nothing for as long"

    # -- cache tables ---------------------------------------------------------------------------
    def send_table(self, request_id: int = 0) -> None:
        if self.ready:
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
        if self.ready:
            self.stream.send(encode_release_key(release))

    async def refresh_table(self) -> None:
        """One round trip for the peer's current cache table (callers bound it with their deadline)."""
        op = self._new_op(Kind.TABLE_REQUEST)
        self.stream.send(encode_json(Kind.TABLE_REQUEST, op.request_id, {}))
        try:
            await asyncio.shield(op.future)
        finally:
            self.requests.forget(op)

    # -- requests ---------------------------------------------------------------------------------
    def _new_op(self, kind: Kind) -> PendingOp:
        if not self.ready:
            raise self.not_ready()
        return self.requests.new(kind)

    def not_ready(self) -> LLMException:
        return LLMException(LLMStatusCode.LLM_NOT_YET_LINK,
                            f"link to cluster {self.peer_cluster_id} is {self.state.value}: {self.close_reason}")

    def broke(self) -> str:
        return f"link to cluster {self.peer_cluster_id} broke during the transfer: {self.close_reason}"

    async def send_message(self, channel: int, data: bytes) -> None:
        """Send a message (or a notification) to the peer, in order behind everything sent so far;
        returns when the peer queued it. LLM_LINK_BUSY when its inbox is full; LLM_TIMEOUT when the
        link breaks first. Cancellation stops waiting for the answer (the message may still arrive)."""
        op = self._new_op(Kind.MESSAGE)
        if self.protocol.onesided is not None:
            self.protocol.onesided.flush_notices()  # what this link's writes landed goes first
        self.stream.send(encode_message(op.request_id, channel, data))
        try:
            await op.future
        finally:
            self.requests.forget(op)

    def note_failure(self, error: LLMException) -> None:
        """Count a failure (a request's, or one the engine raised itself, e.g. a layer's deadline)."""
        self.failures[error.status_code.name] += 1
        self.last_error = str(error)

    # -- closing --------------------------------------------------------------------------------
    async def unlink(self, timeout: float) -> bool:
        """Tell the peer and wait for its acknowledgement (bounded); always closes locally. True when
        both ends agreed: the peer acknowledged, or sent its own BYE (it unlinks too, and whichever end
        closes first ends the link: a crossing unlink is never a failure).

        Cancellation closes the link at once (force)."""
        protocol = self.protocol
        try:
            if not protocol.begin_unlink():
                return protocol.agreed
            onesided = protocol.onesided
            done = onesided is None or await onesided.drain_leases(timeout)
            if self._bye.done() and self._bye.exception() is None:
                return True  # the peer's own unlink crossed ours while we drained: both ends agreed
            if not self.ready:
                return protocol.agreed
            self.stream.send(encode_json(Kind.BYE, 0, {"leases_done": done}))
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._bye)
            return True
        except (TimeoutError, ConnectionError, LLMException):
            return protocol.agreed
        finally:
            self.close("unlinked")

    def close(self, reason: str, abort: bool = False) -> None:
        """Close now. Every pending request fails with LLM_TIMEOUT (it was in flight when the
        link broke); later calls see LLM_NOT_YET_LINK. ``abort`` resets the connection so bytes
        still queued in this host's kernel are discarded instead of delivered. Idempotent."""
        if self.state is LinkState.CLOSED:
            return
        was_ready = self.protocol.close()
        self.close_reason = reason
        self.stream.close(reason, abort)
        self.tasks.cancel()
        self.requests.fail_all(LLMStatusCode.LLM_TIMEOUT, self.broke())
        lent = self.protocol.onesided.close() if self.protocol.onesided is not None else []
        held = self.inbound.close(self.paths.watch_writer, lent)
        for waiter in (self._bye, self._first_table):
            if not waiter.done():
                waiter.set_exception(LLMException(LLMStatusCode.LLM_LINK_FAILED, reason))
                waiter.exception()
        if was_ready:
            log.info("link to cluster %s closed: %s", self.peer_cluster_id, reason)
        self.owner.link_closed(self, reason, held)

    async def wait_closed(self) -> None:
        """After ``close``: wait until the link's own tasks have unwound."""
        await self.tasks.aclose()

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
