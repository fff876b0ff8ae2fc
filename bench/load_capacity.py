#!/usr/bin/env python3
"""Why P/D pays, or not, under bench/vllm_load.py's mixed workload: the run's own calibration turned into the
cores each kind of work needs, per rate. Pure arithmetic, no vLLM.

    python bench/load_capacity.py docs/perf/vllm-load-96.jsonl        # any run's .jsonl (its first line)

bench/vllm_load.py prints the same tables after its own. From the run's machine record (what one instance
alone measured, one request at a time: each prompt length's TTFT, the TPOT, the mix, the rates):

- **A generating request's budget.** Its TPOT target is twice the unloaded TPOT, so over its ``outputs - 1``
  steps it can sit through ``budget`` seconds of other work on its core: exactly its own unloaded generation
  time. A prompt whose prefill takes longer than that fails the TPOT of every request generating on the core
  that computes it ("long" prompts; the others are "short").
- **Data parallel** (round robin, vllm-router): every core computes long prompts. The share of requests a long
  prefill interrupts while they generate is at least ``1 - exp(-rate_long / cores * generation)`` (one long
  prompt placed on its core during its unloaded generation; it ignores that generation stretches under load,
  hence "at least").
- **P/D keeps long prefills off the generating cores**, so some cores must compute every long prompt and
  nothing else. On this host that is one core of two: its utilisation is the long prompts' share of the rate
  times their compute; past 1 it cannot keep up. Below 1 the long prompts queue (M/G/1, Pollaczek-Khinchine:
  the mean wait), and a wait longer than a length's TTFT slack (its target minus its unloaded TTFT) fails that
  length's TTFT on average. ``pd_load_limit``: the highest load at which one core keeps that mean wait within
  the smallest long slack.
- **A larger host** pools the long prompts over k dedicated cores (M/G/k, Allen-Cunneen's approximation of the
  mean wait): ``utilisation_limit`` per k, the highest utilisation of those k cores at which the mean wait
  stays within the same slack. Pooling raises it, which is what more cores change.

Prints one JSON line per rate and one for the pooling, then two tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TTFT_FACTOR, TTFT_SLACK_S, TPOT_FACTOR = 2.0, 0.25, 2.0  # bench/vllm_load.py's targets: 2x unloaded (+250 ms)
POOLS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Unloaded:
    """What one instance measured alone: unloaded TTFT per prompt length, TPOT, the mix, the outputs, and the
    two-core rate (load 1)."""

    ttft_s: Mapping[int, float]
    tpot_s: float
    mix: Mapping[int, float]
    outputs: int
    two_core_rps: float
    cores: int = 2

    @classmethod
    def of_machine(cls, machine: Mapping[str, Any]) -> Unloaded:
        """From bench/vllm_load.py's machine record (its targets undone: target = 2 x unloaded + 250 ms).
        ValueError when a prompt length of the mix has no unloaded TTFT (none of its requests completed)."""
        ttft = {int(n): (ms / 1e3 - TTFT_SLACK_S) / TTFT_FACTOR for n, ms in machine["ttft_target_ms"].items()}
        mix = {int(n): w for n, w in machine["mix"].items()}
        if missing := sorted(n for n, w in mix.items() if w > 0 and n not in ttft):
            raise ValueError(f"no unloaded TTFT for prompts of {missing} tokens: the capacity cannot be computed")
        return cls(ttft, machine["tpot_target_ms"] / 1e3 / TPOT_FACTOR, mix, int(machine["output_tokens"]),
                   float(machine["two_core_rps"]), 2)

    @property
    def generation_s(self) -> float:
        """A request's unloaded generation after its first token."""
        return (self.outputs - 1) * self.tpot_s

    @property
    def budget_s(self) -> float:
        """Other work a generating request can sit through on its core and still meet its TPOT target."""
        return (self.outputs - 1) * self.tpot_s * (TPOT_FACTOR - 1)

    @property
    def long(self) -> list[int]:
        """Prompt lengths whose prefill fails the TPOT of every request generating on its core."""
        return sorted(n for n, t in self.ttft_s.items() if t > self.budget_s and self.mix.get(n, 0) > 0)

    def slack_s(self, length: int) -> float:
        """How long a prompt of ``length`` may queue and still meet its TTFT target."""
        t = self.ttft_s[length]
        return TTFT_FACTOR * t + TTFT_SLACK_S - t

    def long_moments(self) -> tuple[float, float, float]:
        """(share of requests, mean, second moment of the prefill time) of the long prompts."""
        share = sum(self.mix[n] for n in self.long)
        if not share:
            return 0.0, 0.0, 0.0
        mean = sum(self.mix[n] * self.ttft_s[n] for n in self.long) / share
        second = sum(self.mix[n] * self.ttft_s[n] ** 2 for n in self.long) / share
        return share, mean, second


def erlang_c(servers: int, offered: float) -> float:
    """The chance an arrival waits in M/M/k with ``offered`` = rate x mean service (< servers)."""
    term, total = 1.0, 1.0  # a^0/0!
    for n in range(1, servers):
        term *= offered / n
        total += term
    last = term * offered / servers * servers / (servers - offered)
    return last / (total + last)


def mgk_wait(rate: float, mean: float, second: float, servers: int) -> float:
    """Mean queueing wait in M/G/k (Allen-Cunneen; exact for k = 1: Pollaczek-Khinchine); inf at or past
    saturation."""
    offered = rate * mean
    if rate <= 0:
        return 0.0
    if offered >= servers:
        return math.inf
    variation = second / (mean * mean) - 1.0  # squared coefficient of variation of the service time
    return erlang_c(servers, offered) / (servers / mean - rate) * (1.0 + variation) / 2.0


def at_load(cal: Unloaded, load: float) -> dict[str, Any]:
    """The cores each kind of work needs at ``load`` (a fraction of the two-core rate), and what that leaves
    P/D and data parallelism on this host."""
    rate = load * cal.two_core_rps
    share, mean, second = cal.long_moments()
    long_rate = rate * share
    pd_utilisation = long_rate * mean  # one core takes every long prompt
    wait = mgk_wait(long_rate, mean, second, 1) if long_rate else 0.0
    return {
        "workload": "VLLM-LOAD-CAPACITY", "case": "at load", "load": load, "rate_rps": round(rate, 3),
        "prefill_cores": round(rate * sum(w * cal.ttft_s[n] for n, w in cal.mix.items()), 2),
        "long_prompt_cores": round(pd_utilisation, 2),
        "dp_interrupted_at_least": round(1 - math.exp(-long_rate / cal.cores * cal.generation_s), 2),
        "pd_long_core_utilisation": round(pd_utilisation, 2),
        "pd_long_wait_s": None if math.isinf(wait) else round(wait, 2),
        "pd_long_lengths_late": [n for n in cal.long if wait > cal.slack_s(n)],
    }


def load_limit(cal: Unloaded, servers: int = 1) -> float:
    """The highest load (of this host's two-core rate) at which ``servers`` cores computing only the long prompts
    keep their mean wait within the smallest long slack (bisection; 0 with no long prompts)."""
    share, mean, second = cal.long_moments()
    if not share:
        return 0.0
    slack = min(cal.slack_s(n) for n in cal.long)
    low, high = 0.0, servers / (cal.two_core_rps * share * mean)  # saturation
    for _ in range(60):
        middle = (low + high) / 2
        if mgk_wait(middle * cal.two_core_rps * share, mean, second, servers) <= slack:
            low = middle
        else:
            high = middle
    return low


def pooling(cal: Unloaded, pools: Sequence[int] = POOLS) -> dict[str, Any]:
    """Per k dedicated cores: the highest utilisation of them at which the long prompts' mean wait stays within
    the smallest long slack, and the load of this host's rate that is."""
    share, mean, _ = cal.long_moments()
    record: dict[str, Any] = {"workload": "VLLM-LOAD-CAPACITY", "case": "pooling", "long": cal.long,
                              "budget_s": round(cal.budget_s, 3),
                              "slack_s": {str(n): round(cal.slack_s(n), 2) for n in cal.long}}
    loads = {k: load_limit(cal, k) for k in {1, *pools}}
    record["utilisation_limit"] = {str(k): round(loads[k] * cal.two_core_rps * share * mean / k, 2) for k in pools}
    record["pd_load_limit"] = round(loads[1], 2)
    return record


def of_run(machine: Mapping[str, Any], loads: Sequence[float]) -> tuple[list[dict[str, Any]], list[str]]:
    """``tables`` of a run's machine record, or, when it cannot be computed, one record and one line saying why
    (a load run goes on without it)."""
    try:
        return tables(Unloaded.of_machine(machine), loads)
    except ValueError as error:
        return [{"workload": "VLLM-LOAD-CAPACITY", "case": "not computed", "error": str(error)}], \
            [f"Capacity: {error}."]


def tables(cal: Unloaded, loads: Sequence[float]) -> tuple[list[dict[str, Any]], list[str]]:
    """The records and the markdown lines of both tables."""
    rows = [at_load(cal, load) for load in loads]
    pool = pooling(cal)
    lengths = ", ".join(str(n) for n in cal.long) or "none"
    lines = [f"Capacity (bench/load_capacity.py): a generating request can sit through {cal.budget_s * 1e3:.0f} ms "
             f"of other work on its core and meet its TPOT; a prefill of {lengths} tokens takes longer (the long "
             f"prompts, {sum(cal.mix[n] for n in cal.long):.0%} of requests).", "",
             f"| load | req/s | prefill, cores of {cal.cores} | long prompts, cores | data parallel: requests a long "
             "prefill interrupts (at least) | P/D, one core for the long prompts: utilisation, mean wait s | "
             "lengths late on average |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        wait = "never keeps up" if r["pd_long_wait_s"] is None else f"{r['pd_long_wait_s']:.2f}"
        late = ", ".join(str(n) for n in r["pd_long_lengths_late"]) or "-"
        lines.append(f"| {r['load']:g} | {r['rate_rps']:.2f} | {r['prefill_cores']:.2f} | {r['long_prompt_cores']:.2f} "
                     f"| {r['dp_interrupted_at_least']:.0%} | {r['pd_long_core_utilisation']:.2f}, {wait} | {late} |")
    slack = ", ".join(f"{n}: {s} s" for n, s in pool["slack_s"].items())
    lines += ["", f"One core keeps the long prompts within their TTFT slack ({slack}) up to load "
              f"{pool['pd_load_limit']:g}. Pooled over k dedicated cores (a larger host), the highest utilisation "
              "of those cores that does:", "", "| k | " + " | ".join(pool["utilisation_limit"]) + " |",
              "|---|" + "---|" * len(pool["utilisation_limit"]),
              "| utilisation | " + " | ".join(f"{v:.2f}" for v in pool["utilisation_limit"].values()) + " |"]
    return [*rows, pool], lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a bench/vllm_load.py .jsonl (its machine record is read)")
    parser.add_argument("--load", default=None, help="loads (default: the run's own)")
    args = parser.parse_args(argv)
    with open(args.run) as source:
        records = [json.loads(line) for line in source if line.strip()]
    machine = next((r for r in records if r.get("case") == "machine" and "ttft_target_ms" in r), None)
    if machine is None:
        sys.stderr.write(f"{args.run}: no machine record of the mixed workload\n")
        return 2
    loads = ([float(f) for f in args.load.split(",")] if args.load else
             sorted({r["load"] for r in records if r.get("workload") == "VLLM-LOAD" and r.get("load")}))
    try:
        found, lines = tables(Unloaded.of_machine(machine), loads)
    except ValueError as error:
        sys.stderr.write(f"{args.run}: {error}\n")
        return 2
    for record in found:
        print(json.dumps(record))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
