"""Tests that run SGLang for real, in its own venv (``tests/sglang/sglang_venv.py``): the backend between two and more
processes over SGLang's real disaggregation classes, and real SGLang servers on CPU.

The venv is ``$KVPUSH_SGLANG_VENV`` or ``.venv-sglang`` at the repository root. It is built (a few minutes,
once) in CI (``CI`` set, as .ci/run runs), with ``KVPUSH_REQUIRE_SGLANG=1`` or when ``KVPUSH_SGLANG_VENV`` names
a venv to complete; otherwise, without a built venv, these tests are skipped, saying how to build it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sglang_venv  # noqa: E402 - tests/sglang/sglang_venv.py

LOOPBACK_ENV = {"SGLANG_HOST_IP": "127.0.0.1", "UCX_NET_DEVICES": "lo", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "SGLANG_USE_CPU_ENGINE": "1", "PYTHONUNBUFFERED": "1"}


def _required() -> bool:
    return (os.environ.get("KVPUSH_REQUIRE_SGLANG") == "1" or os.environ.get("CI", "").lower() in ("1", "true")
            or bool(os.environ.get("KVPUSH_SGLANG_VENV")))


_BUILD_ERROR: list[BaseException] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build (or check) the SGLang test venv once, after collection and before any test runs, so that no test's
    timeout pays for the build; a failed build fails the SGLang tests with its error."""
    if session.config.option.collectonly or not any(
            "sglang_python" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    if not _required() and not (sglang_venv.venv_dir() / "bin" / "python").exists():
        return
    if not sglang_venv.ready():
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"building the SGLang test venv in {sglang_venv.venv_dir()} (a few minutes, once)")
    try:
        sglang_venv.ensure_venv(log=False)
    except (OSError, subprocess.CalledProcessError) as error:
        _BUILD_ERROR.append(error)


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The SGLang test venv's Python (built before the tests by ``pytest_collection_finish``)."""
    if _BUILD_ERROR:
        pytest.fail(f"the SGLang test venv could not be built: {_BUILD_ERROR[0]}")
    if not _required() and not (sglang_venv.venv_dir() / "bin" / "python").exists():
        pytest.skip("the SGLang test venv is not built: python tests/sglang/sglang_venv.py "
                    "(or KVPUSH_REQUIRE_SGLANG=1)")
    return sglang_venv.ensure_venv()


class Peer:
    """A ``peer.py`` process: one SGLang rank's backend, driven by JSON commands."""

    def __init__(self, python: Path, role: str, port: int, tp_rank: int = 0, tp_size: int = 1,
                 env: dict[str, str] | None = None) -> None:
        self.role = role
        self.process = subprocess.Popen([str(python), str(HERE / "peer.py"), role, str(port), str(tp_rank),
                                         str(tp_size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True,
                                        env={**os.environ, **LOOPBACK_ENV, **(env or {})})
        self.ready: dict[str, Any] | None = None

    def wait_ready(self, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while self.ready is None:
            assert time.monotonic() < deadline, f"{self.role} peer not ready in {timeout} s"
            line = self.process.stdout.readline() if self.process.stdout else ""
            if not line:
                raise AssertionError(f"{self.role} peer exited: {self.stderr_tail()}")
            if line.startswith("{"):
                self.ready = json.loads(line)
        return self.ready

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"{self.role} peer exited during {op}: {self.stderr_tail()}")
        reply: dict[str, Any] = json.loads(line)
        assert "error" not in reply, f"{self.role} {op}: {reply['error']}"
        return reply

    def stderr_tail(self) -> str:
        """Its standard error's end, once it exited (its stdout may close a moment before it does)."""
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            return "(running)"
        return (self.process.stderr.read() if self.process.stderr else "")[-3000:]

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.close()
                self.process.wait(20)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                pass
        self.kill()


def start_peers(python: Path, specs: list[dict[str, Any]]) -> list[Peer]:
    """Start every peer at once (their imports overlap), then wait for each."""
    peers = [Peer(python, **spec) for spec in specs]
    try:
        for peer in peers:
            peer.wait_ready()
    except BaseException:
        for peer in peers:
            peer.stop()
        raise
    return peers


@pytest.fixture(scope="module")
def peer_factory(sglang_python: Path) -> Iterator[Any]:
    started: list[Peer] = []

    def start(specs: list[dict[str, Any]]) -> list[Peer]:
        peers = start_peers(sglang_python, specs)
        started.extend(peers)
        return peers
    yield start
    for peer in started:
        peer.stop()
