"""Where a request goes (``place``): a decode alone, or a prefill and a decode - chosen per request from what
each instance already holds, how busy each is, and what the transfer costs. Pure: the shells hand in the
request's block hashes' matches and each instance's load, and show the ``Decision`` (route, instances,
reason) in a response header, the log and ``/metrics``.

The cost of a choice is counted in prompt tokens computed: a decode alone computes the prompt tokens it does
not hold; a prefill computes those *it* does not hold, and the decode then loads the blocks it lacks. Load is
counted in tokens too: the prompt tokens still to be computed of the requests placed on an instance
(``Candidate.pending_tokens``, until each answer begins: a queued 2048-token prompt delays the next request
more than two 32-token ones), and each request it is running or queueing weighs ``Policy.request_tokens``
besides. That weight is small: vLLM batches a newcomer's prompt with the decode steps of those it runs, so
each of them delays its first token by a share of one step, while leaving the instance that holds a
conversation's history makes another compute it all again.

A request is disaggregated only where that pays (llm-d and NVIDIA Dynamo decide alike):
- the decode would compute at least ``Policy.pd_min_tokens`` itself - below that, a prefill's round trip and
  the transfer cost more than the decode's own step, and the prompt's KV stays where its conversation is;
- a prefill is free: fewer than ``Policy.prefill_queue`` prefills in flight on it, and no busier than the
  decode (a prefill queue is the bottleneck of static P/D: short prompts waited behind long ones);
- the decode has no more prompt tokens queued than the best decode alone would compute for the whole request:
  its first steps for the request would wait behind them;
- the prefill does not compute much more than the decode would have (``Policy.waste``): a decode that holds a
  conversation's history computes only its new message, where a prefill without it would compute it all.
``Policy.static`` places as the proxy did before: every request to a prefill, then a decode, fewest in
flight each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PD, DECODE_ONLY = "pd", "decode-only"


@dataclass(frozen=True)
class Policy:
    pd_min_tokens: int = 128  # issue 42: P/D adds 1-4 ms; see docs/performance/load.md for the runs
    prefill_queue: int = 1
    waste: float = 1.25
    request_tokens: int = 32
    static: bool = False


@dataclass(frozen=True)
class Candidate:
    """One instance, for one request: what it can do, how much of the prompt it holds, how busy it is."""

    name: str
    prefill: bool  # may compute prompts for others (kv_producer, kv_both)
    decode: bool  # may serve requests (kv_consumer, kv_both)
    held_blocks: int = 0  # leading blocks of this request's prompt in its prefix cache
    running: int = 0  # requests it serves or queues (whole ones, or as a decode)
    prefilling: int = 0  # prefills it computes for other instances
    group: str = ""  # its KV geometry's fingerprint: a prefill serves only decodes of its group ("": any)
    pending_tokens: int = 0  # prompt tokens it was given to compute (alone or as a prefill), answers not begun


@dataclass(frozen=True)
class Prompt:
    tokens: int
    block_size: int


@dataclass(frozen=True)
class Decision:
    route: str  # PD or DECODE_ONLY
    decode: str
    prefill: str | None
    reason: str
    computed: int  # prompt tokens the choice computes (where they are computed)
    loaded: int  # prompt tokens the decode loads from the prefill


def uncached(prompt: Prompt, held_blocks: int) -> int:
    """Prompt tokens an instance holding ``held_blocks`` leading blocks computes: vLLM reuses at most all but
    the prompt's last token, block-aligned."""
    reusable = min(held_blocks * prompt.block_size, prompt.tokens - 1)
    reusable -= reusable % prompt.block_size
    return prompt.tokens - max(reusable, 0)


def place(prompt: Prompt, candidates: Sequence[Candidate], policy: Policy) -> Decision | None:
    """The decision for one request, or None when no candidate may serve it."""
    decodes = [c for c in candidates if c.decode]
    if not decodes:
        return None
    prefills = [c for c in candidates if c.prefill]
    if policy.static:
        return _static(prompt, decodes, prefills)
    load = policy.request_tokens

    def alone(c: Candidate) -> int:
        return uncached(prompt, c.held_blocks) + c.pending_tokens + load * (c.running + c.prefilling)

    best = min(decodes, key=alone)  # ties: the first, in the order handed in (the shell rotates it)
    local = uncached(prompt, best.held_blocks)
    if local < policy.pd_min_tokens:
        return Decision(DECODE_ONLY, best.name, None, _held(prompt, best, local) + f"; below the {policy.pd_min_tokens}"
                        f"-token threshold to disaggregate", local, 0)
    pairs = []
    for decode in decodes:
        for prefill in prefills:
            if prefill.name == decode.name or prefill.prefilling >= policy.prefill_queue \
                    or not _pairs(prefill, decode):
                continue
            if prefill.running + prefill.prefilling > decode.running:
                continue
            if decode.pending_tokens > alone(best):  # its decode steps would wait behind prompts queued there
                continue
            computed = uncached(prompt, prefill.held_blocks)
            if computed > policy.waste * local:
                continue
            cost = computed + prefill.pending_tokens + load * (prefill.running + prefill.prefilling + decode.running)
            pairs.append((cost, computed, prefill, decode))
    if not pairs:
        return Decision(DECODE_ONLY, best.name, None, _held(prompt, best, local) + "; no prefill is free to "
                        "take it without computing more or queueing", local, 0)
    _, computed, prefill, decode = min(pairs, key=lambda pair: pair[0])
    loaded = uncached(prompt, decode.held_blocks)  # the blocks it lacks come from the prefill
    return Decision(PD, decode.name, prefill.name, f"{local} uncached tokens on the decode (threshold "
                    f"{policy.pd_min_tokens}); the prefill computes {computed}", computed, loaded)


def _held(prompt: Prompt, candidate: Candidate, computes: int) -> str:
    held = prompt.tokens - computes
    return f"it holds {held} of {prompt.tokens} prompt tokens and computes {computes}"


def _pairs(prefill: Candidate, decode: Candidate) -> bool:
    return not prefill.group or not decode.group or prefill.group == decode.group


def _static(prompt: Prompt, decodes: Sequence[Candidate], prefills: Sequence[Candidate]) -> Decision:
    decode = min(decodes, key=lambda c: c.running)
    prefills = [p for p in prefills if _pairs(p, decode) and p.name != decode.name]
    if not prefills:
        return Decision(DECODE_ONLY, decode.name, None, "static: no prefill", prompt.tokens, 0)
    prefill = min(prefills, key=lambda c: c.running + c.prefilling)
    return Decision(PD, decode.name, prefill.name, "static: every request to a prefill", prompt.tokens,
                    prompt.tokens)
