"""Connections that try to exhaust a decode engine (issue 13): memory announced before the handshake,
floods of connections in handshake, a write that drips its payload. The engine runs in its own
process (its memory is measured there); the attacker speaks the wire by hand, on loopback only."""

from __future__ import annotations

import asyncio
import resource
import socket
import time

import pytest
from kvtest import EngineFactory, cluster
from peer import Peer
from wire import RawPeer, write_frame

from kvpush import BlocksCacheKey, CacheDesc, DataType, LLMStatusCode
from kvpush.protocol import Kind, encode_header

PATIENT = {"kvpush.keepalive_timeout_ms": "60000", "llm.SyncKvCacheWaitTime": "500"}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def enough_fds(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count:
        if hard < count:
            pytest.fail(f"this test needs {count} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while True:
            if not sock.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_a_stranger_announcing_big_frames_gets_no_memory_and_is_closed_at_once() -> None:
    enough_fds(1200)
    with Peer(2, options={"llm.listenIpInfo": "127.0.0.1:0", **PATIENT}) as decode:
        before = rss_mib(decode.proc.pid)
        attackers = []
        for _ in range(400):  # each announces a 1 MiB HELLO and sends 100 bytes of it
            sock = socket.create_connection(("127.0.0.1", decode.port), timeout=5)
            sock.sendall(encode_header(Kind.HELLO, 0, 1 << 20, 0) + b"{" * 100)
            attackers.append(sock)
        closed = sum(closed_within(sock, 2.0) for sock in attackers)
        grown = rss_mib(decode.proc.pid) - before
        for sock in attackers:
            sock.close()
        assert closed == 400  # frames larger than a handshake needs close the connection at once
        assert grown < 20, f"the decode process grew by {grown:.0f} MiB"
        assert decode.call("links")["links"] == []


async def test_a_flood_of_idle_connections_never_keeps_a_peer_out(make_engine: EngineFactory) -> None:
    enough_fds(4400)
    with Peer(2, options={"llm.listenIpInfo": "127.0.0.1:0", **PATIENT}) as decode:
        decode.call("allocate", name="kv", num_tensors=4, shape=[16, 64], model_id=0)
        idle = [socket.create_connection(("127.0.0.1", decode.port), timeout=5) for _ in range(2000)]
        try:
            cpu_before = time.process_time()
            prefill = await make_engine(1, **{"llm__SyncKvCacheWaitTime": "2000"})
            src = prefill.cache_manager.allocate_blocks_cache(CacheDesc(4, (16, 64), DataType.DT_FLOAT16),
                                                              BlocksCacheKey(1, 0))
            status, codes = await prefill.link_clusters([cluster(2, decode.port)], timeout=5000)
            assert codes == [LLMStatusCode.LLM_SUCCESS]
            await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0, 1], [2, 3])
            assert time.process_time() - cpu_before < 5  # this side did not spin
            await asyncio.sleep(6.5)  # past the handshake timeout every idle connection is dropped
            still_open = sum(not closed_within(sock, 0.001) for sock in idle)
            assert still_open == 0
            assert decode.call("cpu")["seconds"] < 10  # the decode did not spin on 2000 connections
        finally:
            for sock in idle:
                sock.close()


def test_a_dripping_write_is_ended_by_the_receiver_and_unpinned() -> None:
    with Peer(2, options={"llm.listenIpInfo": "127.0.0.1:0", **PATIENT}) as decode:
        decode.call("allocate", name="kv", num_tensors=2, shape=[4, 256], model_id=0)
        attacker = RawPeer(decode.port)
        table = attacker.handshake()
        cache_id = table["caches"][0]["id"]
        frame = write_frame(cache_id, 0, 2, [0], [256], budget_ms=200)
        attacker.send(frame[:-400])  # header, meta and most of the payload; the rest drips
        started = time.monotonic()
        closed = False
        for _ in range(400):  # one byte every 50 ms, answering keepalives is not needed: it is patient
            try:
                attacker.send(b"\xAB")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if closed_within(attacker.sock, 0.05):
                closed = True
                break
        elapsed = time.monotonic() - started
        attacker.close()
        assert closed and elapsed < 5, f"the write was still open after {elapsed:.1f} s"
        assert decode.call("links")["links"] == []
        assert decode.call("pins", name="kv")["pins"] == 0  # the cache can be released
