"""Warm links (``kvpush proxy``'s default; ``--no-warm-links`` turns it off): every prefill-decode pair the router
may use carries one small P/D request before any client's, so what a pair's first transfer makes - the decode's
kvpush link to the prefill and its geometry handshake, each side's first transfer and vLLM's first request of
that kind - is made off every client's path (issue 42: a first request took 16x the second).

A warm-up is a real request through the same mechanism as a client's (``PrefillRun`` beside the decode's copy,
under one transfer id): a short text prompt, one output token, the answers read and dropped. The pairs up at the
router's start are warmed before it listens (``warm``, bounded by ``AT_START_S``); a pair that comes up later
(an instance that was still starting, a fleet member that joined) is warmed in the background (``keep_warm``),
each pair at most ``MAX_ATTEMPTS`` times. Counted in ``/metrics`` as ``kvpush_proxy_warmups_total{outcome}``;
never counted as a client's request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from kvpush.integrations.config import new_transfer_id

from .core.pools import Pool, Prefill, decode_body, prefill_body
from .relay import PrefillRun, describe, healthy

log = logging.getLogger(__name__)

PROMPT = "kvpush warms this link."
AT_START_S = 20.0  # the warm-ups before the router listens end within this
TIMEOUT_S = 15.0  # one warm-up
MAX_ATTEMPTS = 3  # a pair whose warm-ups failed this often is left to its first client request
MAX_PAIRS = 64  # pairs warmed (a larger fleet: the first ones seen)
EVERY_S = 1.0  # how often the background looks for pairs to warm


class Warmer:
    """Which pairs are warm; ``pairs`` says which the router may use now (prefill, decode URL). A warm-up's prefill
    counts in ``prefills`` as a client's does while it runs (one that refuses it sits out its back-off)."""

    def __init__(self, session: aiohttp.ClientSession, counters: Counter[str], prefills: Pool[Prefill],
                 pairs: Callable[[], Sequence[tuple[Prefill, str]]], headers: dict[str, str]) -> None:
        self.session = session
        self.counters = counters
        self.prefills = prefills
        self.pairs = pairs
        self.headers = headers
        self.warm_pairs: set[tuple[Prefill, str]] = set()
        self._attempts: Counter[tuple[Prefill, str]] = Counter()

    def _due(self) -> list[tuple[Prefill, str]]:
        pairs = [pair for pair in self.pairs() if pair not in self.warm_pairs and self._attempts[pair] < MAX_ATTEMPTS]
        return pairs[:max(0, MAX_PAIRS - len(self.warm_pairs))]

    async def warm(self, within_s: float) -> None:
        """Warm every pair due whose two instances are up now, one after the other, for at most ``within_s``."""
        try:
            async with asyncio.timeout(within_s):
                for prefill, decode in self._due():
                    await self._warm(prefill, decode)
        except TimeoutError:
            log.info("warming links: stopped after %.0f s; the rest are warmed in the background", within_s)

    async def keep_warm(self) -> None:
        """Warm pairs as they become due (instances that come up, fleet members that join), until cancelled."""
        while True:
            await asyncio.sleep(EVERY_S)
            await self.warm(TIMEOUT_S * 2)

    async def _warm(self, prefill: Prefill, decode: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT_S
        for url in (prefill.url, decode):
            if await healthy(self.session, url, min(deadline, loop.time() + 2.0)) is not None:
                return  # not up (yet): not an attempt
        pair = (prefill, decode)
        self._attempts[pair] += 1
        problem = await self._request(prefill, decode, deadline)
        if problem is None:
            self.warm_pairs.add(pair)
            self.counters["warmup_ok"] += 1
            log.info("warmed the link from decode %s to prefill %s", decode, prefill.url)
        else:
            self.counters["warmup_failed"] += 1
            log.warning("warming the link from decode %s to prefill %s failed (%s)%s", decode, prefill.url,
                        problem, "" if self._attempts[pair] < MAX_ATTEMPTS else "; its first request makes it")

    async def _request(self, prefill: Prefill, decode: str, deadline: float) -> str | None:
        """One warm-up through ``prefill`` and ``decode`` at once; None, or what went wrong."""
        remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
        try:
            async with self.session.get(decode + "/v1/models", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=remaining)) as reply:
                model = (await reply.json())["data"][0]["id"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as error:
            return f"{decode}/v1/models: {describe(error)}"
        body: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}
        transfer_id = new_transfer_id()
        run = PrefillRun(self.session, self.prefills, prefill, (prefill.url + "/v1/completions",
                                                              prefill_body(body, transfer_id), self.headers),
                         deadline, TIMEOUT_S, transfer_id)
        try:
            async with self.session.post(decode + "/v1/completions", json=decode_body(body, transfer_id, prefill),
                                         headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=remaining)) as reply:
                await reply.read()
                if reply.status != 200:
                    return f"the decode answered {reply.status}"
            refusal = await run.settled
            return None if refusal is None else f"the prefill did not accept it: {refusal.reason}"
        except (aiohttp.ClientError, TimeoutError) as error:
            return f"the decode: {describe(error)}"
        finally:
            await run.end(2.0)
