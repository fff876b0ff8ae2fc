#!/usr/bin/env python3
"""Side-by-side push benchmark: kvpush against the limits of this machine, in one run.

    python bench/push_bench.py                      # W-KV and W-KV-RUNS, every case
    python bench/push_bench.py --workloads W-KV --cases memcpy,kvpush-cma --reps 7

Cases (each prints one JSON line: GB/s median, per-layer ms, verified):
  memcpy      one process, numpy copy of each merged run (the one-copy limit)
  socket      two processes, blocking TCP over loopback, sendmsg/recvmsg_into straight into the
              destination blocks, one acknowledgement per layer (what plain Python sockets reach)
  kvpush-tcp  two processes, `await push_blocks(...)` of all layers over kvpush's TCP transport
  kvpush-cma  the same over kvpush's same-host one-sided transport (cross-memory attach)
  ucx_perftest-ucp_put_bw, ucx_perftest-tag_bw
              UCX's own C benchmark at the run size on the same UCX transport (needs the ucx extra)
  kvpush-ucx  `await push_blocks(...)` over kvpush's UCX binding (one-sided puts, one flush per layer)
  zerocopy-netns
              (root) two network namespaces joined by a veth pair: plain sockets sending each layer with
              and without MSG_ZEROCOPY, then kvpush-tcp, alternating for two rounds (throughput, CPU per
              GB of both sides, how many zerocopy sends the kernel copied after all)
The socket and kvpush throughput cases also record both processes' user and system CPU (``CpuSplit``).
A last line gives the ratios of kvpush to the baselines measured in this same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.workload import (  # noqa: E402
    Target,
    Workload,
    add_workload_args,
    emit,
    emit_ctl,
    fill_source,
    pin_child,
    summarize,
    verify,
    workload_from_args,
)
from kvpush import (  # noqa: E402
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMRole,
)
from kvpush.layout import Blocks, block_runs  # noqa: E402

IOV_MAX = 1024
os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX over tcp stays on loopback in benchmarks
HERE = os.path.abspath(__file__)
# A 1 s keepalive timeout (the engine's default) dropped links in W-LAYER-PINNED on the shared machine, before and
# after the reader-side copy, when other work took a pinned side's only core for longer: 5 s, as vllm_bench sets.
ENGINE_OPTIONS = {"kvpush.keepalive_timeout_ms": "5000"}


def _alloc(count: int, blocks: int, block_bytes: int) -> list[np.ndarray[Any, Any]]:
    arrays = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(count)]
    return arrays


def _layer_plan(work: Workload) -> tuple[list[int], list[int], list[int]]:
    src, dst = work.block_lists()
    runs = block_runs(Blocks.of(src), Blocks.of(dst), work.block_bytes)
    return runs.src_offset.tolist(), runs.dst_offset.tolist(), runs.length.tolist()


# -- CPU time: who pays for a transfer ---------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, every thread of it, from ``/proc/<pid>/stat`` (clock
    ticks, split between user and system by tick sampling). With ``CONFIG_IRQ_TIME_ACCOUNTING`` off (this
    machine's kernel) the softirqs a process runs itself (loopback's receive-side TCP processing, on the
    sending side) are its system time."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK  # utime, stime: fields 14 and 15


def _softirq_seconds() -> float:
    """Softirq CPU seconds of the whole machine (what no process was charged for; other work included)."""
    with open("/proc/stat") as stat:
        return int(stat.readline().split()[7]) / _TICK


class CpuSplit:
    """User and system CPU of the driver (this process) and the target process over the intervals between
    ``start`` and ``stop``, as fractions of those intervals' wall time; ``extra`` adds a named CPU time
    measured by the caller (the compute thread's ``time.thread_time``) as a fraction the same way."""

    def __init__(self, target_pid: int) -> None:
        self.target_pid = target_pid
        self.wall = 0.0
        self.totals = {"driver_user": 0.0, "driver_sys": 0.0, "target_user": 0.0, "target_sys": 0.0,
                       "softirq": 0.0}
        self.extra: dict[str, float] = {}
        self._begin: tuple[float, ...] = ()

    def _now(self) -> tuple[float, ...]:
        return (time.perf_counter(), *cpu_seconds(os.getpid()), *cpu_seconds(self.target_pid), _softirq_seconds())

    def start(self) -> None:
        self._begin = self._now()

    def stop(self) -> None:
        end = self._now()
        self.wall += end[0] - self._begin[0]
        for name, before, after in zip(self.totals, self._begin[1:], end[1:]):
            self.totals[name] += after - before

    def add(self, name: str, seconds: float) -> None:
        self.extra[name] = self.extra.get(name, 0.0) + seconds

    def record(self) -> dict[str, float]:
        wall = max(self.wall, 1e-9)
        shares = {name: round(value / wall, 3) for name, value in (*self.totals.items(), *self.extra.items())}
        return {"wall_s": round(self.wall, 4), **shares}


# -- memcpy --------------------------------------------------------------------------------------
Progress = Any  # callable(done, total) or None


def _tick(progress: Progress, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


def case_memcpy(work: Workload, reps: int, progress: Progress = None) -> dict[str, Any]:
    src = _alloc(work.tensors, work.src_blocks, work.block_bytes)
    dst = _alloc(work.tensors, work.dst_blocks, work.block_bytes)
    fill_source(src, work.seed)
    s_off, d_off, length = _layer_plan(work)
    src_views = [memoryview(a.reshape(-1)) for a in src]
    dst_views = [memoryview(a.reshape(-1)) for a in dst]
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        for s_view, d_view in zip(src_views, dst_views):
            for s, d, n in zip(s_off, d_off, length):
                d_view[d:d + n] = s_view[s:s + n]
        if rep:
            times.append(time.perf_counter() - start)
        _tick(progress, rep + 1, reps + 1)
    return summarize(work, "memcpy", times, verify(work, dst))


# -- raw socket ------------------------------------------------------------------------------------
def _advance(views: list[Any], index: int, count: int) -> int:
    """``count`` bytes of ``views[index:]`` went through: drop them (a view partly through is cut where it
    resumes); the index of the first view with bytes left."""
    while count and index < len(views):
        if count >= len(views[index]):
            count -= len(views[index])
            index += 1
        else:
            views[index] = memoryview(views[index])[count:]
            count = 0
    return index


def _recv_into_views(sock: socket.socket, views: list[memoryview]) -> None:
    index = 0
    while index < len(views):
        count = sock.recvmsg_into(views[index:index + IOV_MAX])[0]
        if count == 0:
            raise EOFError
        index = _advance(views, index, count)


def _send_views(sock: socket.socket, views: list[Any]) -> None:
    index = 0
    while index < len(views):
        index = _advance(views, index, sock.sendmsg(views[index:index + IOV_MAX]))


def socket_target(work: Workload) -> None:
    dst = _alloc(work.tensors, work.dst_blocks, work.block_bytes)
    views = [memoryview(a.reshape(-1)) for a in dst]
    listener = socket.create_server(("127.0.0.1", 0))
    errors: list[str] = []

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header = bytearray(8)
            while True:
                _recv_into_views(conn, [memoryview(header)])
                runs, first_tensor = struct.unpack("<II", header)
                if runs == 0:
                    break
                desc = bytearray(16 * runs)
                _recv_into_views(conn, [memoryview(desc)])
                pairs = np.frombuffer(desc, "<u8").reshape(-1, 2).tolist()
                targets = [views[first_tensor + t][o:o + n] for t in range(work.kv) for o, n in pairs]
                _recv_into_views(conn, targets)
                conn.sendall(b"\x01")
            conn.close()
        except Exception as error:  # reported through verify
            errors.append(repr(error))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    emit_ctl({"port": listener.getsockname()[1]})
    for line in sys.stdin:
        command = line.strip()
        if '"exit"' in command:
            emit_ctl({"ok": True})
            return
        if '"zero"' in command:
            for array in dst:
                array.fill(0)
            emit_ctl({"ok": True})
        elif '"verify"' in command:
            thread.join(30)
            emit_ctl({**verify(work, dst), "server_error": errors[0] if errors else None})


class SocketClient:
    """The sending side of the socket baseline: ``push`` sends every layer's runs (a header, the run
    table, the bytes) and waits for the target's one-byte acknowledgement of each layer."""

    def __init__(self, work: Workload, target: Target) -> None:
        self.work = work
        src = _alloc(work.tensors, work.src_blocks, work.block_bytes)
        fill_source(src, work.seed)
        self.views = [memoryview(a.reshape(-1)) for a in src]
        self.s_off, d_off, self.length = _layer_plan(work)
        self.pairs = np.stack([np.array(d_off, np.uint64), np.array(self.length, np.uint64)],
                              1).astype("<u8").tobytes()
        self.sock = socket.create_connection(("127.0.0.1", target.ready["port"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ack = bytearray(1)

    def push(self) -> None:
        work, views = self.work, self.views
        for layer in range(work.layers):
            first = layer * work.kv
            out: list[Any] = [struct.pack("<II", len(self.s_off), first), self.pairs]
            out += [views[first + t][s:s + n] for t in range(work.kv) for s, n in zip(self.s_off, self.length)]
            _send_views(self.sock, out)
            _recv_into_views(self.sock, [memoryview(self.ack)])

    def close(self) -> None:
        self.sock.sendall(struct.pack("<II", 0, 0))  # the target's serving thread ends
        self.sock.close()


def case_socket(work: Workload, reps: int, progress: Progress = None) -> dict[str, Any]:
    target = Target([HERE, "--role", "socket-target", *work.as_args()])
    try:
        client = SocketClient(work, target)
        times = []
        cpu = CpuSplit(target.proc.pid)
        for rep in range(reps + 1):
            if rep == 1:
                target.ask({"op": "zero"})
            start = time.perf_counter()
            if rep:
                cpu.start()
            client.push()
            if rep:
                cpu.stop()
                times.append(time.perf_counter() - start)
            _tick(progress, rep + 1, reps + 1)
        client.close()
        return summarize(work, "socket", times, {**target.ask({"op": "verify"}), "cpu": cpu.record()})
    finally:
        target.close()


# -- ucx_perftest (what UCX itself does from C) ------------------------------------------------------
def case_ucx_perftest(work: Workload, test: str) -> dict[str, Any]:
    """``ucx_perftest -t <test>`` (ucp_put_bw or tag_bw) from the libucx wheel, two processes, at the
    workload's run size (one block for W-KV, one 16-block run for W-KV-RUNS), on UCX's tcp transport
    like kvpush-ucx. Reports UCX's own overall bandwidth; nothing to verify (UCX moves a scratch buffer)."""
    import libucx  # the 'ucx' extra

    root = os.path.dirname(libucx.__file__)
    env = {**os.environ, "LD_LIBRARY_PATH": os.path.join(root, "lib"), "UCX_TLS": os.environ.get("UCX_TLS", "tcp"),
           "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    binary = os.path.join(root, "bin", "ucx_perftest")
    size = work.block_bytes * (work.src_blocks // work.runs if work.runs else 1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    iterations = max(200, min(20000, (2 << 30) // size))
    server = subprocess.Popen([binary, "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pin_child(server.pid)  # the receiving side, where --pinned puts the targets
    try:
        output = ""
        for _ in range(50):  # the server needs a moment to listen
            client = subprocess.run([binary, "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size),
                                     "-n", str(iterations)], env=env, capture_output=True, text=True, timeout=120)
            output = client.stdout
            if client.returncode == 0 and "Final:" in output:
                break
            time.sleep(0.1)
        final = [line for line in output.splitlines() if line.startswith("Final:")]
        if not final:
            raise RuntimeError(f"ucx_perftest {test} printed no result: {output[-500:]}")
        mb_per_s = float(final[-1].split()[6])  # overall bandwidth, MB/s (2^20 bytes)
    finally:
        server.kill()
        server.wait(10)
    return {"case": f"ucx_perftest-{test}", "workload": work.name, "message_bytes": size,
            "gbps": round(mb_per_s * (1 << 20) / 1e9, 3), "verified": None, "transport": env["UCX_TLS"]}


# -- MSG_ZEROCOPY between two network namespaces -------------------------------------------------------
SO_ZEROCOPY, MSG_ZEROCOPY, SO_EE_ORIGIN_ZEROCOPY, SO_EE_CODE_ZEROCOPY_COPIED = 60, 0x4000000, 5, 1
_EXTENDED_ERR = struct.Struct("=IBBBBII")  # struct sock_extended_err


def _zerocopy_completions(sock: socket.socket) -> tuple[int, int]:
    """Drain the socket's error queue: (sends completed, of them the kernel copied after all)."""
    done = copied = 0
    while True:
        try:
            _, ancillary, _, _ = sock.recvmsg(0, 256, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return done, copied
        for _, _, data in ancillary:
            _, origin, _, code, _, first, last = _EXTENDED_ERR.unpack_from(data)
            if origin == SO_EE_ORIGIN_ZEROCOPY:
                done += last - first + 1
                copied += (last - first + 1) if code & SO_EE_CODE_ZEROCOPY_COPIED else 0


def _layer_views(views: list[memoryview], work: Workload, blocks: list[int]) -> list[list[memoryview]]:
    """Each layer's blocks (K then V), as memoryviews in the order they travel."""
    size = work.block_bytes
    return [[views[layer * work.kv + t][b * size:(b + 1) * size] for t in range(work.kv) for b in blocks]
            for layer in range(work.layers)]


def zerocopy_sender(work: Workload, host: str, port: int, zerocopy: bool, reps: int) -> None:
    """Send every layer of ``work`` ``reps`` times (after one unmeasured time): one ``sendmsg`` per layer of
    its scattered blocks straight from the source, as kvpush writes a layer, each layer acknowledged by the
    receiver; with ``zerocopy``, MSG_ZEROCOPY, and a repetition ends only once the error queue reported
    every send complete (the source may be reused from then on). Prints throughput and this process's CPU
    per GB (per byte, the measure least moved by other work on the machine)."""
    src = _alloc(work.tensors, work.src_blocks, work.block_bytes)
    fill_source(src, work.seed)
    views = [memoryview(a.reshape(-1)) for a in src]
    blocks = work.block_lists()[0].tolist()
    sock = socket.create_connection((host, port), timeout=60)
    sock.settimeout(None)  # blocking: MSG_DONTWAIT reads of the error queue fail at once when it is empty
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if zerocopy:
        sock.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
    ack = bytearray(1)
    calls = completed = copied = 0
    wall = user = system = 0.0
    for rep in range(reps + 1):
        start, cpu_start = time.perf_counter(), os.times()
        for parts in _layer_views(views, work, blocks):
            index = 0
            while index < len(parts):  # a partial send resumes inside the layer
                count = sock.sendmsg(parts[index:index + IOV_MAX], [], MSG_ZEROCOPY if zerocopy else 0)
                calls += 1
                index = _advance(parts, index, count)
            _recv_into_views(sock, [memoryview(ack)])
            if zerocopy:
                done, was_copied = _zerocopy_completions(sock)
                completed, copied = completed + done, copied + was_copied
        for _ in range(600):  # the source may be reused only once every send completed (bounded: 60 s)
            if not zerocopy or completed >= calls:
                break
            select.select([sock], [], [], 0.1)
            done, was_copied = _zerocopy_completions(sock)
            completed, copied = completed + done, copied + was_copied
        cpu_end = os.times()
        if rep:
            wall += time.perf_counter() - start
            user += cpu_end.user - cpu_start.user
            system += cpu_end.system - cpu_start.system
    sock.close()
    gigabytes = work.payload_bytes * reps / 1e9
    emit({"zerocopy": zerocopy, "gbps": round(gigabytes / wall, 3), "wall_s": round(wall, 4),
          "sender_user_s_per_gb": round(user / gigabytes, 4), "sender_sys_s_per_gb": round(system / gigabytes, 4),
          "sends": calls, "completions": completed, "completions_copied": copied})


def zerocopy_receiver(work: Workload, port: int, reps: int) -> None:
    """The other end of ``zerocopy_sender``: each layer straight into its destination blocks, a one-byte
    acknowledgement per layer; at the end, whether the last repetition's bytes are exact, and this
    process's CPU per GB received over the connection's life."""
    dst = _alloc(work.tensors, work.dst_blocks, work.block_bytes)
    views = [memoryview(a.reshape(-1)) for a in dst]
    blocks = work.block_lists()[1].tolist()
    listener = socket.create_server(("0.0.0.0", port))
    listener.settimeout(60)
    emit_ctl({"port": port})
    conn, _ = listener.accept()
    conn.settimeout(60)
    cpu_start = os.times()
    layers = 0
    for _ in range(reps + 1):
        for parts in _layer_views(views, work, blocks):
            _recv_into_views(conn, parts)
            conn.sendall(b"\x01")
            layers += 1
    conn.close()
    cpu_end = os.times()
    gigabytes = work.payload_bytes * (reps + 1) / 1e9  # every repetition, the unmeasured first one too
    emit({"receiver_layers": layers, "receiver_user_s_per_gb": round((cpu_end.user - cpu_start.user) / gigabytes, 4),
          "receiver_sys_s_per_gb": round((cpu_end.system - cpu_start.system) / gigabytes, 4), **verify(work, dst)})


@contextlib.contextmanager
def netns_pair() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Two network namespaces joined by a veth pair, with private addresses that exist only inside them
    (10.214.x.1 and .2); ((namespace, address) of each side). Always removed, also on failure."""
    tag = f"{os.getpid() % 4096:03x}"
    names = [f"kvpb-{tag}-a", f"kvpb-{tag}-b"]
    veths = [f"kvpb{tag}a", f"kvpb{tag}b"]
    addresses = [f"10.214.{os.getpid() % 250}.1", f"10.214.{os.getpid() % 250}.2"]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    created: list[str] = []
    try:
        for name in names:
            ip("netns", "add", name)
            created.append(name)
        ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for name, veth, address in zip(names, veths, addresses):
            ip("link", "set", veth, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", veth)
            ip("-n", name, "link", "set", veth, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield (names[0], addresses[0]), (names[1], addresses[1])
    finally:
        for name in created:  # deleting a namespace deletes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def case_zerocopy_netns(work: Workload, reps: int, rounds: int = 2) -> list[dict[str, Any]]:
    """Plain sockets between two network namespaces over a veth pair (a same-host stand-in for a NIC),
    each layer sent with and without MSG_ZEROCOPY, alternating for ``rounds`` rounds: throughput, the CPU
    of both sides, and how many zerocopy sends the kernel reported it copied after all."""
    records: list[dict[str, Any]] = []
    with netns_pair() as ((sender_ns, _), (receiver_ns, receiver_address)):
        for index in range(2 * rounds):
            zerocopy = index % 2 == 1
            port = 7300 + index
            common = [*work.as_args(), "--reps", str(reps), "--port", str(port)]
            receiver = Target([HERE, "--role", "zc-receiver", *common], prefix=["ip", "netns", "exec", receiver_ns])
            try:
                argv = ["ip", "netns", "exec", sender_ns, sys.executable, HERE, "--role", "zc-sender",
                        "--host", receiver_address, *common] + (["--zerocopy"] if zerocopy else [])
                done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
                sent = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                    "result": "FAIL", "error": done.stderr[-300:]}
                assert receiver.proc.stdout is not None
                received = json.loads(receiver.proc.stdout.read().strip().splitlines()[-1])
            finally:
                receiver.close()
            records.append({"case": "socket-veth-" + ("zerocopy" if zerocopy else "copy"), "workload": work.name,
                            "round": index // 2, **sent, **received})
            if zerocopy:  # kvpush's TCP transport over the same pair, in the same round
                argv = ["ip", "netns", "exec", sender_ns, sys.executable, HERE, "--role", "kvpush-veth",
                        "--host", receiver_address, "--receiver-ns", receiver_ns, "--reps", str(reps),
                        *work.as_args()]
                done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                pushed = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                    "result": "FAIL", "error": done.stderr[-300:]}
                records.append({**pushed, "case": "kvpush-tcp-veth", "round": index // 2})
    return records


# -- kvpush ------------------------------------------------------------------------------------------
def blocks_desc(work: Workload, blocks: int) -> CacheDesc:
    return CacheDesc(work.tensors, (blocks, work.block_bytes // 2), DataType.DT_FLOAT16)


def kvpush_target(work: Workload, transport: str, listen: str = "127.0.0.1") -> None:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def start() -> None:
        engine = LLMDataDist(LLMRole.DECODER, 2)
        await engine.init({"llm.listenIpInfo": f"{listen}:0", "kvpush.transport": transport,
                           "llm.SyncKvCacheWaitTime": "30000", **ENGINE_OPTIONS})
        state["engine"] = engine
        state["cache"] = engine.cache_manager.allocate_blocks_cache(blocks_desc(work, work.dst_blocks),
                                                                    BlocksCacheKey(2, 0))
        state["pingpong"] = await asyncio.get_running_loop().create_server(
            functools.partial(PingPongServer, work.layer_bytes()), listen, 0)
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    ready.wait(60)
    engine = state["engine"]
    emit_ctl({"port": engine.listen_address[1], "host": listen,
              "pingpong_port": state["pingpong"].sockets[0].getsockname()[1]})
    tensors = state["cache"].tensors
    for line in sys.stdin:
        if '"exit"' in line:
            asyncio.run_coroutine_threadsafe(engine.finalize(), loop).result(30)
            emit_ctl({"ok": True})
            break
        if '"zero"' in line:
            for tensor in tensors:
                tensor.fill(0)
            emit_ctl({"ok": True})
        elif '"verify"' in line:
            emit_ctl(verify(work, [t.view(np.uint8) for t in tensors]))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


class PingPongServer(asyncio.BufferedProtocol):
    """The asyncio floor, served in a kvpush target's own event loop: read a layer's bytes straight into a
    buffer (no stream's copies), answer one byte. Protocols, not streams: streams cost twice as much here."""

    def __init__(self, size: int) -> None:
        self.buffer = memoryview(bytearray(size))
        self.got = 0
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got == len(self.buffer):
            self.got = 0
            self.transport.write(b"\x01")


class PingPongClient(asyncio.BufferedProtocol):
    """The driver's side of the asyncio ping-pong: a layer's bytes out, the target's one byte back, each
    push a round trip of the same size as kvpush's between the same two processes and event loops."""

    def __init__(self, work: Workload) -> None:
        self.data = bytes(work.layer_bytes())
        self.layers = work.layers
        self.ack = memoryview(bytearray(1))
        self.transport: Any = None
        self.answered: asyncio.Future[None] | None = None

    async def connect(self, target: Target) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_connection(lambda: self, target.ready.get("host", "127.0.0.1"),
                                     target.ready["pingpong_port"])

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.ack

    def buffer_updated(self, nbytes: int) -> None:
        if self.answered is not None and not self.answered.done():
            self.answered.set_result(None)

    async def push(self) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(self.layers):
            self.answered = loop.create_future()
            self.transport.write(self.data)
            await self.answered

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def linked_prefill(work: Workload, transport: str, target: Target) -> tuple[LLMDataDist, Any]:
    """A prefill engine with the workload's source cache (filled), linked to the target."""
    options = {"kvpush.transport": transport, "llm.SyncKvCacheWaitTime": "30000", **ENGINE_OPTIONS}
    engine = LLMDataDist(LLMRole.PROMPT, 1, options)
    await engine.init()
    cache = engine.cache_manager.allocate_blocks_cache(blocks_desc(work, work.src_blocks), BlocksCacheKey(1, 0))
    fill_source([t.view(np.uint8) for t in cache.tensors], work.seed)
    info = LLMClusterInfo()
    info.remote_cluster_id = 2
    info.append_remote_ip_info(target.ready.get("host", "127.0.0.1"), target.ready["port"])
    status, _ = await engine.link_clusters([info], timeout=10000)
    if status != 0:
        await engine.finalize()
        raise RuntimeError(f"link failed: {status!r}")
    return engine, cache


async def _kvpush_driver(work: Workload, reps: int, transport: str, target: Target,
                         progress: Progress = None) -> dict[str, Any]:
    engine, cache = await linked_prefill(work, transport, target)
    try:
        src, dst = (b.tolist() for b in work.block_lists())
        key = BlocksCacheKey(2, 0)
        n = work.kv
        times = []
        cpu = CpuSplit(target.proc.pid)
        for rep in range(reps + 1):
            if rep == 1:
                await asyncio.to_thread(target.ask, {"op": "zero"})
            start = time.perf_counter()
            if rep:
                cpu.start()
            await engine.cache_manager.push_blocks(key, cache, src, dst, tensor_num_per_layer=n)
            if rep:
                cpu.stop()
                times.append(time.perf_counter() - start)
            _tick(progress, rep + 1, reps + 1)
        transport_used = engine.links[2].transport
    finally:
        await engine.finalize()
    result = await asyncio.to_thread(target.ask, {"op": "verify"})
    return summarize(work, f"kvpush-{transport_used}", times,
                     {**result, "transport": transport_used, "cpu": cpu.record()})


def start_target(work: Workload, transport: str, listen: str = "127.0.0.1", prefix: list[str] | None = None) -> Target:
    """The decode side; ``listen``: its address, ``prefix``: the command it runs under (another namespace)."""
    return Target([HERE, "--role", "kvpush-target", "--transport", transport, "--host", listen, *work.as_args()],
                  prefix=prefix)


def case_kvpush(work: Workload, reps: int, transport: str, progress: Progress = None, listen: str = "127.0.0.1",
                prefix: list[str] | None = None) -> dict[str, Any]:
    target = start_target(work, transport, listen, prefix)
    try:
        return asyncio.run(_kvpush_driver(work, reps, transport, target, progress))
    finally:
        target.close()


def case_latency(work: Workload, reps: int, transports: list[str], chunk: int, warm: int,
                 progress: Progress = None, socket_name: str = "socket") -> list[dict[str, Any]]:
    """Latency of the socket baseline and of kvpush over ``transports``, interleaved: one driver
    process pushes ``chunk`` times through one system, then the next (a different one first each
    round), until each has ``reps`` pushes, so the systems see the same phases of a shared, noisy
    machine and their ratios do not depend on which ran when. A turn starts with ``warm`` pushes that
    are not measured: after a switch, the first pushes of a system find its memory out of the caches
    and its processes where the scheduler last put them (run alone, a case has one warm-up). The
    suite pairs each transport with a socket baseline of its own (``socket_name``, which each kvpush
    record names as its ``baseline``): engines of several transports in one driver disturb one
    another (a UCX engine beside two others stalled ~1.5% of its pushes for 1-3 ms, alone ~0.1%).
    Every target is a process of its own and verifies every destination byte at the end."""
    targets: dict[str, Target] = {}
    try:
        targets["socket"] = Target([HERE, "--role", "socket-target", *work.as_args()])
        for transport in transports:
            targets[transport] = start_target(work, transport)
        return asyncio.run(_latency_driver(work, reps, transports, chunk, warm, targets, progress, socket_name))
    finally:
        for target in targets.values():
            target.close()


async def _latency_driver(work: Workload, reps: int, transports: list[str], chunk: int, warm: int,
                          targets: dict[str, Target], progress: Progress, socket_name: str) -> list[dict[str, Any]]:
    client = SocketClient(work, targets["socket"])
    pingpong = PingPongClient(work)
    engines: dict[str, tuple[LLMDataDist, Any]] = {}
    src, dst = (b.tolist() for b in work.block_lists())
    key, n = BlocksCacheKey(2, 0), work.kv
    try:
        for transport in transports:
            engines[transport] = await linked_prefill(work, transport, targets[transport])
        await pingpong.connect(targets[transports[0]])

        async def push(system: str) -> None:
            if system == "socket":
                client.push()
            elif system == "asyncio":
                await pingpong.push()
            else:
                engine, cache = engines[system]
                await engine.cache_manager.push_blocks(key, cache, src, dst, tensor_num_per_layer=n)

        systems = ["socket", "asyncio", *transports]
        for system in systems:  # a warm-up push each, then every destination is zeroed
            await push(system)
        for target in targets.values():
            await asyncio.to_thread(target.ask, {"op": "zero"})
        times: dict[str, list[float]] = {system: [] for system in systems}
        rounds = max(1, reps // chunk)
        for index in range(rounds):
            for system in systems[index % len(systems):] + systems[:index % len(systems)]:
                for _ in range(warm):  # unmeasured: the switch from another system's memory and sockets
                    await push(system)
                for _ in range(chunk):
                    start = time.perf_counter()
                    await push(system)
                    times[system].append(time.perf_counter() - start)
            _tick(progress, index + 1, rounds)
        used = {transport: engines[transport][0].links[2].transport for transport in transports}
    finally:
        client.close()
        pingpong.close()
        for engine, _ in engines.values():
            await engine.finalize()
    interleaved = {"interleaved": {"chunk": chunk, "warm": warm, "rounds": rounds, "with": systems}}
    records = [summarize(work, socket_name, times["socket"],
                         {**await asyncio.to_thread(targets["socket"].ask, {"op": "verify"}), **interleaved})]
    # the floor of any asyncio protocol: a ping-pong of the same bytes between the same two event loops
    floor = socket_name.replace("socket", "asyncio ping-pong")
    records.append(summarize(work, floor, times["asyncio"], {"verified": None, **interleaved}))
    for transport in transports:
        result = await asyncio.to_thread(targets[transport].ask, {"op": "verify"})
        records.append(summarize(work, f"kvpush-{used[transport]}", times[transport],
                                 {**result, "transport": used[transport], "baseline": socket_name,
                                  "floor": floor, **interleaved}))
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--reps", type=int, default=5, help="measured repetitions per case (after one warm-up)")
    parser.add_argument("--cases", default="memcpy,socket,kvpush-tcp,kvpush-cma,ucx_perftest-ucp_put_bw,"
                                           "ucx_perftest-tag_bw,kvpush-ucx")
    parser.add_argument("--workloads", default="W-KV,W-KV-RUNS", help="comma-separated (driver only)")
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="tcp", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--zerocopy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--receiver-ns", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = workload_from_args(args)
    if args.role == "zc-sender":
        zerocopy_sender(work, args.host, args.port, args.zerocopy, args.reps)
        return 0
    if args.role == "zc-receiver":
        zerocopy_receiver(work, args.port, args.reps)
        return 0
    if args.role == "kvpush-veth":  # in the sending namespace: kvpush-tcp to a target in --receiver-ns
        emit(case_kvpush(work, args.reps, "tcp", listen=args.host, prefix=["ip", "netns", "exec", args.receiver_ns]))
        return 0
    if args.role == "socket-target":
        socket_target(work)
        return 0
    if args.role == "kvpush-target":
        kvpush_target(work, args.transport, args.host)
        return 0
    ok = True
    for name in args.workloads.split(","):
        args.workload = name
        ok &= run_workload(parser, workload_from_args(args), args)
    return 0 if ok else 1


def run_workload(parser: argparse.ArgumentParser, work: Workload, args: argparse.Namespace) -> bool:
    results: dict[str, dict[str, Any]] = {}
    for case in args.cases.split(","):
        if case == "memcpy":
            record = case_memcpy(work, args.reps)
        elif case == "socket":
            record = case_socket(work, args.reps)
        elif case == "zerocopy-netns":  # a list of records: emitted here, not compared below
            for zerocopy_record in case_zerocopy_netns(work, args.reps):
                emit(zerocopy_record)
            continue
        elif case.startswith("ucx_perftest-"):
            record = case_ucx_perftest(work, case.removeprefix("ucx_perftest-"))
        elif case.startswith("kvpush-"):
            record = case_kvpush(work, args.reps, case.removeprefix("kvpush-"))
        else:
            parser.error(f"unknown case {case}")
        results[case] = record
        emit(record)
    ratios = {}
    for name, record in results.items():
        if name.startswith("kvpush"):
            for base in ("memcpy", "socket", "ucx_perftest-ucp_put_bw", "ucx_perftest-tag_bw"):
                if base in results:
                    ratios[f"{name}/{base}"] = round(record["gbps"] / results[base]["gbps"], 3)
    verified = all(r.get("verified") is not False for r in results.values())
    emit({"case": "ratios", "workload": work.name, **ratios, "all_verified": verified})
    return verified


if __name__ == "__main__":
    sys.exit(main())
