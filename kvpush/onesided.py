"""One-sided transfers on a link (same host: ``transports.cma``), both ends.

Sender: WRITE_INTENT / READ_INTENT -> the receiver validates against its registry, pins the cache
and answers GRANT -> the sender copies in a worker thread (process_vm_writev / _readv straight
between the two processes' block memory) -> LANDED tells the receiver the copy is over (or was
abandoned) so it unpins. Remote completion is the copy itself returning: the kernel has put every
byte into the peer's pages by then.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from transports import cma

from .memory import CacheEntry
from .protocol import FrameHeader, Kind, decode_status, encode_status
from .remote import PendingOp
from .status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from .link import Link

log = logging.getLogger(__name__)

LANDED_ABORTED = 1
# How long a receiver keeps a granted cache pinned after its link broke: a copy the sender had
# already started runs to its end (a memory copy, bounded) even when the control stream is gone.
GRANT_GRACE_S = 2.0


class OneSidedSender:
    """The sending half: owns the pinned peer and the copy thread of one link."""

    def __init__(self, link: Link, peer: cma.CmaPeer) -> None:
        self.link = link
        self.peer = peer
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvpush-cma-{link.peer_cluster_id}")

    def on_grant(self, header: FrameHeader, meta: bytes) -> None:
        status, message = decode_status(header, meta)
        op = self.link.pending(header.request_id)
        if op is None or op.kind not in (Kind.WRITE_INTENT, Kind.READ_INTENT):
            if status == 0:  # abandoned before the grant came: nothing was copied, let the peer unpin
                self.link.stream.send(encode_status(Kind.LANDED, header.request_id, LANDED_ABORTED))
            return
        if status != 0:
            op.release()
            self.link.complete(op, LLMException(LLMStatusCode.from_wire(status), f"peer refused: {message}"))
            return
        assert op.local_iov is not None and op.remote_iov is not None
        copy = self.peer.write if op.kind == Kind.WRITE_INTENT else self.peer.read
        op.copy = self.executor.submit(copy, op.local_iov, op.remote_iov)
        asyncio.wrap_future(op.copy, loop=self.link.loop).add_done_callback(lambda _: self._copied(op))

    def _copied(self, op: PendingOp) -> None:
        op.release()
        assert op.copy is not None
        error = op.copy.exception()
        self.link.stream.send(encode_status(Kind.LANDED, op.request_id, LANDED_ABORTED if error else 0))
        if error is None:
            self.link.complete(op, None)
        elif isinstance(error, cma.CmaError) and error.errno == errno.ESRCH:
            self.link.close(f"peer process exited: {error}")
        else:
            log.error("one-sided copy for request %d failed: %s", op.request_id, error)
            self.link.complete(op, LLMException(LLMStatusCode.LLM_FAILED, f"one-sided copy failed: {error}"))

    async def settle(self, ops: list[PendingOp]) -> None:
        """Wait for copies already running (bounded: memory copies) so none outlives its request."""
        copies: list[ThreadFuture[int]] = [op.copy for op in ops if op.copy is not None and not op.copy.done()]
        if copies:
            await asyncio.wait([asyncio.wrap_future(c, loop=self.link.loop) for c in copies])

    def close(self) -> None:
        self.executor.submit(self.peer.close)  # after copies in flight, which still use the pidfd
        self.executor.shutdown(wait=False)


class OneSidedReceiver:
    """The receiving half: grants validated intents and holds the pins until LANDED."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.granted: dict[int, tuple[CacheEntry, int, str]] = {}

    def on_intent(self, header: FrameHeader, meta: bytes) -> None:
        resolved = self.link.resolve_remote_request(header, meta)
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
        held = [entry for entry, _, _ in self.granted.values()]
        self.granted.clear()

        def release() -> None:
            for entry in held:
                entry.unpin()

        if held:
            self.link.loop.call_later(GRANT_GRACE_S, release)
