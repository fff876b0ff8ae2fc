"""``kvpush proxy``: one OpenAI endpoint in front of vLLM prefill and decode instances that run
KvpushConnector (``kvpush.integrations.proxy``; needs aiohttp, ``pip install 'kvpush[proxy]'``).

    kvpush proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Serves until Ctrl-C (SIGINT) or SIGTERM. aiohttp is imported only when the proxy runs, so the other
subcommands work without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from typing import TYPE_CHECKING

from .args import UsageError, positive
from .output import configure_logging, fail, format_address

if TYPE_CHECKING:
    from kvpush.integrations.proxy import ProxyConfig

    from .args import Subcommands

DEFAULT_KV_PORT = 14579  # vLLM's kv_port default; kvpush.integrations.proxy.DEFAULT_KV_PORT (not imported here)
API_KEY_ENV, UPSTREAM_API_KEY_ENV = "KVPUSH_PROXY_API_KEY", "KVPUSH_UPSTREAM_API_KEY"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535)")
    return int(text)


def add_parser(commands: Subcommands) -> None:
    proxy = commands.add_parser(
        "proxy", help="one OpenAI endpoint in front of vLLM prefill and decode instances (KvpushConnector)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve /v1/completions and /v1/chat/completions (streamed or not), /v1/models, /health and\n"
                    "/metrics. Each request gets a fresh transfer id and goes first to a prefill (max_tokens=1,\n"
                    "do_remote_decode); once that prefill accepted it, the decode gets the client's request with\n"
                    "do_remote_prefill and the prefill's kvpush address, and the client gets the decode's response\n"
                    "as it is. When no prefill accepts (down, starting, refusing), the decode gets the request\n"
                    "plain and computes it alone. Requests spread over several --prefill/--decode (fewest in\n"
                    "flight, ties in turn); an upstream that refuses a request is skipped for a back-off.",
        epilog="A prefill's kvpush address is its URL's host and --prefill-kv-port; one prefill's own goes\n"
               "in its URL's fragment:\n"
               "  --prefill 'http://10.0.0.5:8100#kv=10.0.0.5:14600'   (or #kv=14600: the URL's host)\n"
               "  --prefill 'http://10.0.0.5:8100#kv=14600&cluster=7'  (a prefill with cluster_id 7 in its config)\n"
               "The host must be spelt as the prefill's connector listens (its VLLM_HOST_IP; an IP address\n"
               "is safest): the decode derives the prefill's cluster id from it.\n\n"
               "example (one host, vLLM's default kv_port):\n"
               "  kvpush proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000")
    proxy.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="a prefill instance's base URL, e.g. http://127.0.0.1:8100 (repeatable)")
    proxy.add_argument("--decode", action="append", default=[], metavar="URL",
                       help="a decode instance's base URL, e.g. http://127.0.0.1:8200 (repeatable)")
    proxy.add_argument("--discovery", default=None, metavar="etcd://HOST:PORT[,...]",
                       help="route over the instances registered in this etcd (KvpushConnector's \"discovery\"), "
                            "watched: new ones get requests when seen, gone or draining ones none; needs "
                            "pip install 'kvpush[fleet]'")
    proxy.add_argument("--prefill-kv-port", type=positive, default=DEFAULT_KV_PORT, metavar="PORT",
                       help=f"the kvpush port of prefills without #kv= (default {DEFAULT_KV_PORT}, vLLM's kv_port)")
    proxy.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    proxy.add_argument("--port", type=_port, default=8000, help="port to serve on; 0 picks a free one (default 8000)")
    proxy.add_argument("--timeout", type=_seconds, default=600.0, metavar="SECONDS",
                       help="bound on a client's request, from its arrival to the last byte of the answer, streamed "
                            "ones included (default 600)")
    proxy.add_argument("--accept-timeout", type=_seconds, default=5.0, metavar="SECONDS",
                       help="how long a prefill may take to accept a request before the next prefill is tried, or the "
                            "decode computes it alone (default 5)")
    proxy.add_argument("--retry-for", type=_non_negative, default=30.0, metavar="SECONDS",
                       help="how long a request waits for a decode to accept it when every decode refuses connections "
                            "(restarting); then 503 (default 30)")
    proxy.add_argument("--kv-probe-interval", type=_non_negative, default=1.0, metavar="SECONDS",
                       help="how often each prefill's kvpush engine is asked whether it answers; one that does not "
                            "answer within --kv-probe-timeout gets no request until it does (default 1; 0: never)")
    proxy.add_argument("--kv-probe-timeout", type=_seconds, default=1.5, metavar="SECONDS",
                       help="how long a prefill's kvpush engine may take to answer a probe (default 1.5)")
    proxy.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"clients must send 'Authorization: Bearer KEY' (every route but /health), as vLLM's "
                            f"--api-key; default: the environment variable {API_KEY_ENV} (keeps it out of process "
                            f"listings). The header goes on to the upstreams unless --upstream-api-key is set")
    proxy.add_argument("--upstream-api-key", default=None, metavar="KEY",
                       help=f"the key the upstream vLLM servers expect (their --api-key), sent instead of the "
                            f"client's; default: the environment variable {UPSTREAM_API_KEY_ENV}")
    proxy.add_argument("--max-body-mb", type=_seconds, default=32.0, metavar="MB",
                       help="refuse request bodies larger than this (413; default 32)")
    proxy.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose, 30)
    try:
        from kvpush.integrations import proxy
    except ImportError as error:
        return fail("proxy", f"needs aiohttp (pip install 'kvpush[proxy]'): {error}")
    if not args.discovery and not (args.prefill and args.decode):
        raise UsageError("give --prefill and --decode URLs, or --discovery etcd://HOST:PORT")
    try:
        prefills = [proxy.parse_prefill(spec, args.prefill_kv_port) for spec in args.prefill]
        upstream_key = args.upstream_api_key or os.environ.get(UPSTREAM_API_KEY_ENV) or None
        config = proxy.ProxyConfig(prefills, [proxy.base_url(spec) for spec in args.decode], args.timeout,
                                   accept_timeout_s=args.accept_timeout, retry_for_s=args.retry_for,
                                   api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                                   upstream_api_key=upstream_key, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                                   discovery=args.discovery, kv_probe_s=args.kv_probe_interval,
                                   kv_probe_timeout_s=args.kv_probe_timeout)
    except ValueError as error:  # SpecError, or FleetError for --discovery
        raise UsageError(str(error)) from None
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(_serve(args, config))
    return 130


async def _serve(args: argparse.Namespace, config: ProxyConfig) -> int:
    from kvpush.integrations import proxy

    try:
        runner = await proxy.start(config, args.host, args.port)
    except OSError as error:
        return fail("proxy", f"cannot serve on {format_address(args.host, args.port)}: {error}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    try:
        where = format_address(args.host, proxy.bound_port(runner))
        routes = ", ".join(f"prefill {p.url} (kvpush {format_address(p.kv_host, p.kv_port)})" for p in config.prefills)
        if config.discovery:
            routes = ", ".join(filter(None, (routes, f"the fleet registered in {config.discovery}")))
        decodes = f"; decode {', '.join(config.decodes)}" if config.decodes else ""
        print(f"kvpush proxy: serving http://{where} -> {routes}{decodes}. Ctrl-C to stop", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
