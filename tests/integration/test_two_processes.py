"""Pushes and pulls between this process (prefill) and a decode engine in another OS process, over
real loopback sockets. Every destination byte is checked, and so is every block that must not
change. Faults are real signals to the peer process."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import EngineFactory, cluster, link
from peer import Peer, pattern

from kvpush import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
)
from kvpush.validate import layer_steps

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
    """What the destination must hold: computed independently of kvpush's layout code."""
    out = dst.copy()
    steps = layer_steps("test", src.shape[0], dst.shape[0], n, src_range, dst_range)
    for step in steps:
        for j in range(step.count):
            out[step.dst_first + j][dst_blocks] = src[step.src_first + j][src_blocks]
    return out


@pytest.fixture
def decode_peer() -> Iterator[Peer]:
    with Peer(2) as peer:
        peer.call("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0)
        yield peer


async def prefill(make_engine: EngineFactory, peer: Peer, **options: str) -> tuple[LLMDataDist, Cache]:
    engine = await make_engine(1, **options)
    cache = engine.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    fill(cache, seed=11)
    await link(engine, 2, peer.port)
    return engine, cache


def random_blocks(seed: int, count: int = SRC_BLOCKS) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.permutation(SRC_BLOCKS)[:count].tolist(), rng.permutation(DST_BLOCKS)[:count].tolist()


@pytest.mark.parametrize("n", [1, 2, 4])
async def test_push_random_permutation_all_layers(make_engine: EngineFactory, decode_peer: Peer, tmp_path: Any,
                                                  n: int) -> None:
    engine, src = await prefill(make_engine, decode_peer)
    before = await decode_peer.asnapshot("kv", tmp_path)
    src_blocks, dst_blocks = random_blocks(n, count=20)
    await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, src_blocks, dst_blocks,
                                           tensor_num_per_layer=n)
    after = await decode_peer.asnapshot("kv", tmp_path)
    assert np.array_equal(after, expected_after(before, raw(src), src_blocks, dst_blocks, n))
    assert after[:, dst_blocks].any()  # the check above compared real data


@pytest.mark.parametrize("n, src_range, dst_range", [
    (1, range(2, 5), range(4, 7)),
    (2, range(0, 2), range(1, 3)),
    (4, range(0, 1), range(1, 2)),
])
async def test_push_layer_subrange_to_shifted_destination(make_engine: EngineFactory, decode_peer: Peer,
                                                          tmp_path: Any, n: int, src_range: range,
                                                          dst_range: range) -> None:
    engine, src = await prefill(make_engine, decode_peer)
    decode_peer.call("fill", name="kv", seed=5)  # untouched blocks and layers must keep these bytes
    before = await decode_peer.asnapshot("kv", tmp_path)
    src_blocks, dst_blocks = random_blocks(7, count=12)
    await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, src_blocks, dst_blocks, src_range, dst_range,
                                           tensor_num_per_layer=n)
    after = await decode_peer.asnapshot("kv", tmp_path)
    assert np.array_equal(after, expected_after(before, raw(src), src_blocks, dst_blocks, n, src_range, dst_range))


@pytest.mark.parametrize("n, src_range, dst_range", [
    (1, None, None),
    (2, range(1, 3), range(0, 2)),
    (4, None, None),
])
async def test_pull_blocks(make_engine: EngineFactory, decode_peer: Peer, tmp_path: Any, n: int,
                           src_range: range | None, dst_range: range | None) -> None:
    engine = await make_engine(1)
    local = engine.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    fill(local, seed=3)
    await link(engine, 2, decode_peer.port)
    decode_peer.call("fill", name="kv", seed=21)
    remote = await decode_peer.asnapshot("kv", tmp_path)
    before = raw(local).copy()
    dst_blocks, src_blocks = random_blocks(9, count=16)  # local (dst) ids < 32, remote (src) ids < 64
    await engine.cache_manager.pull_blocks(BlocksCacheKey(2, 0), local, src_blocks, dst_blocks, src_range, dst_range,
                                           tensor_num_per_layer=n)
    assert np.array_equal(raw(local), expected_after(before, remote, src_blocks, dst_blocks, n, src_range, dst_range))
    assert np.array_equal(await decode_peer.asnapshot("kv", tmp_path), remote)  # a pull never writes remotely


async def test_push_cache_and_pull_cache(make_engine: EngineFactory, tmp_path: Any) -> None:
    with Peer(2) as peer:
        remote_id = peer.call("allocate", name="batch", num_tensors=4, shape=[3, 512], blocks=False)["cache_id"]
        engine = await make_engine(1)
        local = engine.cache_manager.allocate_cache(CacheDesc(4, (2, 512), DataType.DT_FLOAT16))
        fill(local, seed=8)
        await link(engine, 2, peer.port)
        await engine.cache_manager.push_cache(CacheKeyByIdAndIndex(2, remote_id, 2), local, src_batch_index=1)
        remote = (await peer.asnapshot("batch", tmp_path)).reshape(4, -1)
        assert np.array_equal(remote[:, 2 * 1024:], raw(local)[:, 1:2].reshape(4, -1))
        assert not remote[:, :2 * 1024].any()
        peer.call("fill", name="batch", seed=4)
        remote = (await peer.asnapshot("batch", tmp_path)).reshape(4, -1)
        await engine.cache_manager.pull_cache(CacheKeyByIdAndIndex(2, remote_id, 1), local, batch_index=0,
                                              size=600)
        got = raw(local).reshape(4, -1)
        assert np.array_equal(got[:, :600], remote[:, 1024:1624])
        assert np.array_equal(got[:, 600:1024], np.stack([pattern(8, i, 2048)[600:1024] for i in range(4)]))


async def test_sigstop_timeout_then_same_link_works(make_engine: EngineFactory, decode_peer: Peer,
                                                    tmp_path: Any) -> None:
    engine, src = await prefill(make_engine, decode_peer, llm__SyncKvCacheWaitTime="300")
    before = await decode_peer.asnapshot("kv", tmp_path)
    key = BlocksCacheKey(2, 0)
    decode_peer.signal(signal.SIGSTOP)
    try:
        with pytest.raises(LLMException) as caught:
            await engine.cache_manager.push_blocks(key, src, [0, 1], [5, 6])
        assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert caught.value.completed_layers == []
    finally:
        decode_peer.signal(signal.SIGCONT)
    assert 2 in engine.links  # the link survived the timeout
    fill(src, seed=12)
    src_blocks, dst_blocks = random_blocks(4, count=10)
    await engine.cache_manager.push_blocks(key, src, src_blocks, dst_blocks)
    after = await decode_peer.asnapshot("kv", tmp_path)
    assert np.array_equal(after[:, dst_blocks], raw(src)[:, src_blocks])
    untouched = sorted(set(range(DST_BLOCKS)) - set(dst_blocks) - {5, 6})
    assert np.array_equal(after[:, untouched], before[:, untouched])


async def test_sigkill_mid_push_raises_promptly(make_engine: EngineFactory, decode_peer: Peer) -> None:
    engine, src = await prefill(make_engine, decode_peer, llm__SyncKvCacheWaitTime="30000")
    decode_peer.signal(signal.SIGSTOP)  # the push is surely in flight when the peer dies
    task = asyncio.create_task(engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, list(range(32)),
                                                                list(range(32))))
    await asyncio.sleep(0.2)
    assert not task.done()
    decode_peer.kill()
    async with asyncio.timeout(10):  # far below sync_kv_timeout: death is noticed, not waited out
        with pytest.raises(LLMException) as caught:
            await task
    assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert "broke" in str(caught.value)
    assert 2 not in engine.links
    with pytest.raises(LLMException) as caught:
        await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0], [0])
    assert caught.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK


async def wait_for(predicate: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_dead_peer_noticed_without_transfer_and_relink_to_restarted_peer(
        make_engine: EngineFactory, tmp_path: Any) -> None:
    engine = await make_engine(1)
    src = engine.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    fill(src, seed=2)
    with Peer(2) as first:
        first.call("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0)
        await link(engine, 2, first.port)
        first.kill()
        await wait_for(lambda: 2 not in engine.links)
    with Peer(2) as second:  # same cluster id, new process, new port
        second.call("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0)
        status, codes = await engine.link_clusters([cluster(2, second.port)])
        assert (status, codes) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [3, 4], [60, 61])
        after = await second.asnapshot("kv", tmp_path)
        assert np.array_equal(after[:, [60, 61]], raw(src)[:, [3, 4]])


async def test_keepalive_breaks_a_silent_link(make_engine: EngineFactory, decode_peer: Peer) -> None:
    engine, _ = await prefill(make_engine, decode_peer, kvpush__keepalive_interval_ms="50",
                              kvpush__keepalive_timeout_ms="400")
    decode_peer.signal(signal.SIGSTOP)  # alive for the kernel (no EOF), silent for kvpush
    try:
        await wait_for(lambda: 2 not in engine.links, seconds=5)
    finally:
        decode_peer.signal(signal.SIGCONT)
    status, _ = await engine.link_clusters([cluster(2, decode_peer.port)])
    assert status == LLMStatusCode.LLM_SUCCESS


async def test_unlink_and_force_unlink(make_engine: EngineFactory, decode_peer: Peer) -> None:
    engine, src = await prefill(make_engine, decode_peer)
    assert (await decode_peer.acall("links"))["links"] == [1]
    status, codes = await engine.unlink_clusters([cluster(2, decode_peer.port)])
    assert (status, codes) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
    assert 2 not in engine.links
    assert (await decode_peer.acall("links"))["links"] == []  # both ends torn down
    with pytest.raises(LLMException) as caught:
        await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0], [0])
    assert caught.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    await link(engine, 2, decode_peer.port)
    status, codes = await engine.unlink_clusters([cluster(2, decode_peer.port)], force=True)
    assert status == LLMStatusCode.LLM_SUCCESS and 2 not in engine.links
    status, codes = await engine.unlink_clusters([cluster(2, decode_peer.port), cluster(99, 1)])
    assert codes == [LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_SUCCESS]  # unknown clusters: nothing to do
    await link(engine, 2, decode_peer.port)
    await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0], [0])


async def test_unlink_unreachable_peer_reports_failure(make_engine: EngineFactory, decode_peer: Peer) -> None:
    engine, _ = await prefill(make_engine, decode_peer)
    decode_peer.signal(signal.SIGSTOP)
    try:
        status, codes = await engine.unlink_clusters([cluster(2, decode_peer.port)], timeout=300)
    finally:
        decode_peer.signal(signal.SIGCONT)
    assert codes == [LLMStatusCode.LLM_UNLINK_FAILED] and status == LLMStatusCode.LLM_UNLINK_FAILED
    assert 2 not in engine.links


async def test_link_codes(make_engine: EngineFactory, decode_peer: Peer) -> None:
    engine, _ = await prefill(make_engine, decode_peer)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    status, codes = await engine.link_clusters(
        [cluster(2, decode_peer.port), cluster(3, dead_port), cluster(3, dead_port)], timeout=1000)
    assert codes == [LLMStatusCode.LLM_ALREADY_LINK, LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_PARAM_INVALID]
    assert status == LLMStatusCode.LLM_ALREADY_LINK
    status, codes = await engine.link_clusters([cluster(5, decode_peer.port)], timeout=2000)
    assert codes == [LLMStatusCode.LLM_LINK_FAILED]  # the peer there is cluster 2, not 5
    with pytest.raises(LLMException) as caught:
        await engine.link_clusters([cluster(10 + i, dead_port) for i in range(17)])
    assert caught.value.status_code == LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
    with pytest.raises(LLMException) as caught:
        await engine.link_clusters([cluster(3, dead_port)], timeout=0)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        await engine.link_clusters(cluster(3, dead_port))  # type: ignore[arg-type]


async def test_peer_made_link_carries_both_directions_and_sees_new_registrations(
        make_engine: EngineFactory, tmp_path: Any) -> None:
    engine = await make_engine(1, listen=True)
    src = engine.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    fill(src, seed=6)
    with Peer(2, options={}) as peer:  # this one does not listen: it dials us
        result = await peer.acall("link", cluster_id=1, port=engine.listen_address[1])
        assert result["codes"] == [0]
        await wait_for(lambda: 2 in engine.links)
        # registered after the link: still visible to us
        await peer.acall("allocate", name="late", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=3)
        await engine.cache_manager.push_blocks(BlocksCacheKey(2, 3), src, [1, 2, 3], [10, 11, 12])
        after = await peer.asnapshot("late", tmp_path)
        assert np.array_equal(after[:, [10, 11, 12]], raw(src)[:, [1, 2, 3]])
        # and a cache they drop stops being addressable
        await peer.acall("unregister", name="late")
        with pytest.raises(LLMException) as caught:
            await engine.cache_manager.push_blocks(BlocksCacheKey(2, 3), src, [1], [10])
        assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


async def test_cancelled_push_drains_and_link_stays_consistent(make_engine: EngineFactory, decode_peer: Peer,
                                                               tmp_path: Any) -> None:
    engine, src = await prefill(make_engine, decode_peer, llm__SyncKvCacheWaitTime="5000")
    key = BlocksCacheKey(2, 0)
    decode_peer.signal(signal.SIGSTOP)
    task = asyncio.create_task(engine.cache_manager.push_blocks(key, src, list(range(32)), list(range(32))))
    await asyncio.sleep(0.1)
    task.cancel()
    await asyncio.sleep(0.1)
    assert not task.done()  # started bytes are drained before CancelledError is let out
    decode_peer.signal(signal.SIGCONT)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 2 in engine.links
    fill(src, seed=13)
    await engine.cache_manager.push_blocks(key, src, [7, 8], [40, 41])
    after = await decode_peer.asnapshot("kv", tmp_path)
    assert np.array_equal(after[:, [40, 41]], raw(src)[:, [7, 8]])


async def test_cancelled_pull_never_writes_after_cancellation(make_engine: EngineFactory, decode_peer: Peer,
                                                              tmp_path: Any) -> None:
    engine = await make_engine(1)
    local = engine.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    await link(engine, 2, decode_peer.port)
    decode_peer.call("fill", name="kv", seed=30)
    remote = await decode_peer.asnapshot("kv", tmp_path)
    key = BlocksCacheKey(2, 0)
    decode_peer.signal(signal.SIGSTOP)
    task = asyncio.create_task(engine.cache_manager.pull_blocks(key, local, list(range(32)), list(range(32))))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    decode_peer.signal(signal.SIGCONT)
    # The peer now answers the abandoned reads; a later pull on the same (ordered) link completes only
    # after those answers were consumed, and they must have been discarded.
    await engine.cache_manager.pull_blocks(key, local, [40], [31], range(0, 1), range(0, 1))
    got = raw(local)
    assert np.array_equal(got[:2, 31], remote[:2, 40])
    assert not got[:, :31].any() and not got[2:].any()


async def test_two_engines_in_one_process(make_engine: EngineFactory) -> None:
    left = await make_engine(1, listen=True)
    right = await make_engine(2, listen=True)
    a = left.cache_manager.allocate_blocks_cache(desc(8, 4), BlocksCacheKey(1, 0))
    b = right.cache_manager.allocate_blocks_cache(desc(8, 4), BlocksCacheKey(2, 0))
    fill(a, 1)
    fill(b, 2)
    await link(left, 2, right.listen_address[1])
    assert 1 in right.links
    await left.cache_manager.push_blocks(BlocksCacheKey(2, 0), a, [0, 1], [6, 7])
    await right.cache_manager.push_blocks(BlocksCacheKey(1, 0), b, [2], [5])  # over the link the other made
    await right.cache_manager.pull_blocks(BlocksCacheKey(1, 0), b, [3], [0])
    assert np.array_equal(raw(b)[:, [6, 7]], raw(a)[:, [0, 1]])
    assert np.array_equal(raw(a)[:, 5], raw(b)[:, 2])
    assert np.array_equal(raw(b)[:, 0], raw(a)[:, 3])
    status, codes = await right.link_clusters([cluster(1, left.listen_address[1])])
    assert codes == [LLMStatusCode.LLM_ALREADY_LINK]
    stats = left.link_stats()[2]
    assert stats["transport"] == "tcp" and stats["write_requests"] == 2 and stats["bytes_served"] == 4 * 4096
