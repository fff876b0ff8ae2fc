"""The outstanding requests of one link: ids, completion, abandonment, failing them all.

Request ids are per link, start at 1 and are never reused, so a late reply to an abandoned request
can never complete a later one: it finds no entry and is dropped. Every request ends exactly once:
completed (with None or an ``LLMException``), abandoned (cancelled), or failed with the others
when the link closes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .protocol import Kind
from .status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from transports.base import OutgoingFrame, PayloadSink

    from .layout import IoVec
    from .marks import LayerMarks
    from .memory import CacheEntry


class PendingOp:
    """A request waiting for its reply. It ends once: ``ended``, with ``error`` None or an
    ``LLMException``, or ``cancelled`` (abandoned). ``future`` mirrors that end for whoever awaits
    the request itself; it is made only when asked for (a transfer's layer waits through ``waiter``
    instead: a small transfer makes no second future).

    One-sided requests also carry both iovecs, the local cache they pin (``release`` unpins it
    exactly once) and, once granted, the transport's ``copy`` future."""

    __slots__ = ("request_id", "kind", "ended", "error", "cancelled", "_loop", "_future", "frame", "sink",
                 "expected", "local_iov", "remote_iov", "copy", "move_args", "held", "granted", "notice",
                 "waiter", "source", "offer", "gate", "_release")

    def __init__(self, request_id: int, kind: Kind, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.kind = kind
        self.ended = False
        self.error: LLMException | None = None
        self.cancelled = False
        self._loop = loop
        self._future: asyncio.Future[None] | None = None
        self.frame: OutgoingFrame | None = None
        self.sink: PayloadSink | None = None
        self.expected = 0
        self.local_iov: IoVec | None = None
        self.remote_iov: IoVec | None = None
        self.copy: asyncio.Future[Any] | None = None
        self.held = False      # prepared (and, one-sided, granted) but waiting for release_held
        self.granted = False
        self.notice: bytes | None = None  # set for a write under a lease: the WRITE_NOTICE to send after the copy
        # where a one-sided request's bytes go: the mover's (cache_id, first_tensor, rkeys, runs_per_tensor)
        self.move_args: tuple[int, int, tuple[bytes, ...] | None, int] = (0, 0, None, 0)
        # set by whoever awaits the request (``transfer.await_layer``): woken in the same loop pass as
        # ``future`` ends, and cancelled instead of ``future`` when that caller is cancelled
        self.waiter: asyncio.Future[None] | None = None
        self.source: CacheEntry | None = None  # a READ_OFFER's source cache: what the receiver reads
        self.offer: bytes | None = None  # a held READ_OFFER, encoded (``OFFER_MORE`` set), until it is sent
        # a gated READ_OFFER's mark (sent when prepared; released by marking it): the marks and its slot
        self.gate: tuple[LayerMarks, int] | None = None
        self._release: Callable[[], None] | None = None

    @property
    def future(self) -> asyncio.Future[None]:
        """Resolves with None, raises the request's ``LLMException``, or is cancelled, as it ends."""
        future = self._future
        if future is None:
            future = self._future = self._loop.create_future()
            if self.ended:
                self._settle(future)
        return future

    def end(self, error: LLMException | None = None, cancelled: bool = False) -> bool:
        """End the request (False: it had ended already)."""
        if self.ended:
            return False
        self.ended, self.error, self.cancelled = True, error, cancelled
        if self._future is not None:
            self._settle(self._future)
        return True

    def _settle(self, future: asyncio.Future[None]) -> None:
        if future.done():  # cancelled by a task that awaited it
            return
        if self.cancelled:
            future.cancel()
        elif self.error is not None:
            future.set_exception(self.error)
            future.exception()  # retrieved by whoever awaits; never "never retrieved" noise
        else:
            future.set_result(None)

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


class Deadlines:
    """Wakes waiters whose deadline passed, with one loop timer for all of them (armed for the
    earliest), so a request's deadline costs a heap entry instead of a loop timer of its own.

    ``add`` a waiter (a future) with its allowance; ``finished`` when its wait is over, whatever
    ended it. A waiter still pending at its deadline gets the result None (the caller then sees
    that its request is not done). Entries of finished waiters leave the heap lazily: from its head
    on every ``add``, and all at once when they outnumber the live ones (bounded memory whatever mix
    of allowances is used)."""

    _REBUILD_AT = 64

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._live = 0
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for = 0.0

    def __len__(self) -> int:
        return self._live

    @property
    def entries(self) -> int:
        """Heap entries held, finished ones included (bounded: see the class docstring)."""
        return len(self._heap)

    def add(self, seconds: float, waiter: asyncio.Future[None]) -> None:
        heap = self._heap
        while heap and heap[0][2].done():
            heapq.heappop(heap)
        when = self._loop.time() + seconds
        heapq.heappush(heap, (when, next(self._order), waiter))
        self._live += 1
        if self._timer is None or when < self._armed_for:
            self._arm(when)

    def finished(self) -> None:
        self._live -= 1
        heap = self._heap
        if len(heap) > self._REBUILD_AT and len(heap) > 2 * self._live:
            heap[:] = [entry for entry in heap if not entry[2].done()]
            heapq.heapify(heap)

    def close(self) -> None:
        """Stop the timer (the link is gone: its waiters are woken by their requests ending)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._expire)
        self._armed_for = when

    def _expire(self) -> None:
        self._timer = None
        heap = self._heap
        now = self._loop.time()
        while heap:
            when, _, waiter = heap[0]
            if not waiter.done():
                if when > now:
                    self._arm(when)
                    return
                waiter.set_result(None)
            heapq.heappop(heap)


class RequestTable:
    """The requests of one link. ``on_failure`` sees every error a request completes with."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_failure: Callable[[LLMException], None]) -> None:
        self._loop = loop
        self._ids = itertools.count(1)
        self._pending: dict[int, PendingOp] = {}
        self._on_failure = on_failure
        self.deadlines = Deadlines(loop)  # of the waits for this link's requests (``transfer.await_layer``)

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[PendingOp]:
        return iter(list(self._pending.values()))

    def reserve(self) -> int:
        """The id of a request ``new`` books later (once its frame is out: no reply can be handled in
        between, this loop handles them)."""
        return next(self._ids)

    def new(self, kind: Kind, request_id: int | None = None) -> PendingOp:
        """Book a request (under a ``reserve``d id, or a fresh one)."""
        if request_id is None:
            request_id = next(self._ids)
        op = PendingOp(request_id, kind, self._loop)
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
        if op.ended:
            return
        if error is not None:
            self._on_failure(error)
        op.end(error)
        waiter = op.waiter  # (``_wake``, inline: every reply ends here)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abandon(self, op: PendingOp) -> None:
        """Stop waiting for ``op``: forget it and end it cancelled."""
        self._pending.pop(op.request_id, None)
        op.end(cancelled=True)
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
        self.deadlines.close()  # every waiter was just woken
