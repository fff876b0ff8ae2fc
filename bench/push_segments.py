#!/usr/bin/env python3
"""Where a one-block push's time goes, phase by phase, beside the asyncio ping-pong of the same bytes.

    python bench/push_segments.py                 # 3000 pushes of each, taking turns 100 at a time
    python bench/push_segments.py --pushes 6000

W-SMALL's shape (one 32 KiB block, ``bench/run.py --pinned --only W-SMALL``) over kvpush's TCP transport, and the
floor that run compares it with: an ``asyncio.BufferedProtocol`` ping-pong of the same bytes between the same
two event loops. The driver runs on core 0, one target process on core 1 (when the host has both), and the two
systems take turns (100 pushes, the first 10 of a turn not measured) so they see the same phases of a shared,
noisy machine.

Both processes stamp each push with ``time.perf_counter_ns`` (CLOCK_MONOTONIC: one clock for every process of
the host), from wrappers this benchmark puts around a few methods on each side, as many for either system:
the sender's write, the receiver's read callback, the receiver's answer, the sender's read callback. The
wrappers cost a few microseconds per push, so the totals sit above ``bench/run.py``'s; compare the two rows.

Prints one JSON line per system (``phases_us``: the p50 of each phase), then a table of the phases, kvpush's
excess over the ping-pong in each, and what each phase is: ``python`` (code between system calls), ``kernel``
(a write: it copies the bytes and, over loopback, delivers them to the peer's socket) or ``wakeup`` (from a
write's return to the peer's callback: the scheduler, epoll and one pass of the peer's event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.push_bench import (  # noqa: E402
    ENGINE_OPTIONS,
    PingPongClient,
    PingPongServer,
    blocks_desc,
    linked_prefill,
)
from bench.workload import WORKLOADS  # noqa: E402
from kvpush import BlocksCacheKey, LLMDataDist, LLMRole  # noqa: E402
from transports import tcp_receive, tcp_send  # noqa: E402

WORK = WORKLOADS["W-SMALL"]
KVPUSH, FLOOR = "kvpush-tcp", "asyncio ping-pong"
# (name, kind, from mark, to mark): the driver's marks t0 (call), w0/w1 (its write), r0/r1 (its read callback),
# t1 (return); the receiver's a0 (its read callback), d0/d1 (its answer's write)
PHASES = (
    ("sender, until its write", "python", "t0", "w0"),
    ("sender's write", "kernel", "w0", "w1"),
    ("receiver wakes", "wakeup", "w1", "a0"),
    ("receiver, until its answer (its read included)", "python", "a0", "d0"),
    ("receiver's answer", "kernel", "d0", "d1"),
    ("sender wakes", "wakeup", "d1", "r0"),
    ("sender reads the answer", "python", "r0", "r1"),
    ("sender returns to its caller (a loop pass)", "python", "r1", "t1"),
    ("total", "", "t0", "t1"),
)
TURN, WARM = 100, 10


def phases(pushes: Sequence[dict[str, int]], answers: Sequence[tuple[int, int, int]]) -> dict[str, float]:
    """The p50 of each phase (us) over ``pushes`` (the driver's marks of each), each matched with the
    receiver's ``(a0, d0, d1)`` whose callback began last before the driver's read callback (r0) and after
    the push began (t0); pushes without one are left out."""
    answers = sorted(answers)
    starts = [answer[0] for answer in answers]
    spans: dict[str, list[int]] = {name: [] for name, *_ in PHASES}
    for push in pushes:
        index = bisect.bisect_right(starts, push["r0"]) - 1
        if index < 0 or starts[index] < push["t0"]:
            continue
        marks = {**push, **dict(zip(("a0", "d0", "d1"), answers[index]))}
        for name, _, start, end in PHASES:
            spans[name].append(marks[end] - marks[start])
    return {name: round(statistics.median(values) / 1000, 1) for name, values in spans.items() if values}


class Marks:
    """The current push's marks in this process, set by wrappers around the stream's and the ping-pong's
    methods (installed before any link or connection exists: the loop keeps bound methods)."""

    def __init__(self) -> None:
        self.now: dict[str, int] = {}

    def wrap(self, owner: Any, name: str, before: str, after: str | None = None) -> None:
        original = getattr(owner, name)
        now = self.now

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            now[before] = time.perf_counter_ns()
            result = original(*args, **kwargs)
            if after is not None:
                now[after] = time.perf_counter_ns()
            return result

        setattr(owner, name, wrapper)


def install(marks: Marks, receiver: bool) -> None:
    """kvpush: the writes of whole frames (the push's WRITE, the DONE) and the stream's read callback. The
    ping-pong: its one write per push or answer, and its read callbacks. The receiver's read callback is
    ``a0``, the sender's ``r0``/``r1``."""
    marks.wrap(tcp_send, "write_whole", "w0" if not receiver else "d0", "w1" if not receiver else "d1")
    marks.wrap(tcp_receive.FrameReceiver, "on_readable", "a0" if receiver else "r0", None if receiver else "r1")
    if receiver:
        original_get = PingPongServer.get_buffer
        original_updated = PingPongServer.buffer_updated

        def get_buffer(self: PingPongServer, sizehint: int) -> memoryview:
            if self.got == 0:  # a push's first bytes
                marks.now["a0"] = time.perf_counter_ns()
            return original_get(self, sizehint)

        def buffer_updated(self: PingPongServer, nbytes: int) -> None:
            answers = self.got + nbytes == len(self.buffer)
            if answers:
                marks.now["d0"] = time.perf_counter_ns()
            original_updated(self, nbytes)
            if answers:
                marks.now["d1"] = time.perf_counter_ns()

        PingPongServer.get_buffer = get_buffer  # type: ignore[method-assign]
        PingPongServer.buffer_updated = buffer_updated  # type: ignore[method-assign]
        return
    marks.wrap(PingPongClient, "get_buffer", "r0")
    original = PingPongClient.buffer_updated

    def client_updated(self: PingPongClient, nbytes: int) -> None:
        original(self, nbytes)
        marks.now["r1"] = time.perf_counter_ns()

    async def push(self: PingPongClient) -> None:
        self.answered = asyncio.get_running_loop().create_future()
        marks.now["w0"] = time.perf_counter_ns()
        self.transport.write(self.data)
        marks.now["w1"] = time.perf_counter_ns()
        await self.answered

    PingPongClient.buffer_updated = client_updated  # type: ignore[method-assign]
    PingPongClient.push = push  # type: ignore[method-assign]


def pin(cpu: int) -> None:
    """This process on ``cpu``, where the host has two (else, or where it may not, where it was)."""
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:
            pass


async def receiver() -> None:
    """The target: a kvpush decode engine and the ping-pong's server in its loop. Logs ``(a0, d0, d1)`` of
    every read callback that answered, and prints them as one JSON line when told to stop."""
    pin(1)
    marks = Marks()
    install(marks, receiver=True)
    log: list[tuple[int, int, int]] = []
    original = tcp_receive.FrameReceiver.on_readable
    ping_updated = PingPongServer.buffer_updated

    def on_readable(self: tcp_receive.FrameReceiver) -> None:
        marks.now.clear()
        original(self)
        if "d0" in marks.now:
            log.append((marks.now["a0"], marks.now["d0"], marks.now["d1"]))

    def answered(self: PingPongServer, nbytes: int) -> None:
        ping_updated(self, nbytes)
        if "d1" in marks.now:
            log.append((marks.now["a0"], marks.now["d0"], marks.now["d1"]))
            marks.now.clear()

    tcp_receive.FrameReceiver.on_readable = on_readable  # type: ignore[method-assign]
    PingPongServer.buffer_updated = answered  # type: ignore[method-assign]
    engine = LLMDataDist(LLMRole.DECODER, 2)
    await engine.init({"llm.listenIpInfo": "127.0.0.1:0", "kvpush.transport": "tcp",
                       "llm.SyncKvCacheWaitTime": "30000", **ENGINE_OPTIONS})
    engine.cache_manager.allocate_blocks_cache(blocks_desc(WORK, WORK.dst_blocks), BlocksCacheKey(2, 0))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(functools.partial(PingPongServer, WORK.layer_bytes()), "127.0.0.1", 0)
    address = engine.listen_address
    assert address is not None
    print(json.dumps({"port": address[1], "pingpong_port": server.sockets[0].getsockname()[1]}),
          flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    print(json.dumps(log), flush=True)
    server.close()
    await engine.finalize()


class _Peer:
    def __init__(self, ready: dict[str, Any]) -> None:
        self.ready = {"host": "127.0.0.1", **ready}


async def driver(pushes: int) -> list[dict[str, Any]]:
    pin(0)
    target = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "receiver"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdin is not None
        peer = _Peer(json.loads(target.stdout.readline()))
        marks = Marks()
        install(marks, receiver=False)
        engine, cache = await linked_prefill(WORK, "tcp", peer)  # type: ignore[arg-type]
        pingpong = PingPongClient(WORK)
        await pingpong.connect(peer)  # type: ignore[arg-type]
        src, dst = (blocks.tolist() for blocks in WORK.block_lists())
        key = BlocksCacheKey(2, 0)

        async def kvpush() -> None:
            await engine.cache_manager.push_blocks(key, cache, src, dst, tensor_num_per_layer=WORK.kv)

        systems = {KVPUSH: kvpush, FLOOR: pingpong.push}
        stamped: dict[str, list[dict[str, int]]] = {name: [] for name in systems}
        for turn in range(max(1, pushes // TURN)):
            order = list(systems) if turn % 2 else list(systems)[::-1]
            for name in order:
                for index in range(WARM + TURN):
                    marks.now.clear()
                    start = time.perf_counter_ns()
                    await systems[name]()
                    if index >= WARM:
                        stamped[name].append({**marks.now, "t0": start, "t1": time.perf_counter_ns()})
        target.stdin.write("stop\n")
        target.stdin.flush()
        answers = [(a0, d0, d1) for a0, d0, d1 in json.loads(target.stdout.readline())]
        pingpong.close()
        await engine.finalize()
        target.wait(30)
    finally:
        if target.poll() is None:
            target.kill()
            target.wait(10)
    return [{"bench": "push_segments", "case": name, "workload": WORK.name, "pushes": len(stamped[name]),
             "phases_us": phases(stamped[name], answers)} for name in systems]


def table(records: list[dict[str, Any]]) -> str:
    by_case = {record["case"]: record["phases_us"] for record in records}
    ours, floor = by_case[KVPUSH], by_case[FLOOR]
    lines = [f"| phase | what it is | {KVPUSH} p50 us | {FLOOR} p50 us | excess us |", "|---|---|---|---|---|"]
    for name, kind, *_ in PHASES:
        if name in ours and name in floor:
            lines.append(f"| {name} | {kind} | {ours[name]} | {floor[name]} | {ours[name] - floor[name]:+.1f} |")
    lines.append(f"\n{KVPUSH} / {FLOOR} (p50 of the totals): {ours['total'] / floor['total']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pushes", type=int, default=3000, help="measured pushes per system (default 3000)")
    parser.add_argument("--role", default="driver", choices=("driver", "receiver"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "receiver":
        asyncio.run(receiver())
        return
    records = asyncio.run(driver(args.pushes))
    for record in records:
        print(json.dumps(record), flush=True)
    print(table(records))


if __name__ == "__main__":
    main()
