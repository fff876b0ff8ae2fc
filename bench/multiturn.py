"""The multi-turn workload of bench/vllm_load.py: conversations that share one system prompt, each turn the
conversation's history (every earlier message and answer) plus a new message; conversations arrive as a
Poisson process, and each turn is sent a think time after the previous one's answer ended.

The prompts are fixed before any setup runs: the single instance of the calibration answers every turn in
order (its greedy answers build the next turns' histories), so every setup gets the same prompts and its
answers must equal the single instance's. Each load level gets conversations of its own (fresh histories:
what an earlier level left cached helps only with the system prompt, as it would in a real fleet).

What it measures beside latency: prompt tokens each setup *computed* per request (vLLM's
``vllm:prompt_tokens_by_source_total{source="local_compute"}``, summed over the setup's instances), against the
floor - what the single instance computed for the same requests one at a time, every conversation's history
in its prefix cache.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SYSTEM_TOKENS = 512
MESSAGE_TOKENS = (48, 256)  # each new message's length: uniform in this range
ANSWER_TOKENS = 32
THINK_S = 0.5  # mean think time between a turn's answer and the next message (exponential)


@dataclass(frozen=True)
class Conversation:
    level: int  # the load level it belongs to
    index: int
    arrival_unit: float  # arrival at rate 1 conversation/s
    messages: tuple[tuple[int, ...], ...]
    thinks_unit: tuple[float, ...]  # think times (scaled by THINK_S)


def conversations(levels: int, per_level: int, turns: int, vocab: int, seed: int = 11
                  ) -> tuple[tuple[int, ...], list[list[Conversation]]]:
    """The shared system prompt and each level's conversations (seeded: the same for every setup)."""
    rng = random.Random(f"kvpush-multiturn-{seed}")
    system = tuple(rng.randrange(3, vocab) for _ in range(SYSTEM_TOKENS))
    out = []
    for level in range(levels):
        convs, at = [], 0.0
        for index in range(per_level):
            messages = tuple(tuple(rng.randrange(3, vocab) for _ in range(rng.randint(*MESSAGE_TOKENS)))
                             for _ in range(turns))
            thinks = tuple(rng.expovariate(1.0) for _ in range(turns))
            convs.append(Conversation(level, index, at, messages, thinks))
            at += rng.expovariate(1.0)
        out.append(convs)
    return system, out


def turn_prompt(system: Sequence[int], conversation: Conversation, turn: int,
                answers: Sequence[Sequence[int]]) -> list[int]:
    """Turn ``turn``'s prompt: the system prompt, then each earlier message and its answer, then the new one."""
    prompt = list(system)
    for k in range(turn):
        prompt += list(conversation.messages[k]) + list(answers[k])
    return prompt + list(conversation.messages[turn])


@dataclass
class TurnOutcome:
    level: int
    conversation: int
    turn: int
    prompt_tokens: int
    sent: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    cached: int | None = None
    route: str | None = None
    reason: str | None = None
    error: str | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return self.level, self.conversation, self.turn

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or len(self.tokens) < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (len(self.tokens) - 1)


async def read_stream(reply: Any, outcome: Any) -> list[float]:
    """A streamed completion's chunks into ``outcome`` (its ``tokens`` and ``cached``); when each token came."""
    import json

    times: list[float] = []
    async for raw in reply.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        chunk = json.loads(line[5:])
        for choice in chunk.get("choices") or ():
            new = choice.get("token_ids") or []
            times += [time.monotonic()] * len(new)
            outcome.tokens += new
        usage = chunk.get("usage")
        if usage:
            outcome.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return times


def timed(outcome: Any, times: Sequence[float]) -> Any:
    """``outcome`` with its TTFT, gaps and end-to-end time from its tokens' ``times`` (a miss without any)."""
    if not times:
        outcome.error = "the stream ended without a token"
        return outcome
    outcome.ttft_s = times[0] - outcome.sent
    outcome.gaps_s = [b - a for a, b in zip(times, times[1:])]
    outcome.e2e_s = time.monotonic() - outcome.sent
    return outcome


async def ask(session: Any, url: str, outcome: TurnOutcome, prompt: Sequence[int], model: str,
              timeout_s: float) -> TurnOutcome:
    """One streamed completion of ``prompt``, into ``outcome``."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": ANSWER_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    outcome.sent = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/completions", json=body) as reply:
                outcome.route = reply.headers.get("X-Kvpush-Route")
                outcome.reason = reply.headers.get("X-Kvpush-Reason")
                if reply.status != 200:
                    raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:200]}")
                times = await read_stream(reply, outcome)
    except Exception as error:  # noqa: BLE001 - a failed request is a miss, not the end of the run
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    return timed(outcome, times)


async def run_level(url: str, system: Sequence[int], convs: Sequence[Conversation],
                    answers: dict[tuple[int, int, int], list[int]] | None, rate: float | None, model: str,
                    timeout_s: float) -> list[TurnOutcome]:
    """Every conversation of one level: arriving at ``rate`` conversations/s (None: one after another, each
    turn right after the previous: the calibration). ``answers``: the reference answers that build the
    histories; None: this run's own answers build them (the calibration)."""
    import aiohttp

    own: dict[tuple[int, int, int], list[int]] = {}

    async def talk(session: Any, conv: Conversation, start: float) -> list[TurnOutcome]:
        if rate is not None:
            await asyncio.sleep(max(0.0, start + conv.arrival_unit / rate - time.monotonic()))
        done, history = [], []
        for turn in range(len(conv.messages)):
            prompt = turn_prompt(system, conv, turn, history)
            outcome = await ask(session, url, TurnOutcome(conv.level, conv.index, turn, len(prompt), 0.0), prompt,
                                model, timeout_s)
            done.append(outcome)
            reference = (answers or {}).get(outcome.key) if answers is not None else outcome.tokens
            if outcome.error or reference is None:
                break  # the rest of this conversation cannot be built
            own[outcome.key] = outcome.tokens
            history.append(reference)
            if rate is not None and turn + 1 < len(conv.messages):
                await asyncio.sleep(THINK_S * conv.thinks_unit[turn])
        return done

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.monotonic() + 0.2
        if rate is None:
            results = [await talk(session, conv, start) for conv in convs]
        else:
            results = list(await asyncio.gather(*(talk(session, conv, start) for conv in convs)))
    return [o for conv in results for o in conv]


def computed_tokens(metrics_text: str) -> float:
    """Prompt tokens an instance computed itself (vLLM's prompt_tokens_by_source, local_compute)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="local_compute"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
