"""bench/vllm_load.py's pure parts: the workload is the same for every rate and setup, the targets come from
the unloaded run, goodput counts only correct requests that met both targets, outputs that differ fail
the record. No vLLM needed."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.vllm_load import MIX, Outcome, Targets, load_record, setup_kind, table, workload  # noqa: E402


def done(index: int, length: int, ttft: float, tpot: float, tokens: list[int], sent: float = 0.0,
         cached: int | None = None) -> Outcome:
    e2e = ttft + tpot * (len(tokens) - 1)
    return Outcome(index, length, sent, ttft, [tpot] * (len(tokens) - 1), e2e, tokens, cached)


def test_the_workload_is_seeded_mixed_and_poisson() -> None:
    jobs = workload(400, 1000)
    assert jobs == workload(400, 1000)
    assert [j.index for j in jobs] == list(range(400))
    lengths = [j.length for j in jobs]
    for length, weight in MIX:  # the mix's shares, within sampling noise
        assert abs(lengths.count(length) / 400 - weight) < 0.08
    assert all(len(j.ids) == j.length for j in jobs)
    assert len({j.ids for j in jobs}) == 400  # distinct prompts
    gaps = [b.offset_unit - a.offset_unit for a, b in zip(jobs, jobs[1:])]
    assert all(g >= 0 for g in gaps) and jobs[0].offset_unit == 0.0
    assert sum(gaps) / len(gaps) == pytest.approx(1.0, abs=0.15)  # unit rate: mean gap 1 s


def test_targets_and_goodput() -> None:
    unloaded = [done(0, 32, 0.1, 0.02, [1, 2, 3]), done(1, 32, 0.3, 0.04, [4, 5, 6]),
                done(2, 512, 1.0, 0.03, [7, 8, 9])]
    targets = Targets.from_unloaded(unloaded)
    assert targets.ttft_s == {32: pytest.approx(2 * 0.2 + 0.25), 512: pytest.approx(2 * 1.0 + 0.25)}
    assert targets.tpot_s == pytest.approx(2 * 0.03)
    refs = {0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9], 3: [1, 1, 1]}
    outcomes = [done(0, 32, 0.5, 0.05, [1, 2, 3], sent=0.0, cached=32),  # meets both
                done(1, 32, 0.7, 0.05, [4, 5, 6], sent=1.0, cached=0),  # TTFT missed
                done(2, 512, 1.0, 0.09, [7, 8, 9], sent=2.0, cached=512),  # TPOT missed
                Outcome(3, 32, 3.0, error="TimeoutError: ")]  # failed: a miss
    record = load_record("kvpush", 0.5, 0.4, outcomes, refs, targets)
    assert record["ok"] == "3/4" and record["outputs_equal"] == "3/3" and record["met_targets"] == "1/4"
    assert record["kv_transferred"] == "2/3" and "result" not in record
    span = 2.0 + 1.0 + 0.09 * 2  # first sent at 0, last answer ends at 2 + e2e
    assert record["throughput_rps"] == pytest.approx(3 / span, abs=1e-3)
    assert record["goodput_rps"] == pytest.approx(1 / span, abs=1e-3)
    assert record["ttft_p50_ms"] == pytest.approx(700.0)
    # why goodput was lost: each miss by the target it failed and its prompt length
    assert record["missed"] == {"ttft": {"32": 1}, "tpot": {"512": 1}, "error": {"32": 1}}
    row = "\n".join(table([record]))
    assert "kvpush" in row and "error 32x1; tpot 512x1; ttft 32x1" in row


def test_router_variants_name_their_threshold() -> None:
    assert setup_kind("router") == ("router", [])
    assert setup_kind("router:128") == ("router", ["--pd-min-tokens", "128"])
    assert setup_kind("rr") == ("rr", [])
    for bad in ("rr:32", "router:many"):
        with pytest.raises(ValueError):
            setup_kind(bad)


def test_an_output_that_differs_fails_the_record_with_no_number() -> None:
    unloaded = [done(0, 32, 0.1, 0.02, [1, 2, 3])]
    targets = Targets.from_unloaded(unloaded)
    record = load_record("rr", 1.0, 2.0, [done(0, 32, 0.1, 0.02, [1, 2, 4])], {0: [1, 2, 3]}, targets)
    assert record["result"] == "FAIL" and "differ" in record["error"]
    assert not any(k.endswith("_ms") or k.endswith("_rps") for k in record if k != "offered_rps")
    assert "FAIL" in "\n".join(table([record]))


def test_multiturn_conversations_share_a_system_prompt_and_build_on_their_answers() -> None:
    from bench import multiturn

    system, levels = multiturn.conversations(2, 3, 4, vocab=2000)
    again = multiturn.conversations(2, 3, 4, vocab=2000)
    assert (system, levels) == again and len(system) == multiturn.SYSTEM_TOKENS
    assert len(levels) == 2 and all(len(level) == 3 for level in levels)
    assert levels[0][0].messages != levels[1][0].messages  # every level its own conversations
    conv = levels[0][1]
    answers = [[7] * multiturn.ANSWER_TOKENS, [8] * multiturn.ANSWER_TOKENS]
    third = multiturn.turn_prompt(system, conv, 2, answers)
    assert third == [*system, *conv.messages[0], *answers[0], *conv.messages[1], *answers[1], *conv.messages[2]]
    assert multiturn.turn_prompt(system, conv, 0, []) == [*system, *conv.messages[0]]


def test_a_multiturn_record_counts_what_was_computed_against_the_floor() -> None:
    from bench import multiturn
    from bench.vllm_load import multiturn_record, multiturn_table

    outcomes = [multiturn.TurnOutcome(0, c, t, 600, sent=float(c), ttft_s=0.1 * (t + 1), e2e_s=1.0,
                                      tokens=[c, t], route="decode-only") for c in range(2) for t in range(2)]
    references = {o.key: [o.conversation, o.turn] for o in outcomes}
    unloaded = {o.key: 0.1 for o in outcomes}
    outcomes[3].ttft_s = 0.5  # over 2 x 0.1 + 0.25
    record = multiturn_record("router", 1.0, 0.05, outcomes, references, unloaded, tpot_target_s=2.0,
                              computed=480.0, floor=100.0)
    assert record["computed_per_request"] == 120.0 and record["computed_vs_floor"] == 1.2
    assert record["met_targets"] == "3/4"
    assert "router" in "\n".join(multiturn_table([record]))
    wrong = multiturn_record("router", 1.0, 0.05, outcomes, {**references, (0, 0, 0): [9]}, unloaded, 2.0, 1.0, 1.0)
    assert wrong["result"] == "FAIL" and "computed_per_request" not in wrong
