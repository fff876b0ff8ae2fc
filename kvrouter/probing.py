"""Whether each prefill's kvpush engine answers (``watch``): a prefill's HTTP side may take requests while its
kvpush engine's event loop does not run (its worker starved of its cores, or frozen), and a decode sent to
it would wait for a link it cannot make. Every ``interval_s`` each prefill is asked (``kvpush.probe``); one
that does not answer within ``timeout_s`` is held out of its pool until it answers again."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from kvpush import LLMException, probe

from .core.pools import Pool, Prefill

log = logging.getLogger(__name__)


async def watch(prefills: Pool[Prefill], counters: Counter[str], interval_s: float, timeout_s: float) -> None:
    """Until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        targets = prefills.targets
        answers = await asyncio.gather(*(_ask(p, timeout_s) for p in targets))
        for prefill, problem in zip(targets, answers):
            if problem is None:
                if prefills.restore(prefill):
                    log.warning("prefill %s: its kvpush side answers again; it gets requests", prefill.url)
                continue
            counters["kv_probe_failed"] += 1
            if prefills.hold_out(prefill, f"kvpush side not answering: {problem}"):
                log.warning("prefill %s: its kvpush side does not answer (%s); it gets no request until it does",
                            prefill.url, problem)
        await asyncio.sleep(max(0.0, interval_s - (loop.time() - started)))


async def _ask(prefill: Prefill, timeout_s: float) -> str | None:
    try:
        await probe(prefill.kv_host, prefill.kv_port, timeout_s)
    except LLMException as error:
        return str(error).partition(": ")[2] or str(error)
    return None
