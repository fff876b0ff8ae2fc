#!/usr/bin/env python3
"""What finishing a layer-pipelined push costs kvpush's event loop, at the moment a forward pass ends.

    python bench/pusher_wait.py                       # 24 and 80 layers over cma, 200 pushes each
    python bench/pusher_wait.py --layers 61 --pushes 500

The shape of the vLLM connector's prefill on one host: a ``layer_pusher`` whose every layer is offered gated to
the decode (a process of its own, on core 0), each layer marked ready from another thread as the forward computes
it (``mark_ready``), then ``wait()`` on the engine's loop thread (a ``Portal``, on core 1 with the caller) when the
forward is over. That ``wait()`` runs while vLLM's thread samples and sends the first token: the two share the
GIL, and on a CPU host the core. Timed: the loop thread's CPU during ``wait()`` (``/proc/self/task/<tid>/schedstat``)
and its wall time, the median over the pushes.

Beside it, in the same process: the floor of asyncio itself for the same number of layers, one task awaiting as many
futures, all set at once (``floor``), and a task per layer awaiting its own (``task_per_layer``), which is what
``wait()`` did before one task waited for them all. One JSON line per case and layer count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.forward_push import linked, schedstat  # noqa: E402
from bench.workload import emit  # noqa: E402


def kvpush_case(layers: int, tokens: int, pushes: int, transport: str) -> dict[str, Any]:
    with linked(tokens, transport, layers) as prefill:
        portal = prefill.portal
        cpu, wall = [], []
        gated = 0  # of the pushes timed, those whose every layer was offered gated (the decode copies them)
        for index in range(pushes + 5):  # the first five warm up
            pusher = portal.run(prefill.make_pusher(), timeout=30)
            for layer in range(pusher.num_layers):  # the forward's thread, layer by layer
                if pusher.gated:
                    pusher.mark_ready(layer)
                else:
                    portal.call_soon(pusher.push_layer, layer)
            time.sleep(0.005)  # the forward's last layer computed; the decode copied what it was let copy
            before, started = schedstat(portal.thread.native_id), time.perf_counter()
            portal.run(pusher.wait(), timeout=30)
            took, after = time.perf_counter() - started, schedstat(portal.thread.native_id)
            if index >= 5:
                cpu.append((after[0] - before[0]) / 1e6)
                wall.append(took * 1e3)
                gated += pusher.gated
        verified = prefill.target.ask({"op": "verify"})
    return {"workload": "PUSHER-WAIT", "case": f"kvpush-{transport}", "layers": layers, "pushes": pushes,
            "gated": f"{gated}/{pushes}", "loop_cpu_ms_p50": round(statistics.median(cpu), 3),
            "wall_ms_p50": round(statistics.median(wall), 3), "verified": verified.get("verified")}


def asyncio_case(layers: int, pushes: int, per_layer: bool) -> dict[str, Any]:
    """asyncio alone: ``layers`` futures set at once, awaited by one task or by a task each (CPU of this thread)."""

    async def one(futures: list[asyncio.Future[None]]) -> None:
        for future in futures:
            await future

    async def each(future: asyncio.Future[None]) -> None:
        await future

    async def measure() -> list[float]:
        loop, spent = asyncio.get_running_loop(), []
        for index in range(pushes + 5):
            futures = [loop.create_future() for _ in range(layers)]
            started = time.thread_time()
            if per_layer:
                waiting: asyncio.Future[Any] = asyncio.gather(*(loop.create_task(each(f)) for f in futures))
            else:
                waiting = loop.create_task(one(futures))
            await asyncio.sleep(0)
            for future in futures:
                future.set_result(None)
            await waiting
            if index >= 5:
                spent.append((time.thread_time() - started) * 1e3)
        return spent

    spent = asyncio.run(measure())
    return {"workload": "PUSHER-WAIT", "case": "task_per_layer" if per_layer else "floor", "layers": layers,
            "pushes": pushes, "loop_cpu_ms_p50": round(statistics.median(spent), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="24,80", help="comma-separated layer counts")
    parser.add_argument("--tokens", type=int, default=32, help="the prompt's tokens (its blocks per layer)")
    parser.add_argument("--pushes", type=int, default=200)
    parser.add_argument("--transport", default="cma")
    parser.add_argument("--label", default="", help="copied into every line (e.g. the tree measured)")
    args = parser.parse_args()
    labelled = {"label": args.label} if args.label else {}
    for layers in (int(n) for n in args.layers.split(",") if n):
        record = kvpush_case(layers, args.tokens, args.pushes, args.transport)
        floor = asyncio_case(layers, args.pushes, per_layer=False)
        emit(floor | labelled)
        emit(asyncio_case(layers, args.pushes, per_layer=True) | labelled)
        record["floor_cpu_ms_p50"] = floor["loop_cpu_ms_p50"]
        record["vs_floor"] = round(record["loop_cpu_ms_p50"] / max(floor["loop_cpu_ms_p50"], 1e-6), 1)
        emit(record | labelled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
