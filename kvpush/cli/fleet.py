"""``kvpush fleet``: the instances registered in a fleet's etcd (``kvpush.fleet``), as a
table or (``--json``) a JSON array with one object per instance: ``role`` (``prefill``, ``decode`` or
``both``), ``url``, ``kv`` (every rank's kvpush address, comma-separated), ``model``, ``state`` (``ready`` /
``draining``), the load it last registered (``running``, ``waiting``, ``kv_usage``), ``tp``, ``age_s``, ``id``
and ``compat`` (its KV-geometry fingerprint). Needs ``pip install 'kvpush[fleet]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import TYPE_CHECKING

from .args import UsageError
from .output import configure_logging, fail

if TYPE_CHECKING:
    from .args import Subcommands

_COLUMNS = ("role", "url", "kv", "model", "state", "running", "waiting", "kv_usage", "tp", "age_s")


def add_parser(commands: Subcommands) -> None:
    fleet = commands.add_parser("fleet", help="the instances registered in a fleet's etcd",
                                description="List the vLLM instances registered in etcd by KvpushConnector's "
                                            "\"discovery\" setting, as kvpush proxy --discovery sees them.")
    fleet.add_argument("--discovery", required=True, metavar="etcd://HOST:PORT[,...]",
                       help="the fleet's etcd endpoints")
    fleet.add_argument("--json", action="store_true", help="a JSON array, one object per instance")
    fleet.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose, 40)
    try:
        from kvpush import fleet
        from kvpush.fleet.etcd import snapshot
    except ImportError as error:
        return fail("fleet", f"needs aetcd (pip install 'kvpush[fleet]'): {error}")
    try:
        endpoints = fleet.parse_discovery(args.discovery)
    except fleet.FleetError as error:
        raise UsageError(str(error)) from None
    try:
        instances, refused = asyncio.run(snapshot(endpoints))
    except fleet.FleetError as error:
        return fail("fleet", str(error))
    rows = [instance.row() for instance in instances]
    if args.json:
        print(json.dumps(rows), flush=True)
        return 0
    table = [list(_COLUMNS)] + [["-" if row[c] is None else str(row[c]) for c in _COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    for key, why in refused.items():
        print(f"unreadable entry {key}: {why}")
    if not rows:
        print(f"no instance is registered in {args.discovery}")
    return 0
