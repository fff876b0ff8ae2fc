"""How late an event loop runs: the measure of this engine's own stalls (``LoopLag``).

A process that is not scheduled (its cores taken by others), or a callback that blocks its loop, makes
every link of the engine look silent to its peers and every peer look silent to it. ``LoopLag`` sleeps
``tick_s`` at a time and measures how much later than asked it woke: a wake later than ``stall_s`` is a
stall of this side, remembered by when it ended (``resumed``), so a link's keepalive counts a peer's
silence only from then on: the peer could not have answered pings this side never sent, nor could this
side have read its answers.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

TICK_S = 0.1
STALL_S = 0.5  # a wake this much later than asked is a stall (a loop busy with a layer's copies is not one)
WARN_S = 1.0  # stalls this long are logged


class LoopLag:
    """The lag of the event loop ``watch`` runs on. Plain numbers, safe to read from any thread:

    - ``resumed``: ``time.monotonic()`` at the end of the last stall (0.0: none yet);
    - ``stalls`` / ``stalled_s``: how many stalls, and their total length;
    - ``worst_s``: the longest one; ``last_s``: the lag of the latest wake (stall or not)."""

    def __init__(self, name: str, tick_s: float = TICK_S, stall_s: float = STALL_S) -> None:
        self.name = name
        self.tick_s = tick_s
        self.stall_s = stall_s
        self.resumed = 0.0
        self.stalls = 0
        self.stalled_s = 0.0
        self.worst_s = 0.0
        self.last_s = 0.0

    def observe(self, asked_s: float, slept_s: float, now: float) -> None:
        """A sleep of ``asked_s`` took ``slept_s``, ending at ``now``."""
        lag = max(0.0, slept_s - asked_s)
        self.last_s = lag
        if lag < self.stall_s:
            return
        self.resumed = now
        self.stalls += 1
        self.stalled_s += lag
        self.worst_s = max(self.worst_s, lag)
        if lag >= WARN_S:
            log.warning("%s: this engine's event loop did not run for %.0f ms (its process was not scheduled, or "
                        "a callback blocked it); peers are not blamed for the silence", self.name, lag * 1e3)

    def heard(self, last_receive: float) -> float:
        """When a peer last had the chance to be heard: its last byte, or the end of this side's last stall
        if that came later."""
        return max(last_receive, self.resumed)

    async def watch(self) -> None:
        """Measure until cancelled (the engine's task scope ends it at ``finalize``)."""
        clock = time.monotonic
        while True:
            started = clock()
            await asyncio.sleep(self.tick_s)
            now = clock()
            self.observe(self.tick_s, now - started, now)

    def stats(self) -> dict[str, float]:
        return {"loop_stalls": self.stalls, "loop_stalled_ms": round(self.stalled_s * 1e3),
                "loop_worst_stall_ms": round(self.worst_s * 1e3)}
