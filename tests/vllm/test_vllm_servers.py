"""Two ``vllm serve`` processes (OpenAI API, vLLM's multi-process engine) with KvpushConnector.

Only ``kv_port`` is configured (one free port for both): the decode finds the prefill through vLLM's
defaults. Requests go to both servers as a proxy would send them (tests/vllm/pd_servers.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    work = tmp_path_factory.mktemp("servers")
    kv_port, urls, processes = _free_port(), [], []
    common = ["--model", str(tiny_model), "--dtype", "float32", "--enforce-eager", "--block-size", "32",
              "--max-model-len", "1024", "--max-num-batched-tokens", "128", "--max-num-seqs", "8",
              "--enable-prefix-caching", "--seed", "0", "--enable-prompt-tokens-details"]
    for core, role in (("0", "kv_producer"), ("1", "kv_consumer")):
        port = _free_port()
        config = ('{"kv_connector":"KvpushConnector","kv_connector_module_path":"kvpush.integrations.vllm",'
                  f'"kv_role":"{role}","kv_port":{kv_port}}}')
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=core)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        log = open(work / f"{role}.log", "wb")
        processes.append(subprocess.Popen(
            ["taskset", "-c", core, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port),
             *common, "--kv-transfer-config", config], env=env, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 180
        while not all(_healthy(url) for url in urls):
            assert all(p.poll() is None for p in processes), f"a server exited; see {work}"
            assert time.monotonic() < deadline, f"servers not healthy in 180 s; see {work}"
            time.sleep(1)
        yield urls[0], urls[1]
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("concurrent", [False, True])
def test_two_vllm_servers_give_single_instance_outputs_with_every_prompt_token_cached(
        servers: tuple[str, str], reference: Path, concurrent: bool) -> None:
    prefill, decode = servers
    command = [sys.executable, str(HERE / "pd_servers.py"), "--prefill", prefill, "--decode", decode, "--reference",
               str(reference)] + (["--concurrent"] if concurrent else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and "prompt" not in line]
    assert len(rows) >= 6
    for prompt, equal, cached, finish, _ in rows:
        assert equal.strip() == "yes" and finish.strip() == "length"
        assert int(cached) >= int(prompt) - (1 if int(prompt) == 1 else 0)
