"""A real etcd for tests (Debian's ``etcd-server``): one member on free loopback ports with a data dir of
its own, always stopped (and its data removed) by the test that started it. ``restart`` keeps the data
and the ports, as an operator restarting etcd would."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing() -> str | None:
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian: apt-get install etcd-server)"
    return None


class Etcd:
    def __init__(self) -> None:
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.data = Path(tempfile.mkdtemp(prefix="kvpush-etcd-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.log = self.data.with_suffix(".log")

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> Etcd:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        command = ["etcd", "--name", "default", "--data-dir", str(self.data / "member-data"),
                   "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                   "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}",
                   "--logger=zap", "--log-level=error", "--log-outputs=stderr", "--heartbeat-interval=10",
                   "--election-timeout=100", "--unsafe-no-fsync"]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"etcd exited: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as answer:
                    if b'"true"' in answer.read():
                        return self
            except OSError:
                pass
            time.sleep(0.02)
        raise AssertionError(f"etcd not ready within {timeout_s} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        shutil.rmtree(self.data, ignore_errors=True)
        self.log.unlink(missing_ok=True)
