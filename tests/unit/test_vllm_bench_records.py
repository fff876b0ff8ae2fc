"""bench/vllm_bench.py's pure parts: outputs that differ from the single instance report FAIL and no
number; percentiles; the hidden share from a trace; the ratio table. No vLLM needed."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.vllm_bench import (  # noqa: E402
    Sample,
    Timing,
    hidden_record,
    latency_record,
    not_run_record,
    percentile,
    phases_of,
    phases_p50,
    plan,
    prompt,
    single_phases_of,
    single_phases_p50,
    tables,
    timing_of,
)

NUMBERS = {"ttft_p50_ms", "ttft_p99_ms", "total_p50_ms", "total_p99_ms"}


def samples(ttfts: list[float], tokens: list[list[int]], cached: int = 64) -> list[Sample]:
    return [Sample(t, t + 0.5, list(tok), cached) for t, tok in zip(ttfts, tokens)]


def test_percentiles_match_numpy() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 1.5, 0.9, 0.4]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([2.0], 99) == 2.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_prompts_are_the_same_in_every_case_and_distinct_per_repetition() -> None:
    assert prompt(512, 0, 2048) == prompt(512, 0, 2048)
    assert len(prompt(512, 0, 2048)) == 512
    assert prompt(512, 0, 2048) != prompt(512, 1, 2048)
    assert prompt(32, 0, 2048)[:16] != prompt(512, 0, 2048)[:16]  # no shared prefix between lengths
    assert all(3 <= t < 2048 for t in prompt(2048, 2, 2048))


def test_plans_cover_the_prompt_lengths() -> None:
    full, quick = plan(False), plan(True)
    assert full.lengths == (32, 128, 512, 2048)
    assert set(full.reps) == set(full.lengths) and set(full.hidden_lengths) <= set(full.lengths)
    assert set(quick.lengths) < set(full.lengths) and set(quick.hidden_lengths) <= set(quick.lengths)


def test_outputs_equal_to_the_reference_give_numbers() -> None:
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    record = latency_record("kvpush-tcp", 64, samples([0.2, 0.1, 0.3], ref), ref)
    assert "result" not in record and record["outputs_equal"] == "3/3"
    assert record["ttft_p50_ms"] == 200.0 and record["total_p50_ms"] == 700.0
    assert record["cached_tokens"] == 64 and record["output_tokens"] == 3
    assert record["tpot_p50_ms"] == pytest.approx(250.0)  # 0.5 s for the 2 tokens after the first


def test_an_output_that_differs_is_fail_and_no_number() -> None:
    ref = [[1, 2, 3], [4, 5, 6]]
    record = latency_record("nixl", 64, samples([0.2, 0.1], [[1, 2, 3], [4, 5, 7]]), ref)
    assert record["result"] == "FAIL" and record["outputs_equal"] == "1/2"
    assert "differ" in record["error"]
    assert not NUMBERS & set(record) and "tpot_p50_ms" not in record


def test_a_failed_request_is_fail_and_no_number() -> None:
    ref = [[1], [2]]
    runs = samples([0.2, 0.1], ref)
    runs[1] = Sample(0.0, 0.0, [], None, error="RuntimeError: the stream ended without a token")
    record = latency_record("kvpush-cma", 64, runs, ref)
    assert record["result"] == "FAIL" and "stream ended" in record["error"]
    assert not NUMBERS & set(record)


def test_the_single_instance_has_no_reference() -> None:
    record = latency_record("single", 64, samples([0.2], [[1]], cached=0), None)
    assert "outputs_equal" not in record and record["ttft_p50_ms"] == 200.0


def test_timing_of_picks_the_request_of_its_window() -> None:
    prefill = [{"ev": "step", "t_bind": 10.0, "t_forward_end": 11.0, "mode": "pipelined", "pushes_pipelined": 1,
                "pushes_after_forward": 0},
               {"ev": "step", "t_bind": 20.0, "t_forward_end": 21.0, "mode": "pipelined", "pushes_pipelined": 0,
                "pushes_after_forward": 0}]
    decode = [{"ev": "ids", "t": 9.9}, {"ev": "landed", "t": 11.01, "reqs": ["a"]}, {"ev": "landed", "t": 21.2}]
    first = timing_of(prefill, decode, (9.0, 12.0))
    assert first == Timing(10.0, 11.0, 11.01, 1, 0)
    second = timing_of(prefill, decode, (19.0, 22.0))
    assert second is not None and second.pipelined_pushes == 0 and second.landed == 21.2
    assert timing_of(prefill, decode, (30.0, 40.0)) is None


def test_phases_of_a_request_add_up_to_its_time_to_first_token() -> None:
    """A request sent at 9.0 s, first token at 9.0 + 2.5 s: held 50 ms by the prefill from 9.1 s, its forward
    10.0-11.0 s, landed at 11.02 s. The phases but the tail follow one another and sum to the TTFT; a request
    without a landed report (or a failed one) has none; the p50 is per phase over the complete ones."""
    prefill = [{"ev": "held", "t": 9.15, "held_ms": 50.0, "ids_in": True},
               {"ev": "step", "t_bind": 10.0, "t_forward_end": 11.0}]
    decode = [{"ev": "ids", "t": 9.12}, {"ev": "landed", "t": 11.02}]
    sample = Sample(2.5, 3.0, [1, 2], 64, t_start=9.0, t_end=12.0)
    phases = phases_of(prefill, decode, sample)
    assert phases == {"to_prefill": 100.0, "held": 50.0, "to_forward": 850.0, "forward": 1000.0,
                      "to_first_token": 500.0, "tail": 20.0}
    assert sum(phases.values()) - phases["tail"] == pytest.approx(2500.0)
    led = phases_of(prefill, decode, Sample(2.01, 3.0, [1, 2], 64, t_start=9.0, t_end=12.0, led=True))
    assert led is not None and led["to_first_token"] == 10.0 and led["tail"] == 20.0  # the prefill's token first
    assert phases_of(prefill, [], sample) is None
    assert phases_of(prefill, decode, Sample(0.0, 0.0, [], None, t_start=9.0, t_end=12.0, error="boom")) is None
    unheld = phases_of([{"ev": "step", "t_bind": 10.0, "t_forward_end": 11.0}], decode, sample)
    assert unheld is not None and unheld["held"] == 0.0 and unheld["to_prefill"] == 1000.0
    assert phases_p50([phases, None, unheld]) == {"to_prefill": 550.0, "held": 25.0, "to_forward": 425.0,
                                                  "forward": 1000.0, "to_first_token": 500.0, "tail": 20.0}
    assert phases_p50([None]) == {}


def test_a_single_instance_request_splits_into_the_same_phases() -> None:
    """A single-instance request sent at 9.0 s, seen by its scheduler at 9.002 s, its prompt's forward 9.004-9.08 s,
    its first token at the client 9.0845 s: the phases follow one another and sum to the TTFT. Another request's
    lines are not its; without a step (or a seen line, or with an error) it has none."""
    trace = [{"ev": "seen", "t": 9.002, "side": "single"}, {"ev": "step", "t_bind": 9.004, "t_forward_end": 9.08},
             {"ev": "seen", "t": 20.0, "side": "single"}, {"ev": "step", "t_bind": 20.5, "t_forward_end": 21.0}]
    sample = Sample(0.0845, 0.6, [1, 2], 0, t_start=9.0, t_end=9.6)
    phases = single_phases_of(trace, sample)
    assert phases == pytest.approx({"to_scheduler": 2.0, "to_forward": 2.0, "forward": 76.0, "to_first_token": 4.5})
    assert phases is not None and sum(phases.values()) == pytest.approx(84.5)
    assert single_phases_of(trace[:1], sample) is None
    assert single_phases_of(trace[1:2], sample) is None
    assert single_phases_of(trace, Sample(0.0, 0.0, [], None, t_start=9.0, t_end=9.6, error="boom")) is None
    assert single_phases_p50([phases, None]) == {"to_scheduler": 2.0, "to_forward": 2.0, "forward": 76.0,
                                                 "to_first_token": 4.5}
    assert single_phases_p50([None]) == {}


def test_each_pd_phase_is_set_beside_the_single_instances() -> None:
    """P/D's phases that are neither compute nor bytes, each beside the single instance's that matches it (to the
    scheduler: the prefill's, with its hold), their sums and what P/D adds, from the interleaved requests."""
    ref = [[1]]
    record = latency_record("kvpush-cma", 32, samples([0.09], ref), ref, {
        "phases_p50_ms": {"to_prefill": 3.0, "held": 0.5, "to_forward": 2.0, "forward": 75.0, "to_first_token": 4.0,
                          "tail": 5.0},
        "single_phases_p50_ms": {"to_scheduler": 2.0, "to_forward": 1.5, "forward": 74.0, "to_first_token": 3.0}})
    lines = tables([record])
    header = next(line for line in lines if "P/D adds ms" in line)
    row = next(line for line in lines if line.startswith("| 32 | kvpush-cma | 3.5 / 2.0 |"))
    at = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert at["to forward: P/D / single"] == "2.0 / 1.5" and at["to first token: P/D / single"] == "4.0 / 3.0"
    assert at["neither compute nor bytes: P/D / single"] == "9.5 / 6.5" and at["P/D adds ms"] == "+3.0"
    assert at["forward: P/D / single"] == "75.0 / 74.0"


def test_kvpush_hook_time_of_a_request_is_cut_at_the_forward() -> None:
    """The clocks of KvpushConnector's hooks in the prefill's scheduler (read at its first look at the request:
    2.0 ms so far, the sending step built: 2.4, the request let go: 2.7) and its worker (the step's bind: 12.5, the
    forward's end: 14.0, the step's reports out: 14.2): 0.4 ms before the forward, 1.5 in it, 0.3 + 0.2 after. A
    trace without the step's reports (or without the clocks: an older connector) gives the other phases only."""
    prefill = [{"ev": "seen", "t": 9.1, "side": "prefill", "hooks_ms": 2.0},
               {"ev": "built", "t": 9.95, "hooks_ms": 2.4},
               {"ev": "step", "t_bind": 10.0, "t_forward_end": 11.0, "hooks_ms_bind": 12.5, "hooks_ms": 14.0},
               {"ev": "reported", "t": 11.1, "hooks_ms": 14.2},
               {"ev": "finished", "t": 11.2, "hooks_ms": 2.7},
               {"ev": "reported", "t": 30.0, "hooks_ms": 99.0}]  # another request's
    decode = [{"ev": "ids", "t": 9.12}, {"ev": "landed", "t": 11.02}]
    sample = Sample(2.5, 3.0, [1, 2], 64, t_start=9.0, t_end=12.0)
    phases = phases_of(prefill, decode, sample)
    assert phases is not None
    assert phases["kvpush_before_forward"] == pytest.approx(0.4)
    assert phases["kvpush_in_forward"] == pytest.approx(1.5)
    assert phases["kvpush_after_forward"] == pytest.approx(0.5)
    last = phases_of([e for e in prefill if e["ev"] != "reported"], decode, sample)
    assert last is not None and "kvpush_before_forward" not in last and last["forward"] == 1000.0
    assert phases_p50([phases, phases])["kvpush_in_forward"] == pytest.approx(1.5)
    assert "kvpush_in_forward" not in phases_p50([phases, last, last])  # every request must have them


def test_hidden_share_from_pipelined_and_serial_pairs() -> None:
    # serial: forward 1.0 s, then the whole transfer (0.1 s); pipelined: forward 1.01 s (slowed by the
    # pushes), and only 0.01 s of transfer left after it
    serial = Timing(0.0, 1.0, 1.1, 1, 0)
    pipelined = Timing(0.0, 1.01, 1.02, 1, 0)
    record = hidden_record("kvpush-tcp", 512, [(pipelined, serial)] * 3, [(1.05, 1.13)] * 3)
    assert record["hidden"] == pytest.approx(0.9)  # 1 - 0.01 / 0.1
    assert record["net_saved_ms"] == pytest.approx(80.0)  # (1.1 - 0.0) - (1.02 - 0.0)
    assert record["compute_inflation"] == pytest.approx(0.01)
    assert record["transfer_serial_ms"] == pytest.approx(100.0)
    assert record["exposed_pipelined_ms"] == pytest.approx(10.0)
    assert record["pipelined_requests"] == "3/3" and record["ttft_saved_ms"] == pytest.approx(80.0)
    assert record["deferred_requests"] == "0/3"
    kept = hidden_record("kvpush-tcp", 512, [(Timing(0.0, 1.0, 1.1, 1, 0, 1), serial)])  # sent after the forward
    assert kept["pipelined_requests"] == "1/1" and kept["deferred_requests"] == "1/1" and kept["hidden"] == 0.0


def test_hidden_share_is_the_median_clipped_and_needs_a_complete_pair() -> None:
    serial = Timing(0.0, 1.0, 1.1, 1, 0)
    slower = Timing(0.0, 1.0, 1.3, 0, 1)  # its ids came late: pushed after the forward, and slowly
    record = hidden_record("kvpush-cma", 512, [(slower, serial)])
    assert record["hidden"] == 0.0 and record["pipelined_requests"] == "0/1"
    mixed = [(Timing(0.0, 1.0, 1.0 + e, 1, 0), serial) for e in (0.01, 0.02, 0.09)]
    assert hidden_record("kvpush-cma", 512, mixed)["hidden"] == pytest.approx(0.8)
    failed = hidden_record("kvpush-cma", 512, [(None, serial), (slower, None)])
    assert failed["result"] == "FAIL" and "hidden" not in failed


def test_table_ratios_are_to_the_single_instance_and_the_other_connectors_of_the_run() -> None:
    ref = [[1]]
    records = [latency_record("single", 32, samples([0.1], ref), None),
               latency_record("kvpush-tcp", 32, samples([0.15], ref), ref, {"pushed_during_forward": "1/1"}),
               latency_record("kvpush-cma", 64, samples([0.3], ref), ref, {"single_ttft_p50_ms": 200.0,
                                                                           "single_total_p50_ms": 400.0}),
               latency_record("single", 64, samples([0.1], ref), None),
               latency_record("example", 32, samples([0.3], ref), ref),
               latency_record("nixl", 32, samples([0.2], [[2]]), ref),
               not_run_record("kvpush-cma", "no cma here")]
    lines = tables(records)
    header = lines[0]
    assert "TTFT vs single" in header and "TTFT vs example" in header and "TTFT vs nixl" in header
    row = next(line for line in lines if line.startswith("| 32 | kvpush-tcp |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    at = dict(zip(columns, cells))
    assert at["TTFT vs single"] == "1.50" and at["TTFT vs example"] == "0.50" and at["pushed in forward"] == "1/1"
    assert at["TTFT vs kvpush-tcp"] == "" and at["TTFT vs nixl"] == ""  # itself; a FAIL has no number
    paired = next(line for line in lines if line.startswith("| 64 | kvpush-cma |"))
    at = dict(zip(columns, [c.strip() for c in paired.strip("|").split("|")]))
    assert at["TTFT vs single"] == "1.50" and at["total vs single"] == "2.00"  # its interleaved single requests
    nixl = next(line for line in lines if line.startswith("| 32 | nixl |"))
    assert "FAIL" in nixl and "200.0" not in nixl
    assert any("kvpush-cma" in line and "not run: no cma here" in line for line in lines)
    phases = {"to_prefill": 5.0, "held": 10.0, "to_forward": 1.0, "forward": 100.0, "tail": 2.0, "to_first_token": 30.0}
    records[1]["phases_p50_ms"] = phases
    lines = tables(records)
    header = next(line for line in lines if line.startswith("| prompt | case | to prefill |"))
    row = next(line for line in lines if line.startswith("| 32 | kvpush-tcp | 5.0 |"))
    at = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert at["held"] == "10.0" and at["to first token"] == "30.0" and at["TTFT p50 ms"] == "150.0"


def test_the_bytes_each_request_moved_are_set_beside_what_full_attention_would_move() -> None:
    """``--family gemma3``: a sliding-window model moves only its windows' blocks (the prefill's
    ``vllm:kvpush_bytes_pushed_total`` per request) - the table says how much that is of every layer's whole KV."""
    from bench.vllm_bench import Settings

    full = Settings("python", ".", ".", full_attention_bytes_per_token=1024, block_size=32).full_attention_bytes(33)
    assert full == 64 * 1024  # whole blocks
    record = latency_record("kvpush", 33, samples([0.1], [[1, 2]]), [[1, 2]],
                            {"bytes_moved_per_request": 16 * 1024, "full_attention_bytes_per_request": full})
    lines = tables([record])
    assert "| 33 | kvpush | 0.02 MiB | 0.06 MiB | 0.25x |" in lines


def test_a_run_may_ask_for_its_own_prompt_lengths() -> None:
    asked = plan(True, [512, 2048])
    assert (asked.lengths, asked.reps, asked.hidden_lengths) == ((512, 2048), {512: 3, 2048: 3}, (512,))
    assert plan(False, [2048]).reps == {2048: 3}
    assert plan(False, [32, 512], reps=24).reps == {32: 24, 512: 24}  # --reps, for medians of 20 or more
    assert plan(False, reps=2).lengths == (32, 128, 512, 2048) and set(plan(False, reps=2).reps.values()) == {2}


def test_the_bytes_a_prefill_pushed_are_read_from_its_trace() -> None:
    from bench.vllm_bench import bytes_pushed

    trace = [{"ev": "step", "t_bind": 1.0}, {"ev": "bytes", "t": 1.1, "total": 4096}, {"ev": "bytes", "t": 2.0,
                                                                                      "total": 12288}]
    assert bytes_pushed(trace) == 12288 and bytes_pushed([]) == 0
