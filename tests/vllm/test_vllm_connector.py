"""KvpushConnector in vLLM's CPU build, for real: loading by name, the hooks, P/D against a single instance.

Each case starts vLLM engines as subprocesses (tests/vllm/probe.py, tests/vllm/pd_offline.py), pinned to
one core each, single-process engine mode, and reads their JSON. A P/D case costs ~20-40 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ENV = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=timeout)


def _pd(tiny_model: Path, reference: Path, tmp_path: Path, *options: str) -> dict[str, Any]:
    summary = tmp_path / "summary.json"
    done = _run([sys.executable, str(HERE / "pd_offline.py"), str(tiny_model), "--reference", str(reference),
                 "--workdir", str(tmp_path), "--summary", str(summary), *options], timeout=280)
    print(done.stdout[-4000:])
    assert summary.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(summary.read_text())
    result["returncode"] = done.returncode
    return result


@pytest.mark.timeout(300)
def test_vllm_loads_the_connector_registers_its_kv_in_place_and_calls_every_hook(tiny_model: Path) -> None:
    done = _run(["taskset", "-c", "1", sys.executable, str(HERE / "probe.py"), str(tiny_model), "--json",
                 "--ids-timeout", "1.5"], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    (registered,) = [s for s in report["seen"] if s["hook"] == "register_kv_caches"]
    layers = registered["layers"]
    assert [layer["name"] for layer in layers] == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    num_blocks = layers[0]["shape"][0]
    # CPU layout: one buffer, a contiguous [num_blocks, kv_heads, block_size, 2 * head_dim] view per layer
    assert all(layer["shape"] == [num_blocks, 2, 32, 64] and layer["dtype"] == "torch.float32"
               and layer["contiguous"] and layer["device"] == "cpu" for layer in layers)
    assert layers[1]["offset"] == num_blocks * 2 * 32 * 64 * 4
    calls = report["calls"]
    for hook in ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "bind_connector_metadata", "save_kv_layer", "wait_for_save", "get_transfer_results",
                 "request_finished"):
        assert calls.get(hook, 0) > 0, hook
    assert "save_kv_layer: tensor differs from the registered one" not in calls
    # the request marked for a decode that never asks: blocks kept, params for the proxy, freed after the deadline
    (marked,) = [s for s in report["seen"] if s["hook"] == "request_finished" and s["result"][0]]
    assert marked["result"][1]["transfer_id"] == "probe-t1" and marked["result"][1]["do_remote_prefill"]
    (freed,) = [s for s in report["seen"] if s["hook"] == "transfer_results" and s["sending"]]
    assert freed["sending"] == [marked["req"]] and 1.4 < freed["t"] - marked["t"] < 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order, transport", [("decode-first", "auto"), ("prefill-first", "tcp"),
                                              ("decode-first", "tcp"), ("prefill-first", "auto")])
def test_pd_outputs_equal_a_single_instance_and_use_the_pushed_kv(tiny_model: Path, reference: Path, tmp_path: Path,
                                                                  order: str, transport: str) -> None:
    result = _pd(tiny_model, reference, tmp_path, "--order", order, "--transport", transport)
    assert result["good"] and result["returncode"] == 0, result["rows"]
    assert len(result["rows"]) >= 6 and {row["finish"] for row in result["rows"]} == {"length"}
    stats = result["prefill"]["stats"]
    assert stats["producer.landed"] == len(result["rows"]) and "producer.failed" not in stats
    pipelined = "producer.pushes_pipelined" if order == "decode-first" else "producer.pushes_after_forward"
    assert stats.get(pipelined, 0) >= len(result["rows"]), stats  # the path the order asks for


@pytest.mark.timeout(300)
def test_a_prefill_with_other_weights_changes_the_outputs(tiny_model: Path, reference: Path, tmp_path: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Negative control: the decode really uses the pushed KV (a prefill with other weights pushes other KV)."""
    other = tmp_path_factory.mktemp("other-weights")
    subprocess.run([sys.executable, "-m", "kvpush.cli.tiny_model", str(other), "--weight-seed", "1"], check=True,
                   capture_output=True)
    result = _pd(tiny_model, reference, tmp_path, "--prefill-model", str(other))
    differing = [row for row in result["rows"] if not row["equal"]]
    assert len(differing) >= len(result["rows"]) - 1  # all but the one-token prompt, which is recomputed


@pytest.mark.timeout(300)
def test_a_prefill_killed_before_pushing_makes_the_decode_recompute_promptly(tiny_model: Path, reference: Path,
                                                                              tmp_path: Path) -> None:
    result = _pd(tiny_model, reference, tmp_path, "--kill-prefill-after", "0.5", "--failure-policy", "recompute")
    assert all(row["equal"] for row in result["rows"]), result["rows"]
    assert result["decode"]["stats"]["consumer.failed"] == len(result["rows"])
    assert result["decode"]["generate_s"] < 10  # the lost link ended the waits, not the 30 s deadline
