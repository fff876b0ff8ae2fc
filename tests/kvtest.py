"""Helpers shared by the two-process tests: cache geometry, deterministic contents, the expected
destination (computed here, independently of kvpush's own layout code) and a linked prefill."""

from __future__ import annotations

import asyncio
import queue
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from typing import IO, Any

import numpy as np
from peer import Peer, pattern

from kvpush import BlocksCacheKey, Cache, CacheDesc, DataType, LLMClusterInfo, LLMDataDist
from transports import cma, ucx

EngineFactory = Callable[..., Awaitable[LLMDataDist]]

# the conformance suites run every case once per transport available here
TRANSPORTS = ["tcp"] + (["cma"] if cma.AVAILABLE else []) + (["ucx"] if ucx.available() is None else [])

TENSORS = 8            # 4 layers of K, V with N = 2
SRC_BLOCKS, DST_BLOCKS = 32, 64
ROW = 2048             # fp16 elements per block: 4 KiB blocks


def desc(blocks: int, tensors: int = TENSORS) -> CacheDesc:
    return CacheDesc(tensors, (blocks, ROW), DataType.DT_FLOAT16)


def fill(cache: Cache, seed: int) -> None:
    for index, tensor in enumerate(cache.tensors):
        tensor.reshape(-1).view(np.uint8)[:] = pattern(seed, index, tensor.nbytes)


def raw(cache: Cache) -> np.ndarray[Any, Any]:
    return np.stack([t.view(np.uint8).reshape(t.shape[0], -1) for t in cache.tensors])


def expected_after(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], src_blocks: list[int],
                   dst_blocks: list[int], n: int, src_range: range | None = None,
                   dst_range: range | None = None) -> np.ndarray[Any, Any]:
    """What the destination must hold after the transfer."""
    out = dst.copy()
    if src_range is None and dst_range is None:
        pairs = [(t, t) for t in range(src.shape[0])]
    else:
        assert src_range is not None and dst_range is not None
        pairs = [(s * n + j, d * n + j) for s, d in zip(src_range, dst_range) for j in range(n)]
    for s, d in pairs:
        out[d][dst_blocks] = src[s][src_blocks]
    return out


def random_blocks(seed: int, count: int = SRC_BLOCKS) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.permutation(SRC_BLOCKS)[:count].tolist(), rng.permutation(DST_BLOCKS)[:count].tolist()


# Tests that SIGSTOP a peer for a while must not have keepalive (1 s by default) end the link.
PATIENT = {"kvpush.keepalive_timeout_ms": "10000"}


def peer_options(transport: str = "auto", listen: bool = True) -> dict[str, str]:
    options = {"kvpush.transport": transport, **PATIENT}
    if listen:
        options["llm.listenIpInfo"] = "127.0.0.1:0"
    return options


def decode_peer_with_kv(transport: str = "auto") -> Peer:
    peer = Peer(2, options=peer_options(transport))
    peer.call("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0)
    return peer


async def prefill(make_engine: EngineFactory, peer: Peer, transport: str = "auto",
                  **options: str) -> tuple[LLMDataDist, Cache]:
    """A prefill engine in this process with a filled source cache, linked to ``peer``."""
    options = {"kvpush__keepalive_timeout_ms": PATIENT["kvpush.keepalive_timeout_ms"], **options}
    engine = await make_engine(1, kvpush__transport=transport, **options)
    cache = engine.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    fill(cache, seed=11)
    await link(engine, 2, peer.port)
    if transport != "auto":
        assert engine.links[2].transport == transport, engine.links[2].fallback_reason
    return engine, cache


async def push_interleaved(engine: LLMDataDist, src: Cache, requests: list[tuple[list[int], list[int]]],
                           layers: int, before: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """One layer pusher per (src_blocks, dst_blocks) request to cluster 2's model 0, their layers started
    interleaved (layer 0 of each, then layer 1, ...), all waited for; returns what the peer's cache, ``before``
    until then, must hold now."""
    pushers = [engine.cache_manager.layer_pusher(BlocksCacheKey(2, 0), src, s, d) for s, d in requests]
    for layer in range(layers):
        for pusher in pushers:
            pusher.push_layer(layer)
    await asyncio.gather(*(pusher.wait() for pusher in pushers))
    expected = before
    for s, d in requests:
        expected = expected_after(expected, raw(src), s, d, 2)
    return expected


async def wait_for(predicate: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def cluster(cluster_id: int, port: int, host: str = "127.0.0.1") -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_remote_ip_info(host, port)
    return info


async def link(engine: LLMDataDist, cluster_id: int, port: int) -> None:
    status, codes = await engine.link_clusters([cluster(cluster_id, port)], timeout=5000)
    assert status == 0 and codes == [0], (status, codes)


class Lines:
    """A child's output (its stdout, or ``stream``), read by a thread, so every read here is bounded by a
    timeout."""

    def __init__(self, proc: subprocess.Popen[str], stream: IO[str] | None = None) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        stream = proc.stdout if stream is None else stream
        assert stream is not None

        def pump() -> None:
            for line in stream:
                self._queue.put(line)
            self._queue.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def next(self, timeout: float = 30.0) -> str:
        line = self._queue.get(timeout=timeout)
        if line is None:
            raise EOFError("the process closed its output")
        return line
