"""Receiver-side completion notifications and small peer messages (SPEC 10): the receiving inboxes.

A push may carry a notification; the sender sends it on the link only after every byte of that
transfer is in this engine's memory (remote completion), so an engine that receives it knows the
transfer has landed. Engines may also send small ordered messages to a linked peer (e.g. a decode
engine tells the prefill where a request's blocks are). Both arrive here, one ``Inbox`` each.

Bounds: a message or notification carries at most ``MAX_MESSAGE_BYTES``; an inbox holds at most
``INBOX_DEPTH`` undelivered items; when it is full the sender's call fails with LLM_LINK_BUSY (never a
silent drop). A link that closes ends every waiter filtered to that peer with LLM_NOT_YET_LINK
(what it already queued stays readable); ``close`` (finalize) ends every waiter.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .status import LLMException, LLMStatusCode, param_invalid

MAX_MESSAGE_BYTES = 64 << 10
INBOX_DEPTH = 4096
MESSAGE, NOTIFICATION = 0, 1  # the channel byte on the wire


def check_notify(api: str, notify: object) -> None:
    """A push's ``notify`` argument: None or at most ``MAX_MESSAGE_BYTES`` bytes."""
    if notify is None:
        return
    if not isinstance(notify, (bytes, bytearray, memoryview)):
        raise TypeError(f"{api}: notify must be bytes, got {type(notify).__name__}")
    if len(notify) > MAX_MESSAGE_BYTES:
        raise param_invalid(f"{api}: notify of {len(notify)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")


@dataclass(frozen=True)
class Delivery:
    """One message or notification from a linked peer. ``epoch``: how many times this engine had lost
    its link to that peer when the item arrived; an item whose epoch is below the engine's
    ``links_lost(peer)`` came over a link that has closed since (the peer was told that link is gone,
    so acting on it now, e.g. pushing over a newer link, can reach memory the peer already reused)."""

    peer_cluster_id: int
    data: bytes
    epoch: int = 0


class Inbox:
    """Messages (or notifications) from linked peers, in arrival order (per peer: the order sent)."""

    def __init__(self, depth: int = INBOX_DEPTH) -> None:
        self._depth = depth
        self._items: collections.deque[Delivery] = collections.deque()
        self._waiters: list[tuple[int | None, asyncio.Future[Delivery]]] = []
        self._closed: LLMException | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, delivery: Delivery) -> bool:
        """Deliver; False (nothing kept) when the inbox is full or closed."""
        for index, (peer, waiter) in enumerate(self._waiters):
            if not waiter.done() and (peer is None or peer == delivery.peer_cluster_id):
                del self._waiters[index]
                waiter.set_result(delivery)
                return True
        if self._closed is not None or len(self._items) >= self._depth:
            return False
        self._items.append(delivery)
        return True

    def get_nowait(self, peer: int | None = None) -> Delivery | None:
        """The oldest item (from ``peer``, when given), or None."""
        for index, item in enumerate(self._items):
            if peer is None or item.peer_cluster_id == peer:
                del self._items[index]
                return item
        return None

    async def get(self, peer: int | None = None) -> Delivery:
        """The oldest item (from ``peer``, when given), waiting for one. Raises LLMException
        (LLM_NOT_YET_LINK) when that peer's link closes, or when the engine is finalized.
        Cancellation: nothing is taken from the inbox."""
        item = self.get_nowait(peer)
        if item is not None:
            return item
        if self._closed is not None:
            raise self._closed
        waiter: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        entry = (peer, waiter)
        self._waiters.append(entry)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._items.appendleft(waiter.result())  # delivered just as we were cancelled: keep it
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delivery]:
        while True:
            yield await self.get()

    def peer_gone(self, peer: int, reason: str) -> None:
        """The link to ``peer`` closed: its waiters end with LLM_NOT_YET_LINK."""
        for waiting_for, waiter in list(self._waiters):
            if waiting_for == peer and not waiter.done():
                waiter.set_exception(LLMException(LLMStatusCode.LLM_NOT_YET_LINK,
                                                  f"link to cluster {peer} closed: {reason}"))
        self._waiters = [(p, w) for p, w in self._waiters if not w.done()]

    def close(self, reason: str) -> None:
        """The engine is finalized: every waiter ends; later ``get`` calls fail once the inbox is empty."""
        self._closed = LLMException(LLMStatusCode.LLM_ENGINE_FINALIZED, reason)
        for _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(LLMException(LLMStatusCode.LLM_ENGINE_FINALIZED, reason))
        self._waiters = []
