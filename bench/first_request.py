#!/usr/bin/env python3
"""What the first request after start-up costs beside the ones after it, through kvpush's router with P/D.

    python bench/first_request.py               # 3 starts
    python bench/first_request.py --starts 1

Per start: a prefill (core 0) and a decode (core 1) of the demo's tiny model (``kvpush.cli.tiny_model``) with
KvpushConnector, each ``vllm serve`` in its own session, and ``kvpush proxy`` in front of them (its own session
too, core 0, its defaults but ``--pd-min-tokens 0``: every request is disaggregated). Once all three answer
``/health`` (and the router's ``/metrics``), the client sends ``--requests`` requests one after the other, each
a new prompt of ``--tokens`` token ids, streamed, ``max_tokens`` 4, on a new connection (as a new client would),
and takes the time to the first token of each. Everything is stopped after each start.

One JSON line per start: the first request's TTFT, the second's, the median of the rest, and ``first_vs_second``
and ``first_vs_rest``; then one line with the medians over the starts (issue 42's target: the first within 1.5x
of the second). ``--no-warm`` starts the router with ``--no-warm-links`` (the links made on the first request's
path, as before issue 42).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.router_hop import _ready  # noqa: E402
from kvpush.cli import demo_vllm  # noqa: E402
from kvpush.cli.ports import free_port  # noqa: E402


def _ttft(url: str, prompt: list[int]) -> float:
    body = json.dumps({"model": demo_vllm.SERVED, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True}).encode()
    started = time.perf_counter()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        for raw in answer:
            line = raw.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                chunk = json.loads(line[5:])
                if any(choice.get("token_ids") for choice in chunk.get("choices") or ()):  # (its text may be "")
                    return time.perf_counter() - started
    raise RuntimeError(f"{url}: the stream ended without a token")


def one_start(model: Path, work: Path, tokens: int, requests: int, warm: bool, seed: int) -> dict[str, float]:
    kv_port = free_port(span=2)
    connector = {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.integrations.vllm"}
    prefill = demo_vllm._start("prefill", model, 0, work, {**connector, "kv_role": "kv_producer", "kv_port": kv_port})
    decode = demo_vllm._start("decode", model, 1, work, {**connector, "kv_role": "kv_consumer", "kv_port": kv_port,
                                                          "kv_load_failure_policy": "recompute"})
    router: subprocess.Popen[bytes] | None = None
    try:
        demo_vllm._wait([prefill, decode])
        port = free_port()
        command = ["taskset", "-c", "0", sys.executable, "-m", "kvpush", "proxy", "--prefill",
                   f"{prefill.url}#kv=127.0.0.1:{kv_port}", "--decode", decode.url, "--port", str(port),
                   "--pd-min-tokens", "0", *([] if warm else ["--no-warm-links"])]
        with open(work / "router.log", "wb") as out:
            router = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        _ready(url, "/metrics", router)
        times = [_ttft(url, demo_vllm._prompt(tokens, seed * 1000 + i)) * 1e3 for i in range(requests)]
        rest = statistics.median(times[2:]) if len(times) > 2 else times[-1]
        return {"first_ms": round(times[0], 1), "second_ms": round(times[1], 1), "rest_p50_ms": round(rest, 1),
                "first_vs_second": round(times[0] / times[1], 2), "first_vs_rest": round(times[0] / rest, 2)}
    finally:
        if router is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(router.pid, signal.SIGTERM)
            try:
                router.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(router.pid, signal.SIGKILL)
                router.wait(timeout=15)
        for server in (prefill, decode):
            server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--no-warm", action="store_true", help="the router's --no-warm-links")
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be at least 2")
    model = demo_vllm._model(demo_vllm.MODEL_DIR)
    case = "cold" if args.no_warm else "warm"
    rows = []
    for start in range(args.starts):
        work = Path(tempfile.mkdtemp(prefix="kvpush-first-request-"))
        row = one_start(model, work, args.tokens, args.requests, not args.no_warm, start)
        rows.append(row)
        print(json.dumps({"workload": "FIRST-REQUEST", "case": case, "start": start, "prompt_tokens": args.tokens,
                          **row, "logs": str(work)}), flush=True)
    summary = {key: round(statistics.median(r[key] for r in rows), 2) for key in rows[0]}
    print(json.dumps({"workload": "FIRST-REQUEST", "case": case, "starts": len(rows), "prompt_tokens": args.tokens,
                      **summary, "target_first_vs_second": 1.5}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
