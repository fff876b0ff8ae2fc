"""``kvpush demo --vllm``: P/D serving on this host, end to end, with nothing to configure.

It builds (once, into ``~/.cache/kvpush/demo-model``) the tiny Llama of ``kvpush.cli.tiny_model``, serves it
from one plain vLLM instance (on core 0, where the prefill will compute) to measure what a request costs without
P/D, stops it, then starts a prefill and a decode with KvpushConnector (each in its own session, on its own
core) and the router in front of them (``kvpush proxy``, in this process, warming the pair's link before it
listens), sends the same requests through it and prints, per request: the route and why, whether the decode
loaded the prompt's KV from the prefill, the first tokens, and the time to first token against the plain
instance: the median of ``REPEATS`` requests of the same shape on each (a new prompt each time, or the same
cached history with a new question), on one kept-alive connection, so the ratio compares like with like. The
very first request after start-up is timed too, beside the next of its kind. Everything it started is stopped
at the end, on errors and on Ctrl-C too.

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
import shutil
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
REPEATS = 5  # requests of each shape timed (the first is the one shown)
PLAIN_CORE = 0  # the plain instance computes where the prefill will


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
    # the whole server on its core (its HTTP front end too, which would otherwise share the other engine's core)
    pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    command = [*pin, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port",
               str(port), "--model", str(model), "--served-model-name", SERVED, "--dtype", "float32", "--enforce-eager",
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


async def _ask(session: Any, url: str, prompt: list[int]) -> Answer:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens: list[int] = []
    first: float | None = None
    cached = None
    started = time.monotonic()
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


def _requests() -> list[tuple[str, list[list[int]]]]:
    """Each row: what it is, and its ``REPEATS`` prompts (the one shown first; then new ones of its shape)."""
    out = []
    for what, length, seed in PROMPTS:
        if "again" in what:  # the first prompt, then a new question: its prefix is cached
            first = _prompt(length, seed)
            prompts = [first + _prompt(24, 1000 + 7 * i)[:24] for i in range(REPEATS)]
        else:
            prompts = [_prompt(length, seed + 100 * i) for i in range(REPEATS)]
        out.append((what, prompts))
    return out


async def _each(url: str) -> list[list[Answer]]:
    """Every row's requests, on one session; the first prompt of a row again before its repeats (so a row whose
    prompt is cached finds it cached every time)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        rows = []
        for _, prompts in _requests():
            rows.append([await _ask(session, url, prompt) for prompt in prompts])
        return rows


async def _through_the_router(prefill: Server, decode: Server, kv_port: int) -> list[list[Answer]]:
    import kvrouter
    from kvrouter import server as router

    config = kvrouter.ProxyConfig([kvrouter.parse_prefill(f"{prefill.url}#kv=127.0.0.1:{kv_port}")], [decode.url],
                                  kv_probe_s=0, block_size=BLOCK, policy=kvrouter.Policy(),
                                  warm_links=True)
    runner = await router.start(config, "127.0.0.1", 0)  # (the pair's link is warmed before it returns)
    try:
        return await _each(f"http://127.0.0.1:{router.bound_port(runner)}")
    finally:
        await runner.cleanup()


def _model(path: Path) -> Path:
    # (a demo model built before it carried its chat template is built again)
    if (path / "config.json").exists() and (path != MODEL_DIR or (path / "chat_template.jinja").exists()):
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
        print(f"one plain vLLM instance (core {PLAIN_CORE}): the requests without P/D ...", flush=True)
        plain = _start("plain", model, PLAIN_CORE, work, None)
        started.append(plain)
        _wait([plain])
        alone = asyncio.run(_each(plain.url))
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


def _report(alone: list[list[Answer]], pd: list[list[Answer]], work: Path) -> int:
    print()
    equal = True
    for (what, prompts), plain_row, routed_row in zip(_requests(), alone, pd):
        prompt, plain, routed = prompts[0], plain_row[0], routed_row[0]
        loaded = routed.cached is not None and routed.cached >= len(prompt) - 1
        equal &= all(r.tokens == p.tokens for r, p in zip(routed_row, plain_row))
        print(f"{what}: {len(prompt)} prompt tokens")
        print(f"  route: {routed.route} ({routed.reason})")
        if routed.route == "pd":
            print(f"  the decode loaded the prompt's KV from the prefill: {'yes' if loaded else 'no'} "
                  f"({routed.cached} of {len(prompt)} prompt tokens cached)")
        else:
            print(f"  the decode computed {len(prompt) - (routed.cached or 0)} prompt tokens itself "
                  f"({routed.cached} cached)")
        print(f"  first tokens: {routed.tokens[:6]} (the plain instance's: {plain.tokens[:6]})")
        through, single = _median(routed_row[1:]), _median(plain_row[1:])
        print(f"  time to first token, the median of {REPEATS - 1} more like it: {through:.0f} ms through the "
              f"router, {single:.0f} ms on the plain instance ({through / single:.2f}x)")
    first, next_ = pd[0][0].ttft_s * 1e3, _median(pd[0][1:])
    print(f"\nthe very first request after start-up: {first:.0f} ms to its first token, the next like it "
          f"{next_:.0f} ms ({first / next_:.2f}x: the router warmed the prefill-decode link before it listened)")
    print(f"answers {'equal' if equal else 'DIFFERENT from'} the plain instance's; logs in {work}; every process "
          "this demo started is stopped")
    print("(the demo model computes a 900-token prompt in about 25 ms, so every millisecond that is not compute\n"
          " shows: here the router and this client share one process, and the two engines' HTTP front ends\n"
          " share their two cores. Measured apart: the router's hop adds 1-2 ms (bench/router_hop.py), and P/D\n"
          " with each engine pinned takes 1.0-1.2x a single instance's time to first token (bench/vllm_bench.py);\n"
          " with a real model the prefill's compute dominates: see docs/performance/vllm.md. The router\n"
          " disaggregates from 128 uncached tokens, its default: P/D adds a few ms to a request's first token\n"
          " and spares the decode's running requests the prompt's compute; docs/performance/load.md has the runs)")
    return 0 if equal else 1


def _median(answers: list[Answer]) -> float:
    times = sorted(a.ttft_s * 1e3 for a in answers)
    return times[len(times) // 2] if len(times) % 2 else (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2
