"""Every example in examples/ runs as a user runs it (its own processes, loopback) and checks itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXPECTED = {"push_blocks.py", "switch_role.py", "push_kv_blocks.py", "async_server.py"}


def example_files() -> list[str]:
    return sorted(path.name for path in EXAMPLES.glob("*.py") if not path.name.startswith("_"))


def test_the_four_walkthroughs_exist() -> None:
    assert EXPECTED <= set(example_files())


@pytest.mark.parametrize("name", example_files())
def test_example_runs_and_verifies(name: str) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=EXAMPLES.parent, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    verdict = result.stdout.strip().splitlines()[-1]
    assert ": OK (" in verdict, verdict
    assert "check passed" in result.stderr  # the role that verifies said so
