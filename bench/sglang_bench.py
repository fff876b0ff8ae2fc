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
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "sglang"))

import servers as sg  # noqa: E402 - tests/sglang/servers.py
import sglang_venv  # noqa: E402 - tests/sglang/sglang_venv.py

BASE = 18440
FAKE_HOST = "2.2.2.2"  # SGLang's FAKE_BOOTSTRAP_HOST: a leg naming it skips the handshake and the transfer
Ask = Callable[[str], float]  # a prompt -> seconds to its first streamed token
# SGLang's mooncake_tcp on a CPU host: a test-only shim (its docstring) and Mooncake's TCP transport on loopback
MOONCAKE_ENV = {"PYTHONPATH": str(REPO / "tests" / "sglang" / "mooncake_cpu"), "MC_FORCE_TCP": "1"}


def legs(prefill: sg.Server, decode: sg.Server, host: str) -> Ask:
    """The mini load balancer's two legs, sent by this client itself at once (no router process): both
    ``/generate`` with the bootstrap fields it adds; TTFT of the decode's stream. ``host`` ``FAKE_HOST``: SGLang's
    own floor, its P/D machinery without a handshake or a byte moved."""
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def ask(text: str) -> float:
        extra = {"bootstrap_host": host, "bootstrap_port": prefill.extra["bootstrap_port"],
                 "bootstrap_room": random.randint(0, 2**63 - 1)}
        prefilled = pool.submit(sg.generate, prefill.url, text, 2, **extra)
        seconds = sg.first_token_seconds(decode.url, text, **extra)
        prefilled.result()
        return float(seconds)

    return ask


def measure(asks: dict[str, Ask], text_url: dict[str, str], lengths: list[int], reps: int,
            seed: int) -> dict[str, dict[int, dict[str, Any]]]:
    """TTFT samples per way of asking and prompt length, the ways taking turns request by request (each first in
    turn), after two warm-up requests each; every request its own prompt (no radix-cache hit). Plus, for the ways
    in ``text_url``, the greedy text of each length's first prompt from that URL."""
    names = list(asks)
    for name in names:
        for warm in range(2):
            asks[name](sg.prompt(64, 900 + warm + seed + 10 * names.index(name)))
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
             pinned: bool) -> dict[str, dict[int, Any]]:
    """Start the case's servers, measure, stop them (always). ``pinned``: each engine on its own core (the prefill
    and a single instance on core 0, the decode on core 1) with one OpenMP thread. A pair is measured in turn
    through sglang-router's mini load balancer (``kvpush``, ``mooncake_tcp``) and with this client sending its two
    legs itself (``-direct``: no router hop); the kvpush pair also with those legs naming SGLang's fake bootstrap
    host (``fake``: no handshake, no transfer)."""
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
                            bootstrap_port=BASE + 10, cores="0", pin=pin("0"), env=env)
        decode = sg.launch(python, model, f"{case}-decode", BASE + 2, work, role="decode", backend=backend, cores="1",
                           pin=pin("1"), env=env)
        started += [prefill, decode]
        sg.wait_ready(started, 600)
        router = sg.router(python, prefill, decode, BASE + 3, work, name=f"{case}-router")
        started.append(router)
        sg.wait_ready([router], 60)
        asks: dict[str, Ask] = {case: lambda text: sg.first_token_seconds(router.url, text),
                                f"{case}-direct": legs(prefill, decode, "127.0.0.1")}
        if case == "kvpush":  # (SGLang's fake transfer is the same whichever backend the servers name)
            asks["fake"] = legs(prefill, decode, FAKE_HOST)
        return measure(asks, {case: router.url}, lengths, reps, 1)
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
    for case in args.cases.split(","):
        try:
            results.update(run_case(case, python, model, work, lengths, reps, args.pinned))
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
    for line in lines:
        print(json.dumps(line), flush=True)
        if args.out is not None:
            with args.out.open("a") as sink:
                sink.write(json.dumps(line) + "\n")
    print(f"# {time.monotonic() - started:.0f} s; server logs in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
