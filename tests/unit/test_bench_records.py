"""bench/workload.py: a case whose verification failed reports FAIL and never a throughput."""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.workload import WORKLOADS, summarize  # noqa: E402


def test_a_verified_case_reports_its_numbers() -> None:
    record = summarize(WORKLOADS["W-KV"], "kvpush-tcp", [0.1, 0.12, 0.11], {"verified": True})
    assert record["gbps"] > 0 and record["p50_us"] > 0 and "result" not in record


def test_a_failed_verification_reports_fail_and_no_number() -> None:
    record = summarize(WORKLOADS["W-KV"], "kvpush-tcp", [0.1, 0.12, 0.11], {"verified": False})
    assert record["result"] == "FAIL"
    assert not {"gbps", "gbps_all", "per_layer_ms", "p50_us", "p99_us"} & set(record)


def test_workload_sizes() -> None:
    assert WORKLOADS["W-KV"].payload_bytes == 512 << 20
    assert WORKLOADS["W-CONTIG"].payload_bytes == 512 << 20
    src, dst = WORKLOADS["W-KV-RUNS"].block_lists()
    assert len(src) == len(dst) == 256 and len(set(dst.tolist())) == 256
    assert sum(1 for a, b in zip(src[:-1], src[1:]) if b != a + 1) == 15  # 16 runs of 16


def test_the_cpu_split_counts_only_the_measured_intervals_as_shares_of_their_wall_time() -> None:
    """bench/push_bench.CpuSplit: user and system CPU of this process and a 'target' (here this process
    too) over start/stop intervals, as fractions of the intervals' wall time; work between intervals is
    not counted."""
    import time

    from bench.push_bench import CpuSplit, cpu_seconds

    user, system = cpu_seconds(os.getpid())
    assert user > 0 and system >= 0
    split = CpuSplit(os.getpid())
    split.start()
    deadline = time.perf_counter() + 0.2
    while time.perf_counter() < deadline:  # busy: about one core's worth of user time
        pass
    split.stop()
    idle_from = time.perf_counter()
    while time.perf_counter() < idle_from + 0.2:  # outside any interval: not counted
        pass
    split.add("driver_compute", 0.05)
    record = split.record()
    assert 0.19 <= record["wall_s"] < 1.0  # the 0.2 s interval only (a loaded machine may stretch it)
    assert set(record) == {"wall_s", "driver_user", "driver_sys", "target_user", "target_sys", "softirq",
                           "driver_compute"}
    # the same process read twice, a moment apart: a clock tick may fall between the two reads
    one_tick = 1 / os.sysconf("SC_CLK_TCK") / split.wall
    assert abs(record["driver_user"] - record["target_user"]) <= 2 * one_tick + 0.002
    assert 0 < record["driver_user"] <= 1.5  # busy in user time (a loaded machine may give it less)
    assert record["driver_compute"] == round(0.05 / split.wall, 3)


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")
def test_pinned_targets_run_on_the_decode_core_and_the_peers_stay_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench/run.py --pinned``: every process the driver starts is put on ``PEER_CPUS`` (a real
    target process, asked over its control lines), and the peers' drivers, which place both of their
    sides themselves, are not in the plan."""
    with mock.patch.dict(os.environ):  # bench/run.py sets its thread counts on import: not for later tests
        from bench import run, workload

    monkeypatch.setattr(workload, "PEER_CPUS", {1})
    target = workload.Target([os.path.join(os.path.dirname(workload.__file__), "push_bench.py"),
                              "--role", "socket-target", *workload.WORKLOADS["W-SMALL"].as_args()])
    try:
        assert os.sched_getaffinity(target.proc.pid) == {1}
    finally:
        target.close()
    pinned = {(work.name, name) for work, name, _ in run.plan(quick=True, pinned=True)}
    unpinned = {(work.name, name) for work, name, _ in run.plan(quick=True)}
    assert not {name for _, name in pinned} & {"mooncake", "nixl", "nixl-tcp"}
    assert ("W-LAYER", "kvpush-tcp") in unpinned and ("W-LAYER", "kvpush-tcp") not in pinned
    assert ("W-LAYER-PINNED", "kvpush-tcp") in pinned and ("W-SMALL", "socket + kvpush-tcp") in pinned


def test_the_latency_case_runs_the_asyncio_floor_beside_kvpush_and_the_table_compares_with_it() -> None:
    """``case_latency``: real target processes; an asyncio ping-pong of a layer's bytes between the driver's
    and the kvpush target's own event loops takes turns with the socket baseline and kvpush, each kvpush
    record names it as its ``floor``, and the ratio table has a column for it."""
    from bench import push_bench, run

    work = WORKLOADS["W-SMALL"]
    records = push_bench.case_latency(work, 6, ["tcp"], 3, 1)
    by_case = {record["case"]: record for record in records}
    assert set(by_case) == {"socket", "asyncio ping-pong", "kvpush-tcp"}
    assert by_case["asyncio ping-pong"]["reps"] == 6 and by_case["asyncio ping-pong"]["p50_us"] > 0
    kvpush = by_case["kvpush-tcp"]
    assert kvpush["verified"] is True and kvpush["floor"] == "asyncio ping-pong" and kvpush["baseline"] == "socket"
    assert kvpush["interleaved"]["with"] == ["socket", "asyncio", "tcp"]
    table = run.ratios(records)
    assert "vs asyncio ping-pong" in table[0]
    row = next(line for line in table if "| kvpush-tcp |" in line).split("|")
    header = table[0].split("|")
    assert row[header.index(" vs asyncio ping-pong ")].strip().endswith("x its latency")


def test_push_segments_match_each_push_with_the_answer_it_got_and_take_each_phases_p50() -> None:
    """bench/push_segments.phases: the receiver's answer of a push is the last whose read callback began after
    the push did and before the sender's read callback; a push that got none is left out."""
    from bench.push_segments import phases

    def push(start: int) -> dict[str, int]:
        return {"t0": start, "w0": start + 10_000, "w1": start + 30_000, "r0": start + 90_000,
                "r1": start + 95_000, "t1": start + 99_000}

    pushes = [push(0), push(1_000_000), push(2_000_000)]
    answers = [(-5_000, -4_000, -3_000),  # a frame of an earlier exchange: not this push's answer
               (50_000, 60_000, 80_000),
               (1_040_000, 1_052_000, 1_070_000)]  # (the third push got none: it is left out)
    got = phases(pushes, answers)
    assert got["total"] == 99.0 and got["sender, until its write"] == 10.0 and got["sender's write"] == 20.0
    assert got["receiver wakes"] == (20.0 + 10.0) / 2  # 50 - 30 and 1040 - 1030 us
    assert got["receiver, until its answer (its read included)"] == 11.0  # median of 10 and 12
    assert got["sender wakes"] == 15.0  # 90 - 80 and 1090 - 1070: median of 10 and 20
