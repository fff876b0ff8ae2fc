"""``kvpush serve``: a decode-side endpoint. Allocate a blocks cache shaped by flags, listen, and
report every ``--interval`` seconds what linked peers pushed into it or pulled from it, until Ctrl-C
(SIGINT) or SIGTERM; then finalize the engine and print the totals.

It reads only the engine's public view: ``engine.links`` and each link's ``stats()``, plus a link
listener that keeps each link that closes (with its final counters), so a peer that links, pushes and
unlinks between two reports is still reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from typing import TYPE_CHECKING

from kvpush import AUTH_TOKEN_ENV, BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMException, LLMRole, is_loopback

from .args import add_engine_args, address_arg, auth_token, dtype_arg, engine_options, positive, shape_arg
from .output import Reporter, configure_logging, fail, format_address, size

if TYPE_CHECKING:
    from kvpush.link import Link

    from .args import Subcommands

_COUNTERS = (("bytes_received", "pushed", "received"), ("bytes_served", "pulled", "served"))


def add_parser(commands: Subcommands) -> None:
    serve = commands.add_parser(
        "serve", help="a decode-side endpoint: allocate a blocks cache, listen, log what arrives",
        description="Allocate a blocks cache of LAYERS x TENSORS_PER_LAYER tensors, each [BLOCKS, *BLOCK_SHAPE] of "
                    "DTYPE, listen on LISTEN as cluster CLUSTER_ID, and log what linked peers push into it (or pull "
                    "from it) until Ctrl-C. Try `kvpush push --to HOST:PORT` against it.")
    serve.add_argument("--listen", type=address_arg, default=("127.0.0.1", 26000), metavar="HOST:PORT",
                       help="address to listen on; port 0 picks a free one (default 127.0.0.1:26000)")
    serve.add_argument("--cluster-id", type=int, default=2, help="this endpoint's cluster id (default 2)")
    serve.add_argument("--model-id", type=int, default=0, help="model_id naming the blocks cache (default 0)")
    serve.add_argument("--layers", type=positive, default=32, help="model layers (default 32)")
    serve.add_argument("--tensors-per-layer", type=positive, default=2, help="tensors per layer, K and V (default 2)")
    serve.add_argument("--blocks", type=positive, default=128, help="blocks in the pool (default 128)")
    serve.add_argument("--block-shape", type=shape_arg, default=(16, 8, 128), metavar="D1,D2,...",
                       help="shape of one block of one tensor, e.g. tokens,heads,head_dim (default 16,8,128)")
    serve.add_argument("--dtype", type=dtype_arg, default=DataType.DT_FLOAT16,
                       help="element type: float16, bf16, float32, int8, int32, ... (default float16)")
    serve.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                       help="how often to report what arrived (default 1.0)")
    serve.add_argument("--insecure", action="store_true",
                       help="listen off loopback without an auth token (any peer that reaches the port can link)")
    add_engine_args(serve)


class _Traffic:
    """What serve has reported so far: per live link the counters already reported, the totals over
    all links, and the links that closed since the last report (filled by the engine's link listener)."""

    def __init__(self, report: Reporter) -> None:
        self.report = report
        self.totals = {"bytes_received": 0, "bytes_served": 0}
        self.reported: dict[Link, dict[str, int]] = {}
        self.closed: list[tuple[Link, str]] = []

    def on_link(self, link: Link, reason: str | None) -> None:
        """The engine's link listener: keep a closed link until the next report."""
        if reason is not None:
            self.closed.append((link, reason))

    def report_all(self, links: list[Link]) -> None:
        """Report the links that closed since the last call, then the live ``links``."""
        closed, self.closed = self.closed, []
        for link, reason in closed:
            self.report_link(link, reason)
        for link in links:
            self.report_link(link, None)

    def report_link(self, link: Link, closed_reason: str | None) -> None:
        """A link's news since it was last reported: linked (the first time), what moved, unlinked."""
        stats = link.stats()
        cluster = stats["peer_cluster_id"]
        clock = time.strftime("%H:%M:%S")
        before = self.reported.get(link)
        if before is None:
            before = {"bytes_received": 0, "bytes_served": 0}
            self.report.event("linked", f"{clock} cluster {cluster} linked over {stats['transport']}",
                              cluster=cluster, transport=stats["transport"])
        for key, verb, event in _COUNTERS:
            delta = int(stats.get(key, 0)) - before[key]
            if delta > 0:
                self.totals[key] += delta
                self.report.event(event, f"{clock} cluster {cluster} {verb} {size(delta)} (link total "
                                         f"{size(int(stats[key]))})",
                                  cluster=cluster, bytes=delta, link_total_bytes=int(stats[key]))
        if closed_reason is None:
            self.reported[link] = {key: int(stats.get(key, 0)) for key in before}
        else:
            self.reported.pop(link, None)
            self.report.event("unlinked", f"{clock} cluster {cluster} unlinked ({closed_reason})", cluster=cluster,
                              reason=closed_reason)


async def _serve(args: argparse.Namespace) -> int:
    report = Reporter(args.json)
    host, port = args.listen
    if not is_loopback(host) and not auth_token(args):
        if not args.insecure:
            return fail("serve", f"{format_address(host, port)} is reachable from other hosts and no auth token is "
                                 f"set: any of them could link and write into the cache. Set the same token on both "
                                 f"ends ({AUTH_TOKEN_ENV}=... or --auth-token), or pass --insecure")
        logging.getLogger("kvpush.cli").warning("insecure: listening on %s with no auth token",
                                                format_address(host, port))
    options = {**engine_options(args), "llm.listenIpInfo": format_address(host, port)}
    traffic = _Traffic(report)
    engine = LLMDataDist(LLMRole.DECODER, args.cluster_id)
    engine.add_link_listener(traffic.on_link)
    try:
        await engine.init(options)
    except LLMException as error:
        return fail("serve", f"cannot start: {error}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    handled = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
            handled.append(signum)
    try:
        num_tensors = args.layers * args.tensors_per_layer
        desc = CacheDesc(num_tensors, (args.blocks, *args.block_shape), args.dtype)
        try:
            engine.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(args.cluster_id, args.model_id))
        except LLMException as error:
            return fail("serve", f"cannot allocate the blocks cache: {error}")
        assert engine.listen_address is not None
        bound_host, bound_port = engine.listen_address
        where = format_address(bound_host, bound_port)
        report.event(
            "listening",
            f"kvpush serve: cluster {args.cluster_id} listening on {where} (transport {args.transport})\n"
            f"  blocks cache model_id={args.model_id}: {num_tensors} tensors ({args.layers} layers x "
            f"{args.tensors_per_layer}) of {list(desc.shape)} {desc.data_type.name}, {desc.block_bytes} bytes per "
            f"block per tensor, {size(desc.size * num_tensors)} in all\n"
            f"  logging what peers push into it; Ctrl-C to stop",
            cluster_id=args.cluster_id, host=bound_host, port=bound_port, model_id=args.model_id,
            num_tensors=num_tensors, shape=list(desc.shape), dtype=desc.data_type.name,
            block_bytes=desc.block_bytes, transport=args.transport)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.interval)
            traffic.report_all(list(engine.links.values()))
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)
        await engine.finalize()
    totals = traffic.totals
    report.event("stopped", f"kvpush serve: stopped; peers pushed {size(totals['bytes_received'])} and pulled "
                            f"{size(totals['bytes_served'])} in all", **totals)
    return 0


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C; exit status 1 (one line on stderr) if the endpoint cannot start."""
    configure_logging(args.verbose, logging.WARNING)
    return asyncio.run(_serve(args))
