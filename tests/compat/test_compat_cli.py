"""The kvpush command's serve, push and bench, run as a user runs them (separate processes, loopback)."""

from __future__ import annotations

import io
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from kvtest import Lines

from kvpush.cli.output import Progress as _Progress

KVPUSH = [sys.executable, "-m", "kvpush"]


@pytest.fixture
def serve() -> Iterator[tuple[subprocess.Popen[str], Lines, dict[str, Any]]]:
    """`kvpush serve --json` on a free loopback port: (process, its output, its "listening" event).
    The process is always ended."""
    proc = subprocess.Popen([*KVPUSH, "serve", "--listen", "127.0.0.1:0", "--layers", "2", "--blocks", "32",
                             "--block-shape", "4,128", "--dtype", "int32", "--interval", "0.1", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc)
        listening = json.loads(lines.next())
        assert listening["event"] == "listening", listening
        yield proc, lines, listening
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_serve_and_push_end_to_end(serve: tuple[subprocess.Popen[str], Lines, dict[str, Any]]) -> None:
    proc, lines, listening = serve
    assert listening["num_tensors"] == 4 and listening["shape"] == [32, 4, 128] and listening["dtype"] == "DT_INT32"
    assert listening["block_bytes"] == 4 * 128 * 4
    pushed = subprocess.run([*KVPUSH, "push", "--to", f"127.0.0.1:{listening['port']}", "--blocks", "8", "--reps", "3",
                             "--json"], capture_output=True, text=True, timeout=60)
    assert pushed.returncode == 0, pushed.stderr
    report = json.loads(pushed.stdout)
    assert report["verified"] is True and report["pushes"] == 3 and report["remote_blocks"] == 32
    assert report["num_tensors"] == 4 and report["block_shape"] == [4, 128] and report["dtype"] == "DT_INT32"
    assert len(set(report["dst_blocks"])) == 8 and all(0 <= b < 32 for b in report["dst_blocks"])
    payload = report["bytes_per_push"]
    assert payload == 8 * 4 * 2048

    received = served = 0
    events = []
    while "unlinked" not in events:  # what serve logged about this push, as it saw it
        event = json.loads(lines.next())
        events.append(event["event"])
        if event["event"] == "received":
            received += event["bytes"]
        elif event["event"] == "served":
            served += event["bytes"]
    assert events[0] == "linked" and received == 3 * payload and served == payload

    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(15) == 0
    stopped = json.loads(lines.next())
    assert stopped["event"] == "stopped" and stopped["bytes_received"] == 3 * payload


def test_push_to_an_address_where_nothing_listens_says_so_in_one_line() -> None:
    port = free_port()
    result = subprocess.run([*KVPUSH, "push", "--to", f"127.0.0.1:{port}"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and lines[0].startswith("kvpush push:"), result.stderr


def test_push_to_a_cache_that_does_not_exist(serve: tuple[subprocess.Popen[str], Lines, dict[str, Any]]) -> None:
    _, _, listening = serve
    result = subprocess.run([*KVPUSH, "push", "--to", f"127.0.0.1:{listening['port']}", "--model-id", "7"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "model_id=7" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    too_many = subprocess.run([*KVPUSH, "push", "--to", f"127.0.0.1:{listening['port']}", "--blocks", "33"],
                              capture_output=True, text=True, timeout=60)
    assert too_many.returncode == 1 and "32 blocks" in too_many.stderr


def test_serve_on_a_busy_port_fails_in_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = subprocess.run([*KVPUSH, "serve", "--listen", f"127.0.0.1:{port}", "--blocks", "4"],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1 and str(port) in result.stderr


@pytest.mark.parametrize("command", [[], ["demo"], ["serve"], ["push"], ["bench"]])
def test_help(command: list[str]) -> None:
    result = subprocess.run([*KVPUSH, *command, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith(f"usage: kvpush{' ' if command else ''}"
                                                               f"{' '.join(command)}"), result.stdout


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["serve", "--bogus"],
    ["serve", "--dtype", "float99"],
    ["serve", "--blocks", "0"],
    ["serve", "--block-shape", "16,x"],
    ["serve", "--listen", "nowhere"],
    ["push"],
    ["push", "--to", "127.0.0.1"],
    ["push", "--to", "127.0.0.1:1", "--reps", "-1"],
    ["demo", "--layers", "many"],
])
def test_wrong_flags_give_usage_and_exit_2(argv: list[str]) -> None:
    result = subprocess.run([*KVPUSH, *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage: kvpush" in result.stderr and result.stdout == "", result


def test_bench_passes_its_arguments_through(tmp_path: Any) -> None:
    own_help = subprocess.run([*KVPUSH, "bench", "--", "--help"], capture_output=True, text=True, timeout=60)
    assert own_help.returncode == 0 and "--quick" in own_help.stdout and "W-SMALL" in own_help.stdout
    run = subprocess.run([*KVPUSH, "bench", "--quick", "--only", "W-SMALL", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kvpush_cases = [r for r in results if r.get("case", "").startswith("kvpush-")]
    assert kvpush_cases and all(r["verified"] is True and r["p50_us"] > 0 for r in kvpush_cases)
    # latency cases: each transport interleaved with a socket baseline of its own, named by its record
    sockets = {r["case"]: r for r in results if r.get("case", "").startswith("socket")}
    assert all(sockets[r["baseline"]]["verified"] is True and sockets[r["baseline"]]["p50_us"] > 0
               for r in kvpush_cases)
    assert all(r["interleaved"]["rounds"] >= 1 for r in kvpush_cases)
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert ".jsonl" in written and ".md" in written


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_is_drawn_on_a_terminal_only() -> None:
    terminal = _Terminal()
    bar = _Progress("kvpush push", 3, enabled=True, stream=terminal)
    for _ in range(3):
        bar.step()
    bar.close()
    drawn = terminal.getvalue()
    assert drawn.endswith("] 3/3\n") and drawn.count("\r") == 4 and "#" * 30 in drawn
    piped = io.StringIO()
    quiet = _Progress("kvpush push", 3, enabled=True, stream=piped)
    quiet.step()
    quiet.close()
    assert piped.getvalue() == ""
