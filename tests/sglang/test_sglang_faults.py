"""Real SGLang 0.5.23 servers on CPU over kvpush (``servers.py``), each in its own session: a prefill or a decode
that dies strands nothing on the other side, whatever stage its requests are in, and a restarted one serves at
once.

The decode runs with SGLang's prefill heartbeat slowed to 10 minutes and its deferred KV-release timeout raised
to 10 minutes, so what ends its requests and frees their pages here is kvpush (a closed link, a prefill whose
process no longer listens), never those timers. Requests are sent the ways a router does: through
sglang-router's mini load balancer (both halves at once), and decode-only (the decode's half of a request whose
prefill half never came, as a router that gave up on a dead prefill leaves it), so that requests wait on the
decode at each stage when the prefill dies: bootstrapped and waiting for a slot (more of them than the decode's
``--max-running-requests``), granted and waiting for the KV, mid-transfer, and arriving with no bootstrap yet.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import servers as sg

BASE = 18540  # prefill, decode, router: BASE + 1 .. BASE + 3; bootstrap: BASE + 10
STARTUP_S = 420
MAX_RUNNING = 4  # the decode's --max-running-requests (servers.COMMON)
ENDED_S = 20.0  # a request whose other half died ends within this; SGLang's own timers here: 600 s
NEW_TOKENS = 16
REFERENCE = [sg.prompt(40, 61), sg.prompt(250, 62)]
SLOW = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "600",
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "600"}
pytestmark = pytest.mark.timeout(2 * STARTUP_S + 240)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-sglang-faults")
    subprocess.run([sys.executable, "-m", "kvpush.cli.tiny_model", str(path)], check=True, capture_output=True)
    return path


class Deployment:
    """A prefill, a decode and sglang-router in front of them; either server can be killed and started again
    on the same ports."""

    def __init__(self, python: Path, model: Path, logs: Path) -> None:
        self.python, self.model, self.logs = python, model, logs
        self.env = {"KVPUSH_AUTH_TOKEN": uuid.uuid4().hex}
        self.starts = 0
        self.prefill = self._launch("prefill")
        self.decode = self._launch("decode")
        self.router: sg.Server | None = None
        self.reference: dict[str, str] = {}

    def _launch(self, role: str) -> sg.Server:
        self.starts += 1
        port, core = (BASE + 1, "0") if role == "prefill" else (BASE + 2, "1")
        return sg.launch(self.python, self.model, f"{role}-{self.starts}", port, self.logs, role=role,
                         bootstrap_port=BASE + 10 if role == "prefill" else None, cores=core,
                         env={**self.env, **(SLOW if role == "decode" else {})})

    def restart(self, role: str) -> float:
        """Start ``role`` again (after a kill) and wait until it is healthy; returns the seconds it took."""
        server = self._launch(role)
        setattr(self, role, server)
        return sg.wait_ready([server], STARTUP_S)

    def revive(self) -> None:
        """Start again a server an earlier test killed and left dead (it failed before restarting it), so that
        each test's verdict is its own."""
        for role in ("prefill", "decode"):
            if not getattr(self, role).alive():
                self.restart(role)

    def servers(self) -> list[sg.Server]:
        return [server for server in (self.router, self.decode, self.prefill) if server is not None]


@pytest.fixture(scope="module")
def deployment(sglang_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        Deployment]:
    pd = Deployment(sglang_python, tiny_model, tmp_path_factory.mktemp("sglang-fault-logs"))
    try:
        ready_s = sg.wait_ready([pd.prefill, pd.decode], STARTUP_S)
        pd.router = sg.router(sglang_python, pd.prefill, pd.decode, BASE + 3, pd.logs)
        sg.wait_ready([pd.router], 60)
        pd.reference = {text: sg.generate(pd.router.url, text, NEW_TOKENS)["text"] for text in REFERENCE}
        print(f"\nSGLang servers ready in {ready_s:.0f} s; logs in {pd.logs}")
        yield pd
    finally:
        for server in pd.servers():
            server.stop()


def _decode_only(decode: sg.Server, text: str, timeout: float = 120) -> dict[str, Any]:
    """The decode's half of a request whose prefill half never came: how it ended and when."""
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": BASE + 10, "bootstrap_room": random.getrandbits(62)}
    request = urllib.request.Request(decode.url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            outcome = f"HTTP {response.status}: {response.read()[:200]!r}"
    except urllib.error.HTTPError as error:
        outcome = f"HTTP {error.code}: {error.read()[:200]!r}"
    except OSError as error:
        outcome = f"{type(error).__name__}: {error}"
    return {"outcome": outcome, "ended": time.monotonic()}


class Load:
    """``clients`` threads sending requests through the router, one after another, until stopped."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.stop, self.ends = url, threading.Event(), []
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, k: int) -> None:
        for i in range(10_000):
            if self.stop.is_set():
                return
            try:
                sg.generate(self.url, sg.prompt(200 + 20 * k, 1000 * k + i), 48, timeout=120)
            except OSError:  # an error answer or a refused connection: it ended, which is what is asked
                time.sleep(0.05)
            self.ends.append(time.monotonic())

    def finish(self, timeout: float) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in self.threads), "a request through the router hung"


def _wait_held(server: sg.Server, at_least: int, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        busy = sg.held(server.url)
        waiting = busy["decode_prealloc_queue_reqs"] + busy["decode_transfer_queue_reqs"]
        if waiting >= at_least or time.monotonic() > deadline:
            assert waiting >= at_least, f"{server.name} holds {busy}"
            return busy
        time.sleep(0.2)


def _kvpush_lines(server: sg.Server, last: int = 40) -> str:
    """The last lines of ``server``'s log that kvpush wrote or that name it (what a failure report needs)."""
    lines = [line for line in server.log_tail(10**7).splitlines() if "kvpush" in line or "link to cluster" in line]
    return "\n".join(line[:400] for line in lines[-last:])


def _restarted_serves_at_once(pd: Deployment, role: str) -> None:
    """Start ``role`` again: the first requests through the router after its health check give the answers
    they gave before any fault, and neither side holds anything after."""
    assert pd.router is not None
    restart_s = pd.restart(role)
    slowest = 0.0
    for text, expected in pd.reference.items():
        answer = sg.generate(pd.router.url, text, NEW_TOKENS, timeout=60)
        assert answer["text"] == expected, (text[:40], answer["text"], expected)
        slowest = max(slowest, answer["elapsed"])
    print(f"{role} restarted in {restart_s:.0f} s; its first requests answered as before, the slowest in "
          f"{slowest:.2f} s")
    sg.idle(pd.decode.url, ENDED_S)
    sg.idle(pd.prefill.url, ENDED_S)


def test_a_killed_prefill_strands_no_decode_request_and_a_restarted_one_serves_at_once(deployment: Deployment
                                                                                       ) -> None:
    pd = deployment
    assert pd.router is not None
    pd.revive()
    # decode-only requests, twice the decode's running slots: some granted and waiting for their KV (linked,
    # no transfer coming), the rest bootstrapped and waiting for a slot; and a load through the router
    # (requests mid-transfer when the prefill dies)
    with concurrent.futures.ThreadPoolExecutor(2 * MAX_RUNNING + 4) as pool:
        stranded = [pool.submit(_decode_only, pd.decode, sg.prompt(300, 70 + i)) for i in range(2 * MAX_RUNNING)]
        before = _wait_held(pd.decode, 2 * MAX_RUNNING)
        load = Load(pd.router.url, 3)
        time.sleep(1.5)
        pd.prefill.stop(grace=0)  # SIGKILL to its process group
        killed = time.monotonic()
        _, pending = concurrent.futures.wait(stranded, timeout=ENDED_S + 30)
        assert not pending, (f"{len(pending)} decode-only requests still wait {ENDED_S + 30:.0f} s after the "
                             f"prefill's kill; the decode holds {sg.held(pd.decode.url)}; its kvpush log:\n"
                             + _kvpush_lines(pd.decode))
        ends = [future.result() for future in stranded]
        late = [round(end["ended"] - killed, 1) for end in ends]
        print(f"\nheld by the decode at the kill: {before}\ndecode-only requests ended {late} s after the kill: "
              f"{ends[0]['outcome']}")
        assert max(late) < ENDED_S, late
        load.finish(ENDED_S + 30)
        freed = sg.idle(pd.decode.url, ENDED_S)
        print(f"decode idle {time.monotonic() - killed:.1f} s after the kill: {freed}")
        # no bootstrap yet: requests that come to the decode while the prefill is dead end at once
        started = time.monotonic()
        late_comers = [pool.submit(_decode_only, pd.decode, sg.prompt(100, 90 + i)) for i in range(3)]
        ended = [round(future.result(timeout=ENDED_S + 30)["ended"] - started, 1) for future in late_comers]
        print(f"decode-only requests to the dead prefill ended after {ended} s")
        assert max(ended) < ENDED_S, ended
        sg.idle(pd.decode.url, ENDED_S)
    _restarted_serves_at_once(pd, "prefill")
    log = pd.decode.log_tail(10**7)
    assert "is gone" in log and "its requests fail now" in log, "kvpush did not end the requests"


def test_a_killed_decode_strands_no_prefill_request_and_a_restarted_one_serves_at_once(deployment: Deployment
                                                                                      ) -> None:
    pd = deployment
    assert pd.router is not None
    pd.revive()
    load = Load(pd.router.url, 2 * MAX_RUNNING)
    time.sleep(3)
    pd.decode.stop(grace=0)
    killed = time.monotonic()
    load.finish(ENDED_S + 30)
    print(f"\nrequests through the router ended {max(load.ends) - killed:.1f} s after the decode's kill at most")
    freed = sg.idle(pd.prefill.url, ENDED_S)
    print(f"prefill idle {time.monotonic() - killed:.1f} s after the kill: {freed}")
    _restarted_serves_at_once(pd, "decode")
