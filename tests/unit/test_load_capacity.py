"""bench/load_capacity.py: the arithmetic that explains a load run (its calibration in, cores and waits out).
No vLLM needed."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.load_capacity import (  # noqa: E402
    Unloaded,
    at_load,
    erlang_c,
    load_limit,
    main,
    mgk_wait,
    of_run,
    pooling,
)

# bench/vllm_load.py's machine record of docs/perf/vllm-load-threshold-a.jsonl
MACHINE = {"workload": "-", "case": "machine", "mix": {"32": 0.4, "128": 0.3, "512": 0.2, "2048": 0.1},
           "output_tokens": 16, "two_core_rps": 1.636, "ttft_target_ms": {"32": 432, "128": 781, "512": 2276,
                                                                           "2048": 10459}, "tpot_target_ms": 84.5}


def test_the_calibration_is_the_targets_undone() -> None:
    cal = Unloaded.of_machine(MACHINE)
    assert cal.ttft_s[512] == pytest.approx(1.013)
    assert cal.tpot_s == pytest.approx(0.04225)
    # twice the unloaded TPOT over 15 steps: the request may sit through its own generation time again
    assert cal.budget_s == pytest.approx(cal.generation_s) == pytest.approx(15 * 0.04225)
    assert cal.long == [512, 2048]  # 1.01 s and 5.1 s of prefill; 128 tokens take 0.27 s
    assert cal.slack_s(512) == pytest.approx(2.276 - 1.013)


def test_the_queue_waits_of_known_systems() -> None:
    # M/M/2 at rate 1, service 1: an arrival waits with chance 1/3, on average 1/3
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert mgk_wait(1.0, 1.0, 2.0, 2) == pytest.approx(1 / 3)  # exponential: second moment 2 mean^2
    # M/D/1 (Pollaczek-Khinchine): rho / (2 mu (1 - rho))
    assert mgk_wait(0.5, 1.0, 1.0, 1) == pytest.approx(0.5)
    assert math.isinf(mgk_wait(2.0, 1.0, 1.0, 2))  # saturated
    assert mgk_wait(0.0, 1.0, 1.0, 1) == 0.0


def test_a_load_says_what_two_cores_can_give() -> None:
    cal = Unloaded.of_machine(MACHINE)
    record = at_load(cal, 1.0)
    # the long prompts alone need more than the one core P/D would keep for them
    assert record["long_prompt_cores"] == pytest.approx(1.636 * (0.2 * 1.013 + 0.1 * 5.1045), abs=0.01)
    assert record["long_prompt_cores"] > 1
    assert record["pd_long_wait_s"] is None and record["pd_long_lengths_late"] == [512, 2048]
    assert record["prefill_cores"] > record["long_prompt_cores"]
    assert 0 < record["dp_interrupted_at_least"] < 1
    light = at_load(cal, 0.2)
    assert light["pd_long_wait_s"] is not None and light["pd_long_lengths_late"] == []


def test_the_limits_sit_where_the_wait_meets_the_slack_and_pooling_raises_them() -> None:
    cal = Unloaded.of_machine(MACHINE)
    share, mean, second = cal.long_moments()
    limit = load_limit(cal)
    assert mgk_wait(limit * cal.two_core_rps * share, mean, second, 1) == pytest.approx(cal.slack_s(512), rel=1e-6)
    assert at_load(cal, limit * 0.99)["pd_long_lengths_late"] == []
    assert at_load(cal, limit * 1.01)["pd_long_lengths_late"] == [512]
    utilisations = list(pooling(cal)["utilisation_limit"].values())
    assert utilisations == sorted(utilisations) and utilisations[0] < 0.5 < utilisations[-1] < 1


def test_without_long_prompts_nothing_is_late() -> None:
    cal = Unloaded.of_machine({**MACHINE, "mix": {"32": 0.5, "128": 0.5, "512": 0, "2048": 0}})
    assert cal.long == []
    record = at_load(cal, 1.0)
    assert record["long_prompt_cores"] == 0 and record["pd_long_lengths_late"] == []
    assert load_limit(cal) == 0.0


def test_the_command_reads_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "load.jsonl"
    run.write_text("\n".join(json.dumps(r) for r in (
        MACHINE, {"workload": "VLLM-LOAD", "case": "single", "load": 0.0},
        {"workload": "VLLM-LOAD", "case": "rr", "load": 1.0}, {"workload": "VLLM-LOAD", "case": "rr", "load": 1.25})))
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["load"] for r in records if r["case"] == "at load"] == [1.0, 1.25]
    assert "| 1 | 1.64 | 1.36 | 1.17 |" in out
    (tmp_path / "none.jsonl").write_text(json.dumps({"case": "machine"}) + "\n")
    assert main([str(tmp_path / "none.jsonl")]) == 2


def test_a_length_without_an_unloaded_sample_says_so_and_the_run_goes_on() -> None:
    machine = {**MACHINE, "ttft_target_ms": {"32": 432, "128": 781, "512": 2276}}  # no 2048-token request done
    with pytest.raises(ValueError, match=r"\[2048\]"):
        Unloaded.of_machine(machine)
    records, lines = of_run(machine, [1.0])
    assert records[0]["case"] == "not computed" and "2048" in lines[0]
    assert of_run(MACHINE, [1.0])[0][0]["case"] == "at load"
