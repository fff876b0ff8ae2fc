#!/usr/bin/env python3
"""The time to first token of one P/D pair of vLLM instances with KvpushConnector, driven by each router contract
the field uses, in one run: kvpush's own router, vllm-router's two P/D modes and llm-d's concurrent Mooncake legs.

    python bench/router_modes.py                    # 32 and 512 tokens, 20 requests per case and length
    python bench/router_modes.py --requests 5       # fewer

A prefill (``kv_producer``, serving the Mooncake bootstrap contract on a free port) on core 1, a decode
(``kv_consumer``) on core 0, both the demo's tiny model (``kvpush.cli.tiny_model``), and a plain instance without a
connector on core 1 (the prefill's core) as the baseline. Every router runs on core 0 in its own session. The
client (this process, core 0) streams a token-id prompt (one of its own per request: no instance's prefix cache
holds any of it), ``max_tokens`` 8, greedy; the cases take turns request by request, each first in turn; the first
3 rounds warm up and are not counted. Every P/D answer must equal the plain instance's for the same prompt (asked
after the timed requests), or the run fails.

Cases:
- ``single``: the plain instance alone (the baseline);
- ``kvpush-proxy``: ``kvpush proxy --pd-min-tokens 1``: both legs at once under the id it mints, the first token
  relayed from the prefill when it comes first;
- ``vllm-router-nixl``: vllm-router 0.1.17 ``--vllm-pd-disaggregation`` (``--kv-connector nixl``, its default):
  the prefill's leg, then the decode's with the prefill's answer's ``kv_transfer_params`` relayed;
- ``vllm-router-mooncake``: the same with ``--kv-connector mooncake``: the engine id from the prefill's ``/query``
  at start-up, the prefill's leg, then the decode's (0.1.17 sends them one after the other);
- ``llmd-mooncake``: llm-d's routing sidecar's legs (``pkg/sidecar/proxy/connector_mooncake.go``: both at once,
  the decode's streamed to the client), sent by this client itself: the sidecar is a Go binary no package index
  serves, so this case has no router process and no hop.

One JSON line per (case, length): p50 and p90 TTFT (ms), and ``vs_single``, ``vs_kvpush_proxy``: its p50 over
theirs. A table follows the lines.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.router_hop import _ready, _spawn, stop_helpers  # noqa: E402
from kvpush.cli import demo_vllm  # noqa: E402
from kvpush.cli.ports import free_port  # noqa: E402

LENGTHS = (32, 512)
ANSWER_TOKENS = 8
WARM = 3
SPACING_S = 0.05
CASES = ("single", "kvpush-proxy", "vllm-router-nixl", "vllm-router-mooncake", "llmd-mooncake")


def _router_binary() -> str | None:
    """vllm-router of this environment (the ``vllm`` extra), else bench/peers' (``bench/peers/setup.sh``)."""
    for candidate in (Path(sys.executable).parent, HERE / "peers" / "venv-router" / "bin"):
        if (candidate / "vllm-router").exists():
            return str(candidate / "vllm-router")
    return None


def _stream(url: str, body: dict[str, Any], started: float, headers: dict[str, str] | None = None
            ) -> tuple[float, list[int], str]:
    """POST a streamed completion; (seconds from ``started`` to the first token, the tokens, the text)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=120)
    try:
        connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                           {"Content-Type": "application/json", **(headers or {})})
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status}: {reply.read()[:300]!r}")
        first, tokens, text = 0.0, [], ""
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices") or []:
                got = choice.get("token_ids") or []
                if (got or choice.get("text")) and not first:
                    first = time.perf_counter() - started
                tokens += got
                text += choice.get("text") or ""
        return first, tokens, text
    finally:
        connection.close()


def _complete(url: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=120) as reply:
        reply.read()
        return int(reply.status)


class LlmdLegs:
    """llm-d's sidecar's two legs, sent at once: the prefill's capped to one token, not streamed, without
    ``min_tokens``, with ``X-data-parallel-rank``; the decode's the client's body with the Mooncake params."""

    def __init__(self, prefill: str, decode: str, bootstrap: str) -> None:
        self.prefill, self.decode, self.bootstrap = prefill, decode, bootstrap
        with urllib.request.urlopen(f"{bootstrap}/query", timeout=10) as reply:
            self.dp_rank, entry = next(iter(json.loads(reply.read()).items()))
        self.engine_id = entry["engine_id"]
        self.pool = concurrent.futures.ThreadPoolExecutor(2)

    def __call__(self, body: dict[str, Any], started: float) -> tuple[float, list[int], str]:
        transfer_id = f"xfer-{uuid.uuid4()}"
        to_prefill = {**body, "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "kv_transfer_params": {
            "do_remote_prefill": False, "do_remote_decode": True, "transfer_id": transfer_id}}
        prefilled = self.pool.submit(_complete, self.prefill, to_prefill, {"X-data-parallel-rank": self.dp_rank})
        result = _stream(self.decode, {**body, "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
            "remote_bootstrap_addr": self.bootstrap, "remote_engine_id": self.engine_id}}, started)
        if prefilled.result() != 200:
            raise RuntimeError("the prefill's leg failed")
        return result


def main() -> int:  # noqa: PLR0915
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="per case and length (default 20)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths in tokens")
    parser.add_argument("--cases", default=",".join(CASES), help="the cases to run (single always)")
    parser.add_argument("--single-core", type=int, default=1, help="the plain instance's core (default 1, the "
                        "prefill's)")
    parser.add_argument("--spacing-ms", type=float, default=SPACING_S * 1e3, help="pause between requests")
    args = parser.parse_args()
    cases = tuple(dict.fromkeys(["single", *(c for c in args.cases.split(",") if c)]))
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    router = _router_binary()
    if router is None:
        print("vllm-router is not installed (pip install -e '.[vllm]' or bash bench/peers/setup.sh)", file=sys.stderr)
        return 2
    model = demo_vllm._model(demo_vllm.MODEL_DIR)
    work = Path(tempfile.mkdtemp(prefix="kvpush-router-modes-"))
    servers: list[demo_vllm.Server] = []
    helpers: list[subprocess.Popen[bytes]] = []
    try:
        kv_port, bootstrap_port = free_port(span=2), free_port()
        connector = {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.integrations.vllm",
                     "kv_port": kv_port}
        prefill = demo_vllm._start("prefill", model, 1, work, {
            **connector, "kv_role": "kv_producer", "kv_connector_extra_config": {"bootstrap_port": bootstrap_port}})
        decode = demo_vllm._start("decode", model, 0, work, {
            **connector, "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"})
        single = demo_vllm._start("single", model, args.single_core, work, None)
        servers += [prefill, decode, single]
        demo_vllm._wait(servers)
        os.sched_setaffinity(0, {0})  # after the servers started: they must not inherit it
        bootstrap = f"http://127.0.0.1:{bootstrap_port}"
        urls: dict[str, str] = {"single": single.url}
        port = free_port()
        _spawn("kvpush-proxy", [sys.executable, "-m", "kvpush", "proxy", "--prefill", f"{prefill.url}#kv={kv_port}",
                                "--decode", decode.url, "--pd-min-tokens", "1", "--port", str(port)], work, helpers)
        urls["kvpush-proxy"] = f"http://127.0.0.1:{port}"
        for mode in ("nixl", "mooncake"):
            port = free_port()
            _spawn(f"vllm-router-{mode}", [
                router, "--vllm-pd-disaggregation", "--kv-connector", mode, "--host", "127.0.0.1", "--port", str(port),
                "--prefill", prefill.url, *([str(bootstrap_port)] if mode == "mooncake" else []),
                "--decode", decode.url, "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port())], work, helpers, {"RUST_LOG": "warn"})
            urls[f"vllm-router-{mode}"] = f"http://127.0.0.1:{port}"
        for (case, url), helper in zip(list(urls.items())[1:], helpers):
            _ready(url, "/v1/models" if case == "kvpush-proxy" else "/health", helper)
        llmd = LlmdLegs(prefill.url, decode.url, bootstrap)
        lengths = [int(n) for n in args.lengths.split(",")]
        samples: dict[tuple[str, int], list[float]] = {}
        answered: list[tuple[str, dict[str, Any], list[int]]] = []
        seed = 1000
        for i in range(WARM + args.requests):
            for n in lengths:
                for case in cases[i % len(cases):] + cases[:i % len(cases)]:  # each case first in turn
                    seed += 1  # a prompt of its own: no instance's prefix cache holds any of it
                    body = {"model": demo_vllm.SERVED, "prompt": demo_vllm._prompt(n, seed),
                            "max_tokens": ANSWER_TOKENS, "temperature": 0.0, "ignore_eos": True,
                            "return_token_ids": True}
                    started = time.perf_counter()
                    ttft, tokens, _ = (llmd(body, started) if case == "llmd-mooncake"
                                       else _stream(urls[case], body, started))
                    answered.append((case, body, tokens))
                    time.sleep(args.spacing_ms / 1e3)
                    if i >= WARM:
                        samples.setdefault((case, n), []).append(ttft * 1e3)
        # every P/D answer against the plain instance's for the same prompt (asked now, untimed)
        wrong = [(case, len(body["prompt"])) for case, body, tokens in answered
                 if case != "single" and _stream(single.url, body, time.perf_counter())[1] != tokens]
        if wrong:
            raise RuntimeError(f"answers unlike the plain instance's (case, prompt tokens): {wrong}")
        rows = []
        for n in lengths:
            p50 = {case: statistics.median(samples[(case, n)]) for case in cases}
            for case in cases:
                values = sorted(samples[(case, n)])
                row = {"workload": "ROUTER-MODES", "case": case, "prompt_tokens": n, "requests": len(values),
                       "ttft_p50_ms": round(p50[case], 2),
                       "ttft_p90_ms": round(values[min(len(values) - 1, int(len(values) * 0.9))], 2),
                       "vs_single": round(p50[case] / p50["single"], 2),
                       **({"vs_kvpush_proxy": round(p50[case] / p50["kvpush-proxy"], 2)} if "kvpush-proxy" in p50
                          else {})}
                rows.append(row)
                print(json.dumps(row), flush=True)
        print("\n| tokens | case | TTFT p50 ms | p90 ms | vs single | vs kvpush proxy |\n|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['prompt_tokens']} | {row['case']} | {row['ttft_p50_ms']:.1f} | {row['ttft_p90_ms']:.1f} | "
                  f"{row['vs_single']:.2f} | {row.get('vs_kvpush_proxy', '')} |")
        print(f"\nlogs: {work}")
        return 0
    finally:
        stop_helpers(helpers)
        for server in servers:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
