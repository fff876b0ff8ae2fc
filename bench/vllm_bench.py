#!/usr/bin/env python3
"""vLLM serving benchmark: a single instance against prefill/decode pairs over kvpush and over vLLM's own
KV connectors, with real `vllm serve` processes (vLLM's CPU build) and a model made on this machine.

    python bench/vllm_bench.py            # with vLLM's CPU build installed (the python of a vLLM venv)
    python bench/vllm_bench.py --quick    # prompts of 32 and 512 tokens, fewer repetitions

The model (bench/vllm_model.py, built once into a temp directory): a Llama with random float32 weights,
24 layers, hidden 512, 8 KV heads of 64, 334 MB; 96 KiB of KV per token (a 2048-token prompt is
192 MiB of KV). Greedy decoding, ``ignore_eos``; every prompt is distinct random token ids.

Cases (one ``vllm serve`` per engine, each engine pinned to its own core with ``taskset`` and
``VLLM_CPU_OMP_THREADS_BIND``, and pinned again after start-up if it moved itself; prefix caching
off; one request at a time; the client does the routing a proxy would, so no proxy hop is measured):
- ``single``: one instance on core 1, with a connector that moves nothing and only stamps its phases
  (bench/vllm_timed_connector.py's ``TracingConnector``). The reference for every output and ratio.
- ``single-plain``: the same instance without any connector, its requests interleaved with the reference's:
  its "TTFT vs single" is what the tracing connector costs the reference (a connector makes vLLM hash every
  request's blocks and carry its metadata through each step).
- ``kvpush-tcp``, ``kvpush-cma``: a prefill (``kv_producer``, on core 1, where the single instance
  computed the same prompts) and a decode (``kv_consumer``, core 0) with KvpushConnector (its timed
  subclass, bench/vllm_timed_connector.py) and ``kv_connector_extra_config={"transport": ...}``.
  Each request goes as ``kvpush proxy`` sends it: the prefill's copy (``max_tokens=1``, streamed) and the
  decode's at once, under one transfer id the client mints; the client streams the
  decode's, led by the prefill's first token when that came first (the proxy's ``first_token``: the
  decode's copy of it is checked). "pushed in forward" counts the requests whose
  block ids reached the prefill before its forward started (the others are pushed after it).
- ``kvpush-tp2``: as ``kvpush-cma``, with tensor parallelism: the prefill runs TP 2 (its two ranks on
  cores 0 and 1, each pushing its KV heads), the decode TP 1 on core 0; its TTFT is read beside
  ``kvpush-cma``'s (TP 1 -> TP 1). On 2 cores the prefill's ranks share them with the decode (and rank 1
  with the single instance): tensor parallelism buys no compute here, so this shows what splitting a
  push over ranks costs, not what TP gains on real hardware.
- ``example``: vLLM's ExampleConnector (prefill ``kv_producer``, decode ``kv_consumer``): the prefill
  writes every layer's KV to files (on tmpfs, /dev/shm, emptied after each request), the decode
  reads them. vLLM's pull flow, as upstream's toy proxy drives it: the prefill's request, then the
  decode's. It matches whole blocks of the prompt less its last token, so a 32-token prompt (one
  block) is recomputed by the decode (cached 0).
- ``nixl``: vLLM's NixlConnector (prefill ``kv_producer``, decode ``kv_consumer``,
  ``kv_buffer_device="cpu"``, NIXL's UCX backend with UCX's defaults but ``UCX_NET_DEVICES=lo``):
  the prefill's request, its ``kv_transfer_params`` handed to the decode, which pulls the blocks. NIXL comes from NIXL's
  ``nixl``/``nixl-cu12`` 1.5.1 wheels, installed with ``--no-deps`` into a private directory on first
  use and put on the servers' ``PYTHONPATH`` (the CUDA wheel's Python API and UCX backend run on a
  CPU host). If it does not import or run, the case says why instead of a number. On a CPU host its
  worker moves itself to the NUMA node's last core (reserved for KV transfer): the JSON line records
  that under ``repinned`` and the engines are pinned back to their own cores. Its agent's progress
  thread polls (vLLM creates the agent with ``enable_prog_thread`` on and no option to turn it off):
  an idle NIXL server takes ~0.7 of its core (``idle_core_share``), which its forward passes and
  decode steps lose (measured with NIXL's API alone: 0.5-0.7 of a core with the progress thread,
  0.0 without).

Per prompt length and case (one JSON line each): TTFT p50/p99 (client side: from the first request
sent to the first streamed token of the decode), total latency p50/p99 (to the last token) and TPOT
(per output token after the first), the prompt tokens the decode reports as cached
(``--enable-prompt-tokens-details``; the prompt length when it used the transferred KV), and whether
every output equals the single instance's token for token: a case whose outputs differ reports FAIL
and no number. Percentiles are numpy's linear interpolation over the repetitions (with n samples,
p99 is close to the maximum). Engines are warmed up first (a short request through the same path,
which also links the connectors); ``idle_core_share`` is the share of a core each server uses in the 2 s
after the warm-up request, with none in flight (vLLM's worker spins on its shared-memory queue, yielding the
core, for 1 s after its last step, and sleeps after that: so about 0.5 for a vLLM server),
``core_share_in_request`` the median share of its core each engine used while a request ran (a decode
waiting for KV steps without pause: vLLM's engine loop with a request in ``WAITING_FOR_REMOTE_KVS``).

The single instance stays up for the whole run, and one of its requests runs right before every P/D
request of the same prompt: "vs single" divides a case's p50 by the p50 of those interleaved single
requests (``single_ttft_p50_ms``), so both were measured seconds apart on this shared host, whose
load drifts over minutes. Its own rows pool all of its requests. Ratios between connectors divide
their p50s directly (cases run minutes apart: read them with their "vs single").

Hidden share (``VLLM-HIDDEN``, kvpush cases, on the same servers after the latency pass): six pairs of
requests of one prompt, back to back (each mode first in every other pair), both sent decode first (the
prefill's copy once the decode's block ids are out, so the pipelined one really pipelines). One is
``pipelined`` (KvpushConnector as it is: each layer pushed from ``save_kv_layer`` while the forward computes
the next), one ``serial``
(the timed connector's control file stops ``save_kv_layer`` from pushing, so the connector pushes
every layer from ``wait_for_save``, after the forward: the same bytes, no overlap). From the trace,
on one clock (``time.monotonic``, shared by every process of the host), per request:
    S = the prefill's forward start (metadata bound), F = its forward end (``wait_for_save``),
    L = the decode reporting the transfer landed (``finished_recving``, after the prefill's notice
        that every byte of every layer landed).
The serial request's ``L - F`` is the whole transfer (``transfer after the forward``); the pipelined
one's ``L - F`` is what was left of it after the forward. Per pair:
    hidden = 1 - (L - F)_pipelined / (L - F)_serial
the share of the KV transfer (its notice and the decode's report included) that ran behind the
prefill's compute; the median over pairs. The price is reported beside it: ``forward slowed`` =
(F - S)_pipelined / (F - S)_serial - 1 (the pushes share the prefill's core: with TCP the kernel copies
on the sender; this also carries the host's load noise, which on a shared host can exceed the
transfer), and ``net saved`` = (L - S)_serial - (L - S)_pipelined, which counts both (W-LAYER in
bench/run.py defines its "hidden" that way). vLLM's own connectors move KV after the prefill finished
(the decode pulls or reads after ``request_finished``): nothing of their transfer is hidden, by design.

Where the time to first token goes (kvpush cases, from the same traces and the client's clock, per request,
medians in ``phases_p50_ms`` and a table): ``to_prefill`` (the request sent -> the prefill's scheduler saw it),
``held`` (its hold for the decode's block ids), ``to_forward`` (-> the forward started), ``forward`` and
``to_first_token`` (-> the client had the first token: the prefill's when it came first, as ``kvpush proxy``
leads a greedy stream with it (``first_token_from_prefill`` counts those), else the decode's step for it and
the stream), and beside them ``tail`` (the forward's end -> the decode reported the KV landed); see
``phases_of``. Of those, the prefill's time in KvpushConnector's own hooks (every hook timed,
bench/vllm_timed_connector.py): before the forward, in it, and after it until its scheduler let the request go
(``kvpush_before_forward``, ``kvpush_in_forward``, ``kvpush_after_forward``; a table of their own).
The single instance runs bench/vllm_timed_connector.py's ``TracingConnector`` (it moves nothing: its scheduler
answers that nothing is cached outside), which stamps the same clock points, so its requests' time to first token
splits into ``to_scheduler``, ``to_forward``, ``forward`` and ``to_first_token`` (``single_phases_of``;
``single_phases_p50_ms`` in its records, and in each P/D record for the single requests interleaved with it).
A table puts each P/D phase that is neither compute nor bytes beside the single instance's: what P/D adds to what
vLLM itself costs per request.

Writes ``bench/results/vllm-<stamp>.jsonl`` (one JSON line per case), ``.md`` (the tables, with
ratios to the single instance and to every other connector of the same run) and ``.png``, and
prints the table. Every process it starts is ended (its process group), also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import http.client
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the servers get it on PYTHONPATH too

from kvrouter.core.first_token import event_of, lead_of  # noqa: E402 (pure: json only)

RESULTS = HERE / "results"
NIXL_WHEELS = ("nixl==1.5.1", "nixl-cu12==1.5.1")
NIXL_SITE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpush-bench" / "nixl-1.5.1"
SYSTEMS = ("single", "kvpush-tcp", "kvpush-cma", "kvpush-tp2", "example", "nixl", "single-plain")
RUN_ORDER = ("single", "single-plain", "nixl", "example", "kvpush-tcp", "kvpush-cma", "kvpush-tp2")
PD_SYSTEMS = SYSTEMS[1:-1]
SERVED = "bench"
BLOCK_SIZE = 32
# A 1 s keepalive timeout (kvpush's engine default) dropped a link here when the prefill's core was taken by other
# work for longer (its event-loop thread shares the core with the forward); the connector now defaults to 5 s,
# set here too so runs before and after that change compare.
KVPUSH_ENGINE_OPTIONS = {"kvpush.keepalive_timeout_ms": "5000"}


# -- pure: plans, statistics, records, tables (tests/unit/test_vllm_bench_records.py) -------------------

@dataclass(frozen=True)
class Plan:
    lengths: tuple[int, ...]
    reps: dict[int, int]
    max_tokens: int
    hidden_lengths: tuple[int, ...]
    hidden_pairs: int


def plan(quick: bool, lengths: Sequence[int] = (), reps: int | None = None) -> Plan:
    """The prompt lengths, repetitions and output tokens of a run; ``lengths``: these prompt lengths instead (3
    repetitions each when ``quick``, else the full plan's or 3), the hidden share measured at those of them the
    plan measures it at; ``reps``: this many repetitions of every length instead."""
    chosen = Plan((32, 512), {32: 3, 512: 3}, 8, (512,), 2) if quick else \
        Plan((32, 128, 512, 2048), {32: 8, 128: 8, 512: 5, 2048: 3}, 16, (512, 2048), 6)
    if lengths:
        chosen = Plan(tuple(lengths), {n: 3 if quick else chosen.reps.get(n, 3) for n in lengths}, chosen.max_tokens,
                      tuple(n for n in chosen.hidden_lengths if n in lengths), chosen.hidden_pairs)
    if reps is not None:
        chosen = Plan(chosen.lengths, dict.fromkeys(chosen.lengths, reps), chosen.max_tokens, chosen.hidden_lengths,
                      chosen.hidden_pairs)
    return chosen


def prompt(length: int, rep: int, vocab: int) -> list[int]:
    """Distinct random token ids per (length, repetition), the same in every case; ids 0-2 are the
    tokenizer's specials. Repetition -1 is the warm-up."""
    rng = random.Random(f"kvpush-bench-{length}-{rep}")
    return [rng.randrange(3, vocab) for _ in range(length)]


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's default (linear interpolation between closest ranks), without numpy."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


@dataclass
class Sample:
    """One measured request."""

    ttft_s: float
    total_s: float
    tokens: list[int]
    cached: int | None
    t_start: float = 0.0
    t_end: float = 0.0
    error: str | None = None
    led: bool = False  # the first token was the prefill's (it came before the decode's)


def latency_record(system: str, length: int, samples: Sequence[Sample], reference: Sequence[list[int]] | None,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One (case, prompt length) record. Outputs not equal to the reference, or a failed request:
    ``result: FAIL`` and no latency numbers."""
    record: dict[str, Any] = {"workload": f"VLLM-P{length}", "case": system, "prompt_tokens": length,
                              "n": len(samples), **(extra or {})}
    errors = [s.error for s in samples if s.error]
    mismatched = 0 if reference is None else sum(1 for s, ref in zip(samples, reference) if s.tokens != ref)
    if reference is not None:
        record["outputs_equal"] = f"{len(samples) - mismatched}/{len(samples)}"
    cached = [s.cached for s in samples if s.cached is not None]
    if cached:
        record["cached_tokens"] = min(cached)
    if errors or mismatched or not samples:
        record["result"] = "FAIL"
        if errors:
            record["error"] = errors[0][:400]
        elif mismatched:
            record["error"] = f"{mismatched} of {len(samples)} outputs differ from the single instance's"
        return record
    ttft = [s.ttft_s * 1e3 for s in samples]
    total = [s.total_s * 1e3 for s in samples]
    record.update(ttft_p50_ms=round(median(ttft), 1), ttft_p99_ms=round(percentile(ttft, 99), 1),
                  total_p50_ms=round(median(total), 1), total_p99_ms=round(percentile(total, 99), 1),
                  output_tokens=len(samples[0].tokens))
    if len(samples[0].tokens) > 1:  # time per output token after the first, the decode engine's own pace
        record["tpot_p50_ms"] = round(median([(s.total_s - s.ttft_s) * 1e3 / (len(s.tokens) - 1)
                                              for s in samples]), 1)
    return record


def not_run_record(system: str, reason: str) -> dict[str, Any]:
    return {"workload": "VLLM", "case": system, "result": f"not run: {reason}"}


@dataclass(frozen=True)
class Timing:
    """One P/D request on the shared clock: S forward start, F forward end (prefill), L landed (decode)."""

    start: float
    forward_end: float
    landed: float
    pipelined_pushes: int
    after_forward_pushes: int
    deferred_pushes: int = 0  # pipelined pushes the connector sent after the forward (it copies them to this host)


def timing_of(trace_prefill: Sequence[dict[str, Any]], trace_decode: Sequence[dict[str, Any]],
              window: tuple[float, float]) -> Timing | None:
    """The request that ran in ``window`` (requests run one at a time): its prefill steps and the
    decode's first landed report in the window; None if either is missing."""
    begin, end = window
    steps = [e for e in trace_prefill if e.get("ev") == "step" and begin <= e["t_bind"] <= end]
    landed = [e["t"] for e in trace_decode if e.get("ev") == "landed" and begin <= e["t"] <= end]
    if not steps or not landed:
        return None
    return Timing(min(e["t_bind"] for e in steps), max(e["t_forward_end"] for e in steps), min(landed),
                  sum(e.get("pushes_pipelined", 0) for e in steps if e.get("mode") == "pipelined"),
                  sum(e.get("pushes_after_forward", 0) for e in steps), sum(e.get("pushes_deferred", 0) for e in steps))


PHASES = ("to_prefill", "held", "to_forward", "forward", "to_first_token", "tail")
# the decode's side: its request to its scheduler, its block ids out, and their way to the prefill's scheduler (a
# held request) or how far into the prefill's forward they left (an unheld one; negative: before it)
HOLD_PHASES = ("decode_to_scheduler", "decode_ids_out", "ids_to_prefill", "ids_after_forward_start")
# the prefill's time in KvpushConnector's own hooks, before its forward, in it and after it (``hook_phases``)
HOOK_PHASES = ("kvpush_before_forward", "kvpush_in_forward", "kvpush_after_forward")


def phases_of(trace_prefill: Sequence[dict[str, Any]], trace_decode: Sequence[dict[str, Any]],
              sample: Sample) -> dict[str, float] | None:
    """Where one P/D request's time to first token went (ms, on the shared clock; requests run one at a
    time), or None when its trace is incomplete:
    ``to_prefill``  the request sent -> the prefill's scheduler first saw it (HTTP, vLLM's front end);
    ``held``        the prefill's hold for the decode's block ids (the decode's request and first step);
    ``to_forward``  the hold released -> the forward pass started (the scheduler hands the step out);
    ``forward``     the prefill's forward pass (S -> F);
    ``to_first_token`` the forward's end -> the client had the first token: the prefill's (its sampling and
                    stream, when it came first, as ``kvpush proxy`` leads with it), else the decode's (the tail
                    of the push, the landed report, the decode's step for the token, its stream);
    these five follow one another and sum to the TTFT. Beside them, ``tail``: the forward's end -> the decode
    reported the KV landed (what was left of the push, its notice, the decode's next hook call)."""
    begin, end = sample.t_start, sample.t_end
    first = begin + sample.ttft_s
    steps = [e for e in trace_prefill if e.get("ev") == "step" and begin <= e["t_bind"] <= end]
    held = [e for e in trace_prefill if e.get("ev") == "held" and begin <= e["t"] <= end]
    landed = [e["t"] for e in trace_decode if e.get("ev") == "landed" and begin <= e["t"] <= end]
    if not steps or not landed or sample.error:
        return None
    start = min(e["t_bind"] for e in steps)
    forward_end = max(e["t_forward_end"] for e in steps)
    seen_prefill = [e["t"] for e in trace_prefill if e.get("ev") == "seen" and begin <= e["t"] <= end]
    released = held[0]["t"] if held else min(seen_prefill, default=start)
    seen = released - held[0]["held_ms"] / 1e3 if held else released
    marks = (begin, seen, released, start, forward_end, first)
    phases = {name: round((b - a) * 1e3, 2) for name, a, b in zip(PHASES, marks, marks[1:])}
    phases["tail"] = round((min(landed) - forward_end) * 1e3, 2)
    # the hold, from the decode's side: its request reached its scheduler, its block ids went out
    seen_decode = [e["t"] for e in trace_decode if e.get("ev") == "seen" and begin <= e["t"] <= end]
    ids_out = [e["t"] for e in trace_decode if e.get("ev") == "ids" and begin <= e["t"] <= end]
    phases.update(hook_phases(trace_prefill, begin, end))
    if seen_decode and ids_out:
        phases["decode_to_scheduler"] = round((min(seen_decode) - begin) * 1e3, 2)
        phases["decode_ids_out"] = round((min(ids_out) - min(seen_decode)) * 1e3, 2)
        # the ids' way to the prefill's scheduler (held) or, unheld, how far into its forward they left
        phases["ids_to_prefill" if held else "ids_after_forward_start"] = round(
            ((released if held else min(ids_out)) - (min(ids_out) if held else start)) * 1e3, 2)
    return phases


SINGLE_PHASES = ("to_scheduler", "to_forward", "forward", "to_first_token")
# P/D's phases that are neither compute nor bytes, beside the single instance's that match them
OWN_PHASES = (("to_prefill", "held"), ("to_forward",), ("to_first_token",))


def single_phases_of(trace: Sequence[dict[str, Any]], sample: Sample) -> dict[str, float] | None:
    """Where one single-instance request's time to first token went (ms; bench/vllm_timed_connector.py's
    ``TracingConnector`` writes the trace), or None when its trace is incomplete. The same clock points as a
    prefill's (``phases_of``): ``to_scheduler`` (the request sent -> its scheduler first saw it: HTTP, vLLM's front
    end), ``to_forward`` (-> the forward started), ``forward`` (its prompt's forward pass), ``to_first_token``
    (the forward's end -> the client had the first token: sampling, the step's output, the stream). They follow one
    another and sum to the TTFT."""
    begin, end = sample.t_start, sample.t_end
    seen = [e["t"] for e in trace if e.get("ev") == "seen" and begin <= e["t"] <= end]
    steps = [e for e in trace if e.get("ev") == "step" and begin <= e["t_bind"] <= end and "t_forward_end" in e]
    if not seen or not steps or sample.error:
        return None
    marks = (begin, min(seen), min(e["t_bind"] for e in steps), max(e["t_forward_end"] for e in steps),
             begin + sample.ttft_s)
    return {name: round((b - a) * 1e3, 2) for name, a, b in zip(SINGLE_PHASES, marks, marks[1:])}


def single_phases_p50(phases: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """The median of each of the single instance's phases over its requests with a complete trace."""
    complete = [p for p in phases if p is not None]
    return {name: round(median([p[name] for p in complete]), 1) for name in SINGLE_PHASES} if complete else {}


def own_phases(phases: dict[str, float], single: dict[str, float]) -> list[tuple[float, float]]:
    """(P/D, single) per phase of ``OWN_PHASES``: to the scheduler (P/D: to the prefill's, and its hold), to the
    forward, to the first token; then their sums. Both from requests of the same prompt, seconds apart."""
    pairs = [(sum(phases[name] for name in names), single[SINGLE_PHASES[0] if i == 0 else names[0]])
             for i, names in enumerate(OWN_PHASES)]
    return [*pairs, (sum(p for p, _ in pairs), sum(s for _, s in pairs))]


def hook_phases(trace_prefill: Sequence[dict[str, Any]], begin: float, end: float) -> dict[str, float]:
    """The prefill's time in KvpushConnector's own hooks for the request sent at ``begin`` (answered by ``end``),
    from the clocks of its scheduler and its worker (bench/vllm_timed_connector.py); {} when the trace lacks them:
    ``kvpush_before_forward``  the scheduler's, from its first look at the request to the step that sends it built;
    ``kvpush_in_forward``      the worker's, from the step's bind to the forward's end (a push per layer);
    ``kvpush_after_forward``   the scheduler's, from that step built to the request let go, and the worker's, from
                               the forward's end to the step's last hook (its ``wait_for_save`` and reports)."""
    def within(name: str) -> list[dict[str, Any]]:
        return [e for e in trace_prefill if e.get("ev") == name and begin <= e["t"] <= end and "hooks_ms" in e]

    seen, built, finished, reported = within("seen"), within("built"), within("finished"), within("reported")
    mine = sorted((e for e in trace_prefill if e.get("ev") == "step" and "hooks_ms_bind" in e
                   and begin <= e["t_bind"] <= end), key=lambda e: e["t_bind"])
    last = [e for e in reported if mine and e["t"] >= mine[-1]["t_forward_end"]]
    if not (seen and built and finished and last):
        return {}
    worker_after = min(last, key=lambda e: e["t"])["hooks_ms"] - mine[-1]["hooks_ms"]
    return {"kvpush_before_forward": round(built[0]["hooks_ms"] - seen[0]["hooks_ms"], 3),
            "kvpush_in_forward": round(sum(e["hooks_ms"] - e["hooks_ms_bind"] for e in mine), 3),
            "kvpush_after_forward": round(finished[-1]["hooks_ms"] - built[0]["hooks_ms"] + worker_after, 3)}


def phases_p50(phases: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """The median of each phase over the requests whose trace was complete."""
    complete = [p for p in phases if p is not None]
    names = [*PHASES, *(name for name in HOLD_PHASES if all(name in p for p in complete))]
    p50 = {name: round(median([p[name] for p in complete]), 1) for name in names} if complete else {}
    hooked = [p for p in complete if HOOK_PHASES[0] in p]
    if hooked and len(hooked) == len(complete):
        p50.update({name: round(median([p[name] for p in hooked]), 2) for name in HOOK_PHASES})
    return p50


def hidden_record(system: str, length: int, pairs: Sequence[tuple[Timing | None, Timing | None]],
                  ttft_pairs: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """The hidden share of the transfer (see the module docstring) from (pipelined, serial) pairs."""
    record: dict[str, Any] = {"workload": "VLLM-HIDDEN", "case": system, "prompt_tokens": length,
                              "pairs": len(pairs)}
    good = [(p, s) for p, s in pairs if p is not None and s is not None and s.landed > s.forward_end]
    if not good:
        record["result"] = "FAIL"
        record["error"] = "no pair with a complete trace (forward start and end on the prefill, landed on the decode)"
        return record
    hidden, saved, inflation = [], [], []
    for p, s in good:
        transfer = s.landed - s.forward_end
        hidden.append(1 - (p.landed - p.forward_end) / transfer)
        saved.append((s.landed - s.start) - (p.landed - p.start))
        inflation.append((p.forward_end - p.start) / (s.forward_end - s.start) - 1)

    record.update(
        hidden=round(min(1.0, max(0.0, median(hidden))), 3),
        transfer_serial_ms=round(median([(s.landed - s.forward_end) * 1e3 for _, s in good]), 2),
        exposed_pipelined_ms=round(median([(p.landed - p.forward_end) * 1e3 for p, _ in good]), 2),
        compute_inflation=round(median(inflation), 3), net_saved_ms=round(median(saved) * 1e3, 1),
        forward_serial_ms=round(median([(s.forward_end - s.start) * 1e3 for _, s in good]), 1),
        forward_pipelined_ms=round(median([(p.forward_end - p.start) * 1e3 for p, _ in good]), 1),
        pipelined_requests=f"{sum(1 for p, _ in good if p.pipelined_pushes and not p.after_forward_pushes)}"
                           f"/{len(good)}",
        deferred_requests=f"{sum(1 for p, _ in good if p.deferred_pushes)}/{len(good)}")
    if ttft_pairs:
        record["ttft_saved_ms"] = round(median([(s - p) * 1e3 for p, s in ttft_pairs]), 1)
    return record


def _ratio(mine: dict[str, Any] | None, other: dict[str, Any] | None, key: str) -> str:
    if mine is None or other is None or mine is other or not mine.get(key) or not other.get(key):
        return ""
    return f"{mine[key] / other[key]:.2f}"


def tables(records: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown: latency per (prompt length, case) with ratios of TTFT p50 (and total p50 against the
    single instance) to every other case of the same length; then the hidden share; then what did not
    run. A ratio below 1 is faster than the column's case."""
    latency = [r for r in records if r["workload"].startswith("VLLM-P")]
    others = [s for s in SYSTEMS if any(r["case"] == s for r in latency)]
    versus = [o for o in others if o != "single"]
    lines = ["| prompt | case | TTFT p50 / p99 ms | total p50 / p99 ms | TPOT ms | cached | equal | pushed in forward "
             "| TTFT vs single | total vs single | " + " | ".join(f"TTFT vs {o}" for o in versus) + " |",
             "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(versus)]
    by_length: dict[int, dict[str, dict[str, Any]]] = {}
    for record in latency:
        by_length.setdefault(record["prompt_tokens"], {})[record["case"]] = record
    for length in sorted(by_length):
        cases = by_length[length]
        for name in others:
            record = cases.get(name)
            if record is None:
                continue
            if "result" in record:
                result = f"{record['result']}: {record.get('error', '')}"
                cells = [result, "", "", str(record.get("cached_tokens", "")), record.get("outputs_equal", "")]
            else:
                cells = [f"{record['ttft_p50_ms']:.1f} / {record['ttft_p99_ms']:.1f}",
                         f"{record['total_p50_ms']:.1f} / {record['total_p99_ms']:.1f}",
                         str(record.get("tpot_p50_ms", "")), str(record.get("cached_tokens", "")),
                         record.get("outputs_equal", "ref")]
            cells.append(record.get("pushed_during_forward", ""))
            if "single_ttft_p50_ms" in record:  # the single instance's requests interleaved with this case's
                single: dict[str, Any] | None = {"ttft_p50_ms": record["single_ttft_p50_ms"],
                                                 "total_p50_ms": record.get("single_total_p50_ms")}
            else:
                single = cases.get("single")
            cells += [_ratio(record, single, "ttft_p50_ms"), _ratio(record, single, "total_p50_ms")]
            cells += [_ratio(record, cases.get(o), "ttft_p50_ms") for o in versus]
            lines.append(f"| {length} | {name} | " + " | ".join(cells) + " |")
    hidden = [r for r in records if r["workload"] == "VLLM-HIDDEN"]
    if hidden:
        lines += ["", "| prompt | case | hidden | transfer after the forward, serial ms | left after the forward, "
                  "pipelined ms | forward slowed | net saved ms | TTFT saved ms | pushed during forward "
                  "| of them, sent after it (copied here) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(hidden, key=lambda r: (r["prompt_tokens"], r["case"])):
            if "result" in r:
                lines.append(f"| {r['prompt_tokens']} | {r['case']} | {r['result']}: {r.get('error', '')} "
                             "| | | | | | | |")
                continue
            lines.append(f"| {r['prompt_tokens']} | {r['case']} | {r['hidden'] * 100:.0f}% | {r['transfer_serial_ms']} "
                         f"| {r['exposed_pipelined_ms']} | {r['compute_inflation'] * 100:+.0f}% | {r['net_saved_ms']} "
                         f"| {r.get('ttft_saved_ms', '')} | {r['pipelined_requests']} "
                         f"| {r.get('deferred_requests', '')} |")
    phased = [r for r in records if r.get("phases_p50_ms")]
    if phased:  # where a P/D request's time to first token went (``phases_of``), beside the single instance's
        lines += ["", "| prompt | case | " + " | ".join(name.replace("_", " ") for name in PHASES)
                  + " | TTFT p50 ms | single TTFT p50 ms |", "|---|---|" + "---|" * (len(PHASES) + 2)]
        for r in sorted(phased, key=lambda r: (r["prompt_tokens"], r["case"])):
            cells = [str(r["phases_p50_ms"].get(name, "")) for name in PHASES]
            lines.append(f"| {r['prompt_tokens']} | {r['case']} | " + " | ".join(cells)
                         + f" | {r.get('ttft_p50_ms', '')} | {r.get('single_ttft_p50_ms', '')} |")
        sided = [r for r in phased if "decode_to_scheduler" in r["phases_p50_ms"]]
        if sided:  # the decode's side, and what is neither compute nor bytes
            lines += ["", "| prompt | case | decode: to its scheduler | decode: its block ids out | ids: to the "
                      "prefill's scheduler (held) | ids: after the prefill's forward began (unheld) | neither compute "
                      "nor bytes (to prefill + held + to forward + to first token) | the single instance's (the same "
                      "phases traced; untraced: its TTFT - the prefill's forward) |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in sorted(sided, key=lambda r: (r["prompt_tokens"], r["case"])):
                p = r["phases_p50_ms"]
                overhead = p["to_prefill"] + p["held"] + p["to_forward"] + p["to_first_token"]
                single = r.get("single_ttft_p50_ms")
                own = f"{single - p['forward']:.1f}" if single else ""
                if r.get("single_phases_p50_ms"):  # traced: the same phases of the interleaved requests
                    own = f"{own_phases(p, r['single_phases_p50_ms'])[-1][1]:.1f}"
                lines.append(f"| {r['prompt_tokens']} | {r['case']} | "
                             + " | ".join(str(p.get(n, "")) for n in HOLD_PHASES) + f" | {overhead:.1f} | {own} |")
    beside = [r for r in phased if r.get("single_phases_p50_ms")]
    if beside:  # each phase that is neither compute nor bytes, P/D's beside the single instance's
        lines += ["", "| prompt | case | to the scheduler: P/D (to prefill + held) / single | to forward: P/D / single "
                  "| to first token: P/D / single | neither compute nor bytes: P/D / single | P/D adds ms "
                  "| forward: P/D / single |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(beside, key=lambda r: (r["prompt_tokens"], r["case"])):
            pairs = own_phases(r["phases_p50_ms"], r["single_phases_p50_ms"])
            lines.append(f"| {r['prompt_tokens']} | {r['case']} | " + " | ".join(f"{p:.1f} / {q:.1f}" for p, q in pairs)
                         + f" | {pairs[-1][0] - pairs[-1][1]:+.1f} | {r['phases_p50_ms']['forward']:.1f} / "
                           f"{r['single_phases_p50_ms']['forward']:.1f} |")
    hooked = [r for r in phased if "kvpush_before_forward" in r["phases_p50_ms"]]
    if hooked:  # of the prefill's phases, its time in KvpushConnector's own hooks
        lines += ["", "| prompt | case | to prefill + held + to forward ms | of it, kvpush's hooks | forward ms "
                  "| of it, kvpush's hooks | to first token ms | of it, kvpush's hooks (to the request's end) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sorted(hooked, key=lambda r: (r["prompt_tokens"], r["case"])):
            p = r["phases_p50_ms"]
            before = p["to_prefill"] + p["held"] + p["to_forward"]
            lines.append(f"| {r['prompt_tokens']} | {r['case']} | {before:.1f} | {p['kvpush_before_forward']} "
                         f"| {p['forward']} | {p['kvpush_in_forward']} | {p['to_first_token']} "
                         f"| {p['kvpush_after_forward']} |")
    moved = [r for r in records if r.get("bytes_moved_per_request") is not None and "result" not in r]
    if moved:  # what each request moved, beside what the same model would move were every layer full attention
        lines += ["", "| prompt | case | bytes moved per request | every layer full attention would move "
                  "| moved / that |", "|---|---|---|---|---|"]
        for r in sorted(moved, key=lambda r: (r["prompt_tokens"], r["case"])):
            full = r.get("full_attention_bytes_per_request") or 0
            lines.append(f"| {r['prompt_tokens']} | {r['case']} | {r['bytes_moved_per_request'] / 2**20:.2f} MiB "
                         f"| {full / 2**20:.2f} MiB | {r['bytes_moved_per_request'] / full:.2f}x |" if full else
                         f"| {r['prompt_tokens']} | {r['case']} | {r['bytes_moved_per_request'] / 2**20:.2f} MiB | | |")
    skipped = [r for r in records if r["workload"] == "VLLM"]
    if skipped:
        lines += [""] + [f"- **{r['case']}**: {r['result']}" for r in skipped]
    return lines


# -- processes --------------------------------------------------------------------------------------------

_STARTED: list[subprocess.Popen[bytes]] = []


def _end(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """End a process we started and everything it started (its own process group), by id."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # children left behind by a parent that exited
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    if process in _STARTED:
        _STARTED.remove(process)


def _end_all() -> None:
    for process in list(_STARTED):
        _end(process, grace=10)


atexit.register(_end_all)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def allowed_cpus(pid: int) -> set[int]:
    """The CPUs any thread of ``pid`` or of its descendants may run on (to see the pinning held)."""
    cpus: set[int] = set()
    pids = [pid]
    while pids:
        current = pids.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/status") as status:
                    for line in status:
                        if line.startswith("Cpus_allowed_list:"):
                            cpus |= _cpu_list(line.split(":", 1)[1].strip())
                with contextlib.suppress(OSError), open(f"/proc/{current}/task/{task}/children") as children:
                    pids += [int(child) for child in children.read().split()]
    return cpus


def pin_tree(pid: int, core: int) -> None:
    """Pin every thread of ``pid`` and its descendants to ``core`` again (vLLM's NixlConnector moves its
    worker to the last core of the NUMA node, reserved for KV transfer on a many-core host)."""
    pids = [pid]
    while pids:
        current = pids.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task), {core})
                with contextlib.suppress(OSError), open(f"/proc/{current}/task/{task}/children") as children:
                    pids += [int(child) for child in children.read().split()]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) used so far by every thread of ``pid`` and its descendants."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, pids = 0.0, [pid]
    while pids:
        current = pids.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{current}/task/{task}/stat") as stat:
                        fields = stat.read().rsplit(")", 1)[1].split()
                    total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
                with contextlib.suppress(OSError), open(f"/proc/{current}/task/{task}/children") as children:
                    pids += [int(child) for child in children.read().split()]
    return total


def idle_load(servers: Sequence[Server], seconds: float = 2.0) -> dict[str, float]:
    """The share of a core each server's processes use while no request is in flight."""
    before = {s.name: cpu_seconds(s.process.pid) for s in servers}
    time.sleep(seconds)
    return {s.name: round((cpu_seconds(s.process.pid) - before[s.name]) / seconds, 2) for s in servers}


def _cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        if "-" in part:
            low, high = part.split("-")
            cpus |= set(range(int(low), int(high) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


@dataclass
class Server:
    name: str
    core: int
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    trace: Path | None = None
    tp: int = 1  # tensor-parallel ranks: rank r computes on core r (core is then the engine core's)

    @property
    def cores(self) -> set[int]:
        return {self.core} if self.tp == 1 else set(range(self.tp))

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Settings:
    python: str
    model: Path
    work: Path
    max_model_len: int = 4096
    kv_cache_gib: int = 2
    nixl_install: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    prefix_caching: bool = False  # vLLM's prefix cache (and the stats that count what it saves)
    serve_args: tuple[str, ...] = ()  # every server's, before a case's own (``--family``'s: ``FAMILY_ARGS``)
    full_attention_bytes_per_token: int = 0  # the model's KV per token were every layer full attention
    block_size: int = 32
    kv_extra: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config for kvpush's cases

    def full_attention_bytes(self, tokens: int) -> int:
        """What a request of ``tokens`` prompt tokens would move were every layer full attention (whole blocks)."""
        return -(-tokens // self.block_size) * self.block_size * self.full_attention_bytes_per_token


FAMILY_NAMES = {"llama": "Llama", "mla": "DeepSeek-V2-shaped (MLA)",
                "gemma3": "Gemma-3-shaped (20 sliding-window layers of 512 tokens, 4 full)",
                "granite_hybrid": "Granite-4-shaped (20 Mamba2 layers, 4 attention)"}
#: each family's ``vllm serve`` arguments: vLLM's CPU MLA kernels; a hybrid without prefix caching (vLLM 0.32's CPU
#: build fails a plain Mamba2 server's prompts in prefix caching's "align" mode, tests/vllm/test_vllm_families.py)
FAMILY_ARGS = {"mla": ("--attention-backend", "CPU_MLA"), "granite_hybrid": ("--no-enable-prefix-caching",)}


def _mha_equivalent(model: dict[str, Any]) -> str:
    """Beside an MLA model's bytes per token, what the same model's full multi-head KV would be."""
    if model.get("family") != "mla":
        return ""
    mha = int(model.get("mha_kv_bytes_per_token", 0))
    return f" (its full multi-head KV would be {mha // 1024} KiB: {model.get('kv_bytes_per_token', 0) / mha:.2f}x)"


def bytes_pushed(trace: Sequence[dict[str, Any]]) -> int:
    """What a prefill's pushes were asked to move so far, from its trace (bench/vllm_timed_connector.py's
    cumulative ``bytes`` lines: the connector's ``producer.bytes_pushed``)."""
    return max((int(e["total"]) for e in trace if e.get("ev") == "bytes"), default=0)


def start_server(settings: Settings, name: str, core: int, kv_config: dict[str, Any] | None,
                 env_extra: dict[str, str] | None = None, trace: bool = False, tp: int = 1,
                 args: Sequence[str] = ()) -> Server:
    """``vllm serve`` pinned to ``core`` (or cores 0..tp-1); ``args`` come last (a later flag wins)."""
    port = free_port()
    log = settings.work / f"{name}.log"
    trace_path = settings.work / f"{name}.trace.jsonl" if trace else None
    cores = ",".join(str(c) for c in range(tp)) if tp > 1 else str(core)
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE=str(settings.kv_cache_gib),
               VLLM_CPU_OMP_THREADS_BIND=cores.replace(",", "|"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env.update(settings.extra_env)
    env.update(env_extra or {})
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if trace_path is not None:
        trace_path.unlink(missing_ok=True)
        env["KVPUSH_BENCH_TRACE"] = str(trace_path)
    command = ["taskset", "-c", cores, settings.python, "-m", "vllm.entrypoints.openai.api_server",
               "--host", "127.0.0.1", "--port", str(port), "--model", str(settings.model), "--served-model-name",
               SERVED, "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
               "--max-model-len", str(settings.max_model_len), "--max-num-batched-tokens", "2048",
               "--max-num-seqs", "4", "--seed", "0", "--enable-prompt-tokens-details",
               "--distributed-executor-backend", "uni" if tp == 1 else "mp", "--tensor-parallel-size", str(tp)]
    command += ["--enable-prefix-caching"] if settings.prefix_caching else ["--no-enable-prefix-caching",
                                                                          "--disable-log-stats"]
    if kv_config is not None:
        command += ["--kv-transfer-config", json.dumps(kv_config)]
    command += [*settings.serve_args, *args]
    with open(log, "wb") as out:
        # a process group of its own (ended as one), not a session: a session is a scheduler autogroup, and a
        # vLLM worker in one of its own left another process on its core 0.8% of the CPU on this host
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0)
    _STARTED.append(process)
    return Server(name, core, port, process, log, trace_path, tp)


def wait_healthy(servers: Sequence[Server], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.process.returncode}: {server.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{server.url}/health", timeout=2) as response:
                    if response.status == 200:
                        pending.remove(server)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].name} not healthy in {timeout_s:.0f} s: {pending[0].log_tail()}")
        if pending:
            time.sleep(0.5)


# -- requests ---------------------------------------------------------------------------------------------

def _body(ids: list[int], max_tokens: int, stream: bool, params: dict[str, Any] | None) -> bytes:
    body: dict[str, Any] = {"model": SERVED, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return json.dumps(body).encode()


def post(server: Server, ids: list[int], max_tokens: int, params: dict[str, Any] | None,
         timeout_s: float = 600) -> dict[str, Any]:
    """A non-streamed completion (the prefill's copy of a request)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s)
    try:
        connection.request("POST", "/v1/completions", _body(ids, max_tokens, False, params),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status}: {data[:300]!r}")
        result: dict[str, Any] = json.loads(data)
        return result
    finally:
        connection.close()


def accept(server: Server, ids: list[int], params: dict[str, Any], timeout_s: float = 600) -> http.client.HTTPResponse:
    """The prefill's copy of a request as ``kvpush proxy`` sends it (one token, streamed): returns once the
    prefill accepted it (the head of its answer came; the decode's copy went at the same time); ``drain``
    reads the rest."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s)
    connection.request("POST", "/v1/completions", _body(ids, 1, True, params), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        text = response.read()[:300]
        connection.close()
        raise RuntimeError(f"{server.name}: HTTP {response.status}: {text!r}")
    return response


def drain(response: http.client.HTTPResponse) -> tuple[float | None, list[int]]:
    """Read an accepted prefill's stream to its end: when its token came (time.monotonic) and its id."""
    when: float | None = None
    ids: list[int] = []
    try:
        for line in response:
            if when is None and (lead := lead_of(event_of(line), True)) is not None:  # the proxy's rule
                when, ids = time.monotonic(), [lead.token_id]
    finally:
        response.close()
    return when, ids


def stream(server: Server, ids: list[int], max_tokens: int, params: dict[str, Any] | None, started: float,
           timeout_s: float = 600) -> Sample:
    """A streamed completion; TTFT and total are measured from ``started`` (time.monotonic)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s)
    tokens: list[int] = []
    first: float | None = None
    cached: int | None = None
    try:
        connection.request("POST", "/v1/completions", _body(ids, max_tokens, True, params),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            for choice in chunk.get("choices") or ():
                new = choice.get("token_ids") or []
                if (new or choice.get("text")) and first is None:
                    first = time.monotonic()
                tokens += new
            usage = chunk.get("usage")
            if usage:
                cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    finally:
        connection.close()
    done = time.monotonic()
    if first is None:
        raise RuntimeError(f"{server.name}: the stream ended without a token")
    return Sample(first - started, done - started, tokens, cached)


class Route:
    """How one request of a case reaches its engines. ``decode_first`` (kvpush only): the prefill's copy
    is sent once the decode's block ids are out (its trace shows them) and ``ids_margin_s`` later, so the
    ids are at the prefill before its forward starts; otherwise both copies go at once."""

    def __init__(self, system: str, servers: list[Server], ids_margin_s: float = 0.03, kv_port: int = 0) -> None:
        self.system = system
        self.servers = servers
        self.kv_port = kv_port  # where the prefill's kvpush engine listens (on this host)
        self.decode_first = False
        self.ids_margin_s = ids_margin_s

    def __call__(self, ids: list[int], max_tokens: int) -> Sample:
        started = time.monotonic()
        try:
            sample = self._run(ids, max_tokens, started)
        except Exception as error:  # noqa: BLE001 - one failed request fails its case, not the run
            sample = Sample(0.0, 0.0, [], None, error=f"{type(error).__name__}: {error}")
        sample.t_start, sample.t_end = started, time.monotonic()
        return sample

    def _run(self, ids: list[int], max_tokens: int, started: float) -> Sample:
        if self.system.startswith("single"):
            return stream(self.servers[0], ids, max_tokens, None, started)
        prefill, decode = self.servers
        if self.system.startswith("kvpush"):  # as kvpush proxy sends them: both copies at once
            tid = uuid.uuid4().hex
            to_prefill = {"do_remote_decode": True, "transfer_id": tid}
            to_decode = {"do_remote_prefill": True, "transfer_id": tid, "remote_host": "127.0.0.1",
                         "remote_port": self.kv_port}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                if not self.decode_first:
                    prefilled = pool.submit(lambda: drain(accept(prefill, ids, to_prefill)))
                    sample = stream(decode, ids, max_tokens, to_decode, started)
                    lead_at, lead = prefilled.result()
                    # the proxy's lead (kvrouter.core.first_token): a greedy stream's first token is the
                    # prefill's when that comes first; the decode's copy of it must be the same token
                    if lead_at is not None and lead_at < started + sample.ttft_s:
                        if sample.tokens[:1] != lead:
                            raise RuntimeError(f"the decode's first token {sample.tokens[:1]} is not the "
                                               f"prefill's {lead}")
                        sample.ttft_s, sample.led = lead_at - started, True
                    return sample
                seen = _count_ids(decode.trace)
                decoded = pool.submit(stream, decode, ids, max_tokens, to_decode, started)
                deadline = time.monotonic() + 30
                while _count_ids(decode.trace) == seen and time.monotonic() < deadline and not decoded.done():
                    time.sleep(0.002)
                time.sleep(self.ids_margin_s)
                post(prefill, ids, 1, to_prefill)
                return decoded.result()
        if self.system == "example":  # the prefill writes the files; then the decode finds them
            post(prefill, ids, 1, None)
            return stream(decode, ids, max_tokens, None, started)
        answer = post(prefill, ids, 1, {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                         "remote_block_ids": None, "remote_host": None, "remote_port": None})
        params = answer.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"the nixl prefill returned no kv_transfer_params: {json.dumps(answer)[:300]}")
        # vLLM 0.32 makes the decode report the prefill's own cache hits when this key is present; without
        # it the decode reports its cached tokens, i.e. whether it used the pulled KV (as for the others)
        params.pop("remote_prefill_cached_tokens", None)
        return stream(decode, ids, max_tokens, params, started)


def _count_ids(trace: Path | None) -> int:
    """How many times the decode's worker has handed out block ids (``ids`` lines of its trace)."""
    if trace is None:
        return 0
    try:
        return trace.read_bytes().count(b'"ev": "ids"')
    except OSError:
        return 0


# -- the cases ----------------------------------------------------------------------------------------------

def nixl_site(python: str, install: bool) -> tuple[Path | None, str | None]:
    """A directory with NIXL's Python API for the servers' PYTHONPATH, or the reason there is none."""
    probe = ("from nixl._api import nixl_agent, nixl_agent_config; "
             "nixl_agent('probe', nixl_agent_config(backends=['UCX']))")

    def works(site: Path | None) -> str | None:
        env = dict(os.environ)
        if site is not None:
            env["PYTHONPATH"] = str(site)
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
        return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]

    if works(None) is None:
        return None, None  # importable as installed
    if not (NIXL_SITE / "nixl").exists():
        if not install:
            return None, f"NIXL is not importable and --no-nixl-install was given; pip install --no-deps {NIXL_WHEELS}"
        done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(NIXL_SITE),
                               *NIXL_WHEELS], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return None, f"pip install --no-deps {' '.join(NIXL_WHEELS)} failed: {done.stderr.strip()[-300:]}"
    problem = works(NIXL_SITE)
    if problem is not None:
        return None, f"NIXL ({' '.join(NIXL_WHEELS)}) does not run here: {problem}"
    return NIXL_SITE, None


def kv_extra(text: str) -> dict[str, Any]:
    """``--kv-extra``'s JSON object (argparse's type: anything else is a usage error naming it)."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is expected")
    return value


def kv_configs(system: str, kv_port: int, storage: Path, kv_extra: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill, decode) KVTransferConfig of a P/D case; ``kv_extra``: more of kvpush's settings (``--kv-extra``)."""
    if system.startswith("kvpush"):
        transport = {"kvpush-tp2": "auto"}.get(system, system.split("-", 1)[1])
        def kvpush(role: str) -> dict[str, Any]:
            return {"kv_connector": "TimedKvpushConnector", "kv_connector_module_path": "bench.vllm_timed_connector",
                    "kv_role": role, "kv_port": kv_port,
                    "kv_connector_extra_config": {"transport": transport, "transfer_timeout_s": 120,
                                                  "ids_timeout_s": 120, "engine_options": KVPUSH_ENGINE_OPTIONS,
                                                  **(kv_extra or {})}}
        return kvpush("kv_producer"), kvpush("kv_consumer")
    if system == "example":
        def example(role: str) -> dict[str, Any]:
            return {"kv_connector": "ExampleConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        return example("kv_producer"), example("kv_consumer")
    def nixl(role: str) -> dict[str, Any]:
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return nixl("kv_producer"), nixl("kv_consumer")


class Bar:
    """One progress line per case on stderr."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.started = label, total, time.monotonic()
        self.draw(0)

    def draw(self, done: int) -> None:
        width = 24
        filled = int(width * done / max(self.total, 1))
        sys.stderr.write(f"\r  {self.label:<28} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                         f"{time.monotonic() - self.started:6.1f}s")
        sys.stderr.flush()

    def close(self, text: str) -> None:
        sys.stderr.write(f"  {text}\n")
        sys.stderr.flush()


def read_trace(path: Path | None) -> list[dict[str, Any]]:
    if path is None or not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events


@dataclass
class Baseline:
    """The single instance, up for the whole run: one of its requests runs right before every P/D
    request of the same prompt, so each case's "vs single" compares requests seconds apart (the host
    is shared and its load drifts over minutes). Its first output per prompt is the reference."""

    route: Route
    reference: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    samples: dict[int, list[Sample]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    drifted: list[str] = field(default_factory=list)

    def measure(self, length: int, rep: int, ids: list[int], max_tokens: int) -> Sample:
        sample = self.route(ids, max_tokens)
        self.samples.setdefault(length, []).append(sample)
        first = self.reference.setdefault((length, rep), sample.tokens)
        if not sample.error and sample.tokens != first:
            self.drifted.append(f"prompt {length}/{rep}: the single instance's greedy output changed between runs")
        return sample

    def phases(self, samples: Sequence[Sample]) -> dict[str, float]:
        """The p50 of ``samples``' phases (``single_phases_of``), from the instance's trace."""
        trace = read_trace(self.route.servers[0].trace)
        return single_phases_p50([single_phases_of(trace, s) for s in samples])

    def records(self) -> list[dict[str, Any]]:
        records = []
        for length in sorted(self.samples):
            extra = dict(self.extra)
            phases = self.phases(self.samples[length])
            if phases:
                extra["single_phases_p50_ms"] = phases
            record = latency_record("single", length, self.samples[length], None, extra)
            drift = [d for d in self.drifted if d.startswith(f"prompt {length}/")]
            if drift and "result" not in record:
                record = {k: v for k, v in record.items() if not k.endswith("_ms")} | {"result": "FAIL",
                                                                                      "error": drift[0]}
            records.append(record)
        return records


# the single instance's connector: it moves nothing and writes the trace of its phases (``single_phases_of``)
TRACING = {"kv_connector": "TracingConnector", "kv_connector_module_path": "bench.vllm_timed_connector",
           "kv_role": "kv_both"}


def start_baseline(settings: Settings, vocab: int, startup_s: float) -> tuple[Server, Baseline]:
    server = start_server(settings, "single", 1, TRACING, trace=True)
    began = time.monotonic()
    wait_healthy([server], startup_s)
    baseline = Baseline(Route("single", [server]))
    baseline.extra["startup_s"] = round(time.monotonic() - began, 1)
    warm = baseline.route(prompt(64, -1, vocab), 2)
    if warm.error:
        raise RuntimeError(f"the single instance's warm-up failed: {warm.error}")
    baseline.extra["idle_core_share"] = idle_load([server])
    return server, baseline


def run_case(system: str, settings: Settings, bench: Plan, vocab: int, baseline: Baseline,
             emit: Callable[[dict[str, Any]], None], startup_s: float) -> None:
    """Start the case's servers, warm up, measure every prompt length (each request after the single
    instance's of the same prompt) and the hidden share for kvpush, end the servers. Records go to
    ``emit``."""
    storage = Path(tempfile.mkdtemp(prefix="kvpush-bench-example-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                    else None))
    servers: list[Server] = []
    extra: dict[str, Any] = {}
    try:
        env: dict[str, str] = {}
        if system == "nixl":
            site, problem = nixl_site(settings.python, settings.nixl_install)
            if problem is not None:
                emit(not_run_record(system, problem))
                return
            if site is not None:
                env["PYTHONPATH"] = os.pathsep.join((str(ROOT), str(site)))
        control = settings.work / f"{system}.control"
        control.write_text("pipelined")
        prefill_kv, decode_kv = kv_configs(system, free_port(), storage, settings.kv_extra)
        traced = system.startswith("kvpush")
        engines = (("prefill", 1, prefill_kv), ("decode", 0, decode_kv)) if system in PD_SYSTEMS else ()
        if system == "single-plain":  # the reference's twin without a connector, on its core
            servers.append(start_server(settings, system, 1, None))
        for name, core, kv in engines:
            own = dict(env, KVPUSH_BENCH_CONTROL=str(control))
            if system == "nixl":
                own |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                        "UCX_NET_DEVICES": "lo"}  # loopback only; same-host peers use UCX's shared memory
            tp = 2 if system == "kvpush-tp2" and name == "prefill" else 1  # ranks on cores 0 and 1
            servers.append(start_server(settings, f"{system}-{name}", core, kv, own, trace=traced, tp=tp))
        began = time.monotonic()
        try:
            wait_healthy(servers, startup_s)
        except RuntimeError as error:
            emit(not_run_record(system, f"servers did not start: {str(error)[-600:]}"))
            return
        extra["startup_s"] = round(time.monotonic() - began, 1)
        route = Route(system, servers, kv_port=int(prefill_kv.get("kv_port", 0)))
        warm = route(prompt(64, -1, vocab), 2)
        if warm.error:
            emit(not_run_record(system, f"the warm-up request failed: {warm.error}; "
                                        f"{servers[-1].log_tail(600)}"))
            return
        cpus = {s.name: allowed_cpus(s.process.pid) for s in servers}
        moved = {s.name: sorted(cpus[s.name]) for s in servers if cpus[s.name] != s.cores}
        if moved:  # every engine computes on its own core in every case
            extra["repinned"] = moved
            for server in servers:
                if server.tp == 1:
                    pin_tree(server.process.pid, server.core)
        extra["cpus"] = {s.name: sorted(allowed_cpus(s.process.pid)) for s in servers}
        extra["idle_core_share"] = idle_load(servers)
        for length in bench.lengths:
            reps = bench.reps[length]
            bar = Bar(f"{system} {length} tokens", reps)
            samples, paired = [], []
            busy: dict[str, list[float]] = {s.name: [] for s in servers}
            pushed_before = bytes_pushed(read_trace(servers[0].trace)) if system.startswith("kvpush") else None
            for rep in range(reps):
                ids = prompt(length, rep, vocab)
                paired.append(baseline.measure(length, rep, ids, bench.max_tokens))
                before = {s.name: cpu_seconds(s.process.pid) for s in servers}
                sample = route(ids, bench.max_tokens)
                samples.append(sample)
                for server in servers:  # how much of its core each engine used while the request ran
                    used = cpu_seconds(server.process.pid) - before[server.name]
                    busy[server.name].append(used / max(sample.t_end - sample.t_start, 1e-3))
                bar.draw(rep + 1)
                if system == "example":
                    _empty(storage)
            measured = dict(extra)
            if pushed_before is not None:  # what the prefill's pushes moved per request (every layer, every block)
                time.sleep(0.2)  # its last trace lines are written (line-buffered) by now
                moved = bytes_pushed(read_trace(servers[0].trace)) - pushed_before
                measured["bytes_moved_per_request"] = round(moved / reps)
                measured["full_attention_bytes_per_request"] = settings.full_attention_bytes(length)
            measured["core_share_in_request"] = {name: round(median(shares), 2) for name, shares in busy.items()}
            good = [s for s in paired if not s.error]
            if good:
                measured["single_ttft_p50_ms"] = round(median([s.ttft_s * 1e3 for s in good]), 1)
                measured["single_total_p50_ms"] = round(median([s.total_s * 1e3 for s in good]), 1)
                single_phases = baseline.phases(good)
                if single_phases:  # the same requests' phases (bench/vllm_timed_connector.py's TracingConnector)
                    measured["single_phases_p50_ms"] = single_phases
            if system.startswith("kvpush"):
                time.sleep(0.2)  # the last trace lines are written (line-buffered) by now
                prefill_trace, decode_trace = read_trace(servers[0].trace), read_trace(servers[1].trace)
                timings = [timing_of(prefill_trace, decode_trace, (s.t_start, s.t_end)) for s in samples]
                measured["pushed_during_forward"] = f"{sum(1 for t in timings if t and t.pipelined_pushes)}/{reps}"
                measured["first_token_from_prefill"] = f"{sum(1 for s in samples if s.led)}/{reps}"
                phases = phases_p50([phases_of(prefill_trace, decode_trace, s) for s in samples])
                if phases:  # where the time to first token went (see phases_of)
                    measured["phases_p50_ms"] = phases
                held = [e for e in prefill_trace if e.get("ev") == "held"
                        and any(s.t_start <= e["t"] <= s.t_end for s in samples)]
                if held:  # the prefill's hold for the decode's block ids (KvpushConnector's ids_wait_ms)
                    measured["held_p50_ms"] = round(median([e["held_ms"] for e in held]), 2)
                    measured["held_max_ms"] = round(max(e["held_ms"] for e in held), 2)
                    measured["held_until_ids"] = f"{sum(1 for e in held if e['ids_in'])}/{len(held)}"
            refs = [baseline.reference.get((length, rep), []) for rep in range(reps)]
            record = latency_record(system, length, samples, refs, measured)
            bar.close(record.get("result") or f"TTFT p50 {record['ttft_p50_ms']} ms (single "
                                              f"{record.get('single_ttft_p50_ms')}), total p50 "
                                              f"{record['total_p50_ms']} ms, cached {record.get('cached_tokens')}")
            emit(record)
        if system.startswith("kvpush"):
            route.decode_first = True  # every pair's pipelined request really pipelines (see Route)
            for length in bench.hidden_lengths:
                emit(measure_hidden(system, route, servers, control, length, bench.hidden_pairs, vocab,
                                    baseline.reference))
    finally:
        for server in servers:
            _end(server.process)
        shutil.rmtree(storage, ignore_errors=True)


def measure_hidden(system: str, route: Route, servers: Sequence[Server], control: Path, length: int, pairs: int,
                   vocab: int, reference: dict[tuple[int, int], list[int]]) -> dict[str, Any]:
    """Pipelined and serial requests of the same prompt, back to back (see the module docstring)."""
    bar = Bar(f"{system} hidden {length}", 2 * pairs)
    windows: list[tuple[Sample, Sample]] = []
    for rep in range(pairs):
        ids = prompt(length, rep, vocab)
        pair_samples: dict[str, Sample] = {}
        # each mode first in every other pair: what the first of two back-to-back requests pays (or gains)
        # is not charged to one mode
        for index, mode in enumerate(("pipelined", "serial") if rep % 2 == 0 else ("serial", "pipelined")):
            control.write_text(mode)
            pair_samples[mode] = route(ids, 1)
            bar.draw(2 * rep + index + 1)
        windows.append((pair_samples["pipelined"], pair_samples["serial"]))
    control.write_text("pipelined")
    time.sleep(0.2)  # the last trace lines are written (line-buffered) by now
    prefill_trace, decode_trace = read_trace(servers[0].trace), read_trace(servers[1].trace)
    timings = [(timing_of(prefill_trace, decode_trace, (p.t_start, p.t_end)),
                timing_of(prefill_trace, decode_trace, (s.t_start, s.t_end))) for p, s in windows]
    ttfts = [(p.ttft_s, s.ttft_s) for p, s in windows if not p.error and not s.error]
    record = hidden_record(system, length, timings, ttfts)
    bad = [s.error for pair in windows for s in pair if s.error]
    wrong = [rep for rep, (p, s) in enumerate(windows)
             if not p.tokens == s.tokens == reference.get((length, rep), p.tokens)[:1]]
    if bad or wrong:
        record = {k: v for k, v in record.items() if k not in ("hidden", "behind")}
        record |= {"result": "FAIL", "error": (bad[0] if bad else "a first token differs")[:300]}
    bar.close(record.get("result") or f"{record['hidden'] * 100:.0f}% hidden: {record['exposed_pipelined_ms']} ms "
                                      f"of {record['transfer_serial_ms']} ms left after the forward")
    return record


def _empty(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


# -- output -------------------------------------------------------------------------------------------------

def chart(records: Sequence[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("matplotlib not installed (pip install matplotlib): no chart\n")
        return False
    latency = [r for r in records if r["workload"].startswith("VLLM-P") and "ttft_p50_ms" in r]
    hidden = [r for r in records if r["workload"] == "VLLM-HIDDEN" and "hidden" in r]
    if not latency:
        return False
    lengths = sorted({r["prompt_tokens"] for r in latency})
    systems = [s for s in SYSTEMS if any(r["case"] == s for r in latency)]
    figure, grid = plt.subplots(2, 2, figsize=(16, 10))
    axes = [grid[0][0], grid[0][1], grid[1][0], grid[1][1]]
    width = 0.8 / max(len(systems), 1)
    ticks = [i + width * (len(systems) - 1) / 2 for i in range(len(lengths))]

    def value(system: str, length: int, key: str) -> float:
        return float(next((r.get(key) or 0.0 for r in latency if r["case"] == system and r["prompt_tokens"] == length),
                          0.0))

    for panel, key, title in ((axes[0], "ttft", "TTFT"), (axes[1], "total", "Total request latency")):
        for index, system in enumerate(systems):
            x = [i + index * width for i in range(len(lengths))]
            panel.bar(x, [value(system, n, f"{key}_p50_ms") for n in lengths], width, label=system)
            panel.scatter(x, [value(system, n, f"{key}_p99_ms") for n in lengths], marker="_", color="black", s=80,
                          zorder=3, label="p99" if index == 0 else None)
        panel.set_xticks(ticks, [str(n) for n in lengths])
        panel.set_xlabel("prompt tokens")
        panel.set_yscale("log")
        panel.set_ylabel("ms (bar: p50, tick: p99; log)")
        panel.set_title(f"{title}: single instance vs P/D")
        panel.legend(fontsize=8)
    pd_systems = [s for s in systems if s != "single"]
    for index, system in enumerate(pd_systems):
        ratios = []
        for n in lengths:
            mine, single = value(system, n, "ttft_p50_ms"), value(system, n, "single_ttft_p50_ms")
            ratios.append(mine / single if mine and single else 0.0)
        axes[2].bar([i + index * 0.8 / max(len(pd_systems), 1) for i in range(len(lengths))], ratios,
                    0.8 / max(len(pd_systems), 1), label=system, color=f"C{systems.index(system)}")
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    axes[2].set_xticks([i + 0.4 - 0.4 / max(len(pd_systems), 1) for i in range(len(lengths))],
                       [str(n) for n in lengths])
    axes[2].set_xlabel("prompt tokens")
    axes[2].set_ylabel("TTFT p50 / interleaved single-instance TTFT p50")
    axes[2].set_title("TTFT relative to the single instance (requests seconds apart)")
    axes[2].legend(fontsize=8)
    names = [f"{r['case'].removeprefix('kvpush-')} {r['prompt_tokens']}" for r in hidden]
    axes[3].bar(range(len(hidden)), [r["hidden"] * 100 for r in hidden], 0.6)
    axes[3].set_xticks(range(len(hidden)), names)
    axes[3].set_ylim(0, 100)
    axes[3].set_ylabel("% of the KV transfer hidden behind prefill compute")
    axes[3].set_title("kvpush layer pipelining: 1 - (left after the forward) / (serial transfer)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def header_lines(stamp: str, machine: dict[str, Any], elapsed: float | None) -> list[str]:
    model = machine.get("model") or {}
    family = (machine.get("model") or {}).get("family", "llama")
    command = "python bench/vllm_bench.py" + (" --quick" if machine.get("quick") else "") + (
        f" --family {family}" if family != "llama" else "") + (
        f" --lengths {','.join(map(str, machine['lengths']))}" if machine.get("lengths_asked") else "")
    took = f"{elapsed:.0f} s" if elapsed is not None else "time not recorded"
    load = machine.get("loadavg_start")
    busy = f"; load average {load[0]:.1f} at the start (a shared host)" if load else ""
    return [f"# vLLM serving benchmark {stamp}", "",
            f"`{command}` on {machine.get('cpus')} cores, {machine.get('platform')}, Python {machine.get('python')}; "
            f"{took}{busy}. "
            "Loopback only; one `vllm serve` per engine, each pinned to its core (single instance and prefill: "
            "core 1, decode: core 0); prefix caching off; one request at a time; greedy, `ignore_eos`. "
            f"Model: {model.get('bytes', 0) / 1e6:.0f} MB float32 "
            f"{FAMILY_NAMES.get(str(model.get('family')), 'Llama')}, 24 layers (bench/vllm_model.py), "
            + (f"{model.get('kv_bytes_per_token', 0) // 1024} KiB of KV per token moved{_mha_equivalent(model)}"
               if model.get("family") in ("llama", "mla", None) else
               f"the bytes moved per request measured (the table's \"bytes moved\") beside the "
               f"{model.get('kv_bytes_per_token', 0) // 1024} KiB per token every layer attending fully would move")
            + f"; {machine.get('max_tokens')} output "
            "tokens per request; requests per prompt length and case: "
            + ", ".join(f"{k}: {v}" for k, v in (machine.get("reps") or {}).items()) + ".",
            "",
            "\"vs single\" divides a case's p50 by the p50 of the single-instance requests interleaved with it "
            "(the same prompts, seconds apart); \"vs X\" divides it by case X's p50 (same prompt length, same run, "
            "minutes apart). Below 1 is faster. FAIL: an output differed from the single instance's (no number). "
            "Definitions: bench/vllm_bench.py's docstring.", ""]


def render(jsonl: Path) -> int:
    """The table and chart of an earlier run, from its JSON lines."""
    lines = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    machine = next((r for r in lines if r.get("case") == "machine"), {})
    records = [r for r in lines if r.get("case") not in ("machine", "run")]
    elapsed = next((r.get("elapsed_s") for r in lines if r.get("case") == "run"), None)
    markdown = jsonl.with_suffix(".md")
    if elapsed is None and markdown.exists():  # a run from before the "run" line: its table's header says it
        found = re.search(r"; (\d+) s\.", markdown.read_text())
        elapsed = float(found.group(1)) if found else None
    table = tables(records)
    header = header_lines(jsonl.stem, machine, elapsed)
    markdown.write_text("\n".join(header + table) + "\n")
    chart(records, jsonl.with_suffix(".png"))
    print("\n".join(table))
    return 0


def vocab_of(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="prompts of 32 and 512 tokens, 3 repetitions")
    parser.add_argument("--lengths", default="", help="comma-separated prompt lengths instead of the plan's (with "
                                                      "--quick: 3 repetitions each), e.g. 512,2048")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions of every prompt length instead of the plan's (e.g. 24 for medians of 20+)")
    parser.add_argument("--cases", default=",".join(SYSTEMS),
                        help=f"comma-separated, from {','.join(SYSTEMS)} (single always runs: it is the reference)")
    parser.add_argument("--python", default=sys.executable, help="the Python with vLLM (default: this one)")
    parser.add_argument("--model", default=None, help="model directory (default: built by bench/vllm_model.py)")
    parser.add_argument("--family", choices=tuple(FAMILY_NAMES), default="llama",
                        help="the model: llama (MHA); mla (DeepSeek-V2's latent, vLLM's CPU_MLA; vLLM then uses "
                             "16-token blocks and no chunked prefill); gemma3 (sliding windows); granite_hybrid "
                             "(Mamba2 layers)")
    parser.add_argument("--out", default=str(RESULTS), help=f"results directory (default {RESULTS})")
    parser.add_argument("--startup-timeout", type=float, default=420, help="seconds for servers to become healthy")
    parser.add_argument("--render", default=None, metavar="JSONL",
                        help="only write the table and chart of an earlier run's .jsonl (beside it)")
    parser.add_argument("--no-nixl-install", action="store_true",
                        help=f"do not pip-install {' '.join(NIXL_WHEELS)} (--no-deps) into {NIXL_SITE}")
    parser.add_argument("--kv-extra", type=kv_extra, default={}, metavar="JSON",
                        help="more of KvpushConnector's kv_connector_extra_config for the kvpush cases, e.g. "
                             "'{\"loop_yields\": true}'")
    args = parser.parse_args(argv)
    if args.render:
        return render(Path(args.render))
    asked = [s for s in args.cases.split(",") if s]
    unknown = [s for s in asked if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(SYSTEMS)}")
    wanted = [s for s in RUN_ORDER if s == "single" or s in asked]
    check = subprocess.run([args.python, "-c", "import vllm, kvpush"], capture_output=True, text=True)
    if check.returncode != 0:
        sys.stderr.write(f"{args.python} cannot import vllm and kvpush (run this with vLLM's CPU build, e.g. "
                         f"/work/vllm-venv/bin/python, or pass --python): {check.stderr.strip()[-300:]}\n")
        return 2
    if args.reps is not None and args.reps < 1:
        parser.error("--reps: at least 1")
    bench = plan(args.quick, [int(n) for n in args.lengths.split(",") if n], args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = "vllm-" + time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
    started = time.monotonic()
    sys.stderr.write("model: building or reusing (bench/vllm_model.py)\n")
    built = subprocess.run(["taskset", "-c", "1", args.python, str(HERE / "vllm_model.py"), "--family", args.family,
                            *([args.model] if args.model else [])], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        sys.stderr.write(f"model build failed: {built.stderr[-1000:]}\n")
        return 2
    model_info = json.loads(built.stdout.strip().splitlines()[-1])
    model = Path(model_info["model"])
    work = Path(tempfile.mkdtemp(prefix="kvpush-vllm-bench-"))
    settings = Settings(args.python, model, work, nixl_install=not args.no_nixl_install,
                        serve_args=FAMILY_ARGS.get(args.family, ()),
                        full_attention_bytes_per_token=int(model_info["mha_kv_bytes_per_token"]), block_size=BLOCK_SIZE,
                        kv_extra=args.kv_extra)
    records: list[dict[str, Any]] = []
    machine = {"workload": "-", "case": "machine", "cpus": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version(), "quick": args.quick, "model": model_info,
               "lengths": list(bench.lengths), "lengths_asked": bool(args.lengths),
               "reps": {str(k): v for k, v in bench.reps.items()},
               "max_tokens": bench.max_tokens, "logs": str(work), "loadavg_start": os.getloadavg(),
               "kv_extra": args.kv_extra}
    jsonl = out / f"{stamp}.jsonl"

    def interrupted(signum: int, frame: Any) -> None:
        _end_all()
        sys.exit(130)

    signal.signal(signal.SIGTERM, interrupted)
    with open(jsonl, "w") as sink:
        sink.write(json.dumps(machine) + "\n")

        def emit(record: dict[str, Any]) -> None:
            records.append(record)
            print(json.dumps(record), flush=True)
            sink.write(json.dumps(record) + "\n")
            sink.flush()

        try:
            single = None
            try:
                single, baseline = start_baseline(settings, vocab_of(model), args.startup_timeout)
            except RuntimeError as error:
                emit(not_run_record("single", str(error)[-600:]))
                baseline = None
            for system in wanted:
                if system == "single" or baseline is None:
                    continue
                try:
                    run_case(system, settings, bench, vocab_of(model), baseline, emit, args.startup_timeout)
                except Exception as error:  # one broken case must not hide the others
                    emit(not_run_record(system, f"{type(error).__name__}: {str(error)[-600:]}"))
            if baseline is not None:
                if not baseline.samples:  # only the single instance was asked for
                    for length in bench.lengths:
                        for rep in range(bench.reps[length]):
                            baseline.measure(length, rep, prompt(length, rep, vocab_of(model)), bench.max_tokens)
                for record in baseline.records():
                    emit(record)
            if single is not None:
                _end(single.process)
        finally:
            _end_all()
            sink.write(json.dumps({"workload": "-", "case": "run", "elapsed_s": round(time.monotonic() - started),
                                   "loadavg_end": os.getloadavg()}) + "\n")
    table = tables(records)
    elapsed = time.monotonic() - started
    header = header_lines(stamp, machine, elapsed)
    (out / f"{stamp}.md").write_text("\n".join(header + table) + "\n")
    drew = chart(records, out / f"{stamp}.png")
    print("\n".join(table))
    print(f"\nresults: {out / stamp}.{{jsonl,md{',png' if drew else ''}}} ({elapsed:.0f} s); logs in {work}")
    failed = any(r.get("result") == "FAIL" for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
