"""bench/workload.py: a case whose verification failed reports FAIL and never a throughput."""

from __future__ import annotations

import os
import sys

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
