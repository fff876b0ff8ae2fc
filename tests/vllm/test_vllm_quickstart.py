"""The quick start, as a newcomer runs it: the by-hand block of docs/quickstart.md (the README carries the
same block) pasted into bash from a checkout with its ``.venv``, and ``kvpush demo --vllm``.

The block builds the tiny demo model into ``$HOME/.cache`` (a home of the test's own), starts a prefill and a
decode in sessions of their own and the router, sends one prompt twice and stops everything. Checked: the
first answer came through the prefill with the prompt's KV loaded, the second from what the decode then held,
both the same tokens, and no process the block started is left once it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORTS = (8000, 8100, 8200, 14579, 14580)


def block(path: Path, name: str = "quickstart") -> str:
    """The bash between the ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers of ``path``."""
    text = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, f"{path}: one {name} block expected"
    inner = text[text.index(begin) + len(begin):text.index(end)].strip()
    assert inner.startswith("```bash\n") and inner.endswith("```"), inner[:80]
    return inner[len("```bash\n"):-3]


def responses(output: str) -> list[tuple[dict[str, str], dict[str, object]]]:
    """``curl -si`` answers in ``output``: (headers, JSON body) each."""
    found = []
    for part in re.split(r"(?m)^(?=HTTP/1\.1 )", output)[1:]:
        head, _, body = part.replace("\r\n", "\n").partition("\n\n")
        status = head.splitlines()[0]
        assert " 200 " in status, part[:2000]
        headers = {key.strip().lower(): value.strip()
                   for key, _, value in (line.partition(":") for line in head.splitlines()[1:])}
        found.append((headers, json.loads(body.strip().splitlines()[0])))
    return found


def ours(cwd: Path) -> list[int]:
    """Processes whose working directory is ``cwd``: everything the block started (they inherit it)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/cwd") == str(cwd):
                    pids.append(int(entry))
    return pids


def free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_readme_carries_the_quick_start_block() -> None:
    assert block(ROOT / "README.md") == block(ROOT / "docs" / "quickstart.md")


def paste(script: str, tmp_path: Path) -> tuple[int, str, Path]:
    """``script`` pasted into bash (it reads it from its input) in a checkout with its ``.venv``, with a home of
    its own: its exit status, its output and its home. Every process it started is killed after it ended."""
    taken = [port for port in PORTS if not free(port)]
    assert not taken, f"the by-hand blocks use ports {PORTS}; taken here: {taken}"
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".venv").symlink_to(Path(sys.prefix))
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("VLLM_", "KVPUSH_"))}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    shell = subprocess.Popen(["bash"], cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = shell.communicate(script, timeout=900)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
        deadline = time.monotonic() + 60  # what it stopped exits within this
        while ours(checkout) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = ours(checkout)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, "processes the block started outlived its last step"
    return shell.returncode, output, home


@pytest.mark.timeout(1000)
def test_quick_start_by_hand(tmp_path: Path) -> None:
    returncode, output, home = paste(block(ROOT / "docs" / "quickstart.md"), tmp_path)
    logs = "".join(f"\n--- {name}\n" + Path(f"/tmp/{name}.log").read_text()[-3000:]
                   for name in ("prefill", "decode", "proxy") if Path(f"/tmp/{name}.log").exists())
    assert returncode == 0, output[-4000:] + logs
    answers = responses(output)
    assert len(answers) == 2, output[-4000:] + logs
    (first_headers, first), (second_headers, second) = answers
    assert first_headers["x-kvpush-route"] == "pd", (first_headers, logs)
    prompt_tokens = first["usage"]["prompt_tokens"]  # type: ignore[index]
    # the decode computed nothing of the prompt but its last token's step: every full block came from the prefill
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 32  # type: ignore[index]
    assert second_headers["x-kvpush-route"] == "decode-only", (second_headers, logs)
    assert "holds" in second_headers["x-kvpush-reason"], second_headers
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # type: ignore[index]
    assert (home / ".cache" / "kvpush" / "demo-model" / "config.json").exists()


def models_block(name: str, tmp_path: Path) -> tuple[dict[str, Any], str, Path, str]:
    """docs/guides/models.md's block ``models-<name>`` pasted into bash: (its completion's answer, its output, its
    home, the tails of its servers' logs)."""
    returncode, output, home = paste(block(ROOT / "docs" / "guides" / "models.md", f"models-{name}"), tmp_path)
    logs = "".join(f"\n--- {server}\n" + Path(f"/tmp/{server}-{name}.log").read_text()[-3000:]
                   for server in ("prefill", "decode", "proxy") if Path(f"/tmp/{server}-{name}.log").exists())
    assert returncode == 0, output[-4000:] + logs
    answer = json.loads(next(line for line in output.splitlines() if line.startswith('{"id"')))
    return answer, output, home, logs


@pytest.mark.timeout(1000)
def test_the_mla_model_by_hand(tmp_path: Path) -> None:
    """docs/guides/models.md's MLA block: a DeepSeek-V2-shaped model's prompt comes whole from the prefill's
    latent (every prompt token cached on the decode), the latent registered as it is."""
    answer, output, home, logs = models_block("mla", tmp_path)
    usage = answer["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"], (usage, logs)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert ", 1, 16, 576) " in output, output[-2000:]  # the grep of the decode's registration: the latent
    assert (home / ".cache" / "kvpush" / "deepseek-v2-tiny" / "config.json").exists()


@pytest.mark.timeout(1000)
def test_the_hybrid_model_by_hand(tmp_path: Path) -> None:
    """docs/guides/models.md's hybrid block: a Granite-4-shaped model (Mamba2 layers beside attention ones) loads
    its prompt but the last token from the prefill (the state and the KV), every KV cache group registered."""
    answer, output, home, logs = models_block("hybrid", tmp_path)
    usage = answer["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, (usage, logs)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert "KV cache groups [state, state, state, full]" in output, output[-2000:]
    assert (home / ".cache" / "kvpush" / "granite-hybrid-tiny" / "config.json").exists()


@pytest.mark.timeout(1000)
def test_kvpush_demo_vllm(tmp_path: Path) -> None:
    """The README's one command: the plain instance, then P/D through the router; every process stopped."""
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("VLLM_", "KVPUSH_"))}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    demo = subprocess.Popen([sys.executable, "-m", "kvpush", "demo", "--vllm"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = demo.communicate(timeout=900)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
        for pid in ours(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert demo.returncode == 0, output[-4000:]
    assert "answers equal the plain instance's" in output, output[-4000:]
    routes = re.findall(r"(?m)^  route: (\S+) ", output)
    assert routes == ["pd", "pd", "decode-only", "decode-only"], output[-4000:]
    assert output.count("the decode loaded the prompt's KV from the prefill: yes") == 2, output[-4000:]
    assert not ours(tmp_path), "processes the demo started outlived it"
