#!/usr/bin/env python3
"""P/D under load: Poisson arrivals of mixed prompts on the same two cores used three ways, with real
``vllm serve`` processes (vLLM's CPU build) and the model of bench/vllm_model.py.

    python bench/vllm_load.py            # 5 rates, 40 requests each, every setup
    python bench/vllm_load.py --quick    # 2 rates, 12 requests each

Setups (each engine pinned to its own core; the client and the proxy float):
- ``rr``: two independent instances (cores 0 and 1, no connector) behind a round-robin proxy
  (bench/load_proxy.py rr): each request is computed whole by one instance.
- ``kvpush``: a prefill (core 1) and a decode (core 0) with KvpushConnector, its defaults
  (transport auto, ``kv_load_failure_policy`` recompute), behind ``kvpush proxy``.
- ``nixl``: the same pair with vLLM's NixlConnector (``kv_buffer_device`` cpu, NIXL 1.5.1's UCX backend
  on loopback, installed as bench/vllm_bench.py does) behind vLLM's own P/D flow (bench/load_proxy.py
  nixl: the prefill's answer, then the decode, which pulls the KV).

Workload: ``--requests`` prompts, lengths drawn from 32/128/512/2048 tokens with weights 40/30/20/10 %
(seeded; distinct random token ids; the same prompts in the same order for every rate and setup), 16
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

Writes ``bench/results/load-<stamp>.jsonl`` and ``.md`` (the table) and prints the table. Every process it
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
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.vllm_bench import (  # noqa: E402
    _STARTED,
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
    median,
    nixl_site,
    percentile,
    pin_tree,
    prompt,
    start_server,
    vocab_of,
    wait_healthy,
)

SETUPS = ("rr", "kvpush", "nixl")
MIX = ((32, 0.4), (128, 0.3), (512, 0.2), (2048, 0.1))
OUTPUT_TOKENS = 16
TTFT_FACTOR, TTFT_SLACK_S, TPOT_FACTOR = 2.0, 0.25, 2.0
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
        if o.error or o.ttft_s is None or o.tokens != list(reference or ()):
            return False
        tpot = o.tpot_s
        return o.ttft_s <= self.ttft_s[o.length] and (tpot is None or tpot <= self.tpot_s)


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
    good = sum(1 for o in outcomes if targets.met(o, references.get(o.index)))
    record.update(
        throughput_rps=round(len(done) / span, 3), output_tok_s=round(sum(len(o.tokens) for o in done) / span, 1),
        ttft_p50_ms=_ms(ttft, 50), ttft_p99_ms=_ms(ttft, 99), itl_p50_ms=_ms(gaps, 50), itl_p99_ms=_ms(gaps, 99),
        e2e_p50_ms=_ms(e2e, 50), e2e_p99_ms=_ms(e2e, 99), goodput_rps=round(good / span, 3),
        met_targets=f"{good}/{len(outcomes)}")
    return record


def table(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| setup | load | offered req/s | req/s | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "E2E p50 / p99 ms | goodput req/s (met) | KV used / routes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("workload") != "VLLM-LOAD":
            continue
        head = f"| {r['case']} | {r['load']:g} | {r['offered_rps']:.2f} "
        if r.get("result"):
            lines.append(head + f"| {r['result']}: {r.get('error', '')} | | | | | | |")
            continue
        used = r.get("kv_transferred", "-")
        if r.get("routes"):
            used += " " + ", ".join(f"{k} {v}" for k, v in r["routes"].items())
        lines.append(head + f"| {r['throughput_rps']:.2f} | {r['output_tok_s']:.0f} "
                     f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
                     f"| {r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} "
                     f"| {r['e2e_p50_ms']:.0f} / {r['e2e_p99_ms']:.0f} "
                     f"| {r['goodput_rps']:.2f} ({r['met_targets']}) | {used} |")
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
    except Exception as error:  # noqa: BLE001 - a failed request is a miss, not the end of the run
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    if not times:
        outcome.error = "the stream ended without a token"
        return outcome
    outcome.ttft_s = times[0] - outcome.sent
    outcome.gaps_s = [b - a for a, b in zip(times, times[1:])]
    outcome.e2e_s = time.monotonic() - outcome.sent
    return outcome


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


def start_setup(setup: str, settings: Settings, startup_s: float) -> tuple[str, list[Server], list[Any],
                                                                           dict[str, Any]]:
    """The setup's engines and proxy: (the proxy's URL, the engines, the processes to end, notes)."""
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
            def kvpush(role: str) -> dict[str, Any]:
                return {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.integrations.vllm",
                        "kv_role": role, "kv_port": kv_port, "kv_load_failure_policy": "recompute"}
            prefill_kv, decode_kv = kvpush("kv_producer"), kvpush("kv_consumer")
        for name, core, kv in (("prefill", 1, prefill_kv), ("decode", 0, decode_kv)):
            own = dict(env)
            if setup == "nixl":
                own |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                        "UCX_NET_DEVICES": "lo"}
            servers.append(start_server(settings, f"{setup}-{name}", core, kv, own, args=extra_args))
        wait_healthy(servers, startup_s)
        prefill, decode = (f"http://{s.url}" for s in servers)
        if setup == "kvpush":
            command = [*kvpush_cli(), "proxy", "--host", "127.0.0.1", "--port", "0",
                       "--prefill", f"{prefill}#kv=127.0.0.1:{kv_port}", "--decode", decode]
        else:
            command = [sys.executable, str(HERE / "load_proxy.py"), "nixl", "--prefill", prefill, "--decode", decode]
        url, proxy = start_helper(f"{setup}-proxy", command, settings.work)
        return url, servers, [*servers, proxy], notes
    except BaseException:
        for process in [*servers, *processes]:
            _end(process.process if isinstance(process, Server) else process)
        raise


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


# -- main ---------------------------------------------------------------------------------------------------

def calibrate(settings: Settings, jobs: Sequence[Job], vocab: int, startup_s: float, timeout_s: float
              ) -> tuple[dict[int, list[int]], list[Outcome]]:
    """The single instance's outputs (the reference) and unloaded latencies, one request at a time."""
    server = start_server(settings, "single", 1, None)
    try:
        wait_healthy([server], startup_s)
        url = f"http://{server.url}"
        warm_up(url, [server], vocab, timeout_s)
        outcomes = asyncio.run(run_rate(url, jobs, None, timeout_s))
    finally:
        _end(server.process)
    broken = [o for o in outcomes if o.error]
    if broken:
        raise RuntimeError(f"the single instance failed a request: {broken[0].error}")
    return {o.index: o.tokens for o in outcomes}, outcomes


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0915 - the run's steps in order
    parser = argparse.ArgumentParser(prog="vllm_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="12 requests at loads 0.5 and 1.0")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, from {','.join(SETUPS)}")
    parser.add_argument("--requests", type=int, default=None, help="requests per rate (default 40, quick 12)")
    parser.add_argument("--load", default=None,
                        help="rates as fractions of 2/S, S the unloaded mean end-to-end time "
                             "(default 0.25,0.5,0.75,1,1.25; quick 0.5,1)")
    parser.add_argument("--python", default=sys.executable, help="the Python with vLLM (default: this one)")
    parser.add_argument("--model", default=None, help="model directory (default: built by bench/vllm_model.py)")
    parser.add_argument("--out", default=str(RESULTS), help=f"results directory (default {RESULTS})")
    parser.add_argument("--startup-timeout", type=float, default=420)
    parser.add_argument("--request-timeout", type=float, default=300, help="a request not done by then is a miss")
    parser.add_argument("--no-nixl-install", action="store_true")
    args = parser.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    if unknown := [s for s in setups if s not in SETUPS]:
        parser.error(f"unknown setups {unknown}; known: {', '.join(SETUPS)}")
    requests = args.requests or (12 if args.quick else 40)
    fractions = [float(f) for f in (args.load or ("0.5,1" if args.quick else "0.25,0.5,0.75,1,1.25")).split(",")]
    built = subprocess.run(["taskset", "-c", "1", args.python, str(HERE / "vllm_model.py"),
                            *([args.model] if args.model else [])], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        sys.stderr.write(f"model build failed: {built.stderr[-1000:]}\n")
        return 2
    model_info = json.loads(built.stdout.strip().splitlines()[-1])
    model = Path(model_info["model"])
    vocab = vocab_of(model)
    work = Path(tempfile.mkdtemp(prefix="kvpush-vllm-load-"))
    settings = Settings(args.python, model, work, nixl_install=not args.no_nixl_install)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = "load-" + time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
    jobs = workload(requests, vocab)
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
            sys.stderr.write(f"calibrating: {requests} prompts one at a time on one instance\n")
            references, unloaded = calibrate(settings, jobs, vocab, args.startup_timeout, args.request_timeout)
            targets = Targets.from_unloaded(unloaded)
            service_s = sum(o.e2e_s or 0.0 for o in unloaded) / len(unloaded)
            capacity = 2.0 / service_s
            rates = [f * capacity for f in fractions]
            emit({"workload": "-", "case": "machine", "cpus": os.cpu_count(), "platform": platform.platform(),
                  "python": platform.python_version(), "model": model_info, "requests": requests,
                  "mix": dict(MIX), "output_tokens": OUTPUT_TOKENS, "max_num_seqs": MAX_NUM_SEQS,
                  "unloaded_e2e_mean_ms": round(service_s * 1e3, 1), "two_core_rps": round(capacity, 3),
                  "ttft_target_ms": {str(n): round(v * 1e3) for n, v in sorted(targets.ttft_s.items())},
                  "tpot_target_ms": round(targets.tpot_s * 1e3, 1), "logs": str(work),
                  "loadavg_start": os.getloadavg()})
            emit(load_record("single", 0.0, 0.0, unloaded, references, targets, {"note": "unloaded, one at a time"}))
            for setup in setups:
                sys.stderr.write(f"{setup}: starting\n")
                try:
                    url, servers, processes, notes = start_setup(setup, settings, args.startup_timeout)
                except Exception as error:  # noqa: BLE001 - one broken setup must not hide the others
                    emit({"workload": "VLLM-LOAD", "case": setup, "load": 0, "offered_rps": 0,
                          "result": "not run", "error": f"{type(error).__name__}: {str(error)[-600:]}"})
                    continue
                try:
                    warm_up(url, servers, vocab, args.request_timeout)
                    notes["idle_core_share"] = idle_load(servers)
                    for fraction, rate in zip(fractions, rates):
                        sys.stderr.write(f"  {setup} at {rate:.2f} req/s ({fraction:g} x 2/S)\n")
                        outcomes = asyncio.run(run_rate(url, jobs, rate, args.request_timeout))
                        emit(load_record(setup, fraction, rate, outcomes, references, targets,
                                         dict(notes, loadavg=round(os.getloadavg()[0], 2))))
                        time.sleep(2)
                except Exception as error:  # noqa: BLE001
                    emit({"workload": "VLLM-LOAD", "case": setup, "load": 0, "offered_rps": 0,
                          "result": "not run", "error": f"{type(error).__name__}: {str(error)[-600:]}"})
                finally:
                    for process in processes:
                        _end(process.process if isinstance(process, Server) else process)
        finally:
            _end_all()
    elapsed = time.monotonic() - started
    lines = table(records)
    head = [f"# {stamp}", "", f"{requests} requests per rate; prompts {', '.join(f'{n} ({w:.0%})' for n, w in MIX)};"
            f" {OUTPUT_TOKENS} output tokens; elapsed {elapsed:.0f} s", ""]
    machine = next((r for r in records if r.get("case") == "machine"), None)
    if machine:
        head += [f"unloaded mean end-to-end {machine['unloaded_e2e_mean_ms']} ms -> 2/S = {machine['two_core_rps']} "
                 f"req/s; targets: TTFT <= {machine['ttft_target_ms']} ms by prompt length, TPOT <= "
                 f"{machine['tpot_target_ms']} ms", ""]
    (out / f"{stamp}.md").write_text("\n".join(head + lines) + "\n")
    print("\n".join(lines))
    print(f"\nresults: {out / stamp}.{{jsonl,md}} ({elapsed:.0f} s); logs in {work}")
    return 1 if any(r.get("result") == "FAIL" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
