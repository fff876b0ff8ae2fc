"""Sans-I/O: one link's protocol state and what every frame from the peer does to it.

``LinkProtocol`` is the link's core, in the style of ``websockets``' protocol/connection split: it owns
the link's state (``LinkState``), the ``Kind`` -> handler table every frame from the peer goes through,
and the unlink agreement (BYE, including unlinks that cross), and it never touches a socket, a task or a
timer. It is the stream's ``StreamHandler``: frames come in through ``on_frame``; what it sends or needs
done goes out through the ``LinkDriver`` it is handed (``kvpush.link.Link``: the thin asyncio side that
owns the stream, the tasks and the waits). The data-path frames are served by the ``Inbound`` side
(``kvpush.serving``); replies complete requests in the link's ``RequestTable``.

States: HANDSHAKE (frames go to the handshake) -> READY (frames go through the table) -> CLOSED (frames
are ignored). The unlink agreement: a BYE from the peer means it unlinks too (``agreed``); a BYE that
answers ours (``ack``) or crosses it (both ends unlinking) ends this side's wait; a BYE this side did not
start is answered once no same-host copy of this side's into the peer runs any more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import Enum
from typing import Protocol

from transports.base import OutgoingFrame, PayloadSink

from .handshake import Handshake
from .layout import IoVec
from .onesided import OneSidedSender
from .peer import PeerTable
from .protocol import (
    FrameHeader,
    Kind,
    ProtocolError,
    decode_json,
    decode_message,
    decode_status,
    encode_json,
    encode_status,
)
from .requests import RequestTable
from .serving import Inbound
from .status import LLMException, LLMStatusCode

log = logging.getLogger(__name__)

Handler = Callable[[FrameHeader, bytes], PayloadSink | None]


class LinkState(Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    CLOSED = "closed"


# bound once: this runs on every transfer, and an attribute of an enum class is looked up anew on each use
_READY = LinkState.READY
_WRITE, _READ, _READ_OFFER = Kind.WRITE, Kind.READ, Kind.READ_OFFER


class LinkDriver(Protocol):
    """What the protocol core needs done (``kvpush.link.Link`` does it)."""

    def send(self, head: bytes, payload: IoVec | None = None) -> OutgoingFrame:
        """Queue a frame behind everything sent so far."""

    def became_ready(self) -> None:
        """The handshake is over: the stream may trust the peer."""

    def table_arrived(self) -> None:
        """A cache table of the peer was applied."""

    def send_table(self, request_id: int) -> None:
        """Send this engine's cache table (an answer to TABLE_REQUEST ``request_id``)."""

    def deliver(self, channel: int, data: bytes) -> bool:
        """A message or notification from the peer: queued, or False when its inbox is full."""

    def bye_answered(self) -> None:
        """This side's unlink was answered, or crossed by the peer's own."""

    def ack_bye(self, leases_done: bool = True) -> None:
        """Answer the peer's unlink; the link closes once the answer is out."""

    def ack_bye_when_idle(self) -> None:
        """Answer the peer's unlink once no same-host copy of this side's into it runs any more."""

    def close(self, reason: str, abort: bool = False) -> None:
        """Close the link now."""

    def stream_closed(self, reason: str) -> None:
        """The stream went away under the link."""


class LinkProtocol:
    """One link's state and frame handlers (see the module docstring)."""

    def __init__(self, driver: LinkDriver, handshake: Handshake, requests: RequestTable, peer: PeerTable,
                 inbound: Inbound) -> None:
        self.driver = driver
        self.handshake = handshake
        self.requests = requests
        self.peer = peer
        self.inbound = inbound
        self.offers = inbound.reads  # the read offers served here: their held answers and gates, per frame
        self.onesided: OneSidedSender | None = None  # set once the link chose a one-sided mover
        self.state = LinkState.HANDSHAKE
        self.unlinking = False  # this side sent BYE and waits for the answer
        self.agreed = False  # a BYE came from the peer: it unlinks too (graceful, whoever closes first)
        self.rtt_ms: float | None = None
        self.handlers: dict[Kind, Handler] = {
            Kind.WRITE: inbound.serve_write,
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
            Kind.READ_OFFER: self._on_read_offer,
        }

    @property
    def ready(self) -> bool:
        return self.state is _READY

    def become_ready(self) -> None:
        """The handshake is over (from either side's view): frames go through the table from now on."""
        if self.state is LinkState.HANDSHAKE:
            self.state = LinkState.READY
            self.driver.became_ready()

    def close(self) -> bool:
        """The link closes: every later frame is ignored. True when it was ready (False: already closed or
        never linked)."""
        was_ready = self.state is LinkState.READY
        self.state = LinkState.CLOSED
        return was_ready

    # -- StreamHandler ---------------------------------------------------------------------------
    def on_frame(self, header: FrameHeader, meta: bytes, in_hand: bool = False) -> PayloadSink | None:
        """A frame from the peer: where its payload goes (None: discarded)."""
        state = self.state
        if state is _READY:
            offers = self.offers  # (two attributes read per frame: a call only when offers wait)
            if (offers.holding or offers.gated_offers) and header.kind is not _READ_OFFER:
                offers.before_frame()
            if in_hand and header.kind == _WRITE:  # a small write, its bytes already here
                return self.inbound.serve_write(header, meta, True)
            handler = self.handlers.get(header.kind)
            if handler is None:
                raise ProtocolError(f"unexpected {header.kind.name} on a ready link")
            return handler(header, meta)
        if state is LinkState.HANDSHAKE and self.handshake.deliver(header.kind, decode_json(header.kind, meta)):
            self.become_ready()  # the acceptor's next frames (its cache table) may be in this same read
        return None

    def on_close(self, reason: str) -> None:
        """The stream went away under the link."""
        if self.state is LinkState.HANDSHAKE:
            self.handshake.stream_closed(reason)
        if self.state is not LinkState.CLOSED:
            self.driver.stream_closed(reason)

    # -- served by the inbound side --------------------------------------------------------------
    def _on_read(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.serve_read(header, meta)

    def _on_intent(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.on_intent(header, meta)

    def _on_landed(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.on_landed(header, meta)

    def _on_notice(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.on_notice(header, meta)

    def _on_read_offer(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.on_read_offer(header, meta)

    def _on_release_key(self, header: FrameHeader, meta: bytes) -> None:
        self.inbound.on_release_key(header, meta)

    # -- answers to this side's requests -----------------------------------------------------------
    def _on_done(self, header: FrameHeader, meta: bytes) -> None:
        status, message = decode_status(header, meta)
        if self.onesided is not None and self.onesided.on_taken(header.request_id, status, message):
            return  # the answer to a READ_OFFER: the peer copied the bytes
        op = self.requests.get(header.request_id, _WRITE)
        if op is None:
            log.debug("ignoring DONE for request %d (abandoned or unknown)", header.request_id)
            return
        self.requests.complete(op, None if status == 0 else LLMException(
            LLMStatusCode.from_wire(status), f"peer refused the write: {message}"))

    def _on_read_data(self, header: FrameHeader, meta: bytes) -> PayloadSink | None:
        status, message = decode_status(header, meta)
        op = self.requests.get(header.request_id, _READ)
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

    def _on_message_ack(self, header: FrameHeader, meta: bytes) -> None:
        status, message = decode_status(header, meta)
        op = self.requests.get(header.request_id, Kind.MESSAGE)
        if op is not None:
            self.requests.complete(op, None if status == 0 else LLMException(
                LLMStatusCode.from_wire(status), f"peer refused the message: {message}"))

    # -- the link's own control frames -------------------------------------------------------------
    def _on_ping(self, header: FrameHeader, meta: bytes) -> None:
        self.driver.send(encode_json(Kind.PONG, 0, decode_json(header.kind, meta)))

    def _on_pong(self, header: FrameHeader, meta: bytes) -> None:
        sent = decode_json(header.kind, meta).get("t")
        if isinstance(sent, (int, float)):
            self.rtt_ms = (time.monotonic() - sent) * 1000

    def _on_table(self, header: FrameHeader, meta: bytes) -> None:
        self.peer.apply(decode_json(header.kind, meta))
        self.driver.table_arrived()
        op = self.requests.get(header.request_id, Kind.TABLE_REQUEST)
        if op is not None:
            self.requests.complete(op, None)

    def _on_table_request(self, header: FrameHeader, meta: bytes) -> None:
        self.driver.send_table(header.request_id)

    def _on_message(self, header: FrameHeader, meta: bytes) -> None:
        channel, data = decode_message(meta)
        if self.driver.deliver(channel, data):
            self.driver.send(encode_status(Kind.MESSAGE_ACK, header.request_id, 0))
        else:
            self.driver.send(encode_status(Kind.MESSAGE_ACK, header.request_id, int(LLMStatusCode.LLM_LINK_BUSY),
                                           "the receiver's inbox is full"))

    # -- unlinking ----------------------------------------------------------------------------------
    def begin_unlink(self) -> bool:
        """This side starts a graceful unlink: from now on a BYE from the peer answers it. False when the
        link is not ready (nothing to agree on)."""
        if self.state is not LinkState.READY:
            return False
        self.unlinking = True
        if self.onesided is not None:
            self.onesided.close_leases()  # nothing new starts, so a drain of the running ones is final
        return True

    def _on_bye(self, header: FrameHeader, meta: bytes) -> None:
        """A graceful unlink. ``leases_done``: the sender of the BYE has no same-host copy into this
        process running any more, so the caches it held standing grants on can be let go now."""
        body = decode_json(header.kind, meta)
        self.agreed = True
        if body.get("leases_done"):
            self.inbound.end_leases()
        if body.get("ack"):  # the answer to this side's BYE
            self.driver.bye_answered()
            self.driver.close("unlinked")
            return
        if self.unlinking:  # both ends unlink at once: the peer's BYE answers ours (our leases are drained)
            self.driver.bye_answered()
            self.driver.send(encode_json(Kind.BYE, 0, {"ack": True, "leases_done": True}))
            return
        if self.onesided is not None:
            self.onesided.close_leases()  # nothing new starts; what runs is drained before the answer
            if not self.onesided.leases_idle():
                self.driver.ack_bye_when_idle()
                return
        self.driver.ack_bye()
