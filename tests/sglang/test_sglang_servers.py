"""Real SGLang 0.5.23 servers on CPU (``servers.py``) with ``--disaggregation-transfer-backend kvpush``, loaded as
a plugin: a prefill and a decode behind sglang-router's mini load balancer against a plain instance with the same
flags. One set of servers for the module (about 2-3 minutes on 2 cores, most of it SGLang starting); the last
test kills the prefill.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import servers as sg

PROMPTS = [sg.prompt(5, 1), sg.prompt(100, 2), sg.prompt(200, 3)]
NEW_TOKENS = 24
BASE = 18340  # single, prefill, decode, router: BASE .. BASE + 3; bootstrap: BASE + 10
STARTUP_S = 420
# the module's servers start inside its first test's timeout (pytest-timeout times fixtures too): room for them
pytestmark = pytest.mark.timeout(STARTUP_S + 60 + 120)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-sglang")
    subprocess.run([sys.executable, "-m", "kvpush.cli.tiny_model", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def deployment(sglang_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str,
                                                                                                               Any]]:
    logs = tmp_path_factory.mktemp("sglang-logs")
    token = {"KVPUSH_AUTH_TOKEN": uuid.uuid4().hex}
    single = sg.launch(sglang_python, tiny_model, "single", BASE, logs, cores="0")
    prefill = sg.launch(sglang_python, tiny_model, "prefill", BASE + 1, logs, role="prefill",
                        bootstrap_port=BASE + 10, cores="0", env=token)
    decode = sg.launch(sglang_python, tiny_model, "decode", BASE + 2, logs, role="decode", cores="1", env=token)
    started = [single, prefill, decode]
    try:
        ready_s = sg.wait_ready([single, prefill, decode], STARTUP_S)
        lb = sg.router(sglang_python, prefill, decode, BASE + 3, logs)
        started.append(lb)
        sg.wait_ready([lb], 60)
        print(f"\nSGLang servers ready in {ready_s:.0f} s; logs in {logs}")
        yield {"single": single, "prefill": prefill, "decode": decode, "router": lb, "logs": logs}
    finally:
        for server in reversed(started):
            server.stop()


def test_pd_over_kvpush_gives_the_single_instances_greedy_outputs(deployment: dict[str, Any]) -> None:
    for text in PROMPTS:
        expected = sg.generate(deployment["single"].url, text, NEW_TOKENS)
        got = sg.generate(deployment["router"].url, text, NEW_TOKENS)
        assert got["text"] == expected["text"], (text[:40], got["text"], expected["text"])
        assert got["meta_info"]["completion_tokens"] == NEW_TOKENS
        if "output_ids" in expected:
            assert got["output_ids"] == expected["output_ids"]


def test_the_decode_loaded_the_prompts_kv_instead_of_computing_it(deployment: dict[str, Any]) -> None:
    """SGLang's own counters: the prompts' tokens were computed on the prefill and never on the decode; the
    prefill reports KV transferred; the decode's log shows the backend took the transfers."""
    before = {name: sg.metrics(deployment[name].url) for name in ("prefill", "decode")}
    text = sg.prompt(150, 9)
    sg.generate(deployment["router"].url, text, 4)
    after = {name: sg.metrics(deployment[name].url) for name in ("prefill", "decode")}

    def grew(name: str, key: str) -> float:
        return after[name].get(key, 0.0) - before[name].get(key, 0.0)
    computed_keys = [k for k in after["prefill"] if k.startswith("sglang:realtime_tokens_total") and "prefill" in k]
    assert computed_keys, sorted(k for k in after["prefill"] if "tokens" in k)
    computed = next((k for k in computed_keys if "compute" in k), computed_keys[0])
    assert grew("prefill", computed) >= 100, computed
    assert grew("decode", computed) == 0, computed
    assert grew("prefill", "sglang:kv_transfer_total_mb_count") >= 1
    assert "kvpush SGLang backend: decode" in deployment["decode"].log_tail(10**7)


def test_aborts_mid_transfer_end_each_request_promptly_and_leak_nothing(deployment: dict[str, Any]) -> None:
    router, decode, prefill = deployment["router"], deployment["decode"], deployment["prefill"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = []
        for i, delay in enumerate((0.05, 0.2, 0.5, 1.0)):
            rid = f"abort-{uuid.uuid4().hex}"
            future = pool.submit(sg.generate, router.url, sg.prompt(400, 20 + i), 64, 90, rid=rid)
            time.sleep(delay)
            sg.abort((decode if i % 2 else prefill).url, rid)
            futures.append(future)
        for future in futures:
            try:
                answer = future.result(timeout=60)
                assert answer["elapsed"] < 60
            except urllib.error.HTTPError:
                pass  # an aborted request may come back as an error: it came back
    sg.idle(decode.url)
    sg.idle(prefill.url)
    assert sg.generate(router.url, PROMPTS[1], NEW_TOKENS)["text"] == sg.generate(
        deployment["single"].url, PROMPTS[1], NEW_TOKENS)["text"]


def test_a_killed_prefill_fails_requests_at_once_and_leaves_the_decode_serving(deployment: dict[str, Any]) -> None:
    """Last: it kills the prefill. No request may wait for SGLang's 300 s bootstrap timeout."""
    router, decode = deployment["router"], deployment["decode"]
    prompts = [sg.prompt(300, 40 + i) for i in range(3)]
    assert sg.kill_prefill_under_load(router.url, deployment["prefill"], prompts, 64) < 90
    sg.idle(decode.url, timeout=60)
    with urllib.request.urlopen(decode.url + "/health", timeout=10) as response:
        assert response.status == 200
