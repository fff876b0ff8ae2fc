"""A P/D fleet on real vLLM and a real etcd: instances register themselves (KvpushConnector's
``discovery`` and ``advertise_url``) and ``kvpush proxy --discovery`` routes over them.

Steps, one test: prefill A and a decode register and serve (outputs equal a single instance's, every
prompt token cached on the decode); prefill B starts later and gets requests; A is killed with SIGKILL
under a client's steady load: it leaves the registry within the lease's TTL and no request fails (they go
to B, or the decode computes them alone); etcd is restarted mid-run and the clients see nothing of it.
``kvpush fleet --json`` is read at each step.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from etcdserver import Etcd, missing  # noqa: E402
from serving import (  # noqa: E402
    KV_CONNECTOR,
    MODEL_NAME,
    Server,
    free_port,
    kvpush_command,
    metric_sum,
    metrics,
    post,
    start_proxy,
    start_vllm,
    wait_for,
    wait_healthy,
)

from kvpush.fleet import TTL_S  # noqa: E402

MAX_TOKENS = 8
STARTUP_S = 400.0
_rng = random.Random(20261204)
PROMPTS = [[_rng.randrange(50, 1900) for _ in range(_rng.choice((12, 40, 70, 150)))] for _ in range(40)]


def _fleet(discovery: str) -> list[dict[str, Any]]:
    listed = subprocess.run([*kvpush_command(), "fleet", "--discovery", discovery, "--json"], capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows: list[dict[str, Any]] = json.loads(listed.stdout)
    return rows


def _urls(rows: list[dict[str, Any]], role: str) -> set[str]:
    return {row["url"] for row in rows if row["role"] == role and row["state"] == "ready"}


def _complete(url: str, index: int, timeout: float = 120) -> tuple[int, list[int], int | None]:
    status, answer = post(f"{url}/v1/completions", {"model": MODEL_NAME, "prompt": PROMPTS[index],
                                                    "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                                                    "return_token_ids": True}, timeout=timeout)
    if status != 200:
        return status, [], None
    cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return status, answer["choices"][0]["token_ids"], cached


@pytest.mark.timeout(2 * STARTUP_S + 300)
def test_a_fleet_registers_itself_and_serves_through_instances_coming_dying_and_etcd_restarting(
        tiny_model: Path, tmp_path: Path) -> None:
    problem = missing()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    etcd = Etcd().start()
    servers: dict[str, Server] = {}
    (tmp_path / "requests.json").write_text(json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS}))
    reference_run = subprocess.Popen(
        [sys.executable, str(HERE / "single_reference.py"), str(tiny_model), "--requests",
         str(tmp_path / "requests.json"), "--out", str(tmp_path / "reference.json"), "--core", "1"],
        env=dict(os.environ, VLLM_HOST_IP="127.0.0.1"), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        def start(name: str, role: str, core: str) -> Server:
            port, kv_port = free_port(), free_port(span=2)
            extra = {"discovery": etcd.url, "advertise_url": f"http://127.0.0.1:{port}"}
            config = {**KV_CONNECTOR, "kv_role": role, "kv_port": kv_port, "kv_connector_extra_config": extra}
            if role == "kv_consumer":
                config["kv_load_failure_policy"] = "recompute"
            servers[name] = start_vllm(name, tiny_model, core, config, tmp_path, port=port)
            return servers[name]

        start("prefill-a", "kv_producer", "0")
        start("decode", "kv_consumer", "1")
        wait_healthy([servers["prefill-a"], servers["decode"]], STARTUP_S)
        assert reference_run.wait(timeout=STARTUP_S) == 0
        reference = [row["tokens"] for row in json.loads((tmp_path / "reference.json").read_text())["prompts"]]
        servers["proxy"] = start_proxy("proxy", [], [], tmp_path, "--discovery", etcd.url, "--retry-for", "60",
                                       "--static")
        assert wait_for(lambda: _urls(_fleet(etcd.url), "prefill") == {servers["prefill-a"].url}
                        and _urls(_fleet(etcd.url), "decode") == {servers["decode"].url}, 20)
        print(f"\nregistered: {[(r['role'], r['url'], r['kv'], r['state']) for r in _fleet(etcd.url)]}")

        failures: list[str] = []
        answered: list[tuple[int, bool, int | None]] = []

        def ask(index: int) -> None:
            status, tokens, cached = _complete(servers["proxy"].url, index)
            answered.append((index, tokens == reference[index], cached))
            if status != 200 or tokens != reference[index]:
                failures.append(f"prompt {index}: status {status}, tokens equal {tokens == reference[index]}")

        for index in range(6):  # A and the decode: the prompts' KV comes through kvpush
            ask(index)
        assert not failures, failures
        assert all(cached is not None and cached >= len(PROMPTS[i]) - 1 for i, _, cached in answered), answered

        start("prefill-b", "kv_producer", "0")  # a prefill that starts later gets traffic
        wait_healthy([servers["prefill-b"]], STARTUP_S)
        assert wait_for(lambda: servers["prefill-b"].url in _urls(_fleet(etcd.url), "prefill"), 20)
        for index in range(6, 12):
            ask(index)
        served_b = metric_sum(metrics(servers["prefill-b"].url), "vllm:request_success_total")
        print(f"prefill B answered {served_b:g} of 6 requests after it registered")
        assert served_b >= 1 and not failures, failures

        stop = threading.Event()

        def steady() -> None:  # one client, all the time, polite
            index = 12
            while not stop.is_set() and index < len(PROMPTS):
                ask(index)
                index += 1
                time.sleep(0.3)

        client = threading.Thread(target=steady)
        client.start()
        try:
            time.sleep(1.0)
            servers["prefill-a"].signal_group(signal.SIGKILL)
            killed = time.monotonic()
            assert wait_for(lambda: servers["prefill-a"].url not in _urls(_fleet(etcd.url), "prefill"),
                            TTL_S + 5, 0.5), "prefill A stayed registered"
            gone = time.monotonic() - killed
            etcd.restart()  # etcd restarted mid-run: nothing changes for the clients
            restarted = time.monotonic()
            time.sleep(3.0)
        finally:
            stop.set()
            client.join(timeout=180)
        print(f"prefill A left the registry {gone:.1f} s after its SIGKILL (TTL {TTL_S} s); etcd restarted "
              f"{restarted - killed:.1f} s after the kill; {len(answered) - 12} requests meanwhile, "
              f"{len(failures)} failed")
        assert not client.is_alive() and not failures, failures
        rows = _fleet(etcd.url)
        print(f"after: {[(r['role'], r['url'], r['state']) for r in rows]}")
        assert _urls(rows, "prefill") == {servers["prefill-b"].url} and _urls(rows, "decode") == {
            servers["decode"].url}
        status, tokens, cached = _complete(servers["proxy"].url, 0)
        assert status == 200 and tokens == reference[0]
    finally:
        if reference_run.poll() is None:
            reference_run.kill()
        reference_run.wait(timeout=30)
        for name in ("proxy", "decode", "prefill-b", "prefill-a"):
            if name in servers:
                servers[name].stop()
        etcd.stop()
