"""Tensor parallelism on real vLLM: prefill and decode with different TP sizes behind ``kvpush proxy``.

The tiny model has 2 KV heads. Stacks (one at a time, each started and stopped here): a prefill with TP 2
and a decode with TP 1 over the same-host path, TP 1 -> TP 2 over TCP, and TP 2 -> TP 2 over the same-host
path; each rank its own worker process with its own kvpush engine, a TP 2 instance's ranks on cores 0 and 1
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Every answer must equal a single TP 1 instance's greedy tokens with
every prompt token cached on the decode (the pushed KV, every head from the rank holding it). Then, on the
2 -> 1 stack, a prefill rank is killed while the decode waits for its KV: the decode must recompute at once.
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
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
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
    wait_for,
    wait_healthy,
)

MAX_TOKENS = 10
TRANSFER_TIMEOUT_S = 15.0
ABORT_GRACE_S = 3.0
STARTUP_S = 400.0
_rng = random.Random(20261203)
PROMPTS = [[_rng.randrange(50, 1900) for _ in range(n)] for n in (7, 32, 45, 100, 260)]
KILLED = [_rng.randrange(50, 1900) for _ in range(90)]


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Greedy tokens of a single TP 1 instance for PROMPTS + [KILLED]."""
    work = tmp_path_factory.mktemp("tp-reference")
    (work / "requests.json").write_text(json.dumps({"prompts": PROMPTS + [KILLED], "max_tokens": MAX_TOKENS}))
    done = subprocess.run([sys.executable, str(HERE / "single_reference.py"), str(tiny_model), "--requests",
                           str(work / "requests.json"), "--out", str(work / "out.json"), "--core", "1"],
                          env=dict(os.environ, VLLM_HOST_IP="127.0.0.1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [row["tokens"] for row in json.loads((work / "out.json").read_text())["prompts"]]


@dataclass
class TpStack:
    p_tp: int
    d_tp: int
    prefill: Server
    decode: Server
    proxy: Server


def _cores(tp: int, single: str) -> str:
    return "0|1" if tp == 2 else single


@contextmanager
def start_stack(model: Path, work: Path, p_tp: int, d_tp: int, transport: str, *extra_args: str) -> Iterator[TpStack]:
    """A prefill and a decode of those TP sizes (``extra_args`` to both ``vllm serve``) and ``kvpush proxy`` in
    front; all ended on exit."""
    kv_port = free_port(span=2 * max(p_tp, d_tp))  # each instance listens on kv_port (+ 1) + 2 * rank
    extra = {"transport": transport, "transfer_timeout_s": TRANSFER_TIMEOUT_S, "abort_grace_s": ABORT_GRACE_S}

    def config(role: str) -> dict[str, Any]:
        policy = {"kv_load_failure_policy": "recompute"} if role == "kv_consumer" else {}
        return {**KV_CONNECTOR, "kv_role": role, "kv_port": kv_port, "kv_connector_extra_config": extra, **policy}

    servers: list[Server] = []
    try:
        servers.append(start_vllm(f"prefill-tp{p_tp}", model, _cores(p_tp, "0"), config("kv_producer"), work,
                                  *extra_args, tp=p_tp))
        servers.append(start_vllm(f"decode-tp{d_tp}", model, _cores(d_tp, "1"), config("kv_consumer"), work,
                                  *extra_args, tp=d_tp))
        wait_healthy(servers, STARTUP_S)
        # warm-up, straight to each server (no KV moves): a TP 2 instance's first forward on these 2 shared cores
        # took 20-40 s (its ranks' first collectives), which the first transfer would otherwise wait out
        for server in servers:
            status, answer = post(f"{server.url}/v1/completions", {"model": MODEL_NAME, "prompt": [5, 6, 7],
                                                                     "max_tokens": 2}, timeout=STARTUP_S)
            assert status == 200, answer
        servers.append(start_proxy("proxy", [f"{servers[0].url}#kv={kv_port}"], [servers[1].url], work, "--static"))
        yield TpStack(p_tp, d_tp, *servers)
    finally:
        for server in reversed(servers):
            server.stop()


def plain_reference(name: str, model: Path, work: Path, prompts: list[list[int]], *extra_args: str) -> list[list[int]]:
    """A plain vLLM instance's greedy tokens (no connector, ``extra_args`` to ``vllm serve``) for ``prompts``; the
    instance ended after."""
    plain = start_vllm(name, model, "1", None, work, *extra_args)
    try:
        wait_healthy([plain], STARTUP_S)
        return [complete(plain.url, prompt, timeout=STARTUP_S)[0] for prompt in prompts]
    finally:
        plain.stop()


def complete(url: str, prompt: list[int], timeout: float = 120) -> tuple[list[int], int | None]:
    status, answer = post(f"{url}/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
                          timeout=timeout)
    assert status == 200, answer
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return answer["choices"][0]["token_ids"], details.get("cached_tokens")


@pytest.mark.timeout(STARTUP_S + 300)
@pytest.mark.parametrize("p_tp, d_tp, transport", [(1, 2, "tcp"), (2, 2, "auto")])
def test_tp_prefill_and_decode_give_single_instance_outputs_from_pushed_kv(
        tiny_model: Path, tmp_path: Path, reference: list[list[int]], p_tp: int, d_tp: int, transport: str) -> None:
    with start_stack(tiny_model, tmp_path, p_tp, d_tp, transport) as stack:
        check_outputs(stack, reference, transport)


def check_outputs(stack: TpStack, reference: list[list[int]], transport: str,
                  prompts: list[list[int]] = PROMPTS, short: int = 0) -> None:
    """Each of ``prompts`` through the proxy gives its ``reference`` tokens with every prompt token cached on
    the decode (but the last ``short``: a model with a recurrent state has the decode compute the last one); one
    kvpush engine per rank; the decode's links over the expected transport."""
    rows = []
    for prompt, expected in zip(prompts, reference):
        started = time.monotonic()
        tokens, cached = complete(stack.proxy.url, prompt)
        rows.append((len(prompt), tokens == expected, cached, time.monotonic() - started))
    print(f"\nprefill TP {stack.p_tp} -> decode TP {stack.d_tp} over {transport}\n"
          "| prompt tokens | tokens equal | cached tokens | seconds |\n|---|---|---|---|")
    for length, equal, cached, seconds in rows:
        print(f"| {length} | {'yes' if equal else 'NO'} | {cached} | {seconds:.2f} |")
    assert all(equal for _, equal, _, _ in rows), rows
    assert all(cached is not None and cached >= length - (1 if length == 1 else short) for length, _, cached, _ in rows)
    for server, tp in ((stack.prefill, stack.p_tp), (stack.decode, stack.d_tp)):
        ranks = log_lines(server, "KvpushConnector worker", f"of {tp}, ")
        assert len(ranks) == tp, ranks  # one kvpush engine per rank
    links = log_lines(stack.decode, "ready over", "dialed")
    expected_transport = "tcp" if transport == "tcp" else "cma"
    assert links and all(f"over {expected_transport}" in line for line in links), links[-3:]


@pytest.mark.timeout(STARTUP_S + 300)
def test_tp2_to_tp1_then_a_prefill_rank_killed_mid_request_makes_the_decode_recompute_at_once(
        tiny_model: Path, tmp_path: Path, reference: list[list[int]]) -> None:
    with start_stack(tiny_model, tmp_path, 2, 1, "auto") as stack:
        check_outputs(stack, reference, "auto")
        kill_a_prefill_rank_mid_request(stack, KILLED, reference[-1])


def kill_a_prefill_rank_mid_request(stack: TpStack, prompt: list[int], expected: list[int]) -> None:
    """Kill the prefill's last rank (1 of 2, or its only one) while the decode waits for ``prompt``'s KV (every
    rank frozen first): the answer comes within the abort grace, recomputed (``expected``, the prompt not all
    cached)."""
    workers = stack.prefill.workers()
    assert len(workers) == stack.p_tp, workers
    for pid in workers:  # the prefill accepts the request, its ranks do not push yet
        os.kill(pid, signal.SIGSTOP)
    result: dict[str, Any] = {}

    def request() -> None:
        result["answer"] = complete(stack.proxy.url, prompt)

    client = threading.Thread(target=request)
    client.start()
    try:
        assert wait_for(lambda: _decode_waits(stack), 20), "the decode never waited for the KV"
        killed = time.monotonic()
        os.kill(workers[-1], signal.SIGKILL)  # one rank dies; any other stays frozen
        client.join(TRANSFER_TIMEOUT_S + ABORT_GRACE_S + 30)
        assert not client.is_alive(), "the request hung after a prefill rank died"
        after = time.monotonic() - killed
    finally:
        for pid in workers:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    tokens, cached = result["answer"]
    print(f"answer {after:.2f} s after killing prefill rank {len(workers) - 1}: tokens equal {tokens == expected}, "
          f"cached {cached}")
    assert tokens == expected and (cached or 0) < len(prompt)  # recomputed, right
    # the lost link ended the transfer at once; the frozen rank had abort_grace_s to confirm, then the recompute
    assert after < ABORT_GRACE_S + 5


def _decode_waits(stack: TpStack) -> bool:
    """The decode holds a request waiting (for its KV) and KV blocks for it."""
    values = metrics(stack.decode.url)
    return metric_sum(values, "vllm:num_requests_waiting") >= 1 and metric_sum(values, "vllm:kv_cache_usage_perc") > 0
