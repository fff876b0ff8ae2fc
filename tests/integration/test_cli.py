"""`kvpush demo` as a user runs it: two processes, a push, verification on the decode side."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_pushes_and_verifies() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpush", "demo", "--json", "--layers", "4", "--blocks", "16", "--dst-blocks", "40",
         "--block-kib", "4", "--reps", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["verified"] is True
    assert report["blocks_checked"] == 16 * 8 and report["untouched_blocks_checked"] == 24 * 8
    assert report["pushes"] == 2 and report["gbps_median"] > 0


def test_demo_help() -> None:
    result = subprocess.run([sys.executable, "-m", "kvpush", "demo", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "--layers" in result.stdout
