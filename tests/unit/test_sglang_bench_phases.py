"""bench/sglang_bench.py's phase table: SGLang's own stage lines (``--enable-request-time-stats-logging``) of both
servers, matched by bootstrap room with the client's records, give each request's phases. No SGLang needed."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.sglang_bench import PHASES, Sent, phase_medians, phase_table, request_phases, stage_records  # noqa: E402

# two lines as SGLang 0.5.23 logs them (the prefill's, then the decode's), and one of another room
LINES = [
    "[2026-12-07 06:48:52] ReqTimeStats(rid=67d4, bootstrap_room=58, input_len=1026, cached_input_len=0, "
    "output_len=1, attempts=0, type=prefill): bootstrap_duration=4.94ms, queue_duration=0.53ms, "
    "forward_duration=49.03ms, entry_time=1000.728, transfer_speed=0.15 GB/s, transfer_total=1.00 MB",
    "[2026-12-07 06:48:52] ReqTimeStats(rid=c4ce, bootstrap_room=58, input_len=1026, cached_input_len=0, "
    "output_len=2, attempts=0, type=decode): bootstrap_duration=0.10ms, alloc_wait_duration=1.16ms, "
    "transfer_duration=49.47ms, queue_duration=0.14ms, forward_duration=4.12ms, entry_time=1000.731",
    "[2026-12-07 06:48:52] ReqTimeStats(rid=51c7, bootstrap_room=99, input_len=10, cached_input_len=0, "
    "output_len=2, attempts=0, type=decode): bootstrap_duration=0.09ms, alloc_wait_duration=1.02ms, "
    "transfer_duration=92.55ms, queue_duration=0.36ms, forward_duration=9.64ms, entry_time=1000.801",
    "[2026-12-07 06:48:52] INFO: something else",
]


def test_stage_lines_are_read_per_room_and_side() -> None:
    stages = stage_records(LINES)
    assert set(stages) == {(58, "prefill"), (58, "decode"), (99, "decode")}
    assert stages[(58, "prefill")]["bootstrap_duration"] == pytest.approx(0.00494)
    assert stages[(58, "decode")]["entry_time"] == pytest.approx(1000.731)  # a wall clock, not a duration


def test_a_request_s_phases_come_from_both_sides_and_the_client() -> None:
    stages = stage_records(LINES)
    sent = Sent(58, 1024, 1000.724, 0.060)
    phases = request_phases(sent, stages)
    assert phases is not None and list(phases) == [name for name, _ in PHASES]
    assert phases["to the decode's scheduler"] == pytest.approx(7.0, abs=0.01)
    assert phases["prefill: forward and send"] == pytest.approx(49.03)
    decode_side = ("to the decode's scheduler", "decode: bootstrap", "decode: pages allocated",
                   "decode: waits for the KV", "decode: queued", "first token out")
    # (the last phase is the rest of the client's TTFT: the decode's side adds up to it by definition)
    assert sum(phases[name] for name in decode_side) == pytest.approx(60.0, abs=0.05)
    assert phases["first token out"] == pytest.approx(60.0 - 7.0 - 0.10 - 1.16 - 49.47 - 0.14, abs=0.01)
    assert request_phases(Sent(99, 8, 1000.8, 0.1), stages) is None  # the prefill's line is missing
    lumped = stage_records([LINES[0], LINES[1].replace("bootstrap_duration=0.10ms, alloc_wait_duration=1.16ms",
                                                       "prealloc_queue_duration=1.26ms")])
    assert request_phases(sent, lumped) is None  # the decode's bootstrap and allocation not told apart


def test_medians_per_length_and_the_table() -> None:
    stages = stage_records(LINES)
    found = phase_medians([Sent(58, 1024, 1000.724, 0.060), Sent(99, 8, 1000.8, 0.1)], stages)
    assert list(found) == [1024] and found[1024]["samples"] == 1
    table = phase_table({"kvpush-direct": found})
    assert table[0].startswith("| phase | what it is | kvpush-direct, 1024 words |")
    assert len(table) == 2 + len(PHASES) and "| prefill: forward and send |" in table[7]
