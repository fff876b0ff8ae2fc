#!/usr/bin/env python3
"""SGLang serving benchmark: time to first token of a plain SGLang instance against prefill/decode pairs over
kvpush and over SGLang's own ``mooncake_tcp`` backend, all real SGLang 0.5.23 servers on CPU.

    python bench/sglang_bench.py           # builds or reuses the SGLang test venv (tests/sglang/sglang_venv.py)
    python bench/sglang_bench.py --quick   # two prompt lengths, three requests each

The model: kvpush's tiny Llama (``python -m kvpush.cli.tiny_model``, float32). Cases run one after another in
one run, each on the same cores (no case competes with another): ``single`` (one instance on core 0);
``kvpush`` and ``mooncake_tcp`` (a prefill on core 0, a decode on core 1, sglang-router's mini load balancer in
front). Every request is a distinct greedy prompt (no radix-cache hit), one at a time; TTFT is client side, to
the first streamed chunk. Per case and prompt length, one JSON line: samples, p50, the ratio to ``single`` (and
for ``mooncake_tcp`` to ``kvpush``) from this run, and whether the greedy text equals ``single``'s. A case that
cannot run says why in its line instead of numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "sglang"))

import servers as sg  # noqa: E402 - tests/sglang/servers.py
import sglang_venv  # noqa: E402 - tests/sglang/sglang_venv.py

BASE = 18440


def measure(url: str, lengths: list[int], reps: int, seed: int) -> dict[int, dict[str, Any]]:
    """TTFT samples per prompt length against ``url``, after two warm-up requests; plus the greedy text of
    each length's first prompt."""
    for warm in range(2):
        sg.generate(url, sg.prompt(64, 900 + warm + seed), 4)
    results: dict[int, dict[str, Any]] = {}
    for length in lengths:
        samples = [sg.first_token_seconds(url, sg.prompt(length, 1000 * length + rep)) * 1000 for rep in range(reps)]
        text = sg.generate(url, sg.prompt(length, 1000 * length), 8)["text"]
        results[length] = {"samples_ms": [round(s, 1) for s in samples], "p50_ms": round(statistics.median(samples), 1),
                           "text": text}
    return results


def run_case(case: str, python: Path, model: Path, work: Path, lengths: list[int], reps: int) -> dict[int, Any]:
    """Start the case's servers, measure, stop them (always)."""
    started: list[sg.Server] = []
    try:
        if case == "single":
            single = sg.launch(python, model, "single", BASE, work, cores="0")
            started.append(single)
            sg.wait_ready(started, 600)
            return measure(single.url, lengths, reps, 0)
        backend = {"kvpush": "kvpush", "mooncake_tcp": "mooncake_tcp"}[case]
        prefill = sg.launch(python, model, f"{case}-prefill", BASE + 1, work, role="prefill", backend=backend,
                            bootstrap_port=BASE + 10, cores="0")
        decode = sg.launch(python, model, f"{case}-decode", BASE + 2, work, role="decode", backend=backend, cores="1")
        started += [prefill, decode]
        sg.wait_ready(started, 600)
        router = sg.router(python, prefill, decode, BASE + 3, work, name=f"{case}-router")
        started.append(router)
        sg.wait_ready([router], 60)
        return measure(router.url, lengths, reps, 1)
    finally:
        for server in reversed(started):
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", default="single,kvpush,mooncake_tcp")
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    lengths, reps = ([64, 1024], 3) if args.quick else ([16, 256, 1024, 2048], 5)
    python = sglang_venv.ensure_venv()
    work = Path(tempfile.mkdtemp(prefix="kvpush-sglang-bench-"))
    model = work / "tiny-llama"
    subprocess.run([str(python), "-m", "kvpush.cli.tiny_model", str(model)], check=True, capture_output=True)
    started = time.monotonic()
    results: dict[str, dict[int, Any] | str] = {}
    for case in args.cases.split(","):
        try:
            results[case] = run_case(case, python, model, work, lengths, reps)
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
            for other in ("single", "kvpush"):
                reference = results.get(other)
                if other != case and isinstance(reference, dict) and case != "single":
                    line[f"vs_{other}"] = round(numbers["p50_ms"] / reference[length]["p50_ms"], 3)
            single = results.get("single")
            if case != "single" and isinstance(single, dict):
                line["text_equals_single"] = numbers["text"] == single[length]["text"]
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
