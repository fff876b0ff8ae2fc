"""A sliding-window model on real SGLang 0.5.23 servers on CPU (``servers.py``): a tiny Gemma-3-shaped model
(``kvpush.cli.tiny_model --arch gemma3``: three layers attending to a 128-token window, every fourth to everything),
a prefill and a decode with ``--disaggregation-transfer-backend kvpush`` behind sglang-router's mini load balancer,
against a plain instance. SGLang keeps a Gemma 3's window layers in its one KV pool (its ``gemma2_gemma3`` model
override turns its hybrid SWA pool off), so the prompt's pages move as any model's; a model whose window layers keep
a sub-pool of their own (gpt-oss) and the hybrids with a Mamba state do not run on SGLang's CPU build, and their
pools are tested over SGLang's real classes in two processes (test_sglang_state_pools.py). Last, the prefill is
killed mid-transfer: every request in flight ends at once. One set of servers for the module (2-3 minutes).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import servers as sg

PROMPTS = [sg.prompt(words, 50 + words) for words in (6, 100, 600, 1500)]
NEW_TOKENS = 16
BASE = 18640  # single, prefill, decode, router: BASE .. BASE + 3; bootstrap: BASE + 10
STARTUP_S = 420
pytestmark = pytest.mark.timeout(STARTUP_S + 60 + 180)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gemma3-sglang")
    subprocess.run([sys.executable, "-m", "kvpush.cli.tiny_model", str(path), "--arch", "gemma3", "--layers", "4"],
                   check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def deployment(sglang_python: Path, gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("sglang-gemma3-logs")
    token = {"KVPUSH_AUTH_TOKEN": uuid.uuid4().hex}
    single = sg.launch(sglang_python, gemma3, "single", BASE, logs, cores="0")
    prefill = sg.launch(sglang_python, gemma3, "prefill", BASE + 1, logs, role="prefill", bootstrap_port=BASE + 10,
                        cores="0", env=token)
    decode = sg.launch(sglang_python, gemma3, "decode", BASE + 2, logs, role="decode", cores="1", env=token)
    started = [single, prefill, decode]
    try:
        sg.wait_ready(started, STARTUP_S)
        lb = sg.router(sglang_python, prefill, decode, BASE + 3, logs)
        started.append(lb)
        sg.wait_ready([lb], 60)
        yield {"single": single, "prefill": prefill, "decode": decode, "router": lb}
    finally:
        for server in reversed(started):
            server.stop()


def test_a_sliding_window_model_gives_the_single_instances_outputs_from_the_prompts_pushed_kv(
        deployment: dict[str, Any]) -> None:
    before = {name: sg.metrics(deployment[name].url) for name in ("prefill", "decode")}
    for text in PROMPTS:
        expected = sg.generate(deployment["single"].url, text, NEW_TOKENS)
        got = sg.generate(deployment["router"].url, text, NEW_TOKENS)
        print(f"{got['meta_info']['prompt_tokens']} prompt tokens: equal {got['text'] == expected['text']}")
        assert got["text"] == expected["text"], (text[:40], got["text"], expected["text"])
    after = {name: sg.metrics(deployment[name].url) for name in ("prefill", "decode")}
    computed = [k for k in after["prefill"] if k.startswith("sglang:realtime_tokens_total") and "prefill" in k]
    assert computed, sorted(k for k in after["prefill"] if "tokens" in k)
    key = next((k for k in computed if "compute" in k), computed[0])
    grew = {name: after[name].get(key, 0.0) - before[name].get(key, 0.0) for name in after}
    assert grew["prefill"] >= 1500 and grew["decode"] == 0, (key, grew)  # the prompts computed there, not here
    log = deployment["decode"].log_tail(10**7)
    assert "kvpush SGLang backend: decode" in log and "state pools beside the KV" not in log  # one pool, as any


def test_a_prefill_killed_mid_transfer_ends_every_request_in_flight_at_once(deployment: dict[str, Any]) -> None:
    """Last: it kills the prefill. A prompt failure, promptly, never SGLang's 300 s bootstrap timeout; the decode
    serves on, holding nothing."""
    router, decode = deployment["router"], deployment["decode"]
    prompts = [sg.prompt(600, 70 + i) for i in range(3)]
    assert sg.kill_prefill_under_load(router.url, deployment["prefill"], prompts, 32) < 90
    assert not any(sg.idle(decode.url, timeout=60).values())
