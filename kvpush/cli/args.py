"""Argument types and the flags several subcommands share.

Every type here raises ``argparse.ArgumentTypeError``, so a wrong value is a usage error (exit status 2)
before any engine starts. ``UsageError`` lets a subcommand report a wrong combination of flags the same
way after parsing. Nothing here touches the network.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Protocol

from kvpush import AUTH_TOKEN_ENV, DataType, LLMClusterInfo


class Subcommands(Protocol):
    """What ``ArgumentParser.add_subparsers()`` returns, as a subcommand's ``add_parser`` uses it."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...

# The names ``kvpush.transport`` accepts, as --help shows them. kvpush's public API has no list of
# transport names to read; the engine validates the option itself, so a name missing here is only a
# name the command line does not offer.
TRANSPORT_CHOICES = ("auto", "tcp", "ucx", "cma")

DTYPES: dict[str, DataType] = {
    "float16": DataType.DT_FLOAT16, "fp16": DataType.DT_FLOAT16, "half": DataType.DT_FLOAT16,
    "bfloat16": DataType.DT_BF16, "bf16": DataType.DT_BF16,
    "float32": DataType.DT_FLOAT, "fp32": DataType.DT_FLOAT, "float": DataType.DT_FLOAT,
    "float64": DataType.DT_DOUBLE, "double": DataType.DT_DOUBLE,
    "int8": DataType.DT_INT8, "uint8": DataType.DT_UINT8, "int16": DataType.DT_INT16,
    "uint16": DataType.DT_UINT16, "int32": DataType.DT_INT32, "uint32": DataType.DT_UINT32,
    "int64": DataType.DT_INT64, "uint64": DataType.DT_UINT64, "bool": DataType.DT_BOOL,
}


class UsageError(Exception):
    """Flags that parse one by one but not together; ``main`` prints the usage and exits with 2."""


def dtype_arg(text: str) -> DataType:
    """An element type by name (``float16``, ``bf16``, ``DT_INT32``, ...)."""
    name = text.strip().lower()
    name = name[3:] if name.startswith("dt_") else name
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r} (one of {', '.join(sorted(DTYPES))})")
    return DTYPES[name]


def shape_arg(text: str) -> tuple[int, ...]:
    """A block shape: positive integers separated by ``,`` or ``x``."""
    parts = [part.strip() for part in text.replace("x", ",").split(",")]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"block shape {text!r} must be positive integers like 16,8,128")
    return tuple(int(part) for part in parts)


def address_arg(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port): the host an IPv4/IPv6 literal or a host name,
    the port in [0, 65535]; a wrong one is described as the engine's ``llm.listenIpInfo`` check would."""
    raw = text.strip()
    if raw.startswith("["):
        host, sep, port_text = raw[1:].partition("]:")
    else:
        host, sep, port_text = raw.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"option address={text!r} must look like 'host:port' or '[v6]:port'")
    probe = LLMClusterInfo()  # its address check is the engine's: an IPv4/IPv6 literal or a host name
    try:
        probe.append_local_ip_info(host, 0)
        port = int(port_text)
    except ValueError as error:
        reason = str(error)
        reason = "address" + reason.removeprefix("ip") if reason.startswith("ip") else reason
        raise argparse.ArgumentTypeError(f"option address={text!r}: {reason}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"option address={text!r}: address={port} is out of range [0, 65535]")
    checked_host, _ = probe.local_ip_info[0]
    return checked_host, port


def positive(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_engine_args(sub: argparse.ArgumentParser) -> None:
    """The flags of a subcommand that runs an engine (serve, push); ``engine_options`` reads them."""
    sub.add_argument("--sync-kv-timeout", type=positive, default=1000, metavar="MS",
                     help="per-layer transfer deadline, llm.SyncKvCacheWaitTime (default 1000)")
    sub.add_argument("--transport", choices=TRANSPORT_CHOICES, default="auto",
                     help="kvpush.transport (default auto)")
    sub.add_argument("--auth-token", default=None,
                     help=f"shared secret both ends must know (kvpush.auth_token); default: the environment variable "
                          f"{AUTH_TOKEN_ENV}, which stays out of process listings and shell history")
    sub.add_argument("--json", action="store_true", help="machine-readable output (JSON)")
    sub.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")


def auth_token(args: argparse.Namespace) -> str | None:
    """The token in force: ``--auth-token``, else the environment's."""
    return str(args.auth_token or os.environ.get(AUTH_TOKEN_ENV) or "") or None


def engine_options(args: argparse.Namespace) -> dict[str, str]:
    """The engine options the flags of ``add_engine_args`` ask for."""
    options = {"llm.SyncKvCacheWaitTime": str(args.sync_kv_timeout), "kvpush.transport": args.transport}
    token = auth_token(args)
    if token:
        options["kvpush.auth_token"] = token
    return options
