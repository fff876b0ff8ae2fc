"""``kvpush bench``: run the benchmark suite, ``bench/run.py`` of the source tree, passing every
argument after ``bench`` through (``main`` hands them over unparsed). The benchmarks ship with a git
clone, not with an installed package; without them this fails in one line.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .output import fail

if TYPE_CHECKING:
    from .args import Subcommands

# kvpush/cli/bench.py -> the source tree's root
_ROOT = Path(__file__).resolve().parents[2]


def add_parser(commands: Subcommands) -> None:
    bench = commands.add_parser(
        "bench", help="run the benchmark suite (bench/run.py; extra arguments are passed through)",
        description="Run bench/run.py from the source tree: W-KV, W-KV-RUNS, W-LAYER, W-SMALL and W-CONTIG for "
                    "every kvpush transport beside memcpy, sockets, ucx_perftest and the peers, verified; JSON "
                    "lines, a Markdown table and a PNG chart in bench/results/. Arguments after `bench` go to "
                    "the script, e.g. `kvpush bench --quick`; `kvpush bench -- --help` shows them.")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for bench/run.py")


def run(args: argparse.Namespace) -> int:
    """The script's exit status (130 on Ctrl-C)."""
    script = _ROOT / "bench" / "run.py"
    if not script.is_file():
        return fail("bench", f"{script} not found: the benchmarks ship with the source tree "
                             f"(git clone), not with the installed package")
    extra = list(args.bench_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    try:
        return subprocess.call([sys.executable, str(script), *extra], cwd=_ROOT)
    except KeyboardInterrupt:
        return 130
