"""summary.py OUT...: per file, old and new medians and the median of the per-pair ratios (new / old)."""

import collections
import statistics
import sys

for path in sys.argv[1:]:
    runs: dict[str, dict[str, dict[str, float]]] = collections.defaultdict(dict)
    for line in open(path):
        fields = line.split()
        label = {"oldlib": "old", "main": "new"}.get(fields[1], fields[1])
        runs[fields[0]][label] = {fields[i]: float(fields[i + 1]) for i in range(3, len(fields) - 1, 2)}
    pairs = [run for run in runs.values() if {"old", "new"} <= set(run)]
    for key in ("p50", "p99", "cpu"):
        ratios = sorted(run["new"][key] / run["old"][key] for run in pairs)
        quart = statistics.quantiles(ratios, n=4)
        print(f"{path} {key}: old {statistics.median(r['old'][key] for r in pairs):.1f} us, new "
              f"{statistics.median(r['new'][key] for r in pairs):.1f} us; per pair {statistics.median(ratios):.3f}x "
              f"(quartiles {quart[0]:.2f}-{quart[-1]:.2f}, {len(pairs)} pairs)")
