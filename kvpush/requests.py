"""The outstanding requests of one link: ids, completion, abandonment, failing them all.

Request ids are per link, start at 1 and are never reused, so a late reply to an abandoned request
can never complete a later one: it finds no entry and is dropped. Every request ends exactly once:
completed (its future gets None or an ``LLMException``), abandoned (cancelled), or failed with the
others when the link closes.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .protocol import Kind
from .status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from transports.base import OutgoingFrame, PayloadSink

    from .layout import FlatIoVec, IoVec


class PendingOp:
    """A request waiting for its reply. ``future`` resolves with None or an LLMException.

    One-sided requests also carry both iovecs, the local cache they pin (``release`` unpins it
    exactly once) and, once granted, the transport's ``copy`` future."""

    __slots__ = ("request_id", "kind", "future", "frame", "sink", "expected", "local_iov", "remote_iov",
                 "copy", "move_args", "held", "granted", "notice", "waiter", "_release")

    def __init__(self, request_id: int, kind: Kind, future: asyncio.Future[Any]) -> None:
        self.request_id = request_id
        self.kind = kind
        self.future = future
        self.frame: OutgoingFrame | None = None
        self.sink: PayloadSink | None = None
        self.expected = 0
        self.local_iov: IoVec | FlatIoVec | None = None
        self.remote_iov: IoVec | FlatIoVec | None = None
        self.copy: asyncio.Future[Any] | None = None
        self.held = False      # prepared (and, one-sided, granted) but waiting for release_held
        self.granted = False
        self.notice: bytes | None = None  # set for a write under a lease: the WRITE_NOTICE to send after the copy
        self.move_args: tuple[int, int, tuple[bytes, ...] | None, int] = (0, 0, None, 0)
        # set by whoever awaits the request (``transfer.await_layer``): woken in the same loop pass as
        # ``future`` ends, and cancelled instead of ``future`` when that caller is cancelled
        self.waiter: asyncio.Future[None] | None = None
        self._release: Callable[[], None] | None = None

    def hold(self, release: Callable[[], None]) -> None:
        """``release`` runs exactly once, from ``release()`` (e.g. it unpins the local cache)."""
        self._release = release

    def take_release(self) -> Callable[[], None] | None:
        """Hand the release to someone else (e.g. a frame's ``sent`` callback)."""
        release, self._release = self._release, None
        return release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    @property
    def bytes_may_land(self) -> bool:
        """True when part of this request may already be in (or on its way to) its destination."""
        if self.copy is not None:
            return True
        return self.kind == Kind.WRITE and self.frame is not None and self.frame.started


def _wake(op: PendingOp) -> None:
    waiter = op.waiter
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class RequestTable:
    """The requests of one link. ``on_failure`` sees every error a request completes with."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_failure: Callable[[LLMException], None]) -> None:
        self._loop = loop
        self._ids = itertools.count(1)
        self._pending: dict[int, PendingOp] = {}
        self._on_failure = on_failure

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[PendingOp]:
        return iter(list(self._pending.values()))

    def new(self, kind: Kind) -> PendingOp:
        request_id = next(self._ids)
        op = PendingOp(request_id, kind, self._loop.create_future())
        self._pending[request_id] = op
        return op

    def get(self, request_id: int, *kinds: Kind) -> PendingOp | None:
        """The outstanding request with that id (of one of ``kinds``, when given), else None."""
        op = self._pending.get(request_id)
        if op is None or (kinds and op.kind not in kinds):
            return None
        return op

    def live(self, op: PendingOp) -> bool:
        return self._pending.get(op.request_id) is op

    def forget(self, op: PendingOp) -> None:
        """Stop matching replies to ``op`` (its future is left as it is)."""
        self._pending.pop(op.request_id, None)

    def complete(self, op: PendingOp, error: LLMException | None) -> None:
        """End ``op`` with success (None) or ``error``; a second completion is ignored."""
        self._pending.pop(op.request_id, None)
        if op.future.done():
            return
        if error is None:
            op.future.set_result(None)
        else:
            self._on_failure(error)
            op.future.set_exception(error)
            op.future.exception()  # retrieved by whoever awaits; never "never retrieved" noise
        _wake(op)

    def abandon(self, op: PendingOp) -> None:
        """Stop waiting for ``op``: forget it and cancel its future."""
        self._pending.pop(op.request_id, None)
        if not op.future.done():
            op.future.cancel()
        _wake(op)

    def fail_all(self, status: LLMStatusCode, message: str) -> None:
        """The link is gone: every request ends with ``LLMException(status, message)``; incoming
        payloads are discarded and local caches of requests whose bytes never started moving are
        unpinned."""
        for op in list(self._pending.values()):
            if op.sink is not None:
                op.sink.cancel()
            if op.copy is None:
                op.release()
            self.complete(op, LLMException(status, message))
