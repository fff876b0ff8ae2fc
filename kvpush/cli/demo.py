"""``kvpush demo``: a prefill process (this one) pushes one realistic request into a decode process
it starts on this host, which verifies every byte; then the throughput is printed.

The decode process is this command again, as the hidden subcommand ``_decode``. The two talk over
the child's stdin/stdout: the child prints control lines prefixed with ``@@KVPUSH `` (its port, then
the verification result) and reads ``{"op": ...}`` lines (``verify``, ``exit``). Both sides derive the
block lists and the bytes from the same seed, so nothing but the push itself crosses the link.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpush import BlocksCacheKey, Cache, CacheDesc, DataType, LLMClusterInfo, LLMDataDist, LLMRole

from .args import UsageError
from .synthetic import fill

if TYPE_CHECKING:
    from .args import Subcommands

_CTL = "@@KVPUSH "


def _workload_args(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--layers", type=int, default=32, help="model layers (2 tensors each; default 32)")
    sub.add_argument("--blocks", type=int, default=256, help="blocks the request owns (default 256)")
    sub.add_argument("--dst-blocks", type=int, default=512, help="decode pool size in blocks (default 512)")
    sub.add_argument("--block-kib", type=int, default=32, help="KiB per block per tensor (default 32)")
    sub.add_argument("--seed", type=int, default=1234)


def add_parser(commands: Subcommands) -> None:
    demo = commands.add_parser("demo", help="two processes on this host: push, verify, print throughput")
    _workload_args(demo)
    demo.add_argument("--reps", type=int, default=3, help="pushes to time (default 3)")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument("--vllm", action="store_true",
                      help="P/D serving instead: a tiny model served by a plain vLLM instance, then by a prefill and a "
                           "decode behind the router; routes, KV loaded, first tokens, time to first token "
                           "(needs pip install 'kvpush[vllm,proxy]')")
    demo.add_argument("--model", default=None, help="with --vllm: a model directory (default: the tiny demo model)")


def add_decode_parser(commands: Subcommands) -> None:
    """The hidden ``_decode`` subcommand (no help line): the demo's decode process."""
    decode = commands.add_parser("_decode")
    _workload_args(decode)


def _check_workload(args: argparse.Namespace) -> None:
    if args.blocks > args.dst_blocks:
        raise UsageError("--blocks must not exceed --dst-blocks")


def _block_lists(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(args.seed)
    src = rng.permutation(args.blocks)
    dst = rng.permutation(args.dst_blocks)[: args.blocks]
    return src.tolist(), dst.tolist()


def _desc(args: argparse.Namespace, blocks: int) -> CacheDesc:
    return CacheDesc(2 * args.layers, (blocks, args.block_kib * 512), DataType.DT_FLOAT16)


def _verify(args: argparse.Namespace, tensors: list[np.ndarray[Any, Any]]) -> dict[str, Any]:
    """Moved blocks equal what the prefill side filled; every other block is still zero."""
    src_blocks, dst_blocks = _block_lists(args)
    expected = [np.empty((args.blocks, args.block_kib * 1024), np.uint8) for _ in tensors]
    fill(expected, args.seed)
    untouched = np.ones(args.dst_blocks, bool)
    untouched[dst_blocks] = False
    moved_ok, stray = True, False
    for source, tensor in zip(expected, tensors):
        blocks = tensor.view(np.uint8).reshape(args.dst_blocks, -1)
        moved_ok &= bool(np.array_equal(blocks[dst_blocks], source[src_blocks]))
        stray |= bool(blocks[untouched].any())
    return {"verified": moved_ok and not stray, "blocks_checked": len(dst_blocks) * len(tensors),
            "untouched_blocks_checked": int(untouched.sum()) * len(tensors)}


# -- the decode process ------------------------------------------------------------------------------
def run_decode(args: argparse.Namespace) -> int:
    """The decode side: listen, own the destination cache, verify on request. The engine runs on a
    loop in a thread so that this thread can block reading commands from stdin."""
    _check_workload(args)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[LLMDataDist, Cache]:
        engine = LLMDataDist(LLMRole.DECODER, 2)
        await engine.init({"llm.listenIpInfo": "127.0.0.1:0", "llm.SyncKvCacheWaitTime": "10000"})
        cache = engine.cache_manager.allocate_blocks_cache(_desc(args, args.dst_blocks), BlocksCacheKey(2, 0))
        return engine, cache

    engine, cache = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    assert engine.listen_address is not None
    print(_CTL + json.dumps({"port": engine.listen_address[1]}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)["op"]
        if command == "verify":
            print(_CTL + json.dumps(_verify(args, cache.tensors)), flush=True)
        elif command == "exit":
            break
    asyncio.run_coroutine_threadsafe(engine.finalize(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    return 0


# -- the prefill process -----------------------------------------------------------------------------
def _read_ctl(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"decode process exited (rc={proc.wait(10)})")
        if line.startswith(_CTL):
            result: dict[str, Any] = json.loads(line[len(_CTL):])
            return result


async def _prefill(args: argparse.Namespace, port: int) -> tuple[list[float], str]:
    """Push the request ``args.reps`` times; (seconds per push, the transport the link chose)."""
    async with LLMDataDist(LLMRole.PROMPT, 1, {"llm.SyncKvCacheWaitTime": "10000"}) as engine:
        cache = engine.cache_manager.allocate_blocks_cache(_desc(args, args.blocks), BlocksCacheKey(1, 0))
        fill(cache.tensors, args.seed)
        info = LLMClusterInfo()
        info.remote_cluster_id = 2
        info.append_remote_ip_info("127.0.0.1", port)
        status, codes = await engine.link_clusters([info], timeout=10000)
        if status != 0:
            raise SystemExit(f"kvpush demo: link failed: {codes[0].name}")
        src_blocks, dst_blocks = _block_lists(args)
        seconds = []
        for _ in range(args.reps):
            start = time.perf_counter()
            await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, src_blocks, dst_blocks)
            seconds.append(time.perf_counter() - start)
        return seconds, engine.links[2].transport


def run(args: argparse.Namespace) -> int:
    """Start the decode process, push, have it verify, report; exit status 0 only if verified. ``--vllm``:
    P/D serving instead (``demo_vllm``)."""
    if getattr(args, "vllm", False):
        from . import demo_vllm

        return demo_vllm.run(args)
    _check_workload(args)
    argv = [sys.executable, "-m", "kvpush", "_decode", "--layers", str(args.layers), "--blocks", str(args.blocks),
            "--dst-blocks", str(args.dst_blocks), "--block-kib", str(args.block_kib), "--seed", str(args.seed)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = _read_ctl(proc)["port"]
        seconds, transport = asyncio.run(_prefill(args, port))
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"op": "verify"}) + "\n")
        proc.stdin.flush()
        result = _read_ctl(proc)
        proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
        proc.stdin.flush()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    payload = 2 * args.layers * args.blocks * args.block_kib * 1024
    median = float(np.median(seconds))
    report = {"layers": args.layers, "tensors": 2 * args.layers, "blocks_per_tensor": args.blocks,
              "block_bytes": args.block_kib * 1024, "bytes_per_push": payload, "pushes": len(seconds),
              "push_ms_median": round(median * 1000, 2), "gbps_median": round(payload / median / 1e9, 3),
              "transport": transport, **result}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"kvpush demo: prefill (pid {os.getpid()}) -> decode (pid {proc.pid}) over {transport} on 127.0.0.1"
              f"{' (same host: one-sided copies)' if transport == 'cma' else ''}")
        print(f"  request: {args.layers} layers x 2 tensors (K, V), {args.blocks} scattered blocks of "
              f"{args.block_kib} KiB into a {args.dst_blocks}-block pool = {payload / 2**20:.0f} MiB per push")
        print(f"  pushed {len(seconds)} times: median {median * 1000:.1f} ms = {report['gbps_median']:.2f} GB/s "
              f"({median * 1000 / args.layers:.2f} ms per layer)")
        state = "OK" if result["verified"] else "FAILED"
        print(f"  verified on the decode side: {state} - {result['blocks_checked']} moved blocks byte for byte, "
              f"{result['untouched_blocks_checked']} untouched blocks still zero")
    return 0 if result["verified"] else 1
