"""The outbound side of one link: starting this engine's transfer requests, and ending them early.

A layer of a plan (``kvpush.plan``) becomes one request: over the stream, a WRITE frame carrying the
bytes (or a READ whose answer lands in place); over a one-sided mover, an intent the peer grants before
the copy, or, under a standing grant, the copy at once and a notice. ``abandon`` and ``settle`` end
requests early without leaving a byte in motion. The peer's answers reach the request table through
the link's protocol core (``kvpush.link_protocol``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Protocol

from transports.base import FrameStream, PayloadSink

from .layout import IoVec
from .link_protocol import LinkProtocol
from .marks import LayerMarks
from .onesided import LeaseState
from .peer import RemoteCache
from .plan import Plan
from .protocol import MAX_OFFER_ENTRIES, Kind, encode_read_offer, encode_status, encode_transfer, offer_flags
from .requests import PendingOp, RequestTable
from .serving import LANDED_ABORTED
from .status import LLMException, LLMStatusCode
from .validate import LayerStep

# bound once: this runs on every transfer, and an attribute of an enum class is looked up anew on each use
_WRITE, _WRITE_INTENT, _WRITE_NOTICE = Kind.WRITE, Kind.WRITE_INTENT, Kind.WRITE_NOTICE
_READ, _READ_INTENT = Kind.READ, Kind.READ_INTENT


class OutboundLink(Protocol):
    """What the outbound side uses of its link (``kvpush.link.Link``)."""

    stream: FrameStream
    requests: RequestTable
    protocol: LinkProtocol
    counters: Counter[str]

    def not_ready(self) -> LLMException:
        """LLM_NOT_YET_LINK naming the link and why it is not ready."""

    def broke(self) -> str:
        """Why a request in flight failed: the link broke under it."""

    def close(self, reason: str, abort: bool = False) -> None: ...


class Outbound:
    """This engine's requests on one link (see the module docstring)."""

    def __init__(self, link: OutboundLink) -> None:
        self.link = link
        self.stream = link.stream
        self.requests = link.requests
        self.protocol = link.protocol
        self.counters = link.counters

    def start_write(self, plan: Plan, step: LayerStep, budget_ms: int, held: bool = False,
                    gate: tuple[LayerMarks, int] | None = None) -> PendingOp:
        """Start one layer's write: one-sided when this link can, else a WRITE frame carrying the bytes.
        The source cache stays pinned until its bytes left. ``held``: prepare everything (a one-sided
        request is even granted) but move no byte until ``release_held``. ``gate`` (held only): where the
        layer's ready mark is, for a receiver that takes gated offers: the offer goes now, and releasing
        the layer is marking it (``kvpush.marks``)."""
        if not self.protocol.ready:
            raise self.link.not_ready()
        local_first, remote_first = step.src_first, step.dst_first  # (``plan.firsts`` of a write)
        source = plan.local_vector(local_first, step.count)
        payload_len = step.count * plan.runs.bytes_per_tensor
        self.counters["write_requests"] += 1
        self.counters["bytes_pushed"] += payload_len
        remote, onesided = plan.remote, self.protocol.onesided
        if onesided is not None and self._onesided_reaches(remote):
            leased = onesided.lease_active(remote.cache_id)
            if held and source.entries <= MAX_OFFER_ENTRIES and onesided.reader_copies():
                return self._prepare_read_offer(plan, step, source, budget_ms,
                                                gate if gate is not None and onesided.reader_gates() else None)
            return self._start_onesided(_WRITE_INTENT, plan, step, source, budget_ms, held, leased)
        # The frame goes first and the request is booked behind it: a small frame on an idle stream leaves
        # within ``send``, the bookkeeping off the round trip's path. Nothing can answer it in between:
        # replies are handled by this loop, after this call returns.
        request_id = self.requests.reserve()
        head = encode_transfer(_WRITE, request_id, remote.cache_id, remote_first, step.count, plan.wire, payload_len,
                               budget_ms)
        frame = self.stream.prepare(head, source, payload_len) if held else self.stream.send(head, source)
        op = self.requests.new(_WRITE, request_id)
        op.frame = frame
        source_entry = plan.local
        if held:  # pinned until its frame leaves (``release_held``) or it is abandoned
            source_entry.pin()
            op.hold(source_entry.unpin)
            op.held = True
        elif not frame.left:  # the source stays pinned until its bytes left (or the stream failed them)
            source_entry.pin()
            frame.sent.add_done_callback(lambda _: source_entry.unpin())
            if self.stream.closed:  # the send closed the link before the request was booked
                self.requests.complete(op, LLMException(LLMStatusCode.LLM_TIMEOUT, self.link.broke()))
        return op

    def start_read(self, plan: Plan, step: LayerStep, budget_ms: int) -> PendingOp:
        """Start one layer's read: one-sided when this link can, else a READ whose answer's payload lands
        straight in the local blocks."""
        if not self.protocol.ready:
            raise self.link.not_ready()
        local_first, remote_first = plan.firsts(step)
        destination = plan.local_vector(local_first, step.count)
        self.counters["read_requests"] += 1
        self.counters["bytes_pulled"] += destination.nbytes
        remote = plan.remote
        if self.protocol.onesided is not None and self._onesided_reaches(remote):
            return self._start_onesided(_READ_INTENT, plan, step, destination, budget_ms)
        op = self.requests.new(_READ)
        op.expected = destination.nbytes
        entry = plan.local
        entry.pin()
        op.future.add_done_callback(lambda _: entry.unpin())
        op.sink = PayloadSink(destination, lambda: self.requests.complete(op, None))
        op.frame = self.stream.send(encode_transfer(_READ, op.request_id, remote.cache_id, remote_first,
                                                    step.count, plan.wire, 0, budget_ms))
        return op

    def release_held(self, op: PendingOp, last: bool = True) -> None:
        """Let a ``held`` request move its bytes now (microseconds: everything was prepared). ``last``
        False: more of the caller's layers follow, so a READ_OFFER says so (``OFFER_MORE``) and the
        receiver may answer it with the next one's frame."""
        if not op.held:
            return
        op.held = False
        if op.gate is not None:  # offered already: marking the layer lets the receiver copy it
            op.gate[0].open(op.gate[1])
            return
        if op.kind == Kind.READ_OFFER:
            self._offer_read(op, last)
            return
        if op.kind != Kind.WRITE:
            if self.protocol.onesided is not None:
                self.protocol.onesided.release_held(op)
            return
        assert op.frame is not None
        release = op.take_release()  # from now on the frame's ``sent`` (not ``abandon``) unpins
        self.stream.enqueue(op.frame)
        if release is None:
            return
        if op.frame.left:  # it left at once (small frames do): no future, no callback round through the loop
            release()
        else:
            op.frame.sent.add_done_callback(lambda _: release())

    def writes_alone(self, remote: RemoteCache) -> bool:
        """True when a write to ``remote`` goes under a standing grant over a same-host mover: the copy
        completes here and needs nothing from the peer (``transfer.run`` may then merge layers)."""
        onesided = self.protocol.onesided
        return (onesided is not None and onesided.mover.capabilities.same_host_only
                and self._onesided_reaches(remote) and onesided.leases.get(remote.cache_id) == LeaseState.ACTIVE)

    def _onesided_reaches(self, remote: RemoteCache) -> bool:
        onesided = self.protocol.onesided
        if onesided is None or remote.addrs is None:
            return False
        return not onesided.mover.capabilities.needs_registration or remote.rkeys is not None

    def _start_onesided(self, kind: Kind, plan: Plan, step: LayerStep, local: IoVec,
                        budget_ms: int, held: bool = False, leased: bool = False) -> PendingOp:
        """A one-sided request: ask for a grant (intent), or under a lease copy at once and notify."""
        onesided = self.protocol.onesided
        assert onesided is not None
        remote, remote_first = plan.remote, plan.firsts(step)[1]
        op = self.requests.new(kind)
        op.held = held
        op.local_iov = local
        op.remote_iov = plan.remote_vector(remote_first, step.count)
        op.move_args = (remote.cache_id, remote_first, remote.rkeys, plan.runs.count)
        plan.local.pin()
        op.hold(plan.local.unpin)
        if leased:
            op.notice = encode_transfer(_WRITE_NOTICE, op.request_id, remote.cache_id, remote_first, step.count,
                                        plan.wire, 0, budget_ms)
            if not held:
                onesided.begin_leased(op)
            return op
        op.frame = self.stream.send(encode_transfer(kind, op.request_id, remote.cache_id, remote_first, step.count,
                                                    plan.wire, 0, budget_ms))
        return op

    def _prepare_read_offer(self, plan: Plan, step: LayerStep, source: IoVec, budget_ms: int,
                            gate: tuple[LayerMarks, int] | None) -> PendingOp:
        """A held write the receiver will copy itself (``OneSidedSender.reader_copies``): its READ_OFFER
        (where the bytes are here, where they go there), sent by ``release_held`` - or, ``gate``d, sent now
        and copied once the layer is marked. The source stays pinned until the receiver answered (or, if
        never sent, the request is abandoned)."""
        remote, remote_first = plan.remote, plan.firsts(step)[1]
        op = self.requests.new(Kind.READ_OFFER)
        op.held = True
        mark = None if gate is None else (gate[0].address(gate[1]), gate[0].token)
        op.offer = encode_read_offer(op.request_id, remote.cache_id, remote_first, step.count, plan.wire, budget_ms,
                                     source.array().tobytes(), more=True, gate=mark)
        plan.local.pin()
        op.hold(plan.local.unpin)
        op.source = plan.local
        if gate is not None:
            self._offer_read(op, last=False)
            if op.frame is not None:  # sent (else the link is unlinking, and the request failed)
                op.gate = gate
        return op

    def _offer_read(self, op: PendingOp, last: bool) -> None:
        onesided = self.protocol.onesided
        if op.ended or onesided is None:  # the link closed while the layer was held: it failed with it
            return
        if onesided.closing:  # unlinking: nothing new starts, so the unlink's drain is final
            op.release()
            self.requests.complete(op, LLMException(LLMStatusCode.LLM_NOT_YET_LINK, "the link is unlinking"))
            return
        assert op.offer is not None and op.source is not None
        op.frame = self.stream.prepare(offer_flags(op.offer, more=False) if last else op.offer)
        op.offer = None
        onesided.lend(op, op.source)
        self.counters["read_offers"] += 1
        self.stream.enqueue(op.frame)

    def abandon(self, op: PendingOp) -> None:
        """Stop waiting for ``op``: an unsent frame is dropped, an incoming payload is discarded from now
        on, and a late reply is ignored. Bytes of a WRITE already on the wire, or of a one-sided copy
        already running, still land (see ``settle``)."""
        self.requests.forget(op)
        if op.frame is not None and op.frame.abandon() and op.kind == Kind.READ_OFFER and self.protocol.onesided:
            self.protocol.onesided.withdraw(op)  # no byte of the offer left: nothing reads the source
        if op.sink is not None:
            op.sink.cancel()
        if op.copy is None:
            op.release()
            if op.granted:  # granted but never moved: let the peer unpin
                self.stream.send(encode_status(Kind.LANDED, op.request_id, LANDED_ABORTED))
                op.granted = False
        self.requests.abandon(op)

    async def settle(self, ops: list[PendingOp], grace: float) -> None:
        """After abandoning ``ops``: wait until none still reads or writes local memory. One-sided copies
        run to their end (memory copies, bounded); frames already started get ``grace`` seconds to finish
        leaving, after which the link is closed abortively (never half a frame in the stream, never a
        read of the source memory after the caller was told)."""
        onesided = self.protocol.onesided
        if onesided is not None and not await onesided.settle(ops, grace):
            self.link.close("a one-sided transfer did not end in time after its request ended", abort=True)
        leaving = [op.frame.sent for op in ops
                   if op.frame is not None and op.frame.started and not op.frame.sent.done()]
        if leaving:
            _, pending = await asyncio.wait(leaving, timeout=grace)
            if pending:
                self.link.close("a layer could not finish leaving after its transfer ended", abort=True)
