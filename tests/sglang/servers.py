"""Real SGLang servers on CPU for the tests and the benchmark: a plain instance, a prefill and a decode with a
transfer backend (kvpush, or SGLang's own ``mooncake_tcp``), and sglang-router's mini load balancer in front of
the pair. Standard library only; every process starts in its own session and is stopped by its group.

The flags are the CPU recipe measured on a 2-core host (docs/guides/sglang.md): torch-native attention, no CUDA
graphs, no overlap schedule, a small KV pool, and on the decode ``--disaggregation-decode-retraction-backup
cpu_tensor`` (its default host pool asserts CUDA).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMMON = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
          "--disable-cuda-graph", "--dtype", "float32", "--max-total-tokens", "4096", "--max-running-requests", "4",
          "--mem-fraction-static", "0.05", "--enable-metrics", "--log-level", "info"]
ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1", "SGLANG_PLUGINS": "kvpush"}
WORDS = ("the cache block layer prefill decode push token model engine request server kernel memory page tensor "
         "head value key attention batch queue stream link cluster transfer river mountain city garden window").split()


def prompt(words: int, seed: int) -> str:
    """A deterministic prompt of about ``words`` tokens."""
    return " ".join(WORDS[(seed * 7 + i * i + i * seed) % len(WORDS)] for i in range(words))


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, grace: float = 15) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace`` seconds (SGLang's children
        included: they share the group)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)


def _spawn(name: str, command: list[str], log: Path, env: dict[str, str], url: str, **extra: Any) -> Server:
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **ENV, **env})
    return Server(name, url, process, log, extra)


def launch(python: Path, model: Path, name: str, port: int, log_dir: Path, *, role: str = "single",  # noqa: PLR0913
           backend: str = "kvpush", bootstrap_port: int | None = None, cores: str = "all",
           env: dict[str, str] | None = None, pin: str | None = None, args: tuple[str, ...] = ()) -> Server:
    """``python -m sglang.launch_server`` for ``role`` single, prefill or decode (without waiting). ``pin``: the
    whole server (every process it starts) on these cores (``taskset``) with one OpenMP thread: on CPUs without
    AMX, SGLang's own ``SGLANG_CPU_OMP_THREADS_BIND`` binds nothing. ``args``: more flags for the server."""
    command = [*(["taskset", "-c", pin] if pin is not None else []), str(python), "-m", "sglang.launch_server",
               "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port), *COMMON, *args]
    if pin is not None:
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
    if role != "single":
        command += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", backend]
    if role == "prefill":
        assert bootstrap_port is not None
        command += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    if role == "decode":
        command += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return _spawn(name, command, log_dir / f"{name}.log", {"SGLANG_CPU_OMP_THREADS_BIND": cores, **(env or {})},
                  f"http://127.0.0.1:{port}", role=role, bootstrap_port=bootstrap_port)


def router(python: Path, prefill: Server, decode: Server, port: int, log_dir: Path, name: str = "router") -> Server:
    """sglang-router's mini load balancer in PD mode in front of ``prefill`` and ``decode``."""
    command = [str(python), "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb", "--prefill",
               prefill.url, str(prefill.extra["bootstrap_port"]), "--decode", decode.url, "--host", "127.0.0.1",
               "--port", str(port)]
    return _spawn(name, command, log_dir / f"{name}.log", {}, f"http://127.0.0.1:{port}")


def wait_ready(servers: list[Server], timeout: float, path: str = "/health") -> float:
    """Wait until every server answers ``path`` with 200; raise (with the log's tail) if one exits or the
    time runs out. Returns the seconds waited."""
    started = time.monotonic()
    pending = list(servers)
    while pending:
        for server in list(pending):
            if not server.alive():
                raise RuntimeError(f"{server.name} exited ({server.process.returncode}):\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(server.url + path, timeout=5) as response:
                    if response.status == 200:
                        pending.remove(server)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() - started > timeout:
            raise RuntimeError(f"{pending[0].name} not ready in {timeout:.0f} s:\n{pending[0].log_tail()}")
        if pending:
            time.sleep(1)
    return time.monotonic() - started


def generate(url: str, text: str, max_new_tokens: int, timeout: float = 120, **extra: Any) -> dict[str, Any]:
    """One greedy ``/generate``; returns SGLang's answer and the seconds it took (``elapsed``)."""
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                              "ignore_eos": True}, **extra}
    request = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer: dict[str, Any] = json.loads(response.read())
    answer["elapsed"] = time.monotonic() - started
    return answer


def first_token_seconds(url: str, text: str, timeout: float = 120, **extra: Any) -> float:
    """Time to the first streamed chunk of a greedy ``/generate`` (TTFT as a client sees it); ``extra``: more
    fields of the body (a P/D leg's bootstrap fields)."""
    body = {"text": text, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 2,
                                                              "ignore_eos": True}, **extra}
    request = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                first = time.monotonic() - started
                response.read()
                return first
    raise RuntimeError("the stream ended without a token")


def metrics(url: str) -> dict[str, float]:
    """A server's Prometheus metrics, summed over labels (``name`` -> value; ``name{labels}`` kept too)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        values[key] = number
        name = key.split("{", 1)[0]
        if "{" in key:
            values[name] = values.get(name, 0.0) + number
    return values


def held(url: str) -> dict[str, float]:
    """What a server holds now, asked of its scheduler (``/v1/loads``; the Prometheus gauges are updated only
    with batches, so an idle scheduler's are stale): running and waiting requests (a decode's waiting ones
    include those waiting for a slot or for their KV, a prefill's those waiting for their decode), each
    disaggregation queue, and the KV tokens in use (pages a request holds, not the prefix cache)."""
    with urllib.request.urlopen(url + "/v1/loads", timeout=10) as response:
        load = json.loads(response.read())["loads"][0]
    queues = {key: float(value) for key, value in (load.get("disaggregation") or {}).items()
              if key.endswith("_queue_reqs")}
    return {"running": float(load["num_running_reqs"]), "waiting": float(load["num_waiting_reqs"]),
            "used_tokens": float(load["num_used_tokens"]), **queues}


def idle(url: str, timeout: float = 30) -> dict[str, float]:
    """Wait until a server holds no request and no KV token; AssertionError naming what it holds if it still
    does after ``timeout`` seconds. Returns what it held last (all zero)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = held(url)
        if not any(busy.values()) or time.monotonic() > deadline:
            assert not any(busy.values()), f"{url} still holds {busy}"
            return busy
        time.sleep(0.5)


def kill_prefill_under_load(router_url: str, prefill: Server, prompts: list[str], new_tokens: int) -> float:
    """Send ``prompts`` through the router at once, SIGKILL the prefill a second later (mid-transfer), and wait for
    every answer, a failure included; the seconds until the last one came back."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        started = time.monotonic()
        futures = [pool.submit(generate, router_url, text, new_tokens, 120) for text in prompts]
        time.sleep(1.0)
        prefill.process.send_signal(signal.SIGKILL)
        prefill.stop(grace=0)
        for future in futures:
            try:
                future.result(timeout=90)
            except (urllib.error.URLError, OSError, TimeoutError):
                pass  # failed: fine, as long as it returned
        return time.monotonic() - started


def abort(url: str, rid: str) -> None:
    """SGLang's ``/abort_request`` for ``rid``."""
    request = urllib.request.Request(url + "/abort_request", json.dumps({"rid": rid}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10):
        pass
