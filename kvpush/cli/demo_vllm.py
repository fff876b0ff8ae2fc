"""``kvpush demo --vllm``: P/D serving on this host, end to end, with nothing to configure.

It builds (once, into ``~/.cache/kvpush/demo-model``) the tiny Llama of ``kvpush.cli.tiny_model``, serves it
from one plain vLLM instance to measure what a request costs without P/D, stops it, then starts a prefill and
a decode with KvpushConnector (each in its own session, on its own core) and the router in front of them
(``kvpush proxy``, in this process), sends the same requests through it and prints, per request: the route
and why, whether the decode loaded the prompt's KV from the prefill, the first tokens, and the time to first
token against the plain instance. Everything it started is stopped at the end, on errors and on Ctrl-C too.

Needs vLLM's CPU build and the proxy's packages in this Python: ``pip install 'kvpush[vllm,proxy]'`` (then
``pip uninstall -y torchvision torchaudio torchcodec triton``, whose CUDA builds break vLLM's imports).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .ports import free_port

MODEL_DIR = Path.home() / ".cache" / "kvpush" / "demo-model"
SERVED = "demo"
BLOCK = 32
ANSWER_TOKENS = 8
PROMPTS = (("a long prompt", 900, 1), ("another long prompt", 600, 2), ("the first one again, and a question", 900, 1),
           ("a short prompt", 40, 3))
STARTUP_S = 600.0
WARM_UP = [50 + (i * 37) % 1800 for i in range(300)]  # a prompt of its own, sent first to each setup


@dataclass
class Server:
    """A ``vllm serve`` started here: its URL, process (a session leader) and log."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def tree(self) -> list[int]:
        """Its processes: itself and every descendant (a connector worker runs in a session of its own)."""
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        found, frontier = [self.process.pid], [self.process.pid]
        while frontier:
            frontier = [pid for pid, parent in parents.items() if parent in frontier]
            found += frontier
        return found

    def stop(self) -> None:
        pids = self.tree()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=15)


def _start(name: str, model: Path, core: int, work: Path, kv: dict[str, Any] | None) -> Server:
    port = free_port()
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(core))
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
               "--model", str(model), "--served-model-name", SERVED, "--dtype", "float32", "--enforce-eager",
               "--block-size", str(BLOCK), "--max-model-len", "2048", "--max-num-seqs", "8", "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--distributed-executor-backend", "uni", "--seed", "0"]
    if kv is not None:
        command += ["--kv-transfer-config", json.dumps(kv)]
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    return Server(name, f"http://127.0.0.1:{port}", process, log)


def _wait(servers: list[Server]) -> None:
    deadline = time.monotonic() + STARTUP_S
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                tail = server.log.read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{server.name} exited while starting (log {server.log}):\n{tail}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{server.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        pending.remove(server)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not up within {STARTUP_S:.0f} s: {', '.join(s.name for s in pending)}")
        if pending:
            time.sleep(0.5)


def _prompt(length: int, seed: int, extra: int = 0) -> list[int]:
    state = seed * 7919
    ids = []
    for _ in range(length + extra):
        state = (state * 1103515245 + 12345) % (1 << 31)
        ids.append(50 + state % 1800)
    return ids


@dataclass
class Answer:
    tokens: list[int]
    ttft_s: float
    cached: int | None
    route: str
    reason: str


async def _ask(url: str, prompt: list[int]) -> Answer:
    import aiohttp

    body = {"model": SERVED, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens: list[int] = []
    first: float | None = None
    cached = None
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"{url}: HTTP {reply.status}: {(await reply.text())[:300]}")
            route, reason = reply.headers.get("X-Kvpush-Route", "-"), reply.headers.get("X-Kvpush-Reason", "")
            async for raw in reply.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or ():
                    if choice.get("token_ids") and first is None:
                        first = time.monotonic()
                    tokens += choice.get("token_ids") or []
                if chunk.get("usage"):
                    cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return Answer(tokens, (first or time.monotonic()) - started, cached, route, reason)


def _requests() -> list[tuple[str, list[int]]]:
    out = []
    for what, length, seed in PROMPTS:
        extra = 24 if "again" in what else 0  # the first prompt, then a new question: its prefix is cached
        out.append((what, _prompt(length, seed, extra)))
    return out


async def _through_the_router(prefill: Server, decode: Server, kv_port: int) -> list[Answer]:
    import kvrouter
    from kvrouter import server as router

    config = kvrouter.ProxyConfig([kvrouter.parse_prefill(f"{prefill.url}#kv=127.0.0.1:{kv_port}")], [decode.url],
                                  kv_probe_s=0, block_size=BLOCK, policy=kvrouter.Policy(pd_min_tokens=256))
    runner = await router.start(config, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{router.bound_port(runner)}"
        await _ask(url, WARM_UP)  # links the decode to the prefill; not shown
        return [await _ask(url, prompt) for _, prompt in _requests()]
    finally:
        await runner.cleanup()


def _model(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    print(f"building the demo model into {path} (once, ~10 s)", flush=True)
    subprocess.run([sys.executable, "-m", "kvpush.cli.tiny_model", str(path)], check=True, capture_output=True)
    return path


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ("vllm", "aiohttp", "zmq", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"kvpush demo --vllm: needs {', '.join(missing)}: pip install 'kvpush[vllm,proxy]' && pip uninstall -y "
              f"torchvision torchaudio torchcodec triton", file=sys.stderr)
        return 1
    model = _model(Path(args.model) if args.model else MODEL_DIR)
    work = Path(tempfile.mkdtemp(prefix="kvpush-demo-vllm-"))
    started: list[Server] = []
    try:
        print("one plain vLLM instance (core 1): the requests without P/D ...", flush=True)
        plain = _start("plain", model, 1, work, None)
        started.append(plain)
        _wait([plain])
        asyncio.run(_ask(plain.url, WARM_UP))  # its first request is slower; not shown
        alone = [asyncio.run(_ask(plain.url, prompt)) for _, prompt in _requests()]
        plain.stop()
        print("a prefill (core 0) and a decode (core 1) with KvpushConnector, and the router ...", flush=True)
        kv_port = free_port(span=2)  # the prefill listens on it, the decode on the next
        connector = {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.integrations.vllm"}
        prefill = _start("prefill", model, 0, work, {**connector, "kv_role": "kv_producer", "kv_port": kv_port})
        decode = _start("decode", model, 1, work, {**connector, "kv_role": "kv_consumer", "kv_port": kv_port,
                                                    "kv_load_failure_policy": "recompute"})
        started += [prefill, decode]
        _wait([prefill, decode])
        pd = asyncio.run(_through_the_router(prefill, decode, kv_port))
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        print(f"kvpush demo --vllm: {error}", file=sys.stderr)
        return 1
    finally:
        for server in started:
            server.stop()
    return _report(alone, pd, work)


def _report(alone: list[Answer], pd: list[Answer], work: Path) -> int:
    print()
    equal = True
    for (what, prompt), plain, routed in zip(_requests(), alone, pd):
        loaded = routed.cached is not None and routed.cached >= len(prompt) - 1
        equal &= routed.tokens == plain.tokens
        print(f"{what}: {len(prompt)} prompt tokens")
        print(f"  route: {routed.route} ({routed.reason})")
        if routed.route == "pd":
            print(f"  the decode loaded the prompt's KV from the prefill: {'yes' if loaded else 'no'} "
                  f"({routed.cached} of {len(prompt)} prompt tokens cached)")
        else:
            print(f"  the decode computed {len(prompt) - (routed.cached or 0)} prompt tokens itself "
                  f"({routed.cached} cached)")
        print(f"  first tokens: {routed.tokens[:6]} (the plain instance's: {plain.tokens[:6]})")
        print(f"  time to first token: {routed.ttft_s * 1e3:.0f} ms through the router, {plain.ttft_s * 1e3:.0f} ms "
              f"on the plain instance ({routed.ttft_s / plain.ttft_s:.2f}x)")
    print(f"\nanswers {'equal' if equal else 'DIFFERENT from'} the plain instance's; logs in {work}; every process "
          "this demo started is stopped")
    print("(the demo model computes a prompt in milliseconds, so here the hop through the prefill costs more than it "
          "saves;\n with a real model the prefill's compute dominates: see docs/performance/vllm.md)")
    return 0 if equal else 1
