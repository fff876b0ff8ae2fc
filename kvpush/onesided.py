"""The outbound one-sided path of one link, over a transport's ``Mover``.

WRITE_INTENT / READ_INTENT -> the receiver validates against its registry, pins the cache and
answers GRANT -> the mover moves the bytes -> LANDED tells the receiver the transfer is over (or was
abandoned) so it unpins. Remote completion is the mover's future completing: every byte is in the
peer's memory by then. (The receiving half is ``kvpush.serving.Inbound``.)

With a mover that allows standing grants (same host; UCX), a writer may also hold a LEASE on a
destination cache: the receiver pins it once, and later writes go without a round trip (copy, then a
one-way WRITE_NOTICE that the receiver validates against the leased cache and counts). Unregistering
the cache revokes the lease; the receiver keeps the memory until the writer answers that no copy into
it runs any more (or its process is gone, or - without a process to watch - a grace period passed). A
same-host writer allowed to ptrace this process, or a UCX peer holding rkeys into it, could write
there anyway; the lease changes when the receiver learns of a write, never where a write may go. The
mover's ``lease_proof`` (the peer's secret, read through the transport) may arrive after the link is
up; until then writes ask per request.

A receiver that can itself read this process on the same host says so when it answers a lease
request, granted or refused (``reads``): a cache opened per request (``RemoteAccess.GRANTED``, as the
vLLM connector's decode registers its KV) is never leased, yet its writes are offered all the same, each
checked against the grants like any write. Then a layer the layer pusher lets go while its caller
computes is not copied here: one READ_OFFER names where its bytes are in this process's memory and where
they go, the receiver (idle, waiting for them) copies them in its own worker thread and answers DONE, and
only then does the request complete (remote completion, as for every write). Until that answer the source stays pinned
(``_lent``): a request abandoned meanwhile keeps it until the DONE, and a link that closes first hands
it to the engine, which releases it once the reader's process is gone (``serving.HeldGrants``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from transports.base import Mover, OutgoingFrame, TransportError

from .memory import CacheEntry
from .protocol import FrameHeader, Kind, ProtocolError, decode_status, encode_json, encode_status
from .requests import PendingOp, RequestTable
from .serving import LANDED_ABORTED
from .status import LLMException, LLMStatusCode

log = logging.getLogger(__name__)


class LeaseState(StrEnum):
    """A standing grant on one destination cache, from the writer's side."""

    REQUESTED = "requested"  # asked for; writes still ask per request
    ACTIVE = "active"        # writes go without a round trip
    REVOKED = "revoked"      # refused or revoked by the receiver: back to per-request grants
    DONE = "done"            # ended (revocation confirmed, or the link is unlinking)


# bound once: this runs on every transfer, and an attribute of an enum class is looked up anew on each use
_ACTIVE = LeaseState.ACTIVE
_WRITE_INTENT, _READ_INTENT, _LANDED = Kind.WRITE_INTENT, Kind.READ_INTENT, Kind.LANDED


class OneSidedSender:
    """The sending half of one link's one-sided path: owns the mover (a pinned peer process, or a
    UCX endpoint)."""

    def __init__(self, mover: Mover, send: Callable[[bytes], OutgoingFrame], requests: RequestTable,
                 close_link: Callable[[str], None], loop: asyncio.AbstractEventLoop) -> None:
        self.mover = mover
        self._send = send
        self._requests = requests
        self._close_link = close_link
        self._loop = loop
        self.leases: dict[int, LeaseState] = {}
        self._leased_inflight: Counter[int] = Counter()
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = False  # unlinking: no new leased copy may start
        # notices of leased writes whose copy is done, sent right after their callers resumed (or
        # before anything else the link sends on their behalf, see ``flush_notices``)
        self._notices: deque[tuple[bytes, int]] = deque()
        self.peer_reads = False  # the receiver copies offered layers out of this process itself (READ_OFFER)
        self.peer_gates = False  # ... and takes them gated by a ready mark (``kvpush.marks``)
        # READ_OFFERs sent and not yet answered: the source each reads, pinned until its DONE
        self._lent: dict[int, tuple[PendingOp, CacheEntry]] = {}

    # -- leases ---------------------------------------------------------------------------------
    def lease_active(self, cache_id: int) -> bool:
        """True when writes to ``cache_id`` may go without asking; asks for a lease the first time."""
        state = self.leases.get(cache_id)
        if self.closing:
            return False
        if state is None and self.mover.capabilities.standing_grants:
            proof = self.mover.lease_proof  # may come after the link is up (UCX reads it one-sided)
            if proof:
                self.leases[cache_id] = LeaseState.REQUESTED
                self._send(encode_json(Kind.LEASE, 0, {"op": "request", "cache": cache_id, "proof": proof}))
        return state is _ACTIVE

    def close_leases(self) -> None:
        """Unlinking: from now on no leased copy starts (held ones fail) and gated offers not marked yet are
        withdrawn (the receiver answers them without copying), so a drain is final."""
        self.closing = True
        for op, _ in self._lent.values():
            if op.gate is not None:  # unless marked already
                op.gate[0].withdraw(op.gate[1])
        for cache_id, state in self.leases.items():
            if state in (LeaseState.REQUESTED, LeaseState.ACTIVE):
                self.leases[cache_id] = LeaseState.DONE

    def on_lease(self, body: dict[str, Any]) -> None:
        op, cache_id = body.get("op"), body.get("cache")
        if not isinstance(cache_id, int):
            raise ProtocolError(f"LEASE without a cache id: {body!r}")
        if op in ("grant", "refuse"):  # either answer says whether the receiver reads this process
            self.peer_reads = body.get("reads") is True
            self.peer_gates = body.get("gates") is True
        if op == "grant" and self.leases.get(cache_id) == LeaseState.REQUESTED and not self.closing:
            self.leases[cache_id] = LeaseState.ACTIVE
        elif op == "refuse":
            self.leases[cache_id] = LeaseState.REVOKED  # the grant-per-request path goes on working
        elif op == "revoke":
            self.leases[cache_id] = LeaseState.REVOKED
            self._maybe_revoked(cache_id)
        else:
            raise ProtocolError(f"unexpected LEASE {op!r} for cache {cache_id}")

    def flush_notices(self) -> None:
        """Send the notices of finished leased writes now, in order: the link calls this before a
        message, so a push's notification never reaches the peer before what its writes landed."""
        notices = self._notices
        if not notices:
            return
        self._notices = deque()
        # one write for all of them (they are frames without payload, back to back): a loop pass that
        # ends many small pushes costs one system call, not one each
        self._send(b"".join([notice for notice, _ in notices]))
        self._leased_done(*[cache_id for _, cache_id in notices])

    def _leased_started(self, cache_id: int) -> None:
        self._leased_inflight[cache_id] += 1
        self._idle.clear()

    def _leased_done(self, *cache_ids: int) -> None:
        """Leased copies to these caches (one id per copy) are over, their notices out if they moved."""
        for cache_id in cache_ids:
            self._leased_inflight[cache_id] -= 1
        self._maybe_idle()
        for cache_id in set(cache_ids):
            self._maybe_revoked(cache_id)

    def _maybe_idle(self) -> None:
        if not self._lent and not any(self._leased_inflight.values()):
            self._idle.set()

    def _maybe_revoked(self, cache_id: int) -> None:
        if self.leases.get(cache_id) == LeaseState.REVOKED and not self._leased_inflight[cache_id]:
            del self._leased_inflight[cache_id]
            self._send(encode_json(Kind.LEASE, 0, {"op": "revoked", "cache": cache_id}))
            self.leases[cache_id] = LeaseState.DONE

    def leases_idle(self) -> bool:
        """No copy under a standing grant is running or queued (here, or in the peer for a READ_OFFER)."""
        return self._idle.is_set()

    async def drain_leases(self, timeout: float) -> bool:
        """Wait (bounded) until no leased copy runs; True when none does."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            pass
        return self.leases_idle()

    def begin_leased(self, op: PendingOp) -> None:
        """Copy a write under an active lease now; the notice follows the bytes."""
        assert op.local_iov is not None and op.remote_iov is not None
        cache_id = op.move_args[0]
        if self.closing or self.leases.get(cache_id) is not _ACTIVE:  # revoked (or unlinking) while held
            op.release()
            status = LLMStatusCode.LLM_NOT_YET_LINK if self.closing else LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            self._requests.complete(op, LLMException(status, f"the standing grant on cache {cache_id} ended"))
            return
        self._leased_started(cache_id)
        try:
            op.copy = self.mover.start(False, op.local_iov, op.remote_iov, *op.move_args)
        except Exception as error:
            self._leased_done(cache_id)
            op.release()
            self._requests.complete(op, LLMException(LLMStatusCode.LLM_FAILED, f"one-sided transfer failed: {error}"))
            return
        if op.copy.done():  # an inline copy: report without another loop iteration
            self._moved(op)
        else:
            op.copy.add_done_callback(lambda _: self._moved(op))

    # -- the receiver reads (READ_OFFER) -----------------------------------------------------------
    def reader_copies(self) -> bool:
        """True when a held write goes as a READ_OFFER: the receiver reads this process (it said so in an
        answer to a lease request, granted or not; the receiver checks every offer like a write), and the
        link is not unlinking."""
        return self.peer_reads and not self.closing

    def reader_gates(self) -> bool:
        """True when held writes may also be offered before their bytes are ready, gated by a mark the
        receiver reads (``kvpush.marks``): it said it takes such offers."""
        return self.peer_gates and self.reader_copies()

    def lend(self, op: PendingOp, source: CacheEntry) -> None:
        """``op``'s READ_OFFER is about to be sent: from now on the receiver may read ``source`` (pinned by
        ``op``) until its DONE arrives (``on_taken``), whatever happens to the request meanwhile."""
        op.copy = self._loop.create_future()  # what ``settle`` waits for: the receiver's copy
        self._lent[op.request_id] = (op, source)
        self._idle.clear()  # an unlink waits for the answer, so the peer has copied before it lets go

    def on_taken(self, request_id: int, status: int, message: str) -> bool:
        """A DONE: if it answers a READ_OFFER (False: it does not), the source may go, and the request
        completes (unless it was abandoned meanwhile)."""
        lent = self._lent.pop(request_id, None)
        if lent is None:
            return False
        op = lent[0]
        self._end_lent(op, None if status == 0 else LLMException(
            LLMStatusCode.from_wire(status), f"peer refused the write: {message}"))
        return True

    def withdraw(self, op: PendingOp) -> None:
        """``op``'s READ_OFFER was dropped before any of it left (the request is being abandoned): nothing
        will read the source."""
        if self._lent.pop(op.request_id, None) is not None:
            self._maybe_idle()
            op.release()
            if op.copy is not None and not op.copy.done():
                op.copy.cancel()

    def _end_lent(self, op: PendingOp, error: LLMException | None) -> None:
        self._maybe_idle()
        op.release()
        if op.copy is not None and not op.copy.done():
            if error is None:
                op.copy.set_result(None)
            else:
                op.copy.set_exception(error)
                op.copy.exception()
        self._requests.complete(op, error)

    # -- per-request grants -----------------------------------------------------------------------
    def on_grant(self, header: FrameHeader, meta: bytes) -> None:
        status, message = decode_status(header, meta)
        op = self._requests.get(header.request_id, _WRITE_INTENT, _READ_INTENT)
        if op is None:
            if status == 0:  # abandoned before the grant came: nothing was moved, let the peer unpin
                self._send(encode_status(Kind.LANDED, header.request_id, LANDED_ABORTED))
            return
        if status != 0:
            op.release()
            self._requests.complete(op, LLMException(LLMStatusCode.from_wire(status), f"peer refused: {message}"))
            return
        op.granted = True
        if not op.held:
            self.begin(op)

    def begin(self, op: PendingOp) -> None:
        """Move a granted request's bytes now."""
        assert op.local_iov is not None and op.remote_iov is not None
        op.granted = False
        try:
            op.copy = self.mover.start(op.kind == _READ_INTENT, op.local_iov, op.remote_iov, *op.move_args)
        except Exception as error:  # e.g. a UCX call refused before anything was posted
            op.release()
            self._send(encode_status(Kind.LANDED, op.request_id, LANDED_ABORTED))
            self._requests.complete(op, LLMException(LLMStatusCode.LLM_FAILED, f"one-sided transfer failed: {error}"))
            return
        op.copy.add_done_callback(lambda _: self._moved(op))

    def release_held(self, op: PendingOp) -> None:
        """A held request may move now: posting the copy is the loop's work, not the caller's."""
        if op.notice is not None:
            self._loop.call_soon(self._begin_if_live, op, True)
        elif op.granted:
            self._loop.call_soon(self._begin_if_live, op, False)

    def _begin_if_live(self, op: PendingOp, leased: bool) -> None:
        if not self._requests.live(op):
            return
        if leased:
            self.begin_leased(op)
        elif op.granted:
            self.begin(op)

    def _moved(self, op: PendingOp) -> None:
        op.release()
        assert op.copy is not None
        error = None if op.copy.cancelled() else op.copy.exception()
        failed = op.copy.cancelled() or error is not None
        if not failed:  # first: the caller resumes in the next pass, before the notice below goes out
            self._requests.complete(op, None)
        if op.notice is not None:  # a leased write: tell the receiver what landed (nothing to unpin there)
            cache_id = op.move_args[0]
            if failed:
                self._leased_done(cache_id)
            else:  # sent right after the caller resumed; the lease counts as busy until it is out
                if not self._notices:  # else a flush is already due and takes this one too
                    self._loop.call_soon(self.flush_notices)
                self._notices.append((op.notice, cache_id))
        else:
            self._send(encode_status(_LANDED, op.request_id, LANDED_ABORTED if failed else 0))
        if not failed:
            return
        if isinstance(error, TransportError) and error.peer_gone:
            self._close_link(f"peer process exited: {error}")
        else:
            log.error("one-sided transfer for request %d failed: %s", op.request_id, error)
            self._requests.complete(op, LLMException(LLMStatusCode.LLM_FAILED, f"one-sided transfer failed: {error}"))

    async def settle(self, ops: list[PendingOp], grace: float) -> bool:
        """Wait for transfers already running so none outlives its request; False if some did not
        end within ``grace`` (the caller then closes the link, which stops them)."""
        running = [op.copy for op in ops if op.copy is not None and not op.copy.done()]
        if not running:
            return True
        _, pending = await asyncio.wait(running, timeout=grace)
        return not pending

    def close(self) -> list[CacheEntry]:
        """The link is gone: the mover stops. Returns the sources whose READ_OFFER the receiver may
        still be reading (each still pinned once): the caller releases them when that is safe."""
        self.mover.close()
        lent, self._lent = list(self._lent.values()), {}
        for op, _ in lent:
            op.take_release()  # the pin goes with the entry to the caller
            self._end_lent(op, LLMException(LLMStatusCode.LLM_TIMEOUT, "the link closed during the transfer"))
        return [entry for _, entry in lent]
