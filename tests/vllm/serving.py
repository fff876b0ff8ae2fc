"""Helpers for tests that start ``vllm serve`` processes and ``kvpush proxy`` (standard library only).

Every server is started in its own session (``setsid``), as users run servers (each in its own terminal,
service or container), so ``stop`` ends it with whatever it started (vLLM's engine core, its workers): SIGTERM
to its process group, a bounded wait, then SIGKILL. A session is a scheduler group of its own (CFS autogroup;
cgroups for services and containers): instances in their own sessions share a core group against group,
not thread against thread, which is what the tests must see (docs/perf/notes.md, "instances in their own
sessions").
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from kvpush.cli.ports import free_port

MODEL_NAME = "tiny"
KV_CONNECTOR = {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.integrations.vllm"}


@dataclass
class Server:
    """A started process (a ``vllm serve`` or a proxy): its URL, process, log file."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    _file: BinaryIO | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, chars: int = 4000) -> str:
        try:
            return f"--- {self.name} log ({self.log}) ---\n" + self.log.read_text(errors="replace")[-chars:]
        except OSError as error:
            return f"--- {self.name}: no log ({error}) ---"

    def tree(self) -> list[int]:
        """The pids of every live process this server started, its own included (children by their parent
        pid: a KvpushConnector worker leaves the server's session and process group for a scheduling group of
        its own, ``kvpush.integrations.sched_group``)."""
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
        found, frontier = [self.process.pid], [self.process.pid]
        while frontier:
            frontier = [pid for pid, parent in parents.items() if parent in frontier]
            found += frontier
        return found

    def workers(self) -> list[int]:
        """The pids of this server's ``VLLM::Worker`` processes (one per tensor-parallel rank): where the model
        runs and the connector's kvpush engine lives."""
        found = []
        for pid in self.tree():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().startswith("VLLM::Worker"):
                        found.append(pid)
            except OSError:
                continue
        return sorted(found)

    def signal_workers(self, signum: int) -> None:
        """Send ``signum`` to this server's worker processes (see ``workers``)."""
        for pid in self.workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to every process this server started (its engine core and workers too)."""
        workers = self.workers()  # found first: a worker whose parent a SIGKILL ended is no longer its child
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)
        for pid in workers:  # each in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the group, up to ``grace_s`` for the leader, then SIGKILL to every process it started
        that is left (found before: a worker whose parent died is no longer its child)."""
        try:
            started = self.tree()
            if self.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # whatever of the group is left
            for pid in started[1:]:  # and of the processes that left it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        finally:
            if self._file is not None:
                self._file.close()


def _spawn(name: str, command: Sequence[str], env: Mapping[str, str], log: Path, url: str) -> Server:
    handle = open(log, "ab")  # a server started again on the same log keeps what the one before wrote
    try:
        process = subprocess.Popen(list(command), env=dict(env), stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    except BaseException:
        handle.close()
        raise
    return Server(name, url, process, log, handle)


def start_vllm(name: str, model: Path, core: str, kv_transfer_config: Mapping[str, Any] | None, workdir: Path,
               *extra: str, port: int | None = None, env: Mapping[str, str] | None = None, tp: int = 1) -> Server:
    """``python -m vllm.entrypoints.openai.api_server`` with its OpenMP threads pinned to ``core``
    (``VLLM_CPU_OMP_THREADS_BIND``), loopback only, tests/vllm's engine settings (float32, eager, block
    size 32). Processes: the API server, its ``VLLM::EngineCore`` (scheduler) and a ``VLLM::Worker`` (the
    model and the connector's kvpush engine): vLLM's CPU platform runs the ``uni`` executor's worker in a
    process of its own too. ``tp`` > 1: that many workers (``mp`` executor), rank r's OpenMP threads on
    ``core``'s r-th ``|``-separated core list (e.g. ``"0|1"``)."""
    port = free_port() if port is None else port
    environment = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=core,
                       **(env or {}))
    environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    executor = ["--distributed-executor-backend", "uni"] if tp == 1 else [
        "--distributed-executor-backend", "mp", "--tensor-parallel-size", str(tp)]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *executor,
               "--host", "127.0.0.1", "--port", str(port), "--model", str(model), "--served-model-name", MODEL_NAME,
               "--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "1024",
               "--max-num-seqs", "8", "--enable-prefix-caching", "--seed", "0", "--enable-prompt-tokens-details",
               *extra]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    return _spawn(name, command, environment, workdir / f"{name}.log", f"http://127.0.0.1:{port}")


def kvpush_command() -> list[str]:
    """The kvpush CLI of this Python's environment."""
    script = Path(sys.executable).parent / "kvpush"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvpush"]


def start_proxy(name: str, prefills: Sequence[str], decodes: Sequence[str], workdir: Path, *extra: str,
                timeout_s: float = 60.0) -> Server:
    """``kvpush proxy`` on a free loopback port (``--port 0``; the URL is read from its first line)."""
    command = [*kvpush_command(), "proxy", "--host", "127.0.0.1", "--port", "0", "--timeout", str(timeout_s), "-v",
               *[a for p in prefills for a in ("--prefill", p)], *[a for d in decodes for a in ("--decode", d)],
               *extra]
    log = workdir / f"{name}.log"
    since = log.stat().st_size if log.exists() else 0  # a proxy started before on this log wrote its URL there
    server = _spawn(name, command, dict(os.environ, PYTHONUNBUFFERED="1"), log, "")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"serving (http://127\.0\.0\.1:\d+)", "\n".join(log_lines(server, since=since)))
        if found:
            server.url = found.group(1)
            return server
        if not server.alive():
            break
        time.sleep(0.1)
    text = server.tail()
    server.stop(5)
    raise AssertionError(f"kvpush proxy did not start within 30 s\n{text}")


def vllm_router_command() -> list[str]:
    """vllm-router (PyPI ``vllm-router``, the ``vllm`` extra) of this Python's environment."""
    script = Path(sys.executable).parent / "vllm-router"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm_router.launch_router"]


def start_vllm_router(name: str, prefill: str, decode: str, workdir: Path, kv_connector: str,
                      bootstrap_port: int | None = None, core: str = "0") -> Server:
    """vllm-router in its P/D mode (``--vllm-pd-disaggregation``) over one prefill and one decode, on a free
    loopback port, its threads on ``core``: ``kv_connector`` "nixl" is prefill-first (the prefill's
    ``kv_transfer_params`` relayed to the decode), "mooncake" the Mooncake contract (the router asks the
    prefill's bootstrap server, at ``bootstrap_port``, for its engine ids before it serves)."""
    port = free_port()
    command = ["taskset", "-c", core, *vllm_router_command(), "--vllm-pd-disaggregation", "--kv-connector",
               kv_connector, "--host", "127.0.0.1", "--port", str(port),
               "--prefill", prefill, *([str(bootstrap_port)] if bootstrap_port is not None else []),
               "--decode", decode, "--policy", "round_robin", "--worker-startup-timeout-secs", "120",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return _spawn(name, command, dict(os.environ), workdir / f"{name}.log", f"http://127.0.0.1:{port}")


def healthy(url: str, timeout: float = 3) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except (OSError, http.client.HTTPException):
        return False


def wait_healthy(servers: Sequence[Server], timeout_s: float) -> float:
    """Wait until every server's /health answers 200 (at most ``timeout_s``); the seconds it took."""
    started = time.monotonic()
    pending = list(servers)
    while pending:
        dead = [s for s in pending if not s.alive()]
        assert not dead, "a server exited during start-up\n" + "\n".join(s.tail() for s in dead)
        pending = [s for s in pending if not healthy(s.url)]
        if pending and time.monotonic() - started > timeout_s:
            raise AssertionError(f"not healthy within {timeout_s:g} s\n" + "\n".join(s.tail() for s in pending))
        if pending:
            time.sleep(0.5)
    return time.monotonic() - started


def routable(proxy_url: str, upstream: str) -> bool:
    """Whether the ``kvpush proxy`` at ``proxy_url`` routes to ``upstream`` now (its /metrics): a prefill
    whose kvpush engine stopped answering is held out until a probe is answered again."""
    try:
        with urllib.request.urlopen(f"{proxy_url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException):
        return False
    return re.search(rf'kvpush_proxy_upstream_up{{role="\w+",url="{re.escape(upstream)}"}} 1', text) is not None


def post(url: str, body: Mapping[str, Any], timeout: float = 120,
         headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """POST JSON; (status, JSON body) for success and error statuses alike."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                      **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as error:
        raw = error.read()
        try:
            return int(error.code), json.loads(raw)
        except ValueError:
            return int(error.code), {"raw": raw.decode("utf-8", "replace")}


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout), parts.path


def open_request(url: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None,
                 timeout: float = 120) -> http.client.HTTPConnection:
    """Send a JSON POST and return its connection without reading the answer (see ``hang_up``)."""
    connection, path = _connection(url, timeout)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    return connection


def hang_up(connection: http.client.HTTPConnection) -> None:
    """Close a client connection at once, as a client that leaves does."""
    if connection.sock is not None:
        with contextlib.suppress(OSError):
            connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()


def stream_events(url: str, body: Mapping[str, Any], timeout: float = 120,
                  headers: Mapping[str, str] | None = None) -> Generator[dict[str, Any], None, None]:
    """POST a ``stream`` request and yield its server-sent events' JSON until ``[DONE]``. Closing the
    generator early closes the connection (a client that leaves)."""
    connection = open_request(url, body, headers, timeout)
    try:
        response = connection.getresponse()
        if response.status != 200:
            raise AssertionError(f"{url}: status {response.status}: {response.read()[:2000]!r}")
        for line in response:
            text = line.decode().strip()
            if not text.startswith("data:"):
                continue
            data = text[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
        raise AssertionError(f"{url}: the stream ended without [DONE]")
    finally:
        hang_up(connection)


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def log_lines(server: Server, *needles: str, since: int = 0) -> list[str]:
    """The lines of ``server``'s log (from byte ``since``, see ``log_size``) that contain every one of
    ``needles``."""
    with open(server.log, "rb") as f:
        f.seek(since)
        text = f.read().decode("utf-8", "replace")
    return [line for line in text.splitlines() if all(n in line for n in needles)]


def log_size(server: Server) -> int:
    return server.log.stat().st_size


def metrics(url: str, timeout: float = 5) -> dict[str, float]:
    """A vLLM server's Prometheus samples, ``name{labels}`` (as printed) -> value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values


def metric_sum(values: Mapping[str, float], name: str, label: str = "") -> float:
    """The sum of ``name``'s samples over its labels (only those whose labels contain ``label``)."""
    return sum(v for k, v in values.items() if (k == name or k.startswith(name + "{")) and label in k)
