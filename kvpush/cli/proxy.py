"""``kvpush proxy``: one OpenAI endpoint in front of vLLM instances that run KvpushConnector - the router,
``kvrouter`` (needs aiohttp, pyzmq and msgpack: ``pip install 'kvpush[proxy]'``). Its flags and its run are
the router's own (``kvrouter.cli``; ``python -m kvrouter`` takes the same).

    kvpush proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvrouter import cli as router

from .args import UsageError

if TYPE_CHECKING:
    from .args import Subcommands


def add_parser(commands: Subcommands) -> None:
    proxy = commands.add_parser(
        "proxy", help="one OpenAI endpoint in front of vLLM prefill and decode instances (KvpushConnector)",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=router.DESCRIPTION, epilog=router.EPILOG)
    router.add_arguments(proxy)


def run(args: argparse.Namespace) -> int:
    try:
        return router.run(args)
    except router.UsageError as error:
        raise UsageError(str(error)) from None
