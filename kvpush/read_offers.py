"""Writes this side copies itself, on one link to a peer on this host: the peer's READ_OFFERs, gated or not,
and the answers held for a layer-pipelined request.

A READ_OFFER names the peer's bytes for this engine's memory. This side (idle, waiting for them; the peer
computes) copies them out of the peer's process with its same-host mover (its worker thread for big layers) and
answers DONE once every byte is here, or with the refusal. A gated offer (``OFFER_GATED``) is checked and pinned
at once and copied once the sender marks its layer ready (``kvpush.gates``), checked again then: its cache may
have been unregistered, or its blocks' grant ended, meanwhile. The cache stays pinned while a copy runs, even if
the link closes meanwhile (the copy is this process's own and ends by itself). The DONEs of offers marked
``OFFER_MORE`` are held and leave together (``send_held``), so the sender's loop wakes once per request.

``ReadOffers`` is handed the link's ports and the inbound side's own checks and deadlines (``OfferPorts``) and
knows no link.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transports.base import Mover, OutgoingFrame, TransportError

from .admission import Refusal, still_open
from .gates import Gates
from .layout import IoVec
from .memory import CacheEntry
from .protocol import OFFER_MORE, FrameHeader, Kind, TransferMeta, decode_read_offer, encode_status
from .status import LLMStatusCode

log = logging.getLogger(__name__)

_DONE = Kind.DONE
# the longest the DONE of a read offer marked OFFER_MORE is held (at most a quarter of that offer's budget, too):
# long enough to span a prefill layer or two, short beside any deadline
HOLD_S = 0.25
# how long a gated read offer may wait for its mark (the sender's computation of the layer, a forward pass
# of at most one scheduler step's tokens); its own deadline starts once it is marked
GATE_WAIT_S = 120.0


Send = Callable[..., OutgoingFrame]


@dataclass(slots=True)
class LinkPorts:
    """What the inbound side (``serving.Inbound``, and its ``ReadOffers``) uses of its link: a frame sender,
    the link's counters, its loop (one timer for the deadlines of incoming transfers), closing the link, the
    data paths' check of a lease proof, and the same-host mover through which this side can read the peer's
    memory (None: it cannot)."""

    send: Send
    counters: Counter[str]
    loop: asyncio.AbstractEventLoop
    close: Callable[[str], None]
    proves_reach: Callable[[str], bool]
    reader: Callable[[], Mover | None] = lambda: None


@dataclass(slots=True)
class OfferPorts:
    """What the read offers of one link use: the link's ports, and the inbound side's check of a request
    (``Inbound``'s resolve: the cache, the iovec and the sender's budget, or the refusal) and its deadlines
    (``watch`` one request, ``done`` with it)."""

    link: LinkPorts
    resolve: Callable[[FrameHeader, bytes, str, TransferMeta], tuple[CacheEntry, IoVec, int] | Refusal]
    watch: Callable[..., None]
    done: Callable[[int], None]


class ReadOffers:
    """The READ_OFFERs of one link being copied, or waiting for their marks, here."""

    def __init__(self, ports: OfferPorts) -> None:
        self._ports = ports
        self._link = ports.link
        self._send = ports.link.send
        self._counters = ports.link.counters
        self.peer = "?"
        self.peer_id: int | None = None  # None until the handshake named the peer: no grant applies
        self.reading: dict[int, CacheEntry] = {}  # READ_OFFERs being copied (or gated) here, until their DONE
        # gated READ_OFFERs waiting for their mark: (entry, iov, source, transfer, budget ms, OFFER_MORE); read
        # (with ``holding``) by the link before it handles each frame: ``before_frame``
        self.gated_offers: dict[int, tuple[CacheEntry, IoVec, IoVec, TransferMeta, int, bool]] = {}
        self._gates = Gates(self._link.loop, self._link.reader, self._gate_opened, self._gate_withdrawn,
                            self._gates_failed)
        # DONEs of copied OFFER_MORE read offers, sent together later (``send_held``)
        self._held: list[bytes] = []
        self._hold_timer: asyncio.TimerHandle | None = None
        self.holding = False

    def rename(self, peer: str, peer_id: int) -> None:
        self.peer, self.peer_id = peer, peer_id

    def on_offer(self, header: FrameHeader, meta: bytes) -> None:
        """A READ_OFFER: the peer's bytes for this engine's memory, to be copied out of the peer's process
        by this side (it waits for them; the peer computes). Checked like a write (``resolve``), then
        copied by this side's mover (its worker thread for big layers) and answered with DONE once every
        byte is here, or with the refusal. A gated offer (``OFFER_GATED``) is checked and pinned now and
        copied once the sender marks its layer ready (``kvpush.gates``). The cache stays pinned while the
        copy runs, even if the link closes meanwhile (the copy is this process's own and ends by itself)."""
        transfer, source, gate = decode_read_offer(header, meta)
        request_id = header.request_id
        reader = self._link.reader()
        resolved = self._ports.resolve(header, meta, "read offer", transfer)
        if reader is None and not isinstance(resolved, Refusal):
            resolved = Refusal(LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "this side cannot read the sender's memory")
        if isinstance(resolved, Refusal):
            self._send(encode_status(_DONE, request_id, int(resolved.status), resolved.reason))
            return
        entry, iov, budget_ms = resolved
        entry.pin()
        self.reading[request_id] = entry
        more = bool(header.flags & OFFER_MORE)
        if gate is not None:
            # the sender computes the layer meanwhile: its own deadline starts when it marks it
            self._ports.watch(request_id, budget_ms, "gated read offer", at_least_s=GATE_WAIT_S)
            self.gated_offers[request_id] = (entry, iov, source, transfer, budget_ms, more)
            self._gates.add(request_id, *gate)
            return
        self._ports.watch(request_id, budget_ms, "read offer")
        self._copy(request_id, entry, iov, source, transfer, budget_ms, more, False)

    def _copy(self, request_id: int, entry: CacheEntry, iov: IoVec, source: IoVec,  # noqa: PLR0913
              transfer: TransferMeta, budget_ms: int, more: bool, gated: bool) -> None:
        reader = self._link.reader()
        self._counters["read_offers_copied"] += 1
        try:
            if reader is None:
                raise TransportError("the same-host reader is gone")
            copy = reader.start(True, iov, source, transfer.cache_id, transfer.first_tensor, None,
                                len(transfer.runs))
        except TransportError as error:
            copy = self._link.loop.create_future()
            copy.set_exception(error)
        hold = min(HOLD_S, budget_ms / 4000) if more and budget_ms > 0 else 0.0
        copy.add_done_callback(lambda done: self._read_done(request_id, entry, iov.nbytes, done, hold, gated))

    def _gate_opened(self, request_id: int) -> None:
        entry, iov, source, transfer, budget_ms, more = self.gated_offers[request_id]
        # checked again: the offer waited for its mark, and the cache may have gone or its grant ended meanwhile
        refusal = still_open(entry, transfer, self.peer_id)
        if refusal is not None:
            log.warning("refused a gated read offer from cluster %s once marked: %s", self.peer, refusal.reason)
            self._end_gated(request_id, refusal.status, refusal.reason, "read_offers_refused_late")
            return
        del self.gated_offers[request_id]
        self._ports.watch(request_id, budget_ms, "read offer")  # from now on, the offer's own deadline
        self._copy(request_id, entry, iov, source, transfer, budget_ms, more, True)

    def _gate_withdrawn(self, request_id: int) -> None:
        self._end_gated(request_id, LLMStatusCode.LLM_FAILED, "withdrawn by the sender", "read_offers_withdrawn")

    def _end_gated(self, request_id: int, status: LLMStatusCode, reason: str, counter: str) -> None:
        """Answer a gated offer without copying (nothing of it was written here) and let its cache go."""
        self._gates.discard(request_id)
        entry = self.gated_offers.pop(request_id)[0]
        entry.unpin()
        self.reading.pop(request_id, None)
        self._ports.done(request_id)
        self._counters[counter] += 1
        self._send(encode_status(_DONE, request_id, int(status), reason))
        if not self.gated_offers and not self.reading:
            self.send_held()

    def _gates_failed(self, error: BaseException) -> None:
        peer_gone = isinstance(error, TransportError) and error.peer_gone
        reason = f"peer process exited: {error}" if peer_gone else f"reading the sender's ready marks failed: {error}"
        log.warning("closing the link to cluster %s: %s", self.peer, reason)
        self._link.close(reason)

    @property
    def gated(self) -> bool:
        """Gated offers wait for their marks (``poll`` reads them now)."""
        return bool(self.gated_offers)

    def before_frame(self) -> None:
        """The link is about to handle a frame of the sender's other than a read offer: held answers go back
        first, and gated offers' marks are read (the sender's caller may just have marked a layer)."""
        if self.holding:
            self.send_held()
        if self.gated_offers:
            self.poll()

    def poll(self) -> None:
        """Read the waiting offers' marks now: the sender's link delivered a frame (a layer pusher whose
        caller finished sends one), so a layer may just have been marked."""
        self._gates.poll()

    def _read_done(self, request_id: int, entry: CacheEntry, nbytes: int,  # noqa: PLR0913
                   copy: asyncio.Future[Any], hold: float, gated: bool = False) -> None:
        entry.unpin()
        if self.reading.pop(request_id, None) is None:
            return  # the link closed meanwhile: no one to answer
        self._ports.done(request_id)
        error = None if copy.cancelled() else copy.exception()
        if error is None and not copy.cancelled():
            self._counters["bytes_received"] += nbytes
            self._held.append(encode_status(_DONE, request_id, 0))
            if gated and not self.gated_offers and not self.reading:
                hold = 0.0  # the sender's last gated offer here: nothing more to answer with it
            if hold:
                self._counters["read_offer_answers_held"] += 1
                self._hold(hold)
            else:
                self.send_held()
            return
        if isinstance(error, TransportError) and error.peer_gone:
            self._link.close(f"peer process exited: {error}")
            return
        log.error("copying read offer %d from cluster %s failed: %s", request_id, self.peer, error)
        self._send(encode_status(_DONE, request_id, int(LLMStatusCode.LLM_FAILED),
                                 f"the receiver's copy failed: {error}"))

    def _hold(self, seconds: float) -> None:
        """Keep the held DONEs until the sender's next frame, or ``seconds`` from now at the latest."""
        self.holding = True
        loop = self._link.loop
        due = loop.time() + seconds
        if self._hold_timer is None or due < self._hold_timer.when():
            if self._hold_timer is not None:
                self._hold_timer.cancel()
            self._hold_timer = loop.call_at(due, self.send_held)

    def send_held(self) -> None:
        """Send the held DONEs now, in one write: with the DONE of an offer not marked ``OFFER_MORE`` (a
        request's last layer), when the hold ends, and before the link handles any frame of the sender's but a
        read offer (a PING: ``Link.nudge``)."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        self.holding = False
        held, self._held = self._held, []
        if held:
            self._send(b"".join(held))

    def refuse_removed(self) -> None:
        """Gated offers into caches unregistered here are refused now rather than when marked."""
        for request_id in [rid for rid, gated in self.gated_offers.items() if gated[0].removed]:
            self._end_gated(request_id, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                            f"cache {self.gated_offers[request_id][3].cache_id} was unregistered",
                            "read_offers_refused_late")

    def close(self) -> None:
        """The link is gone: nothing is answered any more. Offers waiting for their marks let their caches
        go (nothing of this process reads into them); copies running here unpin theirs when they end."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        self._held.clear()
        self.holding = False
        self._gates.clear()
        for gated in self.gated_offers.values():
            gated[0].unpin()
        self.gated_offers.clear()
        self.reading.clear()
