#!/usr/bin/env python3
"""What a layer-pipelined push costs a prefill's forward, without vLLM, in a minute or two.

    python bench/forward_push.py                         # 512 and 2048 tokens, cma and tcp, 9 rounds
    python bench/forward_push.py --tokens 512 --transports cma --rounds 15

The shape of ``bench/vllm_bench.py``'s prefill: a torch forward of the bench model's geometry
(``bench/vllm_model.GEOMETRY``: 24 layers, hidden 512, one thread) on core 1, the kvpush engine on an
event-loop thread of the same process (a ``Portal``, as the vLLM connector runs it) and the decode
target, a process of its own, on core 0. Each layer's KV is the model's (4 KiB a token), in 64 KiB
blocks. After each layer the forward thread hands the layer to the loop thread, as the connector's
``save_kv_layer`` does. Three modes take turns, each first in every third round:

- ``serial``: the forward alone (the push after it, not timed): the baseline;
- ``pipelined``: a ``layer_pusher`` made before the forward, each layer marked ready by the forward's
  thread (``mark_ready``, when the decode copies: cma) or ``push_layer`` handed over per layer (tcp),
  ``wait()`` after;
- ``handoff``: a no-op handed over per layer: the loop thread's wakeups without kvpush's work.

One JSON line per (transport, tokens, mode): the forward's median, its slowdown against the serial
forward of the same round (the median over rounds), and from ``/proc/self/task/<tid>/schedstat`` of
the two threads during the forward: how long the forward thread waited runnable for the core
(``forward_wait_ms``), and how long the loop thread ran and in how many slices. On one core these
show where a pipelined forward's extra time goes: to the loop thread's turns, not to the bytes
(the decode copies them on its own core over cma).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import push_bench as pb  # noqa: E402
from bench.vllm_model import GEOMETRY  # noqa: E402
from bench.workload import Workload, emit, pin_threads  # noqa: E402
from kvpush import BlocksCacheKey  # noqa: E402
from kvpush.portal import Portal  # noqa: E402

MODES = ("serial", "pipelined", "handoff")
KV_BYTES_PER_TOKEN_LAYER = 2 * GEOMETRY["num_kv_heads"] * GEOMETRY["head_dim"] * 4  # K and V, float32
BLOCK_TOKENS = 16


def schedstat(tid: int) -> tuple[int, int, int]:
    """(ns on the core, ns waiting runnable for it, slices) of thread ``tid`` of this process."""
    with open(f"/proc/self/task/{tid}/schedstat") as stat:
        run, wait, slices = (int(value) for value in stat.read().split())
    return run, wait, slices


def model(tokens: int) -> Callable[[Callable[[int], None]], Any]:
    """The forward: attention and MLP per layer, ``after(layer)`` once each layer's output exists."""
    import torch

    torch.set_num_threads(1)
    hidden, inner, layers = GEOMETRY["hidden"], GEOMETRY["intermediate"], GEOMETRY["num_layers"]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator)
    qkv = [torch.randn(hidden, 3 * hidden, generator=generator) for _ in range(layers)]
    up = [torch.randn(hidden, inner, generator=generator) for _ in range(layers)]
    down = [torch.randn(inner, hidden, generator=generator) for _ in range(layers)]
    scale = GEOMETRY["head_dim"] ** -0.5

    def forward(after: Callable[[int], None]) -> Any:
        h = x
        for layer in range(layers):
            q, k, v = (h @ qkv[layer]).split(hidden, dim=1)
            h = h + torch.softmax((q @ k.T) * scale, dim=1) @ v
            h = h + torch.relu(h @ up[layer]) @ down[layer]
            after(layer)
        return h

    return forward


@dataclass
class Prefill:
    """A kvpush prefill engine on its event-loop thread (``portal``), linked to a decode target of its own
    process, and what a ``layer_pusher`` of one request needs."""

    portal: Portal
    engine: Any
    target: Any
    work: Workload
    make_pusher: Callable[[], Coroutine[Any, Any, Any]]  # run it on ``portal``: a pusher of every layer
    push_all: Callable[[], Coroutine[Any, Any, None]]  # run it on ``portal``: the request's push, every layer


@contextmanager
def linked(tokens: int, transport: str, layers: int = GEOMETRY["num_layers"]) -> Iterator[Prefill]:
    """The prefill (this process, pinned to core 1) and the decode target (core 0) of a request of ``tokens``
    tokens and ``layers`` layers, the model's KV per layer in 64 KiB blocks; both ended on leaving."""
    blocks = max(1, tokens // BLOCK_TOKENS)
    work = Workload("W-LAYER", layers=layers, kv=2, src_blocks=blocks, dst_blocks=2 * blocks,
                    block_bytes=BLOCK_TOKENS * KV_BYTES_PER_TOKEN_LAYER // 2)
    target = pb.start_target(work, transport)
    portal = Portal("kvpush-loop")
    engine = None
    try:
        engine, cache = portal.run(pb.linked_prefill(work, transport, target), timeout=60)
        pin_threads(target.proc.pid, {0})
        pin_threads(os.getpid(), {1})
        src, dst = (b.tolist() for b in work.block_lists())
        manager = engine.cache_manager

        async def make_pusher() -> Any:
            return manager.layer_pusher(BlocksCacheKey(2, 0), cache, src, dst)

        async def push_all() -> None:
            await manager.push_blocks(BlocksCacheKey(2, 0), cache, src, dst)

        yield Prefill(portal, engine, target, work, make_pusher, push_all)
    finally:
        if engine is not None:
            portal.run(engine.finalize(), timeout=30)
        portal.close()
        target.close()


def measure(tokens: int, transport: str, rounds: int) -> list[dict[str, Any]]:
    with linked(tokens, transport) as prefill:
        portal, target, make_pusher, work = prefill.portal, prefill.target, prefill.make_pusher, prefill.work
        forward = model(tokens)
        threads = (threading.get_native_id(), portal.thread.native_id)
        took: dict[str, list[float]] = {mode: [] for mode in MODES}
        stats: dict[str, list[tuple[int, ...]]] = {mode: [] for mode in MODES}

        def nothing(*_: object) -> None:
            return None

        def one(mode: str, record: bool) -> None:
            pusher = portal.run(make_pusher(), timeout=30) if mode == "pipelined" else None
            if pusher is not None and pusher.gated:  # as the connector does: the forward's thread marks the layer
                after: Callable[[int], None] = pusher.mark_ready
            elif pusher is not None:
                after = lambda layer: portal.call_soon(pusher.push_layer, layer)  # noqa: E731
            elif mode == "handoff":
                after = lambda layer: portal.call_soon(nothing)  # noqa: E731
            else:
                after = nothing
            before = [schedstat(tid) for tid in threads]
            start = time.perf_counter()
            forward(after)
            seconds = time.perf_counter() - start
            spent = [tuple(b - a for a, b in zip(first, last)) for first, last in
                     zip(before, [schedstat(tid) for tid in threads])]
            if pusher is not None:
                portal.run(pusher.wait(), timeout=60)
            else:
                portal.run(prefill.push_all(), timeout=60)
            if record:
                took[mode].append(seconds)
                stats[mode].append(spent[0] + spent[1])

        for mode in MODES:  # warm-up
            one(mode, False)
        for index in range(rounds):
            for mode in MODES[index % 3:] + MODES[:index % 3]:
                one(mode, True)
        verified = target.ask({"op": "verify"})
    records = []
    for mode in MODES:
        per_round = [t / s - 1 for t, s in zip(took[mode], took["serial"])]
        run_f, wait_f, _, run_l, _, slices_l = (statistics.median(s[i] for s in stats[mode]) for i in range(6))
        records.append({
            "workload": "FORWARD-PUSH", "case": f"kvpush-{transport}", "mode": mode, "prompt_tokens": tokens,
            "rounds": rounds, "layer_bytes": work.payload_bytes // work.layers,
            "forward_ms": round(statistics.median(took[mode]) * 1e3, 1),
            "forward_slowed": round(statistics.median(per_round), 4),
            "forward_run_ms": round(run_f / 1e6, 2), "forward_wait_ms": round(wait_f / 1e6, 2),
            "loop_run_ms": round(run_l / 1e6, 2), "loop_slices": int(slices_l),
            "verified": verified.get("verified")})
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="512,2048", help="comma-separated prompt lengths")
    parser.add_argument("--transports", default="cma,tcp", help="comma-separated kvpush transports")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of the three modes")
    args = parser.parse_args()
    if not {0, 1} <= os.sched_getaffinity(0):
        parser.error("needs cores 0 and 1")
    try:
        import torch  # noqa: F401  (the 'vllm' extra brings it)
    except ImportError:
        parser.error("needs torch (pip install -e '.[vllm]')")
    for transport in args.transports.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for record in measure(tokens, transport, args.rounds):
                emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
