#!/usr/bin/env python3
"""What a router's hop adds to one request, end to end: kvpush's router beside vLLM's own and a bare reverse
proxy, on the same vLLM instance, in one run.

    python bench/router_hop.py                 # 40 and 900 words, 30 requests per case and length
    python bench/router_hop.py --requests 10   # fewer
    python bench/router_hop.py --chat          # the same prompts as chats (/v1/chat/completions, one user message)
    python bench/router_hop.py --conversation  # each prompt the case's last one and 40 words more

One ``vllm serve`` of the demo's tiny model (``kvpush.cli.tiny_model``) with KvpushConnector (``kv_consumer``,
as a decode of the README's setup), on core 1; every router on core 0
in its own session, with the decode as its one upstream. The client (this process, core 0 too) sends a text prompt
of N words, ``max_tokens`` 1, not streamed, on a kept-alive connection per case; the cases take turns request
by request (round robin, each first in turn, 20 ms apart), each request its own prompt (the prefix cache matches
none of it); the first 8 rounds warm up and are not counted.

Cases:
- ``direct``: straight to the decode: the baseline every hop is measured against;
- ``floor``: a bare aiohttp reverse proxy (``--floor``, below): what any Python proxy pays for a hop;
- ``kvpush``: ``kvpush proxy --decode URL --prefill URL2 --pd-min-tokens 1000000 --kv-probe-interval 0`` (else
  its defaults: every request takes the decode-only route; with one decode and no prompt long enough to
  disaggregate, placement does not depend on the prompt's tokens, and the router does not tokenize it on the
  request's path);
- ``kvpush-2-decodes``: the same with a second decode URL (the same server by its IPv4-mapped IPv6 address): now
  placement depends on the prompt's blocks, so the router tokenizes each prompt (with the model's tokenizer,
  found by ``--tokenizer auto``) and matches its blocks first;
- ``kvpush-remote-tokenize``: as ``kvpush-2-decodes`` with ``--tokenizer none``: text prompts tokenized by the
  decode's ``/tokenize`` (a round trip on the request's path: kvpush's default before issue 42);
- ``vllm-router``: vllm-router 0.1.17 (``bench/peers/setup.sh``), ``--worker-urls`` the decode.

With ``--chat`` every request is a chat of one user message. Its ids need the chat template, so every kvpush case
tokenizes it, even with one decode: ``kvpush`` renders it with the model's template once the first chat rendered as
the decode's ``/tokenize`` did, ``kvpush-remote-tokenize`` asks the decode's ``/tokenize`` each time (what every chat
paid before).

With ``--conversation`` each case's prompts of a length form a conversation: each is the last one and 40 words
more (the instance holds the last one's blocks), from N words up to twice N, then a new one. With two decodes
placement needs such a prompt's blocks, and its head is held, so the router tokenizes it on the path: after
issue 42 only what follows the last prompt (``kvrouter.tokens.Known``), before it the whole text.

One JSON line per (case, length): p50 and p99 of the latency (ms), ``added_p50_ms`` = its p50 minus
``direct``'s, and for routers ``vs_vllm_router`` = its added p50 over vllm-router's, and ``target_ms`` =
max(1 ms, 1.5x vllm-router's added p50): issue 42's bound for kvpush's hop. A table follows the lines.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kvpush.cli import demo_vllm  # noqa: E402
from kvpush.cli.ports import free_port  # noqa: E402
from kvpush.cli.tiny_model import WORDS  # noqa: E402

ROUTER_VENV = HERE / "peers" / "venv-router" / "bin" / "vllm-router"
LENGTHS = (40, 900)
WARM = 8  # rounds of requests before the measured ones (connections, the decode's first prompts of a length)
SPACING_S = 0.02  # between requests: what a router does after an answer (its bookkeeping) lands on nobody's


def _floor(port: int, upstream: str) -> None:
    """A bare aiohttp reverse proxy: the body read and sent on as bytes, the answer streamed back."""
    import asyncio

    import aiohttp
    from aiohttp import web

    async def main() -> None:
        session = aiohttp.ClientSession(auto_decompress=False)

        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with session.post(upstream + request.path, data=body,
                                    headers={"Content-Type": "application/json"}) as reply:
                response = web.StreamResponse(status=reply.status, headers={
                    "Content-Type": reply.headers.get("Content-Type", "application/json")})
                await response.prepare(request)
                async for chunk in reply.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response

        app = web.Application()
        app.router.add_post("/v1/completions", forward)
        app.router.add_post("/v1/chat/completions", forward)
        app.router.add_get("/health", lambda _: web.Response(text="ok"))  # type: ignore[arg-type,return-value]
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def _spawn(name: str, command: list[str], work: Path, started: list[subprocess.Popen[bytes]],
           env: dict[str, str] | None = None) -> None:
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        started.append(subprocess.Popen(["taskset", "-c", "0", *command], stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        env={**os.environ, **(env or {})}))


def stop_helpers(helpers: list[subprocess.Popen[bytes]]) -> None:
    """End every helper ``_spawn`` started (each a session leader: its whole group), SIGKILL after 10 s."""
    for helper in helpers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(helper.pid, signal.SIGTERM)
    for helper in helpers:
        try:
            helper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(helper.pid, signal.SIGKILL)
            helper.wait(timeout=10)


def _ready(url: str, path: str, process: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited ({process.returncode})")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + path, timeout=2) as answer:
                if answer.status == 200:
                    return
        time.sleep(0.3)
    raise RuntimeError(f"{url} not up within {timeout_s:.0f} s")


def _tokenizer_loaded(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
            if b"kvpush_proxy_tokenizer_local 1" in answer.read():
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url}: the router did not load the model's tokenizer within {timeout_s:.0f} s")


def _counters(url: str) -> dict[str, float]:
    """A kvpush router's counts of how it tokenized prompts (its /metrics)."""
    names = ("kvpush_proxy_tokenized_head_total", "kvpush_proxy_tokenized_after_known_total",
             'kvpush_proxy_chats_tokenized_total{where="here"}', 'kvpush_proxy_chats_tokenized_total{where="instance"}')
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        lines = answer.read().decode().splitlines()
    return {name.removeprefix("kvpush_proxy_"): float(line.rsplit(" ", 1)[1])
            for name in names for line in lines if line.startswith(name + " ")}


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Client:
    """One kept-alive HTTP connection to a case's URL."""

    def __init__(self, url: str, chat: bool = False) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=60)
        self.chat = chat

    def ask(self, text: str) -> tuple[float, int]:
        prompt = {"messages": [{"role": "user", "content": text}]} if self.chat else {"prompt": text}
        body = json.dumps({"model": demo_vllm.SERVED, **prompt, "max_tokens": 1, "temperature": 0.0}).encode()
        started = time.perf_counter()
        self.connection.request("POST", "/v1/chat/completions" if self.chat else "/v1/completions", body,
                                {"Content-Type": "application/json"})
        reply = self.connection.getresponse()
        data = reply.read()
        elapsed = time.perf_counter() - started
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {data[:300]!r}")
        return elapsed, int(json.loads(data)["usage"]["prompt_tokens"])


def main() -> int:  # noqa: PLR0915
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30, help="per case and length (default 30)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths in words")
    parser.add_argument("--chat", action="store_true", help="send each prompt as a chat of one user message")
    parser.add_argument("--conversation", action="store_true",
                        help="each prompt of a case and length its last one and 40 words more")
    parser.add_argument("--floor", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor:
        _floor(int(args.floor[0]), args.floor[1])
        return 0
    router_binary = os.environ.get("VLLM_ROUTER") or (str(ROUTER_VENV) if ROUTER_VENV.exists() else None)
    model = demo_vllm._model(demo_vllm.MODEL_DIR)
    work = Path(tempfile.mkdtemp(prefix="kvpush-router-hop-"))
    servers: list[demo_vllm.Server] = []
    helpers: list[subprocess.Popen[bytes]] = []
    try:
        connector = {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.integrations.vllm",
                     "kv_role": "kv_consumer", "kv_port": free_port(span=2), "kv_load_failure_policy": "recompute"}
        decode = demo_vllm._start("decode", model, 1, work, connector)
        servers.append(decode)
        demo_vllm._wait(servers)
        os.sched_setaffinity(0, {0})  # after the servers started: they must not inherit it
        urls = {"direct": decode.url}
        port = free_port()
        _spawn("floor", [sys.executable, __file__, "--floor", str(port), decode.url], work, helpers)
        urls["floor"] = f"http://127.0.0.1:{port}"
        # the same server by another address (IPv4-mapped IPv6): a second decode to the router
        second = ["--decode", decode.url.replace("127.0.0.1", "[::ffff:127.0.0.1]")]
        for case, extra in (("kvpush", []), ("kvpush-2-decodes", second),
                            ("kvpush-remote-tokenize", [*second, "--tokenizer", "none"])):
            port = free_port()
            # the README's setup has a prefill too (here a URL nothing listens on, never used: no prompt reaches
            # the P/D threshold), so every request takes the decode-only route
            _spawn(case, [sys.executable, "-m", "kvpush", "proxy", "--decode", decode.url, "--prefill",
                          f"http://127.0.0.1:{free_port()}",
                          "--pd-min-tokens", "1000000", "--kv-probe-interval", "0", "--port", str(port), *extra],
                   work, helpers)
            urls[case] = f"http://127.0.0.1:{port}"
        if router_binary:
            port, metrics = free_port(), free_port()
            _spawn("vllm-router", [router_binary, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
                                   str(metrics), "--worker-urls", decode.url, "--worker-startup-check-interval", "1"],
                   work, helpers, {"RUST_LOG": "warn"})
            urls["vllm-router"] = f"http://127.0.0.1:{port}"
        else:
            print("vllm-router is not installed (bash bench/peers/setup.sh): its case is left out", file=sys.stderr)
        for (case, url), helper in zip(list(urls.items())[1:], helpers):
            _ready(url, "/v1/models" if case.startswith("kvpush") else "/health", helper)  # (its prefill is down)
        for case, url in urls.items():  # each kvpush router has found and loaded the model's tokenizer
            if case.startswith("kvpush") and "remote" not in case:
                _tokenizer_loaded(url)
        rng = random.Random(7)
        clients = {case: Client(url, args.chat) for case, url in urls.items()}
        lengths = [int(n) for n in args.lengths.split(",")]
        samples: dict[tuple[str, int], list[float]] = {}
        tokens: dict[int, list[int]] = {}
        order = list(clients.items())
        said: dict[tuple[str, int], str] = {}  # --conversation: each case's last prompt of a length

        def prompt(case: str, n: int) -> str:
            if not args.conversation:
                return _text(rng, n)
            last = said.get((case, n))
            said[(case, n)] = _text(rng, n) if last is None or len(last.split()) >= 2 * n \
                else last + " " + _text(rng, 40)
            return said[(case, n)]

        for i in range(WARM + args.requests):  # the first WARM rounds warm every path up and are not counted
            for n in lengths:
                for case, client in order[i % len(order):] + order[:i % len(order)]:  # each case first in turn
                    elapsed, used = client.ask(prompt(case, n))
                    time.sleep(SPACING_S)
                    if i >= WARM:
                        samples.setdefault((case, n), []).append(elapsed * 1e3)
                        tokens.setdefault(n, []).append(used)
        (work / "samples.json").write_text(json.dumps({f"{case} {n}": v for (case, n), v in samples.items()}))
        counted = {case: _counters(url) for case, url in urls.items() if case.startswith("kvpush")}
        rows = []
        for n in lengths:
            p50 = {case: statistics.median(samples[(case, n)]) for case in urls}
            router_added = p50["vllm-router"] - p50["direct"] if "vllm-router" in p50 else None
            for case in urls:
                values = sorted(samples[(case, n)])
                row: dict[str, Any] = {
                    "workload": "ROUTER-HOP", "case": case, "api": "chat" if args.chat else "completions",
                    "prompts": "conversation" if args.conversation else "fresh",
                    "prompt_words": n,
                    "prompt_tokens": int(statistics.median(tokens[n])), "requests": len(values),
                    "p50_ms": round(p50[case], 3), "p99_ms": round(values[min(len(values) - 1,
                                                                                int(len(values) * 0.99))], 3),
                    "added_p50_ms": round(p50[case] - p50["direct"], 3)}
                if case in counted:  # the router's own count of how it tokenized (all lengths)
                    row["router_counters"] = counted[case]
                if router_added is not None and case != "direct":
                    row["vs_vllm_router"] = round((p50[case] - p50["direct"]) / max(router_added, 1e-6), 2)
                    row["target_ms"] = round(max(1.0, 1.5 * router_added), 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
        print("\n| words | tokens | case | p50 ms | p99 ms | added p50 ms | vs vllm-router | target ms |")
        print("|---|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['prompt_words']} | {row['prompt_tokens']} | {row['case']} | {row['p50_ms']:.2f} | "
                  f"{row['p99_ms']:.2f} | {row['added_p50_ms']:+.2f} | {row.get('vs_vllm_router', '')} | "
                  f"{row.get('target_ms', '')} |")
        return 0
    finally:
        stop_helpers(helpers)
        for server in servers:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
