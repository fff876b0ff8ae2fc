"""The ``kvpush`` command (also ``python -m kvpush``).

    kvpush demo      a decode process and a prefill process on this host: push one realistic request
                     (32 layers, scattered blocks), verify every byte on the decode side, print the
                     throughput. No configuration needed.
    kvpush serve     a decode-side endpoint: allocate a blocks cache shaped by flags, listen, and log
                     what peers push into it (or pull from it) until Ctrl-C.
    kvpush push      link to a serving endpoint, push synthetic blocks into its cache (its geometry is
                     read from the endpoint), pull them back and compare byte for byte.
    kvpush bench     the benchmark suite (``bench/run.py`` of the source tree; extra arguments
                     are passed through).

Every subcommand has ``--help``; wrong flags exit with status 2, a failed run with status 1 and one
line on stderr saying why. ``--json`` makes ``demo``, ``serve`` and ``push`` print JSON instead of text.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from . import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from .link import Link
from .options import TRANSPORTS, parse_host_port

_CTL = "@@KVPUSH "


def _fill(tensors: list[np.ndarray[Any, Any]], seed: int) -> None:
    for index, tensor in enumerate(tensors):
        raw = tensor.reshape(-1).view(np.uint8)
        words = raw[: raw.nbytes // 8 * 8].view(np.uint64)
        words[:] = np.random.default_rng([seed, index]).integers(0, 2**63, words.shape[0], dtype=np.uint64)


def _block_lists(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(args.seed)
    src = rng.permutation(args.blocks)
    dst = rng.permutation(args.dst_blocks)[: args.blocks]
    return src.tolist(), dst.tolist()


def _desc(args: argparse.Namespace, blocks: int) -> CacheDesc:
    return CacheDesc(2 * args.layers, (blocks, args.block_kib * 512), DataType.DT_FLOAT16)


def _verify(args: argparse.Namespace, tensors: list[np.ndarray[Any, Any]]) -> dict[str, Any]:
    src_blocks, dst_blocks = _block_lists(args)
    expected = [np.empty((args.blocks, args.block_kib * 1024), np.uint8) for _ in tensors]
    _fill(expected, args.seed)
    untouched = np.ones(args.dst_blocks, bool)
    untouched[dst_blocks] = False
    moved_ok, stray = True, False
    for source, tensor in zip(expected, tensors):
        blocks = tensor.view(np.uint8).reshape(args.dst_blocks, -1)
        moved_ok &= bool(np.array_equal(blocks[dst_blocks], source[src_blocks]))
        stray |= bool(blocks[untouched].any())
    return {"verified": moved_ok and not stray, "blocks_checked": len(dst_blocks) * len(tensors),
            "untouched_blocks_checked": int(untouched.sum()) * len(tensors)}


def _decode_process(args: argparse.Namespace) -> int:
    """The decode side of the demo: listen, own the destination cache, verify on request."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[LLMDataDist, Any]:
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
        _fill(cache.tensors, args.seed)
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


def _demo(args: argparse.Namespace) -> int:
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


# -- shared by serve and push -----------------------------------------------------------------------
_DTYPES: dict[str, DataType] = {
    "float16": DataType.DT_FLOAT16, "fp16": DataType.DT_FLOAT16, "half": DataType.DT_FLOAT16,
    "bfloat16": DataType.DT_BF16, "bf16": DataType.DT_BF16,
    "float32": DataType.DT_FLOAT, "fp32": DataType.DT_FLOAT, "float": DataType.DT_FLOAT,
    "float64": DataType.DT_DOUBLE, "double": DataType.DT_DOUBLE,
    "int8": DataType.DT_INT8, "uint8": DataType.DT_UINT8, "int16": DataType.DT_INT16,
    "uint16": DataType.DT_UINT16, "int32": DataType.DT_INT32, "uint32": DataType.DT_UINT32,
    "int64": DataType.DT_INT64, "uint64": DataType.DT_UINT64, "bool": DataType.DT_BOOL,
}


def _dtype_arg(text: str) -> DataType:
    name = text.strip().lower()
    name = name[3:] if name.startswith("dt_") else name
    if name not in _DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r} (one of {', '.join(sorted(_DTYPES))})")
    return _DTYPES[name]


def _shape_arg(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.replace("x", ",").split(",")]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"block shape {text!r} must be positive integers like 16,8,128")
    return tuple(int(part) for part in parts)


def _address_arg(text: str) -> tuple[str, int]:
    try:
        return parse_host_port("address", text)
    except LLMException as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("[LLM_PARAM_INVALID] ")) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _size(nbytes: float) -> str:
    """A byte count for people: B, KiB, MiB or GiB."""
    if nbytes < 2**10:
        return f"{int(nbytes)} B"
    if nbytes < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def _fail(command: str, message: str) -> int:
    """The one line a failed run prints (stderr); returns the exit status."""
    print(f"kvpush {command}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return 1


def _configure_logging(verbose: int, quiet_level: int) -> None:
    level = [quiet_level, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _engine_options(args: argparse.Namespace) -> dict[str, str]:
    options = {"llm.SyncKvCacheWaitTime": str(args.sync_kv_timeout), "kvpush.transport": args.transport}
    if args.auth_token:
        options["kvpush.auth_token"] = args.auth_token
    return options


class _Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream: TextIO = sys.stderr if stream is None else stream
        self.enabled = enabled and total > 1 and self.stream.isatty()
        self._draw()

    def _draw(self) -> None:
        if self.enabled:
            filled = 30 * self.done // self.total
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            self.stream.flush()

    def step(self) -> None:
        self.done += 1
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


# -- serve ------------------------------------------------------------------------------------------
class _Reporter:
    """Prints serve's events as text lines or JSON lines (stdout, flushed at once)."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def event(self, name: str, text: str, **fields: Any) -> None:
        if self.as_json:
            print(json.dumps({"event": name, "time": round(time.time(), 3), **fields}), flush=True)
        else:
            print(text, flush=True)


class _ServeEngine(LLMDataDist):
    """The serve command's engine. It also keeps each link that closes, with its final counters, so a
    peer that links, pushes and unlinks between two reports is still reported."""

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        super().__init__(role, cluster_id)
        self.closed: list[tuple[Link, str]] = []
        self.add_link_listener(self._on_link)

    def _on_link(self, link: Link, reason: str | None) -> None:
        if reason is not None:
            self.closed.append((link, reason))


async def _serve(args: argparse.Namespace) -> int:
    report = _Reporter(args.json)
    host, port = args.listen
    options = {**_engine_options(args), "llm.listenIpInfo": _format_address(host, port)}
    engine = _ServeEngine(LLMRole.DECODER, args.cluster_id)
    try:
        await engine.init(options)
    except LLMException as error:
        return _fail("serve", f"cannot start: {error}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    handled = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
            handled.append(signum)
    totals = {"bytes_received": 0, "bytes_served": 0}
    reported: dict[Link, dict[str, int]] = {}  # counters already reported, per live link

    def report_link(link: Link, closed_reason: str | None) -> None:
        stats = link.stats()
        cluster = stats["peer_cluster_id"]
        clock = time.strftime("%H:%M:%S")
        before = reported.get(link)
        if before is None:
            before = {"bytes_received": 0, "bytes_served": 0}
            report.event("linked", f"{clock} cluster {cluster} linked over {stats['transport']}",
                         cluster=cluster, transport=stats["transport"])
        for key, verb, event in (("bytes_received", "pushed", "received"), ("bytes_served", "pulled", "served")):
            delta = int(stats.get(key, 0)) - before[key]
            if delta > 0:
                totals[key] += delta
                report.event(event, f"{clock} cluster {cluster} {verb} {_size(delta)} (link total "
                                    f"{_size(int(stats[key]))})",
                             cluster=cluster, bytes=delta, link_total_bytes=int(stats[key]))
        if closed_reason is None:
            reported[link] = {key: int(stats.get(key, 0)) for key in before}
        else:
            reported.pop(link, None)
            report.event("unlinked", f"{clock} cluster {cluster} unlinked ({closed_reason})", cluster=cluster,
                         reason=closed_reason)

    try:
        num_tensors = args.layers * args.tensors_per_layer
        desc = CacheDesc(num_tensors, (args.blocks, *args.block_shape), args.dtype)
        try:
            engine.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(args.cluster_id, args.model_id))
        except LLMException as error:
            return _fail("serve", f"cannot allocate the blocks cache: {error}")
        assert engine.listen_address is not None
        bound_host, bound_port = engine.listen_address
        where = _format_address(bound_host, bound_port)
        report.event(
            "listening",
            f"kvpush serve: cluster {args.cluster_id} listening on {where} (transport {args.transport})\n"
            f"  blocks cache model_id={args.model_id}: {num_tensors} tensors ({args.layers} layers x "
            f"{args.tensors_per_layer}) of {list(desc.shape)} {desc.data_type.name}, {desc.block_bytes} bytes per "
            f"block per tensor, {_size(desc.size * num_tensors)} in all\n"
            f"  logging what peers push into it; Ctrl-C to stop",
            cluster_id=args.cluster_id, host=bound_host, port=bound_port, model_id=args.model_id,
            num_tensors=num_tensors, shape=list(desc.shape), dtype=desc.data_type.name,
            block_bytes=desc.block_bytes, transport=args.transport)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.interval)
            closed, engine.closed = engine.closed, []
            for link, reason in closed:
                report_link(link, reason)
            for link in engine.links.values():
                report_link(link, None)
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)
        await engine.finalize()
    report.event("stopped", f"kvpush serve: stopped; peers pushed {_size(totals['bytes_received'])} and pulled "
                            f"{_size(totals['bytes_served'])} in all", **totals)
    return 0


# -- push -------------------------------------------------------------------------------------------
async def _push(args: argparse.Namespace) -> int:
    host, port = args.to
    where = _format_address(host, port)
    remote_id = args.remote_cluster_id
    async with LLMDataDist(LLMRole.PROMPT, args.cluster_id, _engine_options(args)) as engine:
        info = LLMClusterInfo()
        info.remote_cluster_id = remote_id
        info.append_remote_ip_info(host, port)
        status, codes = await engine.link_clusters([info], timeout=args.link_timeout)
        if status != LLMStatusCode.LLM_SUCCESS:
            hint = "is `kvpush serve` running there, with this --remote-cluster-id?" \
                if codes[0] == LLMStatusCode.LLM_LINK_FAILED else ""
            return _fail("push", f"cannot link to cluster {remote_id} at {where}: {codes[0].name}; {hint}".rstrip("; "))
        link = engine.links[remote_id]
        try:
            await asyncio.wait_for(link.refresh_table(), args.sync_kv_timeout / 1000)
        except TimeoutError:
            return _fail("push", f"cluster {remote_id} at {where} did not send its cache table in time")
        remote = link.peer.by_model(args.model_id)
        if remote is None or not remote.is_blocks_cache:
            return _fail("push", f"cluster {remote_id} at {where} has no blocks cache with model_id={args.model_id}")
        if args.blocks > remote.num_blocks:
            return _fail("push", f"--blocks {args.blocks} exceeds the {remote.num_blocks} blocks of cluster "
                                 f"{remote_id}'s cache")
        desc = CacheDesc(remote.num_tensors, (args.blocks, *remote.shape[1:]), remote.data_type)
        cm = engine.cache_manager
        source = cm.allocate_blocks_cache(desc, BlocksCacheKey(args.cluster_id, 0))
        returned = cm.allocate_blocks_cache(desc, BlocksCacheKey(args.cluster_id, 1))
        _fill(source.tensors, args.seed)
        rng = np.random.default_rng(args.seed)
        dst_blocks = sorted(rng.choice(remote.num_blocks, args.blocks, replace=False).tolist())
        src_blocks = list(range(args.blocks))
        key = BlocksCacheKey(remote_id, args.model_id)
        seconds: list[float] = []
        progress = _Progress("kvpush push", args.reps, not args.json)
        try:
            for _ in range(args.reps):
                start = time.perf_counter()
                await cm.push_blocks(key, source, src_blocks, dst_blocks)
                seconds.append(time.perf_counter() - start)
                progress.step()
            progress.close()
            await cm.pull_blocks(key, returned, dst_blocks, src_blocks)
        except LLMException as error:
            progress.close()
            return _fail("push", f"transfer to cluster {remote_id} at {where} failed: {error}")
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
              f"blocks of the remote {remote.num_blocks} = {_size(payload)} per push")
        print(f"  pushed {len(seconds)} times: median {median * 1000:.2f} ms = {payload / median / 1e9:.2f} GB/s")
        state = "OK" if verified else "FAILED: the blocks read back differ from the blocks pushed"
        print(f"  pulled them back and compared byte for byte: {state}")
    return 0 if verified else 1


# -- bench ------------------------------------------------------------------------------------------
def _bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parent.parent
    script = root / "bench" / "run.py"
    if not script.is_file():
        return _fail("bench", f"{script} not found: the benchmarks ship with the source tree "
                              f"(git clone), not with the installed package")
    extra = list(args.bench_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    try:
        return subprocess.call([sys.executable, str(script), *extra], cwd=root)
    except KeyboardInterrupt:
        return 130


# -- the command line -------------------------------------------------------------------------------
def _engine_args(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--sync-kv-timeout", type=_positive, default=1000, metavar="MS",
                     help="per-layer transfer deadline, llm.SyncKvCacheWaitTime (default 1000)")
    sub.add_argument("--transport", choices=TRANSPORTS, default="auto", help="kvpush.transport (default auto)")
    sub.add_argument("--auth-token", default=None, help="shared secret both ends must know (kvpush.auth_token)")
    sub.add_argument("--json", action="store_true", help="machine-readable output (JSON)")
    sub.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description="kvpush: KV-cache block transfer engine")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,serve,push,bench}")

    def workload_args(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--layers", type=int, default=32, help="model layers (2 tensors each; default 32)")
        sub.add_argument("--blocks", type=int, default=256, help="blocks the request owns (default 256)")
        sub.add_argument("--dst-blocks", type=int, default=512, help="decode pool size in blocks (default 512)")
        sub.add_argument("--block-kib", type=int, default=32, help="KiB per block per tensor (default 32)")
        sub.add_argument("--seed", type=int, default=1234)

    demo = commands.add_parser("demo", help="two processes on this host: push, verify, print throughput")
    workload_args(demo)
    demo.add_argument("--reps", type=int, default=3, help="pushes to time (default 3)")
    demo.add_argument("--json", action="store_true", help="print one JSON object")

    serve = commands.add_parser(
        "serve", help="a decode-side endpoint: allocate a blocks cache, listen, log what arrives",
        description="Allocate a blocks cache of LAYERS x TENSORS_PER_LAYER tensors, each [BLOCKS, *BLOCK_SHAPE] of "
                    "DTYPE, listen on LISTEN as cluster CLUSTER_ID, and log what linked peers push into it (or pull "
                    "from it) until Ctrl-C. Try `kvpush push --to HOST:PORT` against it.")
    serve.add_argument("--listen", type=_address_arg, default=("127.0.0.1", 26000), metavar="HOST:PORT",
                       help="address to listen on; port 0 picks a free one (default 127.0.0.1:26000)")
    serve.add_argument("--cluster-id", type=int, default=2, help="this endpoint's cluster id (default 2)")
    serve.add_argument("--model-id", type=int, default=0, help="model_id naming the blocks cache (default 0)")
    serve.add_argument("--layers", type=_positive, default=32, help="model layers (default 32)")
    serve.add_argument("--tensors-per-layer", type=_positive, default=2, help="tensors per layer, K and V (default 2)")
    serve.add_argument("--blocks", type=_positive, default=128, help="blocks in the pool (default 128)")
    serve.add_argument("--block-shape", type=_shape_arg, default=(16, 8, 128), metavar="D1,D2,...",
                       help="shape of one block of one tensor, e.g. tokens,heads,head_dim (default 16,8,128)")
    serve.add_argument("--dtype", type=_dtype_arg, default=DataType.DT_FLOAT16,
                       help="element type: float16, bf16, float32, int8, int32, ... (default float16)")
    serve.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                       help="how often to report what arrived (default 1.0)")
    _engine_args(serve)

    push = commands.add_parser(
        "push", help="link to a serving endpoint, push synthetic blocks, pull them back and verify",
        description="Link to the endpoint at --to (e.g. one started with `kvpush serve`), read its blocks cache's "
                    "geometry, push BLOCKS blocks of random bytes into randomly chosen blocks of it REPS times, "
                    "pull those blocks back and compare them byte for byte. Exit status 0 only if they match.")
    push.add_argument("--to", type=_address_arg, required=True, metavar="HOST:PORT", help="the endpoint's address")
    push.add_argument("--remote-cluster-id", type=int, default=2, help="the endpoint's cluster id (default 2)")
    push.add_argument("--cluster-id", type=int, default=1, help="this side's cluster id (default 1)")
    push.add_argument("--model-id", type=int, default=0, help="model_id of the endpoint's blocks cache (default 0)")
    push.add_argument("--blocks", type=_positive, default=32, help="blocks to push (default 32)")
    push.add_argument("--reps", type=_positive, default=1, help="pushes to time (default 1)")
    push.add_argument("--seed", type=int, default=1234, help="seed for the bytes and the block choice")
    push.add_argument("--link-timeout", type=_positive, default=3000, metavar="MS",
                      help="link_clusters timeout (default 3000)")
    _engine_args(push)

    bench = commands.add_parser(
        "bench", help="run the benchmark suite (bench/run.py; extra arguments are passed through)",
        description="Run bench/run.py from the source tree: W-KV, W-KV-RUNS, W-LAYER, W-SMALL and W-CONTIG for "
                    "every kvpush transport beside memcpy, sockets, ucx_perftest and the peers, verified; JSON "
                    "lines, a Markdown table and a PNG chart in bench/results/. Arguments after `bench` go to "
                    "the script, e.g. `kvpush bench --quick`; `kvpush bench -- --help` shows them.")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for bench/run.py")

    decode = commands.add_parser("_decode")  # the demo's decode process
    workload_args(decode)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and argv[1:2] not in (["-h"], ["--help"]):
        # everything after `bench` belongs to the benchmark script, options included
        args = parser.parse_args(["bench"])
        args.bench_args = argv[1:]
    else:
        args = parser.parse_args(argv)
    if args.command in ("demo", "_decode"):
        if args.blocks > args.dst_blocks:
            parser.error("--blocks must not exceed --dst-blocks")
        return _demo(args) if args.command == "demo" else _decode_process(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "serve":
        _configure_logging(args.verbose, logging.WARNING)
        return asyncio.run(_serve(args))
    _configure_logging(args.verbose, logging.ERROR)
    try:
        return asyncio.run(_push(args))
    except KeyboardInterrupt:
        return _fail("push", "interrupted")


if __name__ == "__main__":
    sys.exit(main())
