#!/usr/bin/env python3
"""The kvpush benchmark suite, in one run: every workload, every available kvpush transport, the
limits of this machine and the peers, side by side.

    python bench/run.py            # also: python -m bench, kvpush bench
    python bench/run.py --quick    # smaller sizes and fewer repetitions: under two minutes
    python bench/run.py --pinned   # every case in the deployed shape: prefill on core 0, decode on core 1

Workloads (shared/bench/WORKLOADS.md): W-KV, W-KV-RUNS, W-LAYER (layer-pipelined prefill with real
CPU compute per layer), W-LAYER-PINNED (the same with the prefill pinned to core 0 and the decode to core 1,
as serving engines pin them), W-SMALL (one 32 KiB block: p50/p99 latency), W-SHORT (a 64-token request at
full depth, 8 MiB in one push: p50/p99 latency), W-CONTIG (8 writes of 64 MiB).
Latency workloads measure each kvpush transport interleaved with a socket baseline of its own
(``push_bench.case_latency``: turns of pushes in one driver), so their ratios share the machine's phases.
Systems: memcpy (one-copy limit), socket (plain Python sockets), ucx_perftest (UCX from C),
kvpush over tcp / cma / ucx, and Mooncake Transfer Engine and NIXL when their environments exist
(``bash bench/peers/setup.sh`` builds them). Every kvpush and baseline case verifies every
destination byte; a case that fails verification reports FAIL and no number.

Writes ``bench/results/<stamp>.jsonl`` (one JSON line per case), ``<stamp>.md`` (medians and ratios)
and ``<stamp>.png`` (GB/s per system per workload, and W-SMALL/W-SHORT latency); prints the table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core computes, the other moves bytes
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import push_bench as pb  # noqa: E402
from bench import workload as workloads  # noqa: E402
from bench.workload import WORKLOADS, Workload  # noqa: E402
from kvpush import BlocksCacheKey, transfer  # noqa: E402
from transports import cma, ucx  # noqa: E402

RESULTS = os.path.join(HERE, "results")
PEERS = os.path.join(HERE, "peers")
LATENCY = ("W-SMALL", "W-SHORT")  # reported as p50/p99 latency per push, compared as latency multiples


# -- progress ------------------------------------------------------------------------------------------
class Bar:
    """One progress bar per case on stderr."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.started = time.monotonic()
        self.draw(0, 1)

    def draw(self, done: int, total: int) -> None:
        width = 24
        filled = int(width * done / max(total, 1))
        elapsed = time.monotonic() - self.started
        sys.stderr.write(f"\r  {self.label:<34} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                         f"{elapsed:5.1f}s")
        sys.stderr.flush()

    def close(self, record: dict[str, Any], named: bool = False) -> None:
        """The case's result after its bar (``named``: one of several records of the case, named)."""
        self.draw(1, 1)  # cases that report no steps of their own (peers, ucx_perftest) end full too
        shown = record.get("result") or (f"{record['gbps']} GB/s" if "gbps" in record else "")
        if record["workload"] in LATENCY and "p50_us" in record:
            shown = f"p50 {record['p50_us']} us, p99 {record['p99_us']} us"
        if record["workload"].startswith("W-LAYER") and "hidden" in record:
            shown = f"{record['hidden'] * 100:.0f}% of transfer hidden"
        sys.stderr.write(f"  {record['case'] + ': ' if named else ''}{shown}\n")
        sys.stderr.flush()


# -- W-LAYER: a prefill loop with real compute per layer ------------------------------------------------
def _matmul_for(seconds: float) -> Callable[[], None]:
    """A numpy matmul sized so one call takes about ``seconds`` on this machine (one BLAS thread)."""
    size = 64
    a = np.ones((size, size), np.float32)
    while True:
        a = np.random.default_rng(0).random((size, size), dtype=np.float32)
        took = float("inf")
        for _ in range(3):  # the best of three: the process's first matmul also starts BLAS up
            start = time.perf_counter()
            a @ a
            took = min(took, time.perf_counter() - start)
        if took >= seconds or size >= 4096:
            break
        size = int(size * max(1.1, min(2.0, (seconds / max(took, 1e-6)) ** (1 / 3))))
    def compute() -> None:
        a @ a
    return compute


async def _layer_driver(work: Workload, reps: int, transport: str, target: pb.Target,
                        progress: Callable[[int, int], None], name: str = "W-LAYER") -> dict[str, Any]:
    engine, cache = await pb.linked_prefill(work, transport, target)
    try:
        src, dst = (b.tolist() for b in work.block_lists())
        key = BlocksCacheKey(2, 0)
        manager = engine.cache_manager
        await manager.push_blocks(key, cache, src, dst)  # warm-up, and the transfer time per layer
        start = time.perf_counter()
        await manager.push_blocks(key, cache, src, dst)
        transfer_per_layer = (time.perf_counter() - start) / work.layers
        compute = _matmul_for(transfer_per_layer)
        push_layer_us: list[float] = []
        start_us: list[float] = []
        samples: list[dict[str, float]] = []  # one per repetition, serial and pipelined measured back to back
        # CPU of each side (and the machine's softirqs) over the serial and the pipelined runs, as fractions of
        # their wall time (whole runs: /proc counts clock ticks, too coarse for one layer's push); the compute
        # thread's own CPU apart, so the prefill's rest is kvpush's Python (user) and the kernel (system)
        serial_cpu, pipelined_cpu = pb.CpuSplit(target.proc.pid), pb.CpuSplit(target.proc.pid)

        def timed_compute(sink: list[float], cpu: pb.CpuSplit | None = None) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            compute()
            sink.append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.add("driver_compute", time.thread_time() - c0)

        total = 2 * reps
        for rep in range(reps):
            serial_compute: list[float] = []
            serial_push = 0.0
            begin = time.perf_counter()
            serial_cpu.start()
            for layer in range(work.layers):  # compute, then push, one layer after the other
                await asyncio.to_thread(timed_compute, serial_compute, serial_cpu)
                t0 = time.perf_counter()
                await manager.push_blocks(key, cache, src, dst, range(layer, layer + 1), range(layer, layer + 1))
                serial_push += time.perf_counter() - t0
            serial_cpu.stop()
            serial = time.perf_counter() - begin
            progress(2 * rep + 1, total)
            pipelined_compute: list[float] = []
            begin = time.perf_counter()
            pipelined_cpu.start()
            async with manager.layer_pusher(key, cache, src, dst) as pusher:
                for layer in range(work.layers):  # compute layer l+1 while layer l is on the wire
                    await asyncio.to_thread(timed_compute, pipelined_compute, pipelined_cpu)
                    t0 = time.perf_counter()
                    pusher.push_layer(layer)
                    push_layer_us.append((time.perf_counter() - t0) * 1e6)
            pipelined_cpu.stop()
            pipelined = time.perf_counter() - begin
            progress(2 * rep + 2, total)
            samples.append({"serial": serial, "pipelined": pipelined, "transfer": serial_push,
                            "compute": sum(serial_compute), "compute_pipelined": sum(pipelined_compute)})
        # the per-layer Python cost of push_blocks: time spent issuing a layer (plan -> request queued)
        original = transfer.start_layer

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                start_us.append((time.perf_counter() - t0) * 1e6)

        transfer.start_layer = timed
        try:
            await manager.push_blocks(key, cache, src, dst)
        finally:
            transfer.start_layer = original
        transport_used = engine.links[2].transport
    finally:
        await engine.finalize()
    result = await asyncio.to_thread(target.ask, {"op": "verify"})
    def median(key: str) -> float:
        return float(np.median([sample[key] for sample in samples]))

    def ratio(sample: dict[str, float], what: str) -> float:
        if what == "hidden":  # the share of the serial transfer time the pipeline saved
            return (sample["serial"] - sample["pipelined"]) / sample["transfer"]
        if what == "behind":  # the share of the transfer that ran behind the compute as it actually ran
            return 1 - (sample["pipelined"] - sample["compute_pipelined"]) / sample["transfer"]
        return sample["compute_pipelined"] / sample["compute"] - 1  # contention on the compute

    def paired(what: str) -> float:
        return float(np.median([ratio(sample, what) for sample in samples]))

    s, p = median("serial"), median("pipelined")
    record = {
        "case": f"kvpush-{transport_used}", "workload": name, "transport": transport_used,
        "bytes": work.payload_bytes, "reps": reps, "serial_s": round(s, 4), "pipelined_s": round(p, 4),
        "compute_s": round(median("compute"), 4), "transfer_s": round(median("transfer"), 4),
        "hidden": round(min(1.0, max(0.0, paired("hidden"))), 3),
        "compute_inflation": round(paired("inflation"), 3),
        "transfer_behind_compute": round(min(1.0, max(0.0, paired("behind"))), 3),
        "gbps": round(work.payload_bytes / p / 1e9, 3),
        "push_layer_us": round(float(np.median(push_layer_us)), 1),
        "push_blocks_python_us_per_layer": round(float(np.median(start_us)), 1),
        "cpu_serial": serial_cpu.record(), "cpu_pipelined": pipelined_cpu.record(),
        **result,
    }
    if result.get("verified") is False:
        record = {k: v for k, v in record.items() if k not in ("gbps", "hidden")} | {"result": "FAIL"}
    return record


def case_layer(work: Workload, reps: int, transport: str, progress: Callable[[int, int], None],
               pinned: bool = False) -> dict[str, Any]:
    """W-LAYER; ``pinned`` (W-LAYER-PINNED): the prefill (this process, every thread: the compute, the event
    loop, kvpush's copy threads) on core 0 and the decode target on core 1, as serving engines pin them."""
    target = pb.start_target(work, transport)
    restore: dict[int, set[int]] = {}
    try:
        if pinned:
            workloads.pin_threads(target.proc.pid, {1})
            restore = workloads.pin_threads(os.getpid(), {0})
        return asyncio.run(_layer_driver(work, reps, transport, target, progress,
                                         "W-LAYER-PINNED" if pinned else "W-LAYER"))
    finally:
        workloads.unpin_threads(restore)
        target.close()


# -- peers ----------------------------------------------------------------------------------------------
def case_peer(work: Workload, system: str, reps: int, env_extra: dict[str, str]) -> dict[str, Any] | None:
    """Mooncake TE (TCP) or NIXL (UCX) through their own Python APIs, when bench/peers/setup.sh built them."""
    venv, script = {"mooncake": ("venv-mc", "bench_mooncake.py"), "nixl": ("venv-nixl", "bench_nixl.py")}[system]
    python = os.path.join(PEERS, venv, "bin", "python")
    if not os.path.exists(python):
        return None
    mode = "contig" if work.name == "W-CONTIG" else "kv"
    argv = [python, os.path.join(PEERS, script), "--mode", mode, "--iters", str(reps), "--layers", str(work.layers),
            "--blocks", str(work.src_blocks), "--dst-blocks", str(work.dst_blocks),
            "--block-bytes", str(work.block_bytes), "--kv", str(work.kv), "--chunk-bytes", str(work.block_bytes)]
    env = {**os.environ, "UCX_NET_DEVICES": "lo", **env_extra}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"case": system, "workload": work.name, "result": "FAIL",
                "error": (done.stderr or done.stdout)[-300:]}
    raw = json.loads(lines[-1])
    name = system + (f"-{env_extra['UCX_TLS']}" if "UCX_TLS" in env_extra else "")
    record = {"case": name, "workload": work.name, "gbps": raw.get("gbps_median"),
              "verified": raw.get("verified"), "transport": raw.get("transport"), "package": raw.get("package")}
    if work.name in LATENCY and raw.get("gbps_median"):  # their drivers report medians only: p50 from it
        record["p50_us"] = round(work.payload_bytes / (raw["gbps_median"] * 1e9) * 1e6, 1)
        record["p99_us"] = None
    if raw.get("verified") is False:
        record.pop("gbps")
        record["result"] = "FAIL"
    return record


# -- the suite --------------------------------------------------------------------------------------------
ONLY_TRANSPORTS: set[str] = set()  # --transports: the kvpush transports to run (default: every available one)


def transports() -> list[str]:
    available = ["tcp"] + (["cma"] if cma.AVAILABLE else []) + (["ucx"] if ucx.available() is None else [])
    return [name for name in available if not ONLY_TRANSPORTS or name in ONLY_TRANSPORTS]


Case = Callable[[Callable[[int, int], None]], "dict[str, Any] | list[dict[str, Any]] | None"]


def plan(quick: bool, pinned: bool = False) -> list[tuple[Workload, str, Case]]:
    """The cases in order. ``pinned``: the peers' drivers start both of their sides themselves, so they are
    left out (and W-LAYER is W-LAYER-PINNED)."""
    layers = 8 if quick else 32
    reps = 3 if quick else 5
    kv, runs = replace(WORKLOADS["W-KV"], layers=layers), replace(WORKLOADS["W-KV-RUNS"], layers=layers)
    contig = WORKLOADS["W-CONTIG"] if not quick else replace(WORKLOADS["W-CONTIG"], block_bytes=16 << 20)
    small = WORKLOADS["W-SMALL"]
    # p99 is the (reps/100)th slowest push: over 1000 one hiccup of the host moves it, so more samples
    small_reps = 300 if quick else 5000
    short = WORKLOADS["W-SHORT"]
    short_reps = 200 if quick else 1000
    layer = replace(WORKLOADS["W-LAYER"], layers=layers)
    have_ucx = ucx.available() is None
    cases: list[tuple[Workload, str, Case]] = []
    for work in (kv, runs, contig):
        cases.append((work, "memcpy", lambda p, w=work: pb.case_memcpy(w, reps, p)))
        cases.append((work, "socket", lambda p, w=work: pb.case_socket(w, reps, p)))
        if have_ucx:
            for test in ("ucp_put_bw", "tag_bw"):
                cases.append((work, f"ucx_perftest-{test}", lambda p, w=work, t=test: pb.case_ucx_perftest(w, t)))
        for transport in transports():
            cases.append((work, f"kvpush-{transport}", lambda p, w=work, t=transport: pb.case_kvpush(w, reps, t, p)))
        if work.name != "W-KV-RUNS" and not pinned:  # the peers' drivers know scattered blocks and contiguous writes
            cases.append((work, "mooncake", lambda p, w=work: case_peer(w, "mooncake", reps, {})))
            cases.append((work, "nixl", lambda p, w=work: case_peer(w, "nixl", reps, {})))
            cases.append((work, "nixl-tcp", lambda p, w=work: case_peer(w, "nixl", reps, {"UCX_TLS": "tcp"})))
    # latency: each kvpush transport interleaved with a socket baseline of its own in one driver (chunks of
    # pushes taking turns), so each ratio compares two systems measured over the same stretch of a noisy
    # machine; the first pair's baseline is the workload's "socket" (the peers are compared with it)
    for timed, count, chunk, warm in ((small, small_reps, 100, 10), (short, short_reps, 20, 2)):
        for index, transport in enumerate(transports()):
            name = "socket" if index == 0 else f"socket (with kvpush-{transport})"
            cases.append((timed, f"{name} + kvpush-{transport}",
                          lambda p, w=timed, r=count, c=chunk, m=warm, t=transport, n=name:
                          pb.case_latency(w, r, [t], c, m, p, n)))
    if not pinned:
        cases.append((short, "mooncake", lambda p: case_peer(short, "mooncake", short_reps, {})))
        cases.append((short, "nixl", lambda p: case_peer(short, "nixl", short_reps, {})))
        cases.append((short, "nixl-tcp", lambda p: case_peer(short, "nixl", short_reps, {"UCX_TLS": "tcp"})))
        for transport in transports():
            cases.append((layer, f"kvpush-{transport}", lambda p, t=transport: case_layer(layer, reps, t, p)))
    if _two_cores():
        layer_pinned = replace(layer, name="W-LAYER-PINNED")
        for transport in transports():
            cases.append((layer_pinned, f"kvpush-{transport}",
                          lambda p, t=transport: case_layer(layer, reps, t, p, pinned=True)))
    return cases


def _two_cores() -> bool:
    """Cores 0 and 1 are both usable (W-LAYER-PINNED pins one side to each)."""
    return {0, 1} <= os.sched_getaffinity(0)


def ratios(records: list[dict[str, Any]]) -> list[str]:
    """A Markdown table: medians, and each case against the baselines of its workload in this run."""
    by_work: dict[str, dict[str, dict[str, Any]]] = {}
    for record in records:
        by_work.setdefault(record["workload"], {})[record["case"]] = record
    lines = ["| workload | case | result | vs memcpy | vs socket | vs asyncio ping-pong | vs ucx_perftest put "
             "| vs mooncake | vs nixl-tcp |", "|---|---|---|---|---|---|---|---|---|"]
    for work, cases in by_work.items():
        for name, record in cases.items():
            if "result" in record:
                result = record["result"]
            elif work in LATENCY:
                result = f"p50 {record['p50_us']} us / p99 {record['p99_us']} us"
            elif work.startswith("W-LAYER"):
                result = (f"{record['hidden'] * 100:.0f}% hidden (serial {record['serial_s']} s, pipelined "
                          f"{record['pipelined_s']} s); transfer behind compute "
                          f"{record['transfer_behind_compute'] * 100:.0f}%, compute slowed "
                          f"{record['compute_inflation'] * 100:.0f}% by contention; push_layer "
                          f"{record['push_layer_us']} us")
            else:
                result = f"{record['gbps']:.2f} GB/s"
            cells = []
            for base in ("memcpy", "socket", "floor", "ucx_perftest-ucp_put_bw", "mooncake", "nixl-tcp"):
                # an interleaved latency case is compared with the socket baseline and the asyncio ping-pong
                # it was measured beside
                if base in ("socket", "floor"):
                    other = cases.get(record.get("baseline" if base == "socket" else "floor", base))
                else:
                    other = cases.get(base)
                key = "p50_us" if work in LATENCY else "gbps"
                if other is None or name.startswith(base) or not record.get(key) or not other.get(key):
                    cells.append("")
                elif work in LATENCY:
                    cells.append(f"{record[key] / other[key]:.2f}x its latency")
                else:
                    cells.append(f"{record[key] / other[key]:.2f}")
            lines.append(f"| {work} | {name} | {result} | " + " | ".join(cells) + " |")
    return lines


def chart(records: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("matplotlib not installed (pip install 'kvpush[bench]'): no chart\n")
        return False
    throughput = [r for r in records if r["workload"] not in LATENCY and isinstance(r.get("gbps"), float)]
    small = [r for r in records if r["workload"] in LATENCY and r.get("p50_us")]
    works = list(dict.fromkeys(r["workload"] for r in throughput))
    systems = list(dict.fromkeys(r["case"] for r in throughput))
    figure, (left, right) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(len(systems), 1)
    for index, system in enumerate(systems):
        values = [next((r["gbps"] for r in throughput if r["workload"] == w and r["case"] == system), 0.0)
                  for w in works]
        left.bar(np.arange(len(works)) + index * width, values, width, label=system)
    left.set_xticks(np.arange(len(works)) + width * (len(systems) - 1) / 2, works)
    left.set_ylabel("GB/s (10^9 B/s of block payload, median)")
    left.set_title("Throughput per system per workload (W-LAYER: pipelined prefill incl. compute)")
    left.legend(fontsize=7, ncol=2)
    names = [f"{r['workload'].removeprefix('W-')} {r['case']}" for r in small]
    right.bar(np.arange(len(small)) - 0.2, [r["p50_us"] for r in small], 0.4, label="p50")
    right.bar(np.arange(len(small)) + 0.2, [r["p99_us"] or 0 for r in small], 0.4, label="p99")
    right.set_xticks(np.arange(len(small)), names, rotation=60, fontsize=7)
    right.set_yscale("log")
    right.set_ylabel("microseconds per push (log)")
    right.set_title("Latency: W-SMALL (one 32 KiB block), W-SHORT (8 MiB, 32 layers)")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpush bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions: under two minutes")
    parser.add_argument("--only", default="", help="comma-separated workloads to run (default: all)")
    parser.add_argument("--transports", default="",
                        help="comma-separated kvpush transports to run (default: every available one)")
    parser.add_argument("--out", default=RESULTS, help=f"results directory (default {RESULTS})")
    parser.add_argument("--pinned", action="store_true",
                        help="every case in the deployed shape: this driver (the prefill side) on core 0, every "
                             "process it starts (the decode side) on core 1; without the peers")
    args = parser.parse_args(argv)
    if args.pinned:
        if not _two_cores():
            parser.error("--pinned needs cores 0 and 1")
        os.sched_setaffinity(0, {0})  # before any thread starts: they inherit it
        workloads.PEER_CPUS = {1}
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "") + ("-pinned" if args.pinned else "")
    only = {w for w in args.only.split(",") if w}
    ONLY_TRANSPORTS.update(t for t in args.transports.split(",") if t)
    records: list[dict[str, Any]] = []
    machine = {"case": "machine", "workload": "-", "cpus": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version(), "transports": transports(), "quick": args.quick,
               "pinned": args.pinned}
    started = time.monotonic()
    with open(os.path.join(args.out, f"{stamp}.jsonl"), "w") as out:
        out.write(json.dumps(machine) + "\n")
        for work, name, run in plan(args.quick, args.pinned):
            if only and work.name not in only:
                continue
            bar = Bar(f"{work.name} {name}")
            try:
                result = run(bar.draw)
            except Exception as error:  # one broken case must not hide the others
                result = {"case": name, "workload": work.name, "result": "FAIL", "error": repr(error)[:300]}
            if result is None:  # a peer whose environment was not built
                sys.stderr.write("  skipped: run bench/peers/setup.sh to build it\n")
                continue
            batch = result if isinstance(result, list) else [result]  # an interleaved case: a record per system
            for record in batch:
                bar.close(record, len(batch) > 1)
                records.append(record)
                print(json.dumps(record), flush=True)
                out.write(json.dumps(record) + "\n")
    table = ratios(records)
    elapsed = time.monotonic() - started
    command = " ".join(["python bench/run.py", *(sys.argv[1:] if argv is None else argv)])
    header = [f"# kvpush benchmark {stamp}", "",
              f"`{command}` on {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}; "
              f"{elapsed:.0f} s. Loopback only. Ratios compare cases of one workload from this same run.", ""]
    with open(os.path.join(args.out, f"{stamp}.md"), "w") as out:
        out.write("\n".join(header + table) + "\n")
    drew = chart(records, os.path.join(args.out, f"{stamp}.png"))
    print("\n".join(table))
    print(f"\nresults: {os.path.join(args.out, stamp)}.{{jsonl,md{',png' if drew else ''}}} ({elapsed:.0f} s)")
    return 1 if any(r.get("result") == "FAIL" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
