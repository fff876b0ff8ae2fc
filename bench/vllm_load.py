#!/usr/bin/env python3
"""P/D under load: Poisson arrivals of mixed prompts on the same two cores used three ways, with real
``vllm serve`` processes (vLLM's CPU build) and the model of bench/vllm_model.py.

    python bench/vllm_load.py            # 5 rates, 40 requests each, every setup
    python bench/vllm_load.py --quick    # 2 rates, 12 requests each

Setups (each engine pinned to its own core; the client and the proxy float):
- ``rr``: two independent instances (cores 0 and 1, no connector) behind a round-robin proxy
  (bench/load_proxy.py rr): each request is computed whole by one instance.
- ``router``: two instances with KvpushConnector as ``kv_both`` (each may prefill for the other or serve a
  request, request by request) publishing their KV events, behind ``kvpush proxy --both``: placement by what
  each holds and how busy it is (kvrouter).
- ``static``: a prefill (core 1) and a decode (core 0) with KvpushConnector behind ``kvpush proxy --static``:
  every request through the prefill, as the proxy placed them before it knew what instances cache.
- ``vllm-router``, ``vllm-router-kv``: the ``router`` setup's instances behind vLLM's own router
  (``vllm-router`` from PyPI, bench/peers/setup.sh) with its ``cache_aware`` and ``kv_aware`` policies
  (the latter reading the same KV events), data parallel: it does not disaggregate.
- ``vllm-router-pd``: the ``static`` setup's prefill and decode behind ``vllm-router --vllm-pd-disaggregation``
  (its prefill-first flow: the prefill's answer, then the decode with its ``kv_transfer_params``).
- ``nixl``: the same pair with vLLM's NixlConnector (``kv_buffer_device`` cpu, NIXL 1.5.1's UCX backend
  on loopback, installed as bench/vllm_bench.py does) behind vLLM's P/D flow (bench/load_proxy.py
  nixl: the prefill's answer, then the decode, which pulls the KV).

Every engine runs with prefix caching and its stats on (what the multi-turn workload counts).

Workload: ``--requests`` prompts, lengths drawn from 32/128/512/2048 tokens with weights 40/30/20/10 %
(seeded; distinct random token ids; the same prompts in the same order for every rate and setup, each rate
starting with every engine's prefix cache emptied), 16
output tokens each (greedy, ``ignore_eos``), streamed. Arrival times: one seeded sequence of unit-rate
exponential gaps, divided by the rate, so every rate and setup sees the same order of prompts.

Calibration (first): one instance alone (core 1) computes every prompt one at a time. Its outputs are the
reference every output of every setup is compared with (a setup and rate whose outputs differ report
FAIL and no number); its latencies are the unloaded ones the targets are stated in; its mean end-to-end
time S sets the rates: ``--load`` fractions of 2/S, the requests per second two cores serve one request
at a time each (batching serves more: the top rates are past what one-at-a-time would carry).

Per setup and rate (one JSON line): offered rate; throughput (completed requests and output tokens per
second, over the span from the first request sent to the last answer's end); TTFT, ITL (every gap
between streamed tokens, pooled) and end-to-end p50/p99; goodput: requests per second that met both
targets, which are
    TTFT <= 2 x the unloaded TTFT of the same prompt length + 250 ms
    TPOT (the request's mean time per output token after the first) <= 2 x the unloaded TPOT (median)
and the share of requests that met them. For P/D: how many requests the decode served from transferred
KV (its reported cached prompt tokens > 0) and, for kvpush, the proxy's routes (``pd`` / ``decode-only``).
A request that fails or does not end within ``--request-timeout`` counts as a miss.

Then what the two cores can give P/D at these rates, from the calibration alone (bench/load_capacity.py: the
cores the long prompts need, the share of requests they interrupt under data parallelism, their queue on a core
of their own). Writes ``bench/results/load-<stamp>.jsonl`` and ``.md`` (the tables) and prints them. Every process it
starts is ended (its process group), also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench import multiturn  # noqa: E402
from bench.load_capacity import TPOT_FACTOR, TTFT_FACTOR, TTFT_SLACK_S  # noqa: E402
from bench.load_capacity import of_run as capacity_of_run  # noqa: E402
from bench.vllm_bench import (  # noqa: E402
    _STARTED,
    BLOCK_SIZE,
    RESULTS,
    ROOT,
    SERVED,
    Server,
    Settings,
    _end,
    _end_all,
    allowed_cpus,
    free_port,
    idle_load,
    kv_configs,
    kv_extra,
    median,
    nixl_site,
    percentile,
    pin_tree,
    prompt,
    start_server,
    vocab_of,
    wait_healthy,
)

SETUPS = ("rr", "router", "static", "vllm-router", "vllm-router-kv", "vllm-router-pd", "nixl")
WORKLOADS = ("mixed", "multiturn")
ROUTER_VENV = HERE / "peers" / "venv-router" / "bin" / "vllm-router"
MIX = ((32, 0.4), (128, 0.3), (512, 0.2), (2048, 0.1))
OUTPUT_TOKENS = 16
MAX_NUM_SEQS = 16


# -- pure: workload, targets, records, table (tests/unit/test_vllm_load.py) ---------------------------------

@dataclass(frozen=True)
class Job:
    index: int
    length: int
    ids: tuple[int, ...]
    offset_unit: float  # arrival time at rate 1/s; at rate r it arrives at offset_unit / r


def workload(requests: int, vocab: int, seed: int = 7) -> list[Job]:
    """The prompts and the unit-rate arrival offsets (the same for every rate and setup)."""
    rng = random.Random(f"kvpush-load-{seed}")
    lengths, weights = [n for n, _ in MIX], [w for _, w in MIX]
    jobs, at = [], 0.0
    for index in range(requests):
        length = rng.choices(lengths, weights)[0]
        jobs.append(Job(index, length, tuple(prompt(length, 1000 + index, vocab)), at))
        at += rng.expovariate(1.0)
    return jobs


@dataclass
class Outcome:
    """One request under load."""

    index: int
    length: int
    sent: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    cached: int | None = None
    route: str | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or len(self.tokens) < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (len(self.tokens) - 1)


@dataclass(frozen=True)
class Targets:
    ttft_s: dict[int, float]  # per prompt length
    tpot_s: float

    @classmethod
    def from_unloaded(cls, outcomes: Sequence[Outcome]) -> Targets:
        by_length: dict[int, list[float]] = {}
        for o in outcomes:
            if o.ttft_s is not None:
                by_length.setdefault(o.length, []).append(o.ttft_s)
        tpots = [o.tpot_s for o in outcomes if o.tpot_s is not None]
        if not tpots or not by_length:
            raise ValueError("no unloaded request completed")
        return cls({n: TTFT_FACTOR * median(v) + TTFT_SLACK_S for n, v in by_length.items()},
                   TPOT_FACTOR * median(tpots))

    def met(self, o: Outcome, reference: Sequence[int] | None) -> bool:
        return not self.missed(o, reference)

    def missed(self, o: Outcome, reference: Sequence[int] | None) -> str:
        """Why ``o`` missed its targets ("" when it met them): error, wrong, ttft, tpot or ttft+tpot."""
        if o.error or o.ttft_s is None:
            return "error"
        if o.tokens != list(reference or ()):
            return "wrong"
        tpot = o.tpot_s
        late = [name for name, over in (("ttft", o.ttft_s > self.ttft_s[o.length]),
                                        ("tpot", tpot is not None and tpot > self.tpot_s)) if over]
        return "+".join(late)


def _ms(values: Sequence[float], q: float) -> float | None:
    return round(percentile(values, q) * 1e3, 1) if values else None


def load_record(setup: str, fraction: float, rate: float, outcomes: Sequence[Outcome],
                references: dict[int, list[int]], targets: Targets, extra: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """One (setup, rate) record. Any output not equal to the reference: ``result: FAIL`` and no number."""
    record: dict[str, Any] = {"workload": "VLLM-LOAD", "case": setup, "load": fraction,
                              "offered_rps": round(rate, 3), "n": len(outcomes), **(extra or {})}
    failed = [o for o in outcomes if o.error]
    done = [o for o in outcomes if not o.error]
    wrong = [o for o in done if o.tokens != references.get(o.index)]
    record["ok"] = f"{len(done)}/{len(outcomes)}"
    record["outputs_equal"] = f"{len(done) - len(wrong)}/{len(done)}"
    if failed:
        record["errors"] = sorted({(o.error or "")[:160] for o in failed})[:3]
    routes = [o.route for o in done if o.route]
    if routes:
        record["routes"] = {r: routes.count(r) for r in sorted(set(routes))}
    if setup != "rr":
        record["kv_transferred"] = f"{sum(1 for o in done if (o.cached or 0) > 0)}/{len(done)}"
    if wrong or not done:
        record["result"] = "FAIL"
        record["error"] = (f"{len(wrong)} of {len(done)} outputs differ from the single instance's" if wrong
                           else "no request completed")
        return record
    span = max(o.sent + (o.e2e_s or 0.0) for o in done) - min(o.sent for o in outcomes)
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    e2e = [o.e2e_s for o in done if o.e2e_s is not None]
    gaps = [g for o in done for g in o.gaps_s]
    whys = [(o, targets.missed(o, references.get(o.index))) for o in outcomes]
    good = sum(1 for _, why in whys if not why)
    missed: dict[str, dict[str, int]] = {}  # why goodput was lost: the target each miss failed, by prompt length
    for o, why in whys:
        if why:
            by_length = missed.setdefault(why, {})
            by_length[str(o.length)] = by_length.get(str(o.length), 0) + 1
    record.update(
        throughput_rps=round(len(done) / span, 3), output_tok_s=round(sum(len(o.tokens) for o in done) / span, 1),
        ttft_p50_ms=_ms(ttft, 50), ttft_p99_ms=_ms(ttft, 99), itl_p50_ms=_ms(gaps, 50), itl_p99_ms=_ms(gaps, 99),
        e2e_p50_ms=_ms(e2e, 50), e2e_p99_ms=_ms(e2e, 99), goodput_rps=round(good / span, 3),
        met_targets=f"{good}/{len(outcomes)}", missed=missed)
    return record


def multiturn_record(setup: str, fraction: float, rate: float, outcomes: Sequence[multiturn.TurnOutcome],
                     references: dict[tuple[int, int, int], list[int]], unloaded: dict[tuple[int, int, int], float],
                     tpot_target_s: float, computed: float | None, floor: float,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One (setup, rate) record of the multi-turn workload. A request meets its targets when its answer is the
    single instance's, its TTFT at most 2x that same request's unloaded TTFT (the single instance, history
    cached) + 250 ms, and its TPOT at most 2x the unloaded median."""
    record: dict[str, Any] = {"workload": "VLLM-MULTITURN", "case": setup, "load": fraction,
                              "offered_conv_per_s": round(rate, 4), "n": len(outcomes), **(extra or {})}
    done = [o for o in outcomes if not o.error]
    wrong = [o for o in done if o.tokens != references.get(o.key)]
    record["ok"], record["outputs_equal"] = f"{len(done)}/{len(outcomes)}", f"{len(done) - len(wrong)}/{len(done)}"
    if failed := [o for o in outcomes if o.error]:
        record["errors"] = sorted({(o.error or "")[:160] for o in failed})[:3]
    routes = [o.route for o in done if o.route]
    if routes:
        record["routes"] = {r: routes.count(r) for r in sorted(set(routes))}
    if wrong or not done:
        record.update(result="FAIL", error=f"{len(wrong)} of {len(done)} answers differ from the single instance's"
                      if wrong else "no request completed")
        return record
    span = max(o.sent + (o.e2e_s or 0.0) for o in done) - min(o.sent for o in outcomes)
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    gaps = [g for o in done for g in o.gaps_s]

    def met(o: multiturn.TurnOutcome) -> bool:
        tpot = o.tpot_s
        return (not o.error and o.ttft_s is not None and o.tokens == references.get(o.key)
                and o.ttft_s <= TTFT_FACTOR * unloaded.get(o.key, 0.0) + TTFT_SLACK_S
                and (tpot is None or tpot <= tpot_target_s))
    good = sum(1 for o in outcomes if met(o))
    record.update(throughput_rps=round(len(done) / span, 3), ttft_p50_ms=_ms(ttft, 50), ttft_p90_ms=_ms(ttft, 90),
                  ttft_p99_ms=_ms(ttft, 99), itl_p99_ms=_ms(gaps, 99), goodput_rps=round(good / span, 3),
                  met_targets=f"{good}/{len(outcomes)}")
    if computed is not None:
        per_request = computed / len(outcomes)
        record.update(computed_per_request=round(per_request, 1), floor_per_request=round(floor, 1),
                      computed_vs_floor=round(per_request / floor, 3) if floor else None)
    return record


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def multiturn_table(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| setup | load | conv/s | req/s | TTFT p50 / p90 ms | ITL p99 ms | goodput req/s (met) | "
             "prompt tokens computed per request (x floor) | routes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("workload") != "VLLM-MULTITURN":
            continue
        head = f"| {r['case']} | {r['load']:g} | {r['offered_conv_per_s']:.3f} "
        if r.get("result"):
            lines.append(head + f"| {r['result']}: {r.get('error', '')} | | | | | |")
            continue
        computed = (f"{r['computed_per_request']:.0f} ({r['computed_vs_floor']:.2f}x)"
                    if r.get("computed_vs_floor") is not None else "-")
        routes = ", ".join(f"{k} {v}" for k, v in (r.get("routes") or {}).items()) or "-"
        lines.append(head + f"| {r['throughput_rps']:.2f} | {_n(r['ttft_p50_ms'])} / {_n(r['ttft_p90_ms'])} "
                     f"| {_n(r['itl_p99_ms'])} | {r['goodput_rps']:.2f} ({r['met_targets']}) | {computed} | {routes} |")
    return lines


def table(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| setup | load | offered req/s | req/s | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "E2E p50 / p99 ms | goodput req/s (met) | missed: target (prompt tokens x n) | KV used / routes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("workload") != "VLLM-LOAD":
            continue
        head = f"| {r['case']} | {r['load']:g} | {r['offered_rps']:.2f} "
        if r.get("result"):
            lines.append(head + f"| {r['result']}: {r.get('error', '')} | | | | | | | |")
            continue
        missed = "; ".join(f"{why} " + " ".join(f"{n}x{c}" for n, c in sorted(by.items(), key=lambda i: int(i[0])))
                           for why, by in sorted((r.get("missed") or {}).items())) or "-"
        used = r.get("kv_transferred", "-")
        if r.get("routes"):
            used += " " + ", ".join(f"{k} {v}" for k, v in r["routes"].items())
        lines.append(head + f"| {r['throughput_rps']:.2f} | {r['output_tok_s']:.0f} "
                     f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
                     f"| {r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} "
                     f"| {r['e2e_p50_ms']:.0f} / {r['e2e_p99_ms']:.0f} "
                     f"| {r['goodput_rps']:.2f} ({r['met_targets']}) | {missed} | {used} |")
    return lines


# -- the client ---------------------------------------------------------------------------------------------

async def send(session: Any, url: str, job: Job, start: float, delay: float, timeout_s: float) -> Outcome:
    """One streamed completion sent ``delay`` seconds after ``start`` (time.monotonic)."""
    await asyncio.sleep(max(0.0, start + delay - time.monotonic()))
    outcome = Outcome(job.index, job.length, time.monotonic())
    body = {"model": SERVED, "prompt": list(job.ids), "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times: list[float] = []
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/completions", json=body) as reply:
                outcome.route = reply.headers.get("X-Kvpush-Route")
                if reply.status != 200:
                    raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:200]}")
                times = await multiturn.read_stream(reply, outcome)
    except Exception as error:  # noqa: BLE001 - a failed request is a miss, not the end of the run
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    return multiturn.timed(outcome, times)


async def run_rate(url: str, jobs: Sequence[Job], rate: float | None, timeout_s: float) -> list[Outcome]:
    """Every job at its arrival time for ``rate`` (None: one at a time, each after the previous ended)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        if rate is None:
            return [await send(session, url, job, time.monotonic(), 0.0, timeout_s) for job in jobs]
        start = time.monotonic() + 0.2
        return list(await asyncio.gather(*(send(session, url, job, start, job.offset_unit / rate, timeout_s)
                                           for job in jobs)))


# -- the setups ---------------------------------------------------------------------------------------------

def start_helper(name: str, command: list[str], work: Path, env: dict[str, str] | None = None) -> tuple[str, Any]:
    """A proxy process on a free port; its URL from its ``serving http://...`` line."""
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, process_group=0,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    _STARTED.append(process)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"serving (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        if found:
            return found.group(1), process
        if process.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{name} did not start: {log.read_text(errors='replace')[-800:]}")


def kvpush_cli() -> list[str]:
    script = Path(sys.executable).parent / "kvpush"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvpush"]


def _kvpush(role: str, kv_port: int, kv_extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.integrations.vllm",
            "kv_role": role, "kv_port": kv_port, "kv_load_failure_policy": "recompute",
            **({"kv_connector_extra_config": kv_extra} if kv_extra else {})}


def _events(port: int) -> list[str]:
    """vLLM's flags for KV events on ``port`` (and the replay socket on ``port + 1``)."""
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 1}"})]


def _vllm_router(settings: Settings) -> str:
    binary = os.environ.get("VLLM_ROUTER") or (str(ROUTER_VENV) if ROUTER_VENV.exists() else "vllm-router")
    if not Path(binary).exists() and subprocess.run(["which", binary], capture_output=True).returncode != 0:
        raise RuntimeError("vllm-router is not installed: bash bench/peers/setup.sh (or pip install vllm-router)")
    return binary


def setup_kind(setup: str) -> tuple[str, list[str]]:
    """A setup's kind and ``kvpush proxy``'s extra flags: ``router:N`` is the ``router`` setup with
    ``--pd-min-tokens N``, so thresholds compare side by side in one run."""
    kind, _, threshold = setup.partition(":")
    if kind != "router" and threshold:
        raise ValueError(f"{setup}: only the router setup takes ':N' (its --pd-min-tokens)")
    if threshold and not threshold.isdigit():
        raise ValueError(f"{setup}: ':N' is a number of tokens")
    return kind, (["--pd-min-tokens", threshold] if threshold else [])


def start_setup(setup: str, settings: Settings, startup_s: float, router_args: Sequence[str] = ()
                ) -> tuple[str, list[Server], list[Any], dict[str, Any]]:
    """The setup's engines and proxy: (the proxy's URL, the engines, the processes to end, notes);
    ``router_args``: more flags for ``kvpush proxy`` in the ``router`` setup (``router:N`` adds its own)."""
    setup, variant = setup_kind(setup)
    router_args = [*router_args, *variant]
    servers: list[Server] = []
    processes: list[Any] = []
    notes: dict[str, Any] = {}
    extra_args = ["--max-num-seqs", str(MAX_NUM_SEQS)]
    try:
        if setup == "rr":
            servers = [start_server(settings, f"rr-{core}", core, None, args=extra_args) for core in (0, 1)]
            wait_healthy(servers, startup_s)
            url, proxy = start_helper("rr-proxy", [sys.executable, str(HERE / "load_proxy.py"), "rr",
                                                   *[a for s in servers for a in ("--upstream", f"http://{s.url}")]],
                                      settings.work)
            return url, servers, [*servers, proxy], notes
        if setup in ("router", "vllm-router", "vllm-router-kv"):
            kv, events = [free_port() for _ in (0, 1)], [free_port() for _ in (0, 1)]
            for core in (0, 1):
                servers.append(start_server(settings, f"{setup}-{core}", core,
                                            _kvpush("kv_both", kv[core], settings.kv_extra),
                                            args=[*extra_args, *_events(events[core])]))
            wait_healthy(servers, startup_s)
            urls = [f"http://{s.url}" for s in servers]
            if setup == "router":
                command = [*kvpush_cli(), "proxy", "-v", *router_args, "--host", "127.0.0.1", "--port", "0",
                           "--block-size", str(BLOCK_SIZE), *[a for core in (0, 1) for a in (
                               "--both", f"{urls[core]}#kv=127.0.0.1:{kv[core]}&events=tcp://127.0.0.1:{events[core]}"
                                         f"&replay=tcp://127.0.0.1:{events[core] + 1}")]]
                url, proxy = start_helper(setup, command, settings.work)
            else:
                url, proxy = _start_vllm_router(setup, settings, urls, [], [], events)
            return url, servers, [*servers, proxy], notes
        kv_port = free_port()
        env: dict[str, str] = {}
        if setup == "nixl":
            site, problem = nixl_site(settings.python, settings.nixl_install)
            if problem is not None:
                raise RuntimeError(problem)
            if site is not None:
                env["PYTHONPATH"] = os.pathsep.join((str(ROOT), str(site)))
            prefill_kv, decode_kv = kv_configs("nixl", kv_port, settings.work)
        else:
            prefill_kv, decode_kv = (_kvpush("kv_producer", kv_port, settings.kv_extra),
                                    _kvpush("kv_consumer", kv_port, settings.kv_extra))
        for name, core, kv_config in (("prefill", 1, prefill_kv), ("decode", 0, decode_kv)):
            own = dict(env)
            if setup == "nixl":
                own |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                        "UCX_NET_DEVICES": "lo"}
            servers.append(start_server(settings, f"{setup}-{name}", core, kv_config, own, args=extra_args))
        wait_healthy(servers, startup_s)
        prefill, decode = (f"http://{s.url}" for s in servers)
        if setup == "static":
            command = [*kvpush_cli(), "proxy", "--host", "127.0.0.1", "--port", "0", "--static",
                       "--prefill", f"{prefill}#kv=127.0.0.1:{kv_port}", "--decode", decode]
            url, proxy = start_helper(f"{setup}-proxy", command, settings.work)
        elif setup == "vllm-router-pd":
            url, proxy = _start_vllm_router(setup, settings, [], [prefill], [decode], [])
        else:
            command = [sys.executable, str(HERE / "load_proxy.py"), "nixl", "--prefill", prefill, "--decode", decode]
            url, proxy = start_helper(f"{setup}-proxy", command, settings.work)
        return url, servers, [*servers, proxy], notes
    except BaseException:
        for process in [*servers, *processes]:
            _end(process.process if isinstance(process, Server) else process)
        raise


def _start_vllm_router(setup: str, settings: Settings, workers: list[str], prefills: list[str], decodes: list[str],
                       events: list[int]) -> tuple[str, Any]:
    """vLLM's router on a free port; ready once its /health answers (it prints no address)."""
    port, metrics_port = free_port(), free_port()
    command = [_vllm_router(settings), "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
               str(metrics_port), "--worker-startup-check-interval", "1", "--request-timeout-secs", "600"]
    if prefills:
        command += ["--vllm-pd-disaggregation", *[a for p in prefills for a in ("--prefill", p)],
                    *[a for d in decodes for a in ("--decode", d)], "--policy", "cache_aware"]
    else:
        command += ["--worker-urls", *workers, "--policy", "kv_aware" if setup.endswith("-kv") else "cache_aware"]
        if setup.endswith("-kv"):
            command += ["--kv-event-model", SERVED, "--kv-event-block-size", str(BLOCK_SIZE),
                        *[a for w, e in zip(workers, events) for a in ("--kv-event-source", f"{w}=tcp://127.0.0.1:{e}")]]
    log = settings.work / f"{setup}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, process_group=0,
                                   env=dict(os.environ, RUST_LOG="warn"))
    _STARTED.append(process)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return url, process
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{setup} did not start: {log.read_text(errors='replace')[-800:]}")


def warm_up(url: str, servers: Sequence[Server], vocab: int, timeout_s: float) -> None:
    """Two requests per engine through the setup's path (links the connectors); engines pinned back."""
    jobs = [Job(-1 - i, n, tuple(prompt(n, -1 - i, vocab)), 0.0) for i, n in enumerate((64, 512, 64, 512))]
    outcomes = asyncio.run(run_rate(url, jobs, None, timeout_s))
    broken = [o.error for o in outcomes if o.error]
    if broken:
        raise RuntimeError(f"warm-up failed: {broken[0]}; {servers[-1].log_tail(600)}")
    for server in servers:  # NixlConnector moves its worker to the last core; every engine keeps its own
        if allowed_cpus(server.process.pid) != server.cores:
            pin_tree(server.process.pid, server.core)


def forget(servers: Sequence[Server], timeout_s: float = 60.0) -> None:
    """Every engine's prefix cache emptied (vLLM's ``/reset_prefix_cache``, served with VLLM_SERVER_DEV_MODE):
    each rate sends the same prompts, which the last rate left cached. A reset fails while blocks are held
    (requests still running, transfers in flight): retried until it succeeds or ``timeout_s`` passed."""
    for server in servers:
        deadline = time.monotonic() + timeout_s
        while True:
            request = urllib.request.Request(f"http://{server.url}/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=10) as answer:
                if json.loads(answer.read()).get("success"):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name}: its prefix cache could not be reset within {timeout_s:.0f} s")
            time.sleep(0.5)


# -- main ---------------------------------------------------------------------------------------------------

def computed(servers: Sequence[Server]) -> float:
    """Prompt tokens the servers computed themselves so far (vLLM's local_compute counter, summed)."""
    total = 0.0
    for server in servers:
        with urllib.request.urlopen(f"http://{server.url}/metrics", timeout=10) as answer:
            total += multiturn.computed_tokens(answer.read().decode("utf-8", "replace"))
    return total


@dataclass
class Calibration:
    """What the single instance answered and how fast, alone, one request at a time."""

    references: dict[int, list[int]]
    unloaded: list[Outcome]
    system: tuple[int, ...] = ()
    levels: list[list[multiturn.Conversation]] = field(default_factory=list)
    answers: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)
    turn_ttft_s: dict[tuple[int, int, int], float] = field(default_factory=dict)
    turn_tpot_s: float = 0.0
    turn_e2e_s: float = 0.0
    floor_per_request: float = 0.0


def calibrate(settings: Settings, jobs: Sequence[Job], vocab: int, startup_s: float, timeout_s: float,
              multiturn_levels: int, conversations: int, turns: int) -> Calibration:
    """The single instance's outputs (the references) and unloaded latencies, one request at a time: the
    mixed prompts, then every multi-turn conversation in order (its answers build the histories), counting
    the prompt tokens it computed (the floor)."""
    server = start_server(settings, "single", 1, None)
    try:
        wait_healthy([server], startup_s)
        url = f"http://{server.url}"
        warm_up(url, [server], vocab, timeout_s)
        outcomes = asyncio.run(run_rate(url, jobs, None, timeout_s)) if jobs else []
        if broken := [o for o in outcomes if o.error]:
            raise RuntimeError(f"the single instance failed a request: {broken[0].error}")
        result = Calibration({o.index: o.tokens for o in outcomes}, outcomes)
        if multiturn_levels:
            result.system, result.levels = multiturn.conversations(multiturn_levels, conversations, turns, vocab)
            before = computed([server])
            turns_done: list[multiturn.TurnOutcome] = []
            for level in result.levels:
                turns_done += asyncio.run(multiturn.run_level(url, result.system, level, None, None, SERVED, timeout_s))
            if broken_turns := [o for o in turns_done if o.error]:
                raise RuntimeError(f"the single instance failed a turn: {broken_turns[0].error}")
            result.floor_per_request = (computed([server]) - before) / len(turns_done)
            result.answers = {o.key: o.tokens for o in turns_done}
            result.turn_ttft_s = {o.key: o.ttft_s or 0.0 for o in turns_done}
            result.turn_tpot_s = median([o.tpot_s for o in turns_done if o.tpot_s is not None])
            result.turn_e2e_s = sum(o.e2e_s or 0.0 for o in turns_done) / len(turns_done)
        return result
    finally:
        _end(server.process)


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0915 - the run's steps in order
    parser = argparse.ArgumentParser(prog="vllm_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="12 requests at loads 0.5 and 1.0")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, from {','.join(SETUPS)}; "
                        "router:N is the router setup with --pd-min-tokens N (several compare in one run)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {','.join(WORKLOADS)}")
    parser.add_argument("--requests", type=int, default=None, help="requests per rate (default 40, quick 12)")
    parser.add_argument("--load", default=None,
                        help="rates as fractions of 2/S, S the unloaded mean end-to-end time "
                             "(default 0.25,0.5,0.75,1,1.25; quick 0.5,1)")
    parser.add_argument("--multiturn-load", default=None, help="the multi-turn workload's rates, fractions of "
                        "2/(S*turns) conversations/s (default 0.5,1,1.5; quick 1)")
    parser.add_argument("--conversations", type=int, default=None, help="per rate (default 8, quick 4)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--python", default=sys.executable, help="the Python with vLLM (default: this one)")
    parser.add_argument("--model", default=None, help="model directory (default: built by bench/vllm_model.py)")
    parser.add_argument("--out", default=str(RESULTS), help=f"results directory (default {RESULTS})")
    parser.add_argument("--startup-timeout", type=float, default=420)
    parser.add_argument("--request-timeout", type=float, default=300, help="a request not done by then is a miss")
    parser.add_argument("--no-nixl-install", action="store_true")
    parser.add_argument("--kv-extra", type=kv_extra, default={}, metavar="JSON",
                        help="KvpushConnector's kv_connector_extra_config in every kvpush setup, e.g. "
                             "'{\"loop_yields\": true}'")
    parser.add_argument("--router-args", default="", help="more flags for kvpush proxy in the router setup, "
                        "e.g. --router-args='--pd-min-tokens 1024 --request-tokens 64' (with '=' for a single flag)")
    args = parser.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    try:
        unknown = [s for s in setups if setup_kind(s)[0] not in SETUPS]
    except ValueError as error:
        parser.error(str(error))
    if unknown:
        parser.error(f"unknown setups {unknown}; known: {', '.join(SETUPS)} (router:N: --pd-min-tokens N)")
    workloads = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    requests = args.requests or (12 if args.quick else 40)
    fractions = [float(f) for f in (args.load or ("0.5,1" if args.quick else "0.25,0.5,0.75,1,1.25")).split(",")]
    mt_fractions = [float(f) for f in (args.multiturn_load or ("1" if args.quick else "0.5,1,1.5")).split(",")]
    conversations = args.conversations or (4 if args.quick else 8)
    built = subprocess.run(["taskset", "-c", "1", args.python, str(HERE / "vllm_model.py"),
                            *([args.model] if args.model else [])], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        sys.stderr.write(f"model build failed: {built.stderr[-1000:]}\n")
        return 2
    model_info = json.loads(built.stdout.strip().splitlines()[-1])
    model = Path(model_info["model"])
    vocab = vocab_of(model)
    work = Path(tempfile.mkdtemp(prefix="kvpush-vllm-load-"))
    settings = Settings(args.python, model, work, nixl_install=not args.no_nixl_install, prefix_caching=True,
                        extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache between rates
                        kv_extra=args.kv_extra)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = "load-" + time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
    jobs = workload(requests, vocab) if "mixed" in workloads else []
    levels = len(mt_fractions) if "multiturn" in workloads else 0
    started = time.monotonic()

    def interrupted(signum: int, frame: Any) -> None:
        _end_all()
        sys.exit(130)

    signal.signal(signal.SIGTERM, interrupted)
    records: list[dict[str, Any]] = []
    with open(out / f"{stamp}.jsonl", "w") as sink:
        def emit(record: dict[str, Any]) -> None:
            records.append(record)
            print(json.dumps(record), flush=True)
            sink.write(json.dumps(record) + "\n")
            sink.flush()

        try:
            sys.stderr.write("calibrating: every request one at a time on one instance\n")
            cal = calibrate(settings, jobs, vocab, args.startup_timeout, args.request_timeout, levels, conversations,
                            args.turns)
            machine: dict[str, Any] = {"workload": "-", "case": "machine", "cpus": os.cpu_count(),
                                       "platform": platform.platform(), "python": platform.python_version(),
                                       "model": model_info, "max_num_seqs": MAX_NUM_SEQS, "logs": str(work),
                                       "loadavg_start": os.getloadavg(), "kv_extra": args.kv_extra}
            rates: list[float] = []
            targets = None
            if jobs:
                targets = Targets.from_unloaded(cal.unloaded)
                service_s = sum(o.e2e_s or 0.0 for o in cal.unloaded) / len(cal.unloaded)
                rates = [f * 2.0 / service_s for f in fractions]
                machine.update(requests=requests, mix=dict(MIX), output_tokens=OUTPUT_TOKENS,
                               unloaded_e2e_mean_ms=round(service_s * 1e3, 1), two_core_rps=round(2.0 / service_s, 3),
                               ttft_target_ms={str(n): round(v * 1e3) for n, v in sorted(targets.ttft_s.items())},
                               tpot_target_ms=round(targets.tpot_s * 1e3, 1))
            mt_rates: list[float] = []
            if levels:
                mt_rates = [f * 2.0 / (cal.turn_e2e_s * args.turns) for f in mt_fractions]
                machine.update(conversations=conversations, turns=args.turns, system_tokens=multiturn.SYSTEM_TOKENS,
                               message_tokens=multiturn.MESSAGE_TOKENS, answer_tokens=multiturn.ANSWER_TOKENS,
                               think_s=multiturn.THINK_S, turn_unloaded_e2e_mean_ms=round(cal.turn_e2e_s * 1e3, 1),
                               floor_computed_per_request=round(cal.floor_per_request, 1),
                               turn_unloaded_ttft_p50_p90_ms=[_ms(list(cal.turn_ttft_s.values()), q) for q in (50, 90)])
            emit(machine)
            if targets is not None:
                for record in capacity_of_run(machine, fractions)[0]:
                    emit(record)  # what the cores can give P/D at these rates (bench/load_capacity.py)
                emit(load_record("single", 0.0, 0.0, cal.unloaded, cal.references, targets,
                                 {"note": "unloaded, one at a time"}))
            for setup in setups:
                sys.stderr.write(f"{setup}: starting\n")
                try:
                    url, servers, processes, notes = start_setup(setup, settings, args.startup_timeout,
                                                                   shlex.split(args.router_args))
                except Exception as error:  # noqa: BLE001 - one broken setup must not hide the others
                    emit({"workload": "-", "case": setup, "load": 0, "result": "not run",
                          "error": f"{type(error).__name__}: {str(error)[-600:]}"})
                    continue
                try:
                    warm_up(url, servers, vocab, args.request_timeout)
                    notes["idle_core_share"] = idle_load(servers)
                    for fraction, rate in zip(fractions, rates):
                        assert targets is not None
                        sys.stderr.write(f"  {setup} mixed at {rate:.2f} req/s ({fraction:g} x 2/S)\n")
                        forget(servers)
                        outcomes = asyncio.run(run_rate(url, jobs, rate, args.request_timeout))
                        emit(load_record(setup, fraction, rate, outcomes, cal.references, targets,
                                         dict(notes, loadavg=round(os.getloadavg()[0], 2))))
                        time.sleep(2)
                    for level, (fraction, rate) in enumerate(zip(mt_fractions, mt_rates)):
                        sys.stderr.write(f"  {setup} multi-turn at {rate:.3f} conversations/s\n")
                        forget(servers)
                        before = computed(servers)
                        turns = asyncio.run(multiturn.run_level(url, cal.system, cal.levels[level], cal.answers,
                                                                rate, SERVED, args.request_timeout))
                        with open(work / f"{setup}-multiturn-{fraction:g}.jsonl", "w") as detail:
                            for o in turns:  # each turn: where it went and why, for reading a tail
                                detail.write(json.dumps({"turn": o.key, "prompt_tokens": o.prompt_tokens,
                                                         "ttft_ms": None if o.ttft_s is None else round(o.ttft_s * 1e3),
                                                         "unloaded_ttft_ms": round(cal.turn_ttft_s[o.key] * 1e3),
                                                         "cached": o.cached, "route": o.route, "reason": o.reason,
                                                         "error": o.error}) + "\n")
                        emit(multiturn_record(setup, fraction, rate, turns, cal.answers, cal.turn_ttft_s,
                                              TPOT_FACTOR * cal.turn_tpot_s, computed(servers) - before,
                                              cal.floor_per_request, dict(notes, loadavg=round(os.getloadavg()[0], 2))))
                        time.sleep(2)
                except Exception as error:  # noqa: BLE001
                    emit({"workload": "-", "case": setup, "load": 0, "result": "not run",
                          "error": f"{type(error).__name__}: {str(error)[-600:]}"})
                finally:
                    for process in processes:
                        _end(process.process if isinstance(process, Server) else process)
        finally:
            _end_all()
    elapsed = time.monotonic() - started
    lines = table(records) + [""] + multiturn_table(records)
    head = [f"# {stamp}", "", f"elapsed {elapsed:.0f} s", ""]
    machine_record = next((r for r in records if r.get("case") == "machine"), None)
    if machine_record and jobs:
        m = machine_record
        head += [f"mixed: {requests} requests per rate; prompts {', '.join(f'{n} ({w:.0%})' for n, w in MIX)}; "
                 f"{OUTPUT_TOKENS} output tokens; unloaded mean end-to-end {m['unloaded_e2e_mean_ms']} ms "
                 f"-> 2/S = {m['two_core_rps']} req/s; targets: TTFT <= {m['ttft_target_ms']} ms by prompt length, "
                 f"TPOT <= {m['tpot_target_ms']} ms", ""]
    if machine_record and levels:
        low, high = multiturn.MESSAGE_TOKENS
        head += [f"multi-turn: {conversations} conversations per rate, {args.turns} turns, a "
                 f"{multiturn.SYSTEM_TOKENS}-token system prompt, messages of {low}-{high} tokens, "
                 f"{multiturn.ANSWER_TOKENS}-token answers, think time {multiturn.THINK_S} s (mean); the floor: "
                 f"{machine_record['floor_computed_per_request']} prompt tokens computed per request by one instance",
                 ""]
    if machine_record and jobs:
        lines += [""] + capacity_of_run(machine_record, fractions)[1]
    (out / f"{stamp}.md").write_text("\n".join(head + lines) + "\n")
    print("\n".join(lines))
    print(f"\nresults: {out / stamp}.{{jsonl,md}} ({elapsed:.0f} s); logs in {work}")
    return 1 if any(r.get("result") == "FAIL" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
