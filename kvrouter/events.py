"""Following an instance's KV events over ZMQ (``Follower``): a SUB socket on its publisher, a DEALER on its
replay socket, and what they say applied to the instance's ``CacheView`` through ``kvrouter.core.kv_events``.

- At start, and after any gap in the sequence numbers (a high-water mark dropped batches, a reconnect), the
  batches it still buffers are replayed from the first one missed (from 0 at start: the index begins with
  what the instance already holds); without a replay socket, or when the replay does not reach back, the
  view guesses again from scratch (``CacheView.unfollow``) and follows anew.
- A restarted engine (its numbers start again at 0) or ``AllBlocksCleared`` clears the index.
- Bounds: messages above ``MAX_MESSAGE_BYTES`` are refused by ZMQ itself (``MAXMSGSIZE``: the connection is
  dropped), ``RCVHWM`` caps what waits unread, each replay has a deadline, and a publisher whose connection
  goes (ZMQ heartbeats) makes the view guess until it is back and resynchronised. Whatever cannot be read
  is counted and logged (once per kind a minute), never applied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import zmq
import zmq.asyncio

from .core.index import CacheView
from .core.kv_events import (
    END_SEQ,
    MAX_MESSAGE_BYTES,
    Batch,
    Cleared,
    EventError,
    EventFeed,
    Removed,
    Source,
    Step,
    Stored,
)
from .core.kv_events import decode as decode_batch

log = logging.getLogger(__name__)

RCVHWM = 10000
REPLAY_TIMEOUT_S = 5.0
HEARTBEAT_MS = 2000
WARN_EVERY_S = 60.0


class Follower:
    """One instance's events into its view, until cancelled. ``counters``: batches applied, replays, gaps,
    restarts, refused messages (by reason), shared with the router's ``/metrics``."""

    def __init__(self, name: str, source: Source, view: CacheView, counters: Counter[str],
                 context: zmq.asyncio.Context, block_size: int | None = None) -> None:
        self.name = name
        self.source = source
        self.view = view
        self.counters = counters
        self.context = context
        self.block_size = block_size  # the engine's, once known (from registration, or its first event)
        self.feed = EventFeed()
        self.last_batch_at = 0.0
        self._warned: dict[str, float] = {}

    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVHWM, RCVHWM)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 4096)
            sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
            sub.connect(self.source.endpoint)
            self.view.follow()
            await self._replay(0)  # what it holds already, as far as it still buffers
            while True:
                batch = self._decode(await sub.recv_multipart())
                if batch is not None:
                    await self._live(batch)
        finally:
            sub.close(linger=0)
            self.view.unfollow()

    async def _live(self, batch: Batch) -> None:
        step = self.feed.step(batch.seq, batch.ts)
        if step is Step.OLD:
            return
        if step is Step.GAP:
            self.counters["events_gaps"] += 1
            log.info("instance %s: KV event batches %d..%d missed", self.name, self.feed.expected, batch.seq - 1)
            await self._replay(self.feed.expected or 0)
            expected = self.feed.expected
            if expected is not None and expected > batch.seq:
                return  # the replay brought it
            if expected is not None and expected < batch.seq:
                self._relearn(f"the batches from {expected} on are not buffered any more")
        elif step is Step.RESTART:
            self.counters["events_restarts"] += 1
            self._relearn(f"its KV events started again at {batch.seq} (a restarted engine)")
        self._apply(batch)

    async def _replay(self, start: int) -> None:
        """Apply what the instance still buffers from ``start`` on; one that cannot be replayed (no replay
        socket, no answer in time, nothing from ``start``) makes the view start over."""
        if self.source.replay is None:
            if start > 0:
                self._relearn("it has no replay socket")
            return
        dealer = self.context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 4096)
            dealer.connect(self.source.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    if frames[2:3] == [END_SEQ.to_bytes(8, "big")]:
                        break
                    batch = self._decode(frames[1:])
                    if batch is None:
                        continue
                    step = self.feed.step(batch.seq, batch.ts)
                    if step is Step.OLD:
                        continue
                    if step is not Step.APPLY:  # it does not reach back to ``start``, or a restart
                        self._relearn(f"its replay starts at {batch.seq}, not {self.feed.expected}")
                    self._apply(batch)
            self.counters["events_replays"] += 1
        except TimeoutError:
            self._refused("a replay that did not end in time")
            if start > 0:
                self._relearn("its replay did not end in time")
        finally:
            dealer.close(linger=0)

    def _relearn(self, why: str) -> None:
        log.info("instance %s: %s: its index starts over", self.name, why)
        self.counters["events_relearnt"] += 1
        self.view.exact.clear()
        self.feed.forget()

    def _decode(self, frames: list[bytes]) -> Batch | None:
        try:
            return decode_batch(frames)
        except EventError as error:
            self._refused(str(error))
            return None

    def _apply(self, batch: Batch) -> None:
        index = self.view.exact
        for event in batch.events:
            if isinstance(event, Stored):
                if self.block_size is None:
                    self.block_size = event.block_size
                if event.block_size != self.block_size:
                    self._refused(f"a BlockStored of {event.block_size}-token blocks (the engine's are "
                                  f"{self.block_size})")
                    continue
                index.store(event.hashes, event.group)
            elif isinstance(event, Removed):
                index.remove(event.hashes, event.group)
            elif isinstance(event, Cleared):
                index.clear()
        self.feed.applied(batch.seq, batch.ts)
        self.counters["events_batches"] += 1
        self.last_batch_at = time.monotonic()

    def _refused(self, reason: str) -> None:
        kind = reason.split(" (")[0][:60]
        self.counters[f"events_refused:{kind}"] += 1
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[kind] = now
            log.warning("instance %s: KV events refused: %s (counted; logged once a minute)", self.name, reason)
