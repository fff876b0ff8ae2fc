"""The standard workloads (shared/bench/WORKLOADS.md) and the two-process plumbing every case uses.

W-KV: 32 layers x 2 tensors (K, V); source 256 blocks, destination 512 blocks; block = 16 tokens x
8 heads x 128 dim x fp16 = 32 KiB per tensor; all 256 source blocks (a random permutation) go to
256 random distinct destination blocks, every layer: 512 MiB per push.
W-KV-RUNS: as W-KV, but the ids are 16 runs of 16 consecutive ids on both sides.
W-SHORT: a 64-token request at full depth (32 layers x 2 tensors x 4 blocks of 32 KiB = 8 MiB), all
layers in one push; reported as p50/p99 latency over >= 200 pushes.

Every case prints one JSON line on stdout. A target process is driven by JSON lines on stdin and
answers with ``@@CTL {json}`` lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

CTL = "@@CTL "


@dataclass(frozen=True)
class Workload:
    name: str
    layers: int = 32
    kv: int = 2
    src_blocks: int = 256
    dst_blocks: int = 512
    block_bytes: int = 16 * 8 * 128 * 2
    runs: int = 0  # 0: scattered permutation; k: k runs of consecutive ids
    seed: int = 1234

    @property
    def tensors(self) -> int:
        return self.layers * self.kv

    @property
    def payload_bytes(self) -> int:
        return self.tensors * self.src_blocks * self.block_bytes

    def block_lists(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        rng = np.random.default_rng(self.seed + 1)
        if self.runs:
            length = self.src_blocks // self.runs
            src_starts = rng.permutation(self.src_blocks // length)[: self.runs] * length
            dst_starts = rng.permutation(self.dst_blocks // length)[: self.runs] * length
            src = (src_starts[:, None] + np.arange(length)[None, :]).reshape(-1)
            dst = (dst_starts[:, None] + np.arange(length)[None, :]).reshape(-1)
            return src, dst
        src = rng.permutation(self.src_blocks)
        dst = rng.permutation(self.dst_blocks)[: self.src_blocks]
        return src, dst

    def layer_bytes(self) -> int:
        return self.kv * self.src_blocks * self.block_bytes

    def as_args(self) -> list[str]:
        return ["--workload", self.name, "--layers", str(self.layers), "--src-blocks", str(self.src_blocks),
                "--dst-blocks", str(self.dst_blocks), "--block-bytes", str(self.block_bytes)]


WORKLOADS = {
    "W-KV": Workload("W-KV"),
    "W-KV-RUNS": Workload("W-KV-RUNS", runs=16),
    # W-KV pushed one layer at a time by a prefill loop that computes the next layer meanwhile
    "W-LAYER": Workload("W-LAYER"),
    # one layer of one tensor, one 32 KiB block: decode-time latency
    "W-SMALL": Workload("W-SMALL", layers=1, kv=1, src_blocks=1, dst_blocks=8),
    # a 64-token request at full depth: 32 layers x (K, V) x 4 blocks of 32 KiB = 8 MiB in one push_blocks
    "W-SHORT": Workload("W-SHORT", layers=32, kv=2, src_blocks=4, dst_blocks=64),
    # 8 writes of 64 MiB into shuffled slots of a 16-slot pool: the transport's ceiling
    "W-CONTIG": Workload("W-CONTIG", layers=1, kv=1, src_blocks=8, dst_blocks=16, block_bytes=64 << 20),
}


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The named workload; size flags override it only where given."""
    base = WORKLOADS[args.workload]
    def pick(name: str, default: int) -> int:
        value = getattr(args, name, None)
        return default if value is None else int(value)
    return Workload(base.name, pick("layers", base.layers), base.kv, pick("src_blocks", base.src_blocks),
                    pick("dst_blocks", base.dst_blocks), pick("block_bytes", base.block_bytes), base.runs, base.seed)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W-KV")
    parser.add_argument("--layers", type=int, default=None, help="override the workload's layer count")
    parser.add_argument("--src-blocks", type=int, default=None)
    parser.add_argument("--dst-blocks", type=int, default=None)
    parser.add_argument("--block-bytes", type=int, default=None)


def fill_source(tensors: list[np.ndarray[Any, Any]], seed: int) -> None:
    """Deterministic content both sides can regenerate."""
    rng = np.random.default_rng(seed)
    for tensor in tensors:
        flat = tensor.reshape(-1).view(np.uint8)
        words = flat[: flat.nbytes // 8 * 8].view(np.uint64)
        words[:] = rng.integers(0, 2**63, words.shape[0], dtype=np.uint64)


def verify(work: Workload, dst_tensors: list[np.ndarray[Any, Any]]) -> dict[str, Any]:
    """Every moved block equals the regenerated source; every other destination block is zero."""
    src_tensors = [np.empty((work.src_blocks, work.block_bytes), np.uint8) for _ in range(work.tensors)]
    fill_source(src_tensors, work.seed)
    src, dst = work.block_lists()
    untouched = np.ones(work.dst_blocks, bool)
    untouched[dst] = False
    ok = True
    stray = False
    for src_tensor, dst_tensor in zip(src_tensors, dst_tensors):
        blocks = dst_tensor.reshape(work.dst_blocks, -1).view(np.uint8)
        ok &= bool(np.array_equal(blocks[dst], src_tensor[src]))
        stray |= bool(blocks[untouched].any())
    return {"verified": ok and not stray, "blocks_checked": int(len(dst) * work.tensors), "stray_writes": stray}


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def emit_ctl(record: dict[str, Any]) -> None:
    print(CTL + json.dumps(record), flush=True)


#: The cores every ``Target`` runs on (``bench/run.py --pinned``: the decode side on core 1 while the driver,
#: the prefill side, runs on core 0); None: wherever the driver may run.
PEER_CPUS: set[int] | None = None


def pin_threads(pid: int, cpus: set[int]) -> dict[int, set[int]]:
    """Pin every thread of process ``pid`` to ``cpus`` (threads it starts later inherit it); the masks
    they had, to restore with ``unpin_threads``."""
    before: dict[int, set[int]] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            before[int(task)] = os.sched_getaffinity(int(task))
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return before


def unpin_threads(before: dict[int, set[int]]) -> None:
    for task, cpus in before.items():
        try:
            os.sched_setaffinity(task, cpus)
        except OSError:
            pass


def pin_child(pid: int) -> None:
    """Put a process this driver just started on ``PEER_CPUS`` (before it starts threads of its own: they
    inherit it)."""
    if PEER_CPUS is not None:
        os.sched_setaffinity(pid, PEER_CPUS)


class Target:
    """A child process driven over stdin/stdout control lines."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        """``prefix``: a command the interpreter runs under (``ip netns exec <name>``)."""
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        pin_child(self.proc.pid)
        self.ready = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(10)
                raise RuntimeError(f"target exited (rc={self.proc.returncode})")
            if line.startswith(CTL):
                result: dict[str, Any] = json.loads(line[len(CTL):])
                return result
            sys.stderr.write("[target] " + line)

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.ask({"op": "exit"})
        except (RuntimeError, BrokenPipeError, OSError):
            pass
        finally:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def summarize(work: Workload, system: str, seconds: list[float], extra: dict[str, Any]) -> dict[str, Any]:
    """One case's JSON record. A case whose verification failed gets no throughput: FAIL, not a number."""
    gbps = np.array([work.payload_bytes / s / 1e9 for s in seconds])
    per_layer_ms = np.array(seconds) * 1000 / work.layers
    record: dict[str, Any] = {
        "case": system,
        "workload": work.name,
        "bytes": work.payload_bytes,
        "reps": len(seconds),
        "gbps": round(float(np.median(gbps)), 3),
        "per_layer_ms": round(float(np.median(per_layer_ms)), 3),
        "p50_us": round(float(np.percentile(seconds, 50)) * 1e6, 1),
        "p99_us": round(float(np.percentile(seconds, 99)) * 1e6, 1),
        **extra,
    }
    if len(seconds) <= 20:
        record["gbps_all"] = [round(float(x), 3) for x in gbps]
    if record.get("verified") is False:
        for key in ("gbps", "gbps_all", "per_layer_ms", "p50_us", "p99_us"):
            record.pop(key, None)
        record["result"] = "FAIL"
    return record
