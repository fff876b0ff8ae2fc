"""``kvpush push``: link to a serving endpoint (e.g. ``kvpush serve``), read its blocks cache's
geometry from the peer's cache table, push synthetic blocks into randomly chosen blocks of it, pull
them back and compare byte for byte. Exit status 0 only if they match; any failure is one line on
stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from kvpush import BlocksCacheKey, CacheDesc, LLMClusterInfo, LLMDataDist, LLMException, LLMRole, LLMStatusCode

from .args import add_engine_args, address_arg, engine_options, positive
from .output import Progress, configure_logging, fail, format_address, size
from .synthetic import fill

if TYPE_CHECKING:
    from .args import Subcommands


def add_parser(commands: Subcommands) -> None:
    push = commands.add_parser(
        "push", help="link to a serving endpoint, push synthetic blocks, pull them back and verify",
        description="Link to the endpoint at --to (e.g. one started with `kvpush serve`), read its blocks cache's "
                    "geometry, push BLOCKS blocks of random bytes into randomly chosen blocks of it REPS times, "
                    "pull those blocks back and compare them byte for byte. Exit status 0 only if they match.")
    push.add_argument("--to", type=address_arg, required=True, metavar="HOST:PORT", help="the endpoint's address")
    push.add_argument("--remote-cluster-id", type=int, default=2, help="the endpoint's cluster id (default 2)")
    push.add_argument("--cluster-id", type=int, default=1, help="this side's cluster id (default 1)")
    push.add_argument("--model-id", type=int, default=0, help="model_id of the endpoint's blocks cache (default 0)")
    push.add_argument("--blocks", type=positive, default=32, help="blocks to push (default 32)")
    push.add_argument("--reps", type=positive, default=1, help="pushes to time (default 1)")
    push.add_argument("--seed", type=int, default=1234, help="seed for the bytes and the block choice")
    push.add_argument("--link-timeout", type=positive, default=3000, metavar="MS",
                      help="link_clusters timeout (default 3000)")
    add_engine_args(push)


async def _push(args: argparse.Namespace) -> int:
    host, port = args.to
    where = format_address(host, port)
    remote_id = args.remote_cluster_id
    async with LLMDataDist(LLMRole.PROMPT, args.cluster_id, engine_options(args)) as engine:
        info = LLMClusterInfo()
        info.remote_cluster_id = remote_id
        info.append_remote_ip_info(host, port)
        status, codes = await engine.link_clusters([info], timeout=args.link_timeout)
        if status != LLMStatusCode.LLM_SUCCESS:
            hint = "is `kvpush serve` running there, with this --remote-cluster-id?" \
                if codes[0] == LLMStatusCode.LLM_LINK_FAILED else ""
            return fail("push", f"cannot link to cluster {remote_id} at {where}: {codes[0].name}; {hint}".rstrip("; "))
        link = engine.links[remote_id]
        try:
            await asyncio.wait_for(link.refresh_table(), args.sync_kv_timeout / 1000)
        except TimeoutError:
            return fail("push", f"cluster {remote_id} at {where} did not send its cache table in time")
        remote = link.peer.by_model(args.model_id)
        if remote is None or not remote.is_blocks_cache:
            return fail("push", f"cluster {remote_id} at {where} has no blocks cache with model_id={args.model_id}")
        if args.blocks > remote.num_blocks:
            return fail("push", f"--blocks {args.blocks} exceeds the {remote.num_blocks} blocks of cluster "
                                f"{remote_id}'s cache")
        desc = CacheDesc(remote.num_tensors, (args.blocks, *remote.shape[1:]), remote.data_type)
        caches = engine.cache_manager
        source = caches.allocate_blocks_cache(desc, BlocksCacheKey(args.cluster_id, 0))
        returned = caches.allocate_blocks_cache(desc, BlocksCacheKey(args.cluster_id, 1))
        fill(source.tensors, args.seed)
        rng = np.random.default_rng(args.seed)
        dst_blocks = sorted(rng.choice(remote.num_blocks, args.blocks, replace=False).tolist())
        src_blocks = list(range(args.blocks))
        key = BlocksCacheKey(remote_id, args.model_id)
        seconds: list[float] = []
        progress = Progress("kvpush push", args.reps, not args.json)
        try:
            for _ in range(args.reps):
                start = time.perf_counter()
                await caches.push_blocks(key, source, src_blocks, dst_blocks)
                seconds.append(time.perf_counter() - start)
                progress.step()
            progress.close()
            await caches.pull_blocks(key, returned, dst_blocks, src_blocks)
        except LLMException as error:
            progress.close()
            return fail("push", f"transfer to cluster {remote_id} at {where} failed: {error}")
        verified = all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                       for a, b in zip(source.tensors, returned.tensors))
        transport = link.transport
        await engine.unlink_clusters([info], timeout=args.link_timeout)
    payload = desc.block_bytes * args.blocks * desc.num_tensors
    median = float(np.median(seconds))
    result = {"to": where, "cluster_id": args.cluster_id, "remote_cluster_id": remote_id, "model_id": args.model_id,
              "transport": transport, "num_tensors": desc.num_tensors, "block_shape": list(desc.shape[1:]),
              "dtype": desc.data_type.name, "block_bytes": desc.block_bytes, "blocks": args.blocks,
              "remote_blocks": remote.num_blocks, "dst_blocks": dst_blocks, "bytes_per_push": payload,
              "pushes": len(seconds), "push_ms_median": round(median * 1000, 3),
              "gbps_median": round(payload / median / 1e9, 3) if median > 0 else None, "verified": verified}
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(f"kvpush push: cluster {args.cluster_id} -> cluster {remote_id} at {where} over {transport}")
        print(f"  {desc.num_tensors} tensors of {list(desc.shape[1:])} {desc.data_type.name} blocks "
              f"({desc.block_bytes} bytes per block per tensor): {args.blocks} blocks into {args.blocks} scattered "
              f"blocks of the remote {remote.num_blocks} = {size(payload)} per push")
        print(f"  pushed {len(seconds)} times: median {median * 1000:.2f} ms = {payload / median / 1e9:.2f} GB/s")
        state = "OK" if verified else "FAILED: the blocks read back differ from the blocks pushed"
        print(f"  pulled them back and compared byte for byte: {state}")
    return 0 if verified else 1


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose, logging.ERROR)
    try:
        return asyncio.run(_push(args))
    except KeyboardInterrupt:
        return fail("push", "interrupted")
