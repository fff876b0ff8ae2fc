#!/bin/bash
# Issue 20's speed check: alternating runs of two trees, a pair at a time, in one sitting.
#   OLD=/path/to/old/tree NEW=/path/to/new/tree docs/perf/issue20-paired/pairs.sh TRANSPORT WORKLOAD PUSHES PAIRS OUT
# Each run is pushes.py in that tree (its own kvpush and bench/), the driver pinned to core 0 and its target to
# core 1; odd pairs run OLD first, even pairs NEW first. summary.py OUT: the median of the per-pair ratios.
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
for r in $(seq 1 "$4"); do
  if [ $((r % 2)) -eq 1 ]; then order="$OLD $NEW"; else order="$NEW $OLD"; fi
  for tree in $order; do
    label=$([ "$tree" = "$NEW" ] && echo new || echo old)
    (cd "$tree" && UCX_NET_DEVICES=lo timeout 300 "$python" "$here/pushes.py" "$1" "$3" "$2" 2>/dev/null | head -1 \
      | sed "s|^[^ ]*|$r $label|") >> "$5"
  done
done
