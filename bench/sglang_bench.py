#!/usr/bin/env python3
"""SGLang serving benchmark: time to first token of a plain SGLang instance against prefill/decode pairs over
kvpush and over SGLang's own ``mooncake_tcp`` backend, all real SGLang 0.5.23 servers on CPU.

    python bench/sglang_bench.py           # builds or reuses the SGLang test venv (tests/sglang/sglang_venv.py)
    python bench/sglang_bench.py --quick   # two prompt lengths, three requests each

The model: kvpush's tiny Llama (``python -m kvpush.cli.tiny_model``, float32). Cases run one after another in
one run, each on the same cores (no case competes with another): ``single`` (one instance on core 0);
``kvpush`` (on one host kvpush moves the pages with cma, a kernel copy), ``kvpush-tcp`` (the same over its TCP
transport) and ``mooncake_tcp`` (a prefill on core 0, a decode on core 1, sglang-router's mini load balancer in
front). Each pair is also asked without the router, taking turns with it request by request: ``kvpush-direct``
and ``mooncake_tcp-direct`` (this client sends the two legs the load balancer would, at once: no router hop); and
the kvpush pair as ``fake`` (those legs naming SGLang's fake bootstrap host: SGLang's own P/D floor, no handshake,
no byte moved). ``mooncake_tcp`` needs Debian's ``libibverbs1`` (Mooncake's engine links it even for TCP) and
runs with a test-only shim for CUDA-less hosts (tests/sglang/mooncake_cpu/sitecustomize.py: one class attribute
of SGLang's Mooncake sender).
``--pinned``: each engine's processes on its core (``taskset``) with one OpenMP thread. Every request is a
distinct greedy prompt (no radix-cache hit), one at a time; TTFT is client side, to the first streamed chunk.
Per case and prompt length, one JSON line: samples, p50, the ratios to ``single`` and to each kvpush way (``vs_*``)
from this run, and whether the greedy text equals ``single``'s. A case that cannot run says why in
its line instead of numbers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes.util
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "sglang"))

import servers as sg  # noqa: E402 - tests/sglang/servers.py
import sglang_venv  # noqa: E402 - tests/sglang/sglang_venv.py

BASE = 18440
FAKE_HOST = "2.2.2.2"  # SGLang's FAKE_BOOTSTRAP_HOST: a leg naming it skips the handshake and the transfer
Ask = Callable[[str], float]  # a prompt -> seconds to its first streamed token
STAGES = ("--enable-request-time-stats-logging",)  # SGLang logs each request's stages on each side
# SGLang's mooncake_tcp on a CPU host: a test-only shim (its docstring) and Mooncake's TCP transport on loopback
MOONCAKE_ENV = {"PYTHONPATH": os.pathsep.join(part for part in (str(REPO / "tests" / "sglang" / "mooncake_cpu"),
                                                                 os.environ.get("PYTHONPATH")) if part),
                "MC_FORCE_TCP": "1"}


@dataclass(frozen=True)
class Sent:
    """One request of the client's own legs: its bootstrap room, its prompt's words, when it was sent (wall clock,
    as SGLang's stage log stamps) and its TTFT."""

    room: int
    words: int
    sent: float
    ttft_s: float


def legs(prefill: sg.Server, decode: sg.Server, host: str, sent: list[Sent] | None = None) -> Ask:
    """The mini load balancer's two legs, sent by this client itself at once (no router process): both
    ``/generate`` with the bootstrap fields it adds; TTFT of the decode's stream. ``host`` ``FAKE_HOST``: SGLang's
    own floor, its P/D machinery without a handshake or a byte moved. ``sent``: each request is noted there."""
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def ask(text: str) -> float:
        room = random.randint(0, 2**63 - 1)
        extra = {"bootstrap_host": host, "bootstrap_port": prefill.extra["bootstrap_port"], "bootstrap_room": room}
        prefilled = pool.submit(sg.generate, prefill.url, text, 2, **extra)
        at = time.time()  # (the decode leg's send, as its TTFT's clock starts)
        seconds = sg.first_token_seconds(decode.url, text, **extra)
        prefilled.result()
        if sent is not None:
            sent.append(Sent(room, len(text.split()), at, float(seconds)))
        return float(seconds)

    return ask


# -- each request's stages, from SGLang's own log on both sides (--enable-request-time-stats-logging) ---------
_STAGE_LINE = re.compile(r"ReqTimeStats\(rid=\S+, bootstrap_room=(\d+), .*type=(\w+)\): (.*)$")
_FIELD = re.compile(r"(\w+)=([-\d.]+)(ms)?")
# (name, what it is, how it is had from a request's client record ``c``, prefill stages ``p``, decode stages ``d``)
PHASES: tuple[tuple[str, str], ...] = (
    ("to the decode's scheduler", "hop: HTTP, tokenizing, the hand-over to the scheduler"),
    ("decode: bootstrap", "round trip of the protocol: the prefill's address from its bootstrap server"),
    ("decode: pages allocated", "scheduler step: the preallocation pass"),
    ("prefill: waits for the decode's pages", "hold: the decode's destination message"),
    ("prefill: queued", "scheduler step"),
    ("prefill: forward and send", "compute, then bytes: the prefill's forward and the KV's transfer"),
    ("decode: waits for the KV", "hold: everything the prefill does, seen from the decode"),
    ("decode: queued", "scheduler step"),
    ("first token out", "scheduler step and hop: the decode's output step, the stream to the client"),
)


def stage_records(lines: list[str]) -> dict[tuple[int, str], dict[str, float]]:
    """SGLang's stage lines -> {(bootstrap room, "prefill"|"decode"): {stage: seconds, "entry_time": wall clock}}."""
    found: dict[tuple[int, str], dict[str, float]] = {}
    for line in lines:
        match = _STAGE_LINE.search(line)
        if match is None:
            continue
        fields = {name: float(value) / (1000 if unit else 1) for name, value, unit in _FIELD.findall(match.group(3))}
        found[(int(match.group(1)), match.group(2))] = fields
    return found


def request_phases(c: Sent, stages: dict[tuple[int, str], dict[str, float]]) -> dict[str, float] | None:
    """One request's phases (ms, ``PHASES``' names), None without both sides' stage lines. Every phase is a
    duration SGLang measured (to 0.01 ms) but the first and the last: SGLang logs when the request entered the
    decode's queue to the millisecond, so "to the decode's scheduler" is the client's send to that (+-0.5 ms), and
    "first token out" the rest of the client's TTFT."""
    p, d = stages.get((c.room, "prefill")), stages.get((c.room, "decode"))
    if p is None or d is None or not {"entry_time", "bootstrap_duration", "transfer_duration"} <= d.keys():
        return None  # (a decode line without its bootstrap's end lumps it with the allocation: left out)
    to_decode = d["entry_time"] - c.sent
    before_out = (to_decode + d.get("bootstrap_duration", 0.0) + d.get("alloc_wait_duration", 0.0)
                  + d["transfer_duration"] + d.get("queue_duration", 0.0))
    values = (to_decode, d.get("bootstrap_duration", 0.0), d.get("alloc_wait_duration", 0.0),
              p.get("bootstrap_duration", 0.0), p.get("queue_duration", 0.0), p.get("forward_duration", 0.0),
              d["transfer_duration"], d.get("queue_duration", 0.0), c.ttft_s - before_out)
    return {name: round(value * 1000, 2) for (name, _), value in zip(PHASES, values)}


def phase_medians(sent: list[Sent], stages: dict[tuple[int, str], dict[str, float]]) -> dict[int, dict[str, Any]]:
    """Per prompt length: the p50 of each phase over the requests with both sides' lines, and their count."""
    by_words: dict[int, list[dict[str, float]]] = {}
    for c in sent:
        phases = request_phases(c, stages)
        if phases is not None:
            by_words.setdefault(c.words, []).append(phases)
    return {words: {"samples": len(rows), "phases_ms": {name: round(statistics.median(r[name] for r in rows), 2)
                                                         for name, _ in PHASES}}
            for words, rows in sorted(by_words.items())}


def phase_table(found: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """The phases side by side: one column per case and prompt length."""
    columns = [(case, words) for case, by in found.items() for words in by]
    lines = ["| phase | what it is | " + " | ".join(f"{case}, {words} words" for case, words in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for name, kind in PHASES:
        lines.append(f"| {name} | {kind} | "
                     + " | ".join(f"{found[case][words]['phases_ms'][name]:.1f}" for case, words in columns) + " |")
    return lines


def measure(asks: dict[str, Ask], text_url: dict[str, str], lengths: list[int], reps: int,  # noqa: PLR0913
            seed: int, warmed: Callable[[], None] = lambda: None) -> dict[str, dict[int, dict[str, Any]]]:
    """TTFT samples per way of asking and prompt length, the ways taking turns request by request (each first in
    turn), after two warm-up requests each (then ``warmed`` is called); every request its own prompt (no
    radix-cache hit). Plus, for the ways in ``text_url``, the greedy text of each length's first prompt from that
    URL."""
    names = list(asks)
    for name in names:
        for warm in range(2):
            asks[name](sg.prompt(64, 900 + warm + seed + 10 * names.index(name)))
    warmed()
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    for length in lengths:
        samples: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps):
            for offset in range(len(names)):
                name = names[(rep + offset) % len(names)]
                text = sg.prompt(length, 1000 * length + 37 * rep + offset + 1)
                samples[name].append(asks[name](text) * 1000)
        for name in names:
            results[name][length] = {"samples_ms": [round(x, 1) for x in samples[name]],
                                     "p50_ms": round(statistics.median(samples[name]), 1)}
            if name in text_url:
                results[name][length]["text"] = sg.generate(text_url[name], sg.prompt(length, 1000 * length), 8)["text"]
    return results


def run_case(case: str, python: Path, model: Path, work: Path, lengths: list[int], reps: int,  # noqa: PLR0913
             pinned: bool, phases: dict[str, dict[int, dict[str, Any]]] | None = None) -> dict[str, dict[int, Any]]:
    """Start the case's servers, measure, stop them (always). ``pinned``: each engine on its own core (the prefill
    and a single instance on core 0, the decode on core 1) with one OpenMP thread. A pair is measured in turn
    through sglang-router's mini load balancer (``kvpush``, ``mooncake_tcp``) and with this client sending its two
    legs itself (``-direct``: no router hop); the kvpush pair also with those legs naming SGLang's fake bootstrap
    host (``fake``: no handshake, no transfer). ``phases``: the ``-direct`` way's phases per prompt length go there
    (``phase_medians``), from the client's records and both servers' stage logs."""
    started: list[sg.Server] = []
    pin = (lambda core: core) if pinned else (lambda core: None)
    try:
        if case == "single":
            single = sg.launch(python, model, "single", BASE, work, cores="0", pin=pin("0"))
            started.append(single)
            sg.wait_ready(started, 600)
            return measure({"single": lambda text: sg.first_token_seconds(single.url, text)},
                           {"single": single.url}, lengths, reps, 0)
        backend, env = {"kvpush": ("kvpush", {}), "kvpush-tcp": ("kvpush", {"KVPUSH_TRANSPORT": "tcp"}),
                        "mooncake_tcp": ("mooncake_tcp", MOONCAKE_ENV)}[case]
        if case == "mooncake_tcp" and ctypes.util.find_library("ibverbs") is None:
            raise RuntimeError("Mooncake's engine links libibverbs.so.1 even for TCP: apt-get install libibverbs1")
        prefill = sg.launch(python, model, f"{case}-prefill", BASE + 1, work, role="prefill", backend=backend,
                            bootstrap_port=BASE + 10, cores="0", pin=pin("0"), env=env, args=STAGES)
        started.append(prefill)  # (each one as soon as it runs: stopped whatever fails next)
        decode = sg.launch(python, model, f"{case}-decode", BASE + 2, work, role="decode", backend=backend, cores="1",
                           pin=pin("1"), env=env, args=STAGES)
        started.append(decode)
        sg.wait_ready(started, 600)
        router = sg.router(python, prefill, decode, BASE + 3, work, name=f"{case}-router")
        started.append(router)
        sg.wait_ready([router], 60)
        sent: list[Sent] = []
        asks: dict[str, Ask] = {case: lambda text: sg.first_token_seconds(router.url, text),
                                f"{case}-direct": legs(prefill, decode, "127.0.0.1", sent)}
        if case == "kvpush":  # (SGLang's fake transfer is the same whichever backend the servers name)
            asks["fake"] = legs(prefill, decode, FAKE_HOST)
        results = measure(asks, {case: router.url}, lengths, reps, 1, sent.clear)
        if phases is not None:
            time.sleep(1)  # (a request's stage line is logged as it finishes, after its first token)
            logs = [server.log.read_text(errors="replace") for server in (prefill, decode)]
            phases[f"{case}-direct"] = phase_medians(sent, stage_records("\n".join(logs).splitlines()))
        return results
    finally:
        for server in reversed(started):
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", default="single,kvpush,kvpush-tcp,mooncake_tcp")
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    parser.add_argument("--pinned", action="store_true",
                        help="each engine on its own core (taskset) with one OpenMP thread, as bench/vllm_bench.py")
    parser.add_argument("--reps", type=int, default=None, help="requests per case and length (default 5; 3 quick)")
    parser.add_argument("--lengths", default=None, help="prompt lengths in words (default 16,256,1024,2048)")
    args = parser.parse_args(argv)
    lengths, reps = ([64, 1024], 3) if args.quick else ([16, 256, 1024, 2048], 5)
    if args.lengths:
        lengths = [int(n) for n in args.lengths.split(",")]
    reps = args.reps or reps
    python = sglang_venv.ensure_venv()
    work = Path(tempfile.mkdtemp(prefix="kvpush-sglang-bench-"))
    model = work / "tiny-llama"
    subprocess.run([str(python), "-m", "kvpush.cli.tiny_model", str(model)], check=True, capture_output=True)
    started = time.monotonic()
    results: dict[str, dict[int, Any] | str] = {}
    phases: dict[str, dict[int, dict[str, Any]]] = {}
    for case in args.cases.split(","):
        try:
            results.update(run_case(case, python, model, work, lengths, reps, args.pinned, phases))
        except Exception as error:  # noqa: BLE001 - the case's line says why
            results[case] = f"{type(error).__name__}: {str(error)[-600:]}"
    lines = []
    for case, result in results.items():
        if isinstance(result, str):
            lines.append({"bench": "sglang_ttft", "case": case, "error": result})
            continue
        for length, numbers in result.items():
            line = {"bench": "sglang_ttft", "case": case, "prompt_words": length, "ttft_p50_ms": numbers["p50_ms"],
                    "ttft_samples_ms": numbers["samples_ms"]}
            for other in ("single", "kvpush", "kvpush-direct", "kvpush-tcp", "kvpush-tcp-direct", "fake"):
                reference = results.get(other)
                if other != case and isinstance(reference, dict) and case != "single":
                    line[f"vs_{other}"] = round(numbers["p50_ms"] / reference[length]["p50_ms"], 3)
            single = results.get("single")
            if case != "single" and isinstance(single, dict) and "text" in numbers:
                line["text_equals_single"] = numbers["text"] == single[length]["text"]
            line["pinned"] = args.pinned
            lines.append(line)
    for case, by_words in phases.items():
        lines += [{"bench": "sglang_phases", "case": case, "prompt_words": words, **found, "pinned": args.pinned}
                  for words, found in by_words.items()]
    for line in lines:
        print(json.dumps(line), flush=True)
        if args.out is not None:
            with args.out.open("a") as sink:
                sink.write(json.dumps(line) + "\n")
    if any(phases.values()):
        print("\n".join(phase_table({case: by for case, by in phases.items() if by})))
    print(f"# {time.monotonic() - started:.0f} s; server logs in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
