"""The receiver's side of gated READ_OFFERs: offers checked and pinned, waiting for the sender to mark
their layer ready (``kvpush.marks``).

``Gates`` reads every waiting offer's mark from the sender's memory with one read through the same-host
mover (a few words: one ``process_vm_readv``, inline), every ``POLL_MIN_S`` while marks turn, backing off to
``POLL_MAX_S`` while none does, and at once whenever the sender's link delivers a frame (``poll``; a layer
pusher sends one when its caller is done). An open mark starts the offer's copy (``opened``), a withdrawn
one ends it unanswered by a copy (``withdrawn``). Nothing here touches the link: the owner (``read_offers.ReadOffers``)
is handed the two callbacks, the reader and the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from transports.base import Mover

from .layout import IoVec

log = logging.getLogger(__name__)

POLL_MIN_S = 0.001
POLL_MAX_S = 0.008
_MASK = (1 << 64) - 1


class Gates:
    """The gated offers of one link, by request id."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reader: Callable[[], Mover | None],
                 opened: Callable[[int], None], withdrawn: Callable[[int], None],
                 failed: Callable[[BaseException], None]) -> None:
        self._loop = loop
        self._reader = reader
        self._opened = opened
        self._withdrawn = withdrawn
        self._failed = failed
        self._waiting: dict[int, tuple[int, int]] = {}  # request id -> (mark address, token)
        self._timer: asyncio.TimerHandle | None = None
        self._interval = POLL_MIN_S
        self._reading = False  # a read of the marks is running (queued behind a copy in the mover)

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request_id: int, address: int, token: int) -> None:
        self._waiting[request_id] = (address, token)
        self._interval = POLL_MIN_S
        self._arm()

    def discard(self, request_id: int) -> bool:
        return self._waiting.pop(request_id, None) is not None

    def clear(self) -> None:
        self._waiting.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        if self._timer is None and self._waiting:
            self._timer = self._loop.call_later(self._interval, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.poll()

    def poll(self) -> None:
        """Read every waiting mark now; act on those that turned."""
        reader = self._reader()
        if not self._waiting or self._reading or reader is None:
            self._arm()
            return
        ids = list(self._waiting)
        got = np.zeros(len(ids), np.uint64)
        base = int(got.ctypes.data)
        local = IoVec.of_array(np.stack([base + 8 * np.arange(len(ids), dtype=np.uint64),
                                         np.full(len(ids), 8, np.uint64)], axis=1))
        remote = IoVec.of_array(np.array([(self._waiting[r][0], 8) for r in ids], np.uint64).reshape(-1, 2))
        self._reading = True
        try:
            read = reader.start(True, local, remote, 0, 0, None, 1)
        except Exception as error:  # noqa: BLE001 - the mover refused at once (its peer is gone)
            read = self._loop.create_future()
            read.set_exception(error)
        read.add_done_callback(lambda done: self._read(ids, got, done))

    def _read(self, ids: list[int], got: np.ndarray[Any, Any], read: asyncio.Future[Any]) -> None:
        self._reading = False
        error = None if read.cancelled() else read.exception()
        if read.cancelled() or error is not None:
            if self._waiting:
                self._failed(error or asyncio.CancelledError())
            return
        turned = False
        for request_id, word in zip(ids, got.tolist(), strict=True):
            waiting = self._waiting.get(request_id)
            if waiting is None:  # ended meanwhile (the link closed, its deadline passed)
                continue
            token = waiting[1]
            if word == token:
                del self._waiting[request_id]
                turned = True
                self._opened(request_id)
            elif word == token ^ _MASK:
                del self._waiting[request_id]
                turned = True
                self._withdrawn(request_id)
        self._interval = POLL_MIN_S if turned else min(POLL_MAX_S, 2 * self._interval)
        self._arm()
