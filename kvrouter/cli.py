"""The router's command line: ``kvpush proxy ...`` (kvpush's command) and ``python -m kvrouter ...`` take the
same flags (``add_arguments``) and run the same way (``run``): serve until Ctrl-C (SIGINT) or SIGTERM.
aiohttp and ZMQ are imported only when the router runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .core.placement import Policy

if TYPE_CHECKING:
    from .config import ProxyConfig

DEFAULT_KV_PORT = 14579  # vLLM's kv_port default (kvrouter.core.pools.DEFAULT_KV_PORT)
API_KEY_ENV, UPSTREAM_API_KEY_ENV = "KVPUSH_PROXY_API_KEY", "KVPUSH_UPSTREAM_API_KEY"
DESCRIPTION = (
    "Serve /v1/completions and /v1/chat/completions (streamed or not), /v1/models, /health and /metrics in\n"
    "front of vLLM instances that run KvpushConnector. Each request is placed from what each instance\n"
    "holds in its prefix cache (its KV events, else what the router sent it) and how busy it is: a decode\n"
    "alone computes it when it holds most of the prompt or the prompt is short; a free prefill computes a\n"
    "long uncached prompt and pushes its KV to the decode. --static: every request through a prefill\n"
    "(fewest in flight), as before. The route and its reason come back as X-Kvpush-Route and\n"
    "X-Kvpush-Reason.")
EPILOG = (
    "A prefill's kvpush address is its URL's host and --prefill-kv-port; one prefill's own goes\n"
    "in its URL's fragment:\n"
    "  --prefill 'http://10.0.0.5:8100#kv=10.0.0.5:14600'   (or #kv=14600: the URL's host)\n"
    "  --prefill 'http://10.0.0.5:8100#kv=14600&cluster=7'  (a prefill with cluster_id 7 in its config)\n"
    "The host must be spelt as the prefill's connector listens (its VLLM_HOST_IP; an IP address\n"
    "is safest): the decode derives the prefill's cluster id from it. Where an instance publishes its KV\n"
    "events is asked of it (vLLM's /kv_event_sources), or given: '#events=tcp://HOST:PORT&replay=tcp://HOST:PORT'.\n\n"
    "example (one host, vLLM's default kv_port):\n"
    "  kvpush proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000\n"
    "  kvpush proxy --both http://127.0.0.1:8100#kv=14579 --both http://127.0.0.1:8200#kv=14589 --port 8000")


class UsageError(Exception):
    """Flags that parse one by one but not together (exit status 2)."""


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return int(text)


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


def add_arguments(proxy: argparse.ArgumentParser) -> None:
    proxy.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="a prefill instance's base URL, e.g. http://127.0.0.1:8100 (repeatable)")
    proxy.add_argument("--decode", action="append", default=[], metavar="URL",
                       help="a decode instance's base URL, e.g. http://127.0.0.1:8200 (repeatable)")
    proxy.add_argument("--discovery", default=None, metavar="etcd://HOST:PORT[,...]",
                       help="route over the instances registered in this etcd (KvpushConnector's \"discovery\"), "
                            "watched: new ones get requests when seen, gone or draining ones none; needs "
                            "pip install 'kvpush[fleet]'")
    proxy.add_argument("--both", action="append", default=[], metavar="URL",
                       help="an instance with kv_role kv_both (a prefill for others or a decode, request by request), "
                            "e.g. http://127.0.0.1:8100#kv=14579 (repeatable)")
    proxy.add_argument("--prefill-kv-port", type=_port, default=DEFAULT_KV_PORT, metavar="PORT",
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
    placing = proxy.add_argument_group("placement")
    placing.add_argument("--static", action="store_true",
                         help="every request through a prefill (fewest in flight), then a decode: the proxy before it "
                              "knew what instances cache")
    placing.add_argument("--pd-min-tokens", type=_count, default=Policy.pd_min_tokens, metavar="N",
                         help="disaggregate a request only when the decode would compute at least N prompt tokens "
                              f"itself (default {Policy.pd_min_tokens})")
    placing.add_argument("--prefill-queue", type=_count, default=1, metavar="N",
                         help="... and a prefill has fewer than N prefills in flight (default 1)")
    placing.add_argument("--request-tokens", type=_count, default=Policy.request_tokens, metavar="N",
                         help="what each request an instance is already serving weighs against it, in prompt tokens "
                              f"to compute (default {Policy.request_tokens}: a decode step's share of a "
                              "newcomer's first token; the prompt tokens queued on it count besides)")
    placing.add_argument("--block-size", type=_count, default=None, metavar="TOKENS",
                         help="the instances' --block-size (default: read from their KV events or registration)")
    placing.add_argument("--prefix-hash-algo", default="sha256", choices=("sha256", "sha256_cbor"),
                         help="the instances' --prefix-caching-hash-algo (default sha256, vLLM's)")
    placing.add_argument("--prefix-hash-seed", default=None, metavar="SEED",
                         help="the instances' engines' PYTHONHASHSEED, if they set one")
    placing.add_argument("--tokenizer", default="auto", metavar="PATH",
                         help="tokenize text prompts here with this model directory's or name's tokenizer (with the "
                              "tokenizer extra); default auto: the instances' model's, when its files are on this host "
                              "and transformers is installed, else the instances tokenize; none: the instances "
                              "tokenize (a round trip on each request's path)")
    placing.add_argument("--chat-template", default=None, metavar="PATH",
                         help="the chat template the instances were started with (their --chat-template: a file, "
                              "or the template itself); default: the tokenizer's own. Chats are rendered here with "
                              "it once one rendered as an instance's /tokenize did")
    placing.add_argument("--no-kv-events", action="store_true",
                         help="do not follow the instances' KV events: guess what they hold from what was sent")
    proxy.add_argument("--no-warm-links", action="store_true",
                       help="do not send each prefill-decode pair a small warm-up request before any client's (by "
                            "default the pairs up at start are warmed before the router listens, at most 20 s, "
                            "and the others in the background as they come up: a pair's first transfer makes its "
                            "link, which would otherwise be on its first client's path)")
    proxy.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")


def run(args: argparse.Namespace) -> int:
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import kvrouter
        from kvrouter.core.pools import parse_events
    except ImportError as error:
        return _fail(f"needs aiohttp, pyzmq and msgpack (pip install 'kvpush[proxy]'): {error}")
    if not args.discovery and not ((args.prefill or args.both) and (args.decode or args.both)):
        raise UsageError("give --prefill and --decode URLs (or --both), or --discovery etcd://HOST:PORT")
    try:
        prefills = [kvrouter.parse_prefill(spec, args.prefill_kv_port) for spec in args.prefill]
        both = [kvrouter.parse_prefill(spec, args.prefill_kv_port) for spec in args.both]
        decodes = [kvrouter.parse_decode(spec) for spec in args.decode]
        sources = {kvrouter.base_url(spec): source for spec in [*args.prefill, *args.both]
                   if (source := parse_events(spec)) is not None}
        sources.update({url: source for url, source in decodes if source is not None})
        upstream_key = args.upstream_api_key or os.environ.get(UPSTREAM_API_KEY_ENV) or None
        policy = kvrouter.Policy(pd_min_tokens=args.pd_min_tokens, prefill_queue=max(1, args.prefill_queue),
                                 request_tokens=args.request_tokens, static=args.static)
        config = kvrouter.ProxyConfig(prefills, [url for url, _ in decodes], both, args.timeout,
                                      accept_timeout_s=args.accept_timeout, retry_for_s=args.retry_for,
                                      api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                                      upstream_api_key=upstream_key, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                                      discovery=args.discovery, kv_probe_s=args.kv_probe_interval,
                                      kv_probe_timeout_s=args.kv_probe_timeout, policy=policy,
                                      block_size=args.block_size, hash_algorithm=args.prefix_hash_algo,
                                      hash_seed=args.prefix_hash_seed, sources=sources,
                                      follow_events=not args.no_kv_events,
                                      tokenizer=None if args.tokenizer == "none" else args.tokenizer,
                                      chat_template=_template(args.chat_template),
                                      warm_links=not args.no_warm_links)
    except ValueError as error:  # SpecError, FleetError, HashConfigError
        raise UsageError(str(error)) from None
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(_serve(args, config))
    return 130


def _template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself (as vLLM's flag takes it)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if any(char in value for char in "{}\n"):
        return value
    raise UsageError(f"--chat-template {value}: no such file, and not a template")


def _fail(message: str) -> int:
    print(f"kvpush proxy: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return 1


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _serve(args: argparse.Namespace, config: ProxyConfig) -> int:
    from . import server

    try:
        runner = await server.start(config, args.host, args.port)
    except OSError as error:
        return _fail(f"cannot serve on {_address(args.host, args.port)}: {error}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    try:
        where = _address(args.host, server.bound_port(runner))
        routes = ", ".join(f"prefill {p.url} (kvpush {_address(p.kv_host, p.kv_port)})" for p in config.prefills)
        routes = ", ".join(filter(None, (routes, *(f"prefill or decode {b.url} (kvpush "
                                                     f"{_address(b.kv_host, b.kv_port)})" for b in config.both))))
        if config.discovery:
            routes = ", ".join(filter(None, (routes, f"the fleet registered in {config.discovery}")))
        decodes = f"; decode {', '.join(config.decodes)}" if config.decodes else ""
        placing = "static P/D" if config.policy.static else f"placed by cache and load (P/D from " \
                                                              f"{config.policy.pd_min_tokens} uncached tokens)"
        print(f"kvpush proxy: serving http://{where} -> {routes}{decodes}; {placing}. Ctrl-C to stop", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvrouter ...``: the flags of ``kvpush proxy``."""
    parser = argparse.ArgumentParser(prog="kvrouter", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as error:
        parser.error(str(error))
