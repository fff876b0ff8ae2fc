"""Two ``vllm serve`` processes (OpenAI API, vLLM's multi-process engine) with KvpushConnector.

Only ``kv_port`` is configured (one free port for both), and the prefill's bootstrap port in vLLM's own variable
(``VLLM_MOONCAKE_BOOTSTRAP_PORT``): requests go to both servers at once in the Mooncake contract's shape
(tests/vllm/pd_servers.py), and the decode finds the prefill from its ``/query``. The decode keeps vLLM's default
``kv_load_failure_policy`` ("fail"): a request that names no prefill fails, saying why.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
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
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    work = tmp_path_factory.mktemp("servers")
    kv_port, bootstrap_port, urls, processes = _free_port(), _free_port(), [], []
    common = ["--model", str(tiny_model), "--dtype", "float32", "--enforce-eager", "--block-size", "32",
              "--max-model-len", "1024", "--max-num-batched-tokens", "128", "--max-num-seqs", "8",
              "--enable-prefix-caching", "--seed", "0", "--enable-prompt-tokens-details"]
    for core, role in (("0", "kv_producer"), ("1", "kv_consumer")):
        port = _free_port()
        config = ('{"kv_connector":"KvpushConnector","kv_connector_module_path":"kvpush.integrations.vllm",'
                  f'"kv_role":"{role}","kv_port":{kv_port}}}')
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=core,
                   VLLM_MOONCAKE_BOOTSTRAP_PORT=str(bootstrap_port))
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
        yield urls[0], urls[1], f"http://127.0.0.1:{bootstrap_port}"
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
        servers: tuple[str, str, str], reference: Path, concurrent: bool) -> None:
    prefill, decode, bootstrap = servers
    command = [sys.executable, str(HERE / "pd_servers.py"), "--prefill", prefill, "--decode", decode, "--bootstrap",
               bootstrap, "--reference", str(reference)] + (["--concurrent"] if concurrent else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and "prompt" not in line]
    assert len(rows) >= 6
    for prompt, equal, cached, finish, _ in rows:
        assert equal.strip() == "yes" and finish.strip() == "length"
        assert int(cached) >= int(prompt) - (1 if int(prompt) == 1 else 0)


@pytest.mark.timeout(200)
def test_a_decode_request_that_names_no_prefill_fails_instead_of_loading_from_a_guessed_host(
        servers: tuple[str, str, str]) -> None:
    """The decode's own kv_port on its own host holds a prefill here, yet a request that names none is refused
    (vLLM's default policy "fail": the client gets an error), and the next one is served."""
    _, decode, _ = servers
    body = {"model": _model(decode), "prompt": list(range(100, 160)), "max_tokens": 4, "temperature": 0.0}
    request = urllib.request.Request(f"{decode}/v1/completions", json.dumps(
        {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "nameless"}}).encode(),
        {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        failed = response.status != 200 or answer["choices"][0].get("finish_reason") not in ("length", "stop")
    except urllib.error.HTTPError as error:
        answer, failed = {"status": error.code, "body": error.read()[:500].decode(errors="replace")}, True
    print(answer)
    assert failed, answer
    plain = urllib.request.Request(f"{decode}/v1/completions", json.dumps(body).encode(),
                                   {"Content-Type": "application/json"})
    with urllib.request.urlopen(plain, timeout=60) as response:
        assert response.status == 200 and len(json.loads(response.read())["choices"][0]["text"]) >= 0


def _model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        return str(json.loads(response.read())["data"][0]["id"])
