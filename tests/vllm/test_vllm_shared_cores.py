"""More vLLM instances than cores, each in its own session as users start them: two prefills and a decode behind
``kvpush proxy`` on this 2-core host (prefill 1 on core 0; prefill 2 and the decode share core 1).

Each instance is a scheduler group of its own (CFS autogroup here, a cgroup for a service or a container), so
the two on core 1 share it group against group. Before, the instance waiting for the other (the decode for
its KV, a prefill for its block ids) spun through empty engine steps and took the shared core from the very
instance it waited for: 10 of 20 requests came without their KV, every one routed to prefill 2. Here every
answer must equal a single instance's greedy tokens with the whole prompt loaded from the prefill that
computed it, one request at a time and then four at once, and both prefills must have served.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving import (  # noqa: E402
    KV_CONNECTOR,
    MODEL_NAME,
    Server,
    free_port,
    log_lines,
    metric_sum,
    metrics,
    post,
    start_proxy,
    start_vllm,
    wait_healthy,
)

MAX_TOKENS = 8
STARTUP_S = 400.0
_rng = random.Random(20261203)
SEQUENTIAL = [[_rng.randrange(50, 1900) for _ in range(_rng.randrange(20, 300))] for _ in range(20)]
CONCURRENT = [[_rng.randrange(50, 1900) for _ in range(_rng.randrange(20, 300))] for _ in range(12)]
PROMPTS = SEQUENTIAL + CONCURRENT


def _ask(url: str, prompt: list[int]) -> dict[str, Any]:
    status, answer = post(f"{url}/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
                          timeout=120)
    if status != 200:
        return {"status": status, "tokens": [], "cached": None, "answer": answer}
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"status": status, "tokens": answer["choices"][0]["token_ids"], "cached": details.get("cached_tokens")}


@pytest.mark.timeout(STARTUP_S + 400)
def test_two_prefills_and_a_decode_on_two_cores_each_in_its_own_session(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "requests.json").write_text(json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS}))
    reference_run = subprocess.Popen(
        [sys.executable, str(HERE / "single_reference.py"), str(tiny_model), "--requests",
         str(tmp_path / "requests.json"), "--out", str(tmp_path / "reference.json"), "--core", "0"],
        env=dict(os.environ, VLLM_HOST_IP="127.0.0.1"), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)
    servers: dict[str, Server] = {}
    try:
        kv = {name: free_port(span=2) for name in ("prefill1", "prefill2", "decode")}
        for name, role, core in (("prefill1", "kv_producer", "0"), ("prefill2", "kv_producer", "1"),
                                 ("decode", "kv_consumer", "1")):
            config: dict[str, Any] = {**KV_CONNECTOR, "kv_role": role, "kv_port": kv[name]}
            if role == "kv_consumer":
                config["kv_load_failure_policy"] = "recompute"
            servers[name] = start_vllm(name, tiny_model, core, config, tmp_path)
        wait_healthy(list(servers.values()), STARTUP_S)
        assert reference_run.wait(timeout=STARTUP_S) == 0
        reference = [row["tokens"] for row in json.loads((tmp_path / "reference.json").read_text())["prompts"]]
        servers["proxy"] = start_proxy(
            "proxy", [f"{servers[p].url}#kv=127.0.0.1:{kv[p]}" for p in ("prefill1", "prefill2")],
            [servers["decode"].url], tmp_path, "--static")

        answers = [_ask(servers["proxy"].url, prompt) for prompt in SEQUENTIAL]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers += list(pool.map(lambda p: _ask(servers["proxy"].url, p), CONCURRENT))
        rows = [(len(p), a["status"], a["tokens"] == reference[i], a["cached"]) for i, (p, a) in
                enumerate(zip(PROMPTS, answers))]
        print("\n| prompt tokens | status | tokens equal | cached |\n|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(map(str, row)) + " |")
        served = {p: metric_sum(metrics(servers[p].url), "vllm:request_success_total")
                  for p in ("prefill1", "prefill2")}
        late = {name: len(log_lines(servers[name], "late, not gone")) for name in ("prefill1", "prefill2", "decode")}
        stalls = {name: len(log_lines(servers[name], "event loop did not run")) for name in servers if name != "proxy"}
        print(f"requests served by each prefill: {served}; links found late: {late}; loop stalls logged: {stalls}")
        bad = [row for row in rows if not (row[1] == 200 and row[2] and row[3] is not None and row[3] >= row[0] - 1)]
        assert not bad, f"answers not equal to a single instance's, or computed by the decode: {bad}"
        assert all(count >= 1 for count in served.values()), served
    finally:
        if reference_run.poll() is None:
            reference_run.kill()
        reference_run.wait(timeout=30)
        for server in servers.values():
            server.stop()
