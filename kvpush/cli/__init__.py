"""The ``kvpush`` command (also ``python -m kvpush``).

    kvpush demo      a decode process and a prefill process on this host: push one realistic request
                     (32 layers, scattered blocks), verify every byte on the decode side, print the
                     throughput. No configuration needed.
    kvpush serve     a decode-side endpoint: allocate a blocks cache shaped by flags, listen, and log
                     what peers push into it (or pull from it) until Ctrl-C.
    kvpush push      link to a serving endpoint, push synthetic blocks into its cache (its geometry is
                     read from the endpoint), pull them back and compare byte for byte.
    kvpush proxy     one OpenAI endpoint in front of vLLM prefill and decode instances that run
                     KvpushConnector (needs aiohttp: ``pip install 'kvpush[proxy]'``).
    kvpush fleet     the vLLM instances registered in a fleet's etcd (``pip install 'kvpush[fleet]'``).
    kvpush bench     the benchmark suite (``bench/run.py`` of the source tree; extra arguments
                     are passed through).

Every subcommand has ``--help``; wrong flags exit with status 2, a failed run with status 1 and one
line on stderr saying why. ``--json`` makes ``demo``, ``serve`` and ``push`` print JSON instead of text.

One module per subcommand (``demo``, ``serve``, ``push``, ``bench``), each adding its own parser and
running it; ``args`` holds the argument types and shared flags, ``output`` what is printed, ``synthetic``
the seeded cache contents. The command uses kvpush's public API only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from . import bench, demo, fleet, proxy, push, serve
from .args import UsageError

_RUN: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": demo.run, "serve": serve.run, "push": push.run, "bench": bench.run, "proxy": proxy.run, "fleet": fleet.run,
    "_decode": demo.run_decode,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description="kvpush: KV-cache block transfer engine")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,serve,push,bench,proxy,fleet}")
    demo.add_parser(commands)
    serve.add_parser(commands)
    push.add_parser(commands)
    bench.add_parser(commands)
    proxy.add_parser(commands)
    fleet.add_parser(commands)
    demo.add_decode_parser(commands)  # last: "invalid choice" lists the subcommands in this order
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status. Usage errors
    exit with status 2 (``SystemExit``), as argparse does."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and argv[1:2] not in (["-h"], ["--help"]):
        # everything after `bench` belongs to the benchmark script, options included
        args = parser.parse_args(["bench"])
        args.bench_args = argv[1:]
    else:
        args = parser.parse_args(argv)
    try:
        return _RUN[args.command](args)
    except UsageError as error:
        parser.error(str(error))
