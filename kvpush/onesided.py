"""One-sided transfers on a link (same host: ``transports.cma``; any host: ``transports.ucx``), both ends.

Sender: WRITE_INTENT / READ_INTENT -> the receiver validates against its registry, pins the cache
and answers GRANT -> the sender moves the bytes (a kernel copy in a worker thread, or UCX puts
and a flush) -> LANDED tells the receiver the transfer is over (or was abandoned) so it unpins.
Remote completion is the copy returning, or the UCX flush completing: every byte is in the peer's
memory by then.

Same host only, a writer may also hold a standing grant (LEASE) on a destination cache: the receiver
pins the cache once, and later writes go without a round trip (copy, then a one-way WRITE_NOTICE that
the receiver validates against the leased cache and counts). Unregistering the cache revokes the
lease; the receiver keeps the memory until the writer answers that no copy into it runs any more (or
its process is gone). A same-host writer allowed to ptrace this process could write anywhere anyway;
the lease changes when the receiver learns of a write, never where a write may go.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import os
import select
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from transports import cma
from transports.base import Capabilities

from . import serving
from .layout import IoVec, runs_in_bounds
from .memory import CacheEntry
from .protocol import FrameHeader, Kind, ProtocolError, decode_status, decode_transfer, encode_json, encode_status
from .remote import PendingOp
from .status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from .link import Link

log = logging.getLogger(__name__)

LANDED_ABORTED = 1
# How long a receiver keeps a granted cache pinned after its link broke when the peer is not on this
# host (UCX): a transfer the sender had already posted runs to its end even when the control stream is gone.
GRANT_GRACE_S = 2.0


class Mover(Protocol):
    """How granted bytes move: ``transports.cma.CmaMover`` or ``transports.ucx.UcxMover``."""

    capabilities: Capabilities

    def start(self, is_read: bool, local: IoVec, remote: IoVec, cache_id: int, first_tensor: int,
              rkeys: tuple[bytes, ...] | None, runs_per_tensor: int) -> asyncio.Future[Any]: ...

    def close(self) -> None: ...


class OneSidedSender:
    """The sending half: owns the mover (a pinned peer process, or a UCX endpoint) of one link."""

    def __init__(self, link: Link, mover: Mover) -> None:
        self.link = link
        self.mover = mover
        # Same host only: a standing grant per destination cache lets a write go without a round trip
        # (copy, then a one-way WRITE_NOTICE). State per cache id: requested, active or revoked.
        self.leases: dict[int, str] = {}
        self.leased_inflight: Counter[int] = Counter()
        peer = getattr(mover, "peer", None)
        self.lease_proof = peer.secret.hex() if peer is not None and getattr(peer, "leases", False) else ""
        self.can_lease = mover.capabilities.name == "cma" and bool(self.lease_proof)
        self.closing = False  # unlinking: no new leased copy may start

    # -- leases ---------------------------------------------------------------------------------
    def lease_active(self, cache_id: int) -> bool:
        """True when writes to ``cache_id`` may go without asking; asks for a lease the first time."""
        state = self.leases.get(cache_id)
        if self.closing:
            return False
        if state is None and self.can_lease:
            self.leases[cache_id] = "requested"
            self.link.stream.send(encode_json(Kind.LEASE, 0, {"op": "request", "cache": cache_id,
                                                              "proof": self.lease_proof}))
        return state == "active"

    def close_leases(self) -> None:
        """Unlinking: from now on no leased copy starts (held ones fail), so a drain is final."""
        self.closing = True
        for cache_id, state in self.leases.items():
            if state in ("requested", "active"):
                self.leases[cache_id] = "done"

    def on_lease(self, body: dict[str, Any]) -> None:
        op, cache_id = body.get("op"), body.get("cache")
        if not isinstance(cache_id, int):
            raise ProtocolError(f"LEASE without a cache id: {body!r}")
        if op == "grant" and self.leases.get(cache_id) == "requested" and not self.closing:
            self.leases[cache_id] = "active"
        elif op == "refuse":
            self.leases[cache_id] = "revoked"  # the grant-per-request path goes on working
        elif op == "revoke":
            self.leases[cache_id] = "revoked"
            self._maybe_revoked(cache_id)
        else:
            raise ProtocolError(f"unexpected LEASE {op!r} for cache {cache_id}")

    def _notify(self, notice: bytes, cache_id: int) -> None:
        self.link.stream.send(notice)
        self._leased_done(cache_id)

    def _leased_done(self, cache_id: int) -> None:
        self.leased_inflight[cache_id] -= 1
        self._maybe_revoked(cache_id)

    def _maybe_revoked(self, cache_id: int) -> None:
        if self.leases.get(cache_id) == "revoked" and not self.leased_inflight[cache_id]:
            del self.leased_inflight[cache_id]
            self.link.stream.send(encode_json(Kind.LEASE, 0, {"op": "revoked", "cache": cache_id}))
            self.leases[cache_id] = "done"

    def leases_idle(self) -> bool:
        """No copy under a standing grant is running or queued."""
        return not any(self.leased_inflight.values())

    async def drain_leases(self, timeout: float) -> bool:
        """Wait (bounded) until no leased copy runs; True when none does."""
        deadline = self.link.loop.time() + timeout
        while not self.leases_idle() and self.link.loop.time() < deadline:
            await asyncio.sleep(0.001)
        return self.leases_idle()

    def begin_leased(self, op: PendingOp) -> None:
        """Copy a write under an active lease now; the notice follows the bytes."""
        assert op.local_iov is not None and op.remote_iov is not None
        cache_id = op.move_args[0]
        if self.closing or self.leases.get(cache_id) != "active":  # revoked (or unlinking) while held
            op.release()
            status = LLMStatusCode.LLM_NOT_YET_LINK if self.closing else LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            self.link.complete(op, LLMException(status, f"the standing grant on cache {cache_id} ended"))
            return
        self.leased_inflight[cache_id] += 1
        try:
            op.copy = self.mover.start(False, op.local_iov, op.remote_iov, *op.move_args)
        except Exception as error:
            self.leased_inflight[cache_id] -= 1
            op.release()
            self.link.complete(op, LLMException(LLMStatusCode.LLM_FAILED, f"one-sided transfer failed: {error}"))
            return
        if op.copy.done():  # an inline copy: report without another loop iteration
            self._moved(op)
        else:
            op.copy.add_done_callback(lambda _: self._moved(op))

    def on_grant(self, header: FrameHeader, meta: bytes) -> None:
        status, message = decode_status(header, meta)
        op = self.link.pending(header.request_id)
        if op is None or op.kind not in (Kind.WRITE_INTENT, Kind.READ_INTENT):
            if status == 0:  # abandoned before the grant came: nothing was moved, let the peer unpin
                self.link.stream.send(encode_status(Kind.LANDED, header.request_id, LANDED_ABORTED))
            return
        if status != 0:
            op.release()
            self.link.complete(op, LLMException(LLMStatusCode.from_wire(status), f"peer refused: {message}"))
            return
        op.granted = True
        if not op.held:
            self.begin(op)

    def begin(self, op: PendingOp) -> None:
        """Move a granted request's bytes now."""
        assert op.local_iov is not None and op.remote_iov is not None
        op.granted = False
        try:
            op.copy = self.mover.start(op.kind == Kind.READ_INTENT, op.local_iov, op.remote_iov, *op.move_args)
        except Exception as error:  # e.g. a UCX call refused before anything was posted
            op.release()
            self.link.stream.send(encode_status(Kind.LANDED, op.request_id, LANDED_ABORTED))
            self.link.complete(op, LLMException(LLMStatusCode.LLM_FAILED, f"one-sided transfer failed: {error}"))
            return
        op.copy.add_done_callback(lambda _: self._moved(op))

    def _moved(self, op: PendingOp) -> None:
        op.release()
        assert op.copy is not None
        error = None if op.copy.cancelled() else op.copy.exception()
        failed = op.copy.cancelled() or error is not None
        if op.notice is not None:  # a leased write: tell the receiver what landed (nothing to unpin there)
            cache_id = op.move_args[0]
            if failed:
                self._leased_done(cache_id)
            else:  # sent right after the caller resumes; the lease counts as busy until it is out
                self.link.loop.call_soon(self._notify, op.notice, cache_id)
        else:
            self.link.stream.send(encode_status(Kind.LANDED, op.request_id, LANDED_ABORTED if failed else 0))
        if not failed:
            self.link.complete(op, None)
        elif isinstance(error, cma.CmaError) and error.errno == errno.ESRCH:
            self.link.close(f"peer process exited: {error}")
        else:
            log.error("one-sided transfer for request %d failed: %s", op.request_id, error)
            self.link.complete(op, LLMException(LLMStatusCode.LLM_FAILED, f"one-sided transfer failed: {error}"))

    async def settle(self, ops: list[PendingOp], grace: float) -> bool:
        """Wait for transfers already running so none outlives its request; False if some did not
        end within ``grace`` (the caller then closes the link, which stops them)."""
        running = [op.copy for op in ops if op.copy is not None and not op.copy.done()]
        if not running:
            return True
        _, pending = await asyncio.wait(running, timeout=grace)
        return not pending

    def close(self) -> None:
        self.mover.close()


class OneSidedReceiver:
    """The receiving half: grants validated intents and holds the pins until LANDED."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.granted: dict[int, tuple[CacheEntry, int, str]] = {}
        self.leases: dict[int, CacheEntry] = {}    # standing write grants, each holding a pin
        self.revoking: dict[int, CacheEntry] = {}  # revoked, pinned until the writer says it is done
        self.ended: set[int] = set()               # leases ended by a graceful unlink: late frames are fine

    def on_lease(self, body: dict[str, Any]) -> None:
        op, cache_id = body.get("op"), body.get("cache")
        if not isinstance(cache_id, int):
            raise ProtocolError(f"LEASE without a cache id: {body!r}")
        if op == "request":
            entry = self.link.owner.registry.get(cache_id)
            probe = self.link.own_probe
            proof = str(body.get("proof", ""))
            # only a writer that read our in-memory secret (it can reach this process) gets a lease
            same_host_writer = (self.link.shares_addresses_same_host and probe is not None
                                and hmac.compare_digest(proof, probe.secret.hex()))
            if (entry is None or not same_host_writer or cache_id in self.leases
                    or not self.link.owner.options.enable_remote_cache_accessible):
                self.link.stream.send(encode_json(Kind.LEASE, 0, {"op": "refuse", "cache": cache_id}))
                return
            entry.pin()
            self.leases[cache_id] = entry
            self.link.stream.send(encode_json(Kind.LEASE, 0, {"op": "grant", "cache": cache_id}))
        elif op == "revoked":
            entry = self.revoking.pop(cache_id, None)
            if entry is None:
                if cache_id in self.ended:
                    return  # the revoke crossed a graceful unlink: already let go
                raise ProtocolError(f"LEASE revoked for cache {cache_id}, which was not being revoked")
            entry.unpin()
        else:
            raise ProtocolError(f"unexpected LEASE {op!r} for cache {cache_id}")

    def end_leases(self) -> None:
        """The writer said no leased copy into this process runs any more (a graceful unlink)."""
        for cache_id, entry in list(self.leases.items()) + list(self.revoking.items()):
            entry.unpin()
            self.ended.add(cache_id)
        self.leases.clear()
        self.revoking.clear()

    def revoke_released(self) -> None:
        """Caches unregistered here lose their leases; their memory stays until the writer confirms."""
        for cache_id, entry in list(self.leases.items()):
            if entry.removed:
                del self.leases[cache_id]
                self.revoking[cache_id] = entry
                self.link.stream.send(encode_json(Kind.LEASE, 0, {"op": "revoke", "cache": cache_id}))

    def on_notice(self, header: FrameHeader, meta: bytes) -> None:
        """A leased write landed: check it lies inside the leased cache and count it."""
        transfer = decode_transfer(header, meta)
        entry = self.leases.get(transfer.cache_id) or self.revoking.get(transfer.cache_id)
        if entry is None and transfer.cache_id in self.ended:
            raise ProtocolError(f"a leased write to cache {transfer.cache_id} after the writer ended its leases")
        if entry is None:
            raise ProtocolError(f"WRITE_NOTICE for cache {transfer.cache_id}, which this link holds no lease on")
        desc = entry.desc
        if (transfer.first_tensor + transfer.num_tensors > desc.num_tensors
                or not runs_in_bounds(transfer.offsets, transfer.lengths, desc.size)):
            raise ProtocolError(f"a leased write to cache {transfer.cache_id} lay outside it")
        self.link.counters["bytes_received"] += transfer.payload_len

    def on_intent(self, header: FrameHeader, meta: bytes) -> None:
        resolved = serving.resolve(self.link, header, meta)
        if isinstance(resolved, str):
            code, _, reason = resolved.partition(":")
            log.warning("refused a one-sided %s from cluster %s: %s", header.kind.name, self.link.peer_cluster_id,
                        reason)
            self.link.stream.send(encode_status(Kind.GRANT, header.request_id, int(code), reason))
            return
        entry, iov = resolved
        entry.pin()
        counter = "bytes_received" if header.kind == Kind.WRITE_INTENT else "bytes_served"
        self.granted[header.request_id] = (entry, int(iov[:, 1].sum()), counter)
        self.link.stream.send(encode_status(Kind.GRANT, header.request_id, 0))

    def on_landed(self, header: FrameHeader, meta: bytes) -> None:
        status, _ = decode_status(header, meta)
        granted = self.granted.pop(header.request_id, None)
        if granted is None:
            return
        entry, size, counter = granted
        entry.unpin()
        if status == 0:
            self.link.counters[counter] += size

    def close(self) -> None:
        """The link is gone with requests still granted. A granted copy may still be queued or
        running in the peer (or the peer may be stopped just before it), so the pins stay until
        the peer cannot write any more: for a same-host peer, until its process has exited (polled
        through a pidfd); otherwise for a grace period."""
        held = [entry for entry, _, _ in self.granted.values()] + list(self.leases.values()) + list(
            self.revoking.values())
        self.granted.clear()
        self.leases.clear()
        self.revoking.clear()
        if not held:
            return
        watch = _peer_process(self.link.peer_offer("cma"))

        def release() -> None:
            for entry in held:
                entry.unpin()

        def check() -> None:
            if watch is None or not _alive(watch):
                if watch is not None:
                    os.close(watch)
                release()
                return
            self.link.loop.call_later(PEER_EXIT_POLL_S, check)

        if watch is None:
            self.link.loop.call_later(GRANT_GRACE_S, release)
        else:
            log.info("link to cluster %s closed with %d grant(s) outstanding: the caches stay mapped until "
                     "the writer's process exits", self.link.peer_cluster_id, len(held))
            check()


PEER_EXIT_POLL_S = 1.0


def _peer_process(offer: Any) -> int | None:
    """A pidfd of the same-host peer that was granted one-sided access, if it is still that process."""
    if not isinstance(offer, dict) or not cma.AVAILABLE:
        return None
    try:
        pid, start = int(offer["pid"]), int(offer["start"])
        pidfd = os.pidfd_open(pid)
    except (KeyError, TypeError, ValueError, OSError):
        return None
    if cma.process_start_time(pid) != start:  # already gone and the pid reused
        os.close(pidfd)
        return None
    return pidfd


def _alive(pidfd: int) -> bool:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return not poller.poll(0)
