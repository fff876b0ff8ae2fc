"""One conformance suite, run for every available transport: pushes and pulls between this process
(prefill) and a decode engine in another OS process. Every destination byte is checked, and so is
every block that must not change. Faults are real signals to the peer process."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import numpy as np
import pytest
from kvtest import (
    DST_BLOCKS,
    ROW,
    SRC_BLOCKS,
    TENSORS,
    EngineFactory,
    cluster,
    desc,
    expected_after,
    fill,
    link,
    peer_options,
    prefill,
    random_blocks,
    raw,
    wait_for,
)
from peer import Peer, pattern

from kvpush import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
)


@pytest.mark.parametrize("n", [1, 2, 4])
async def test_push_random_permutation_all_layers(transport: str,
                                                  make_engine: EngineFactory, decode_peer: Peer, tmp_path: Any,
                                                  n: int) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport)
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
async def test_push_layer_subrange_to_shifted_destination(transport: str, make_engine: EngineFactory, decode_peer: Peer,
                                                          tmp_path: Any, n: int, src_range: range,
                                                          dst_range: range) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport)
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
async def test_pull_blocks(transport: str, make_engine: EngineFactory, decode_peer: Peer, tmp_path: Any, n: int,
                           src_range: range | None, dst_range: range | None) -> None:
    engine = await make_engine(1, kvpush__transport=transport)
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


async def test_push_cache_and_pull_cache(transport: str, make_engine: EngineFactory, tmp_path: Any) -> None:
    with Peer(2, options=peer_options(transport)) as peer:
        remote_id = peer.call("allocate", name="batch", num_tensors=4, shape=[3, 512], blocks=False)["cache_id"]
        engine = await make_engine(1, kvpush__transport=transport)
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


SLOT_ROW = 5000  # fp16 elements per batch slot: 10 000 bytes = two 4 KiB blocks and a partial third


async def test_a_batch_slot_into_blocks_by_cache_key_and_back(transport: str, make_engine: EngineFactory,
                                                              tmp_path: Any) -> None:
    with Peer(2, options=peer_options(transport)) as peer:
        peer.call("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0, seed=2)
        slots_id = peer.call("allocate", name="batch", num_tensors=TENSORS, shape=[3, SLOT_ROW], blocks=False,
                             seed=6, req_ids=[7, 8])["cache_id"]
        engine = await make_engine(1, kvpush__transport=transport)
        blocks = engine.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
        fill(blocks, seed=3)
        await link(engine, 2, peer.port)
        batch = (await peer.asnapshot("batch", tmp_path)).reshape(TENSORS, 3, -1)
        before = raw(blocks).copy()
        # the peer's slot 1 (its key names request 8), cut into this side's 4 KiB blocks 5, 6 and 20
        await engine.cache_manager.pull_blocks(CacheKey(2, 8), blocks, [], [5, 6, 20])
        got, slot = raw(blocks), batch[:, 1]
        assert np.array_equal(got[:, 5], slot[:, :4096]) and np.array_equal(got[:, 6], slot[:, 4096:8192])
        assert np.array_equal(got[:, 20, :1808], slot[:, 8192:]) and np.array_equal(got[:, 20, 1808:],
                                                                                   before[:, 20, 1808:])
        others = [b for b in range(SRC_BLOCKS) if b not in (5, 6, 20)]
        assert np.array_equal(got[:, others], before[:, others])
        assert (await peer.acall("keys", name="batch"))["slots"] == {"0": 7}  # the pull released request 8
        with pytest.raises(LLMException) as caught:
            await engine.cache_manager.pull_blocks(CacheKey(2, 8), blocks, [], [5])
        assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        # slot 0 by (cache id, slot), its first two blocks of one layer: the key of slot 0 stays (it goes when
        # every tensor of the slot was pulled)
        await engine.cache_manager.pull_blocks(CacheKeyByIdAndIndex(2, slots_id, 0), blocks, [], [30, 31],
                                               range(1, 2), range(3, 4))
        assert np.array_equal(raw(blocks)[6:8, 30:32].reshape(2, -1), batch[2:4, 0, :8192])
        assert (await peer.acall("keys", name="batch"))["slots"] == {"0": 7}
        # and back: a local slot into the peer's blocks, by push_blocks and by the layer pusher
        local = engine.cache_manager.allocate_cache(CacheDesc(TENSORS, (2, SLOT_ROW), DataType.DT_FLOAT16))
        fill(local, seed=9)
        kv_before = await peer.asnapshot("kv", tmp_path)
        await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), local, [], [40, 41, 9], src_batch_index=1)
        async with engine.cache_manager.layer_pusher(BlocksCacheKey(2, 0), local, [], [50, 51, 52],
                                                     src_batch_index=0) as pusher:
            for layer in range(pusher.num_layers):
                pusher.push_layer(layer)
        kv, mine = await peer.asnapshot("kv", tmp_path), raw(local).reshape(TENSORS, 2, -1)
        for dst, slot_index in (([40, 41, 9], 1), ([50, 51, 52], 0)):
            assert np.array_equal(kv[:, dst].reshape(TENSORS, -1)[:, :10000], mine[:, slot_index])
            assert np.array_equal(kv[:, dst[2], 1808:], kv_before[:, dst[2], 1808:])  # past the slot: untouched
        untouched = [b for b in range(DST_BLOCKS) if b not in (40, 41, 9, 50, 51, 52)]
        assert np.array_equal(kv[:, untouched], kv_before[:, untouched])


async def test_sigstop_timeout_then_same_link_works(transport: str, make_engine: EngineFactory, decode_peer: Peer,
                                                    tmp_path: Any) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport, llm__SyncKvCacheWaitTime="300")
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


async def test_sigkill_mid_push_raises_promptly(transport: str, make_engine: EngineFactory, decode_peer: Peer) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport, llm__SyncKvCacheWaitTime="30000")
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


async def test_dead_peer_noticed_without_transfer_and_relink_to_restarted_peer(transport: str,
        make_engine: EngineFactory, tmp_path: Any) -> None:
    engine = await make_engine(1, kvpush__transport=transport)
    src = engine.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    fill(src, seed=2)
    with Peer(2, options=peer_options(transport)) as first:
        first.call("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0)
        await link(engine, 2, first.port)
        first.kill()
        await wait_for(lambda: 2 not in engine.links)
    with Peer(2, options=peer_options(transport)) as second:  # same cluster id, new process, new port
        second.call("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0)
        status, codes = await engine.link_clusters([cluster(2, second.port)])
        assert (status, codes) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [3, 4], [60, 61])
        after = await second.asnapshot("kv", tmp_path)
        assert np.array_equal(after[:, [60, 61]], raw(src)[:, [3, 4]])


async def test_cancelled_push_drains_and_link_stays_consistent(transport: str,
                                                               make_engine: EngineFactory, decode_peer: Peer,
                                                               tmp_path: Any) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport, llm__SyncKvCacheWaitTime="5000")
    key = BlocksCacheKey(2, 0)
    await engine.cache_manager.push_blocks(key, src, [0], [0])  # the link is warm
    decode_peer.signal(signal.SIGSTOP)
    task = asyncio.create_task(engine.cache_manager.push_blocks(key, src, list(range(32)), list(range(32))))
    if transport == "cma":
        # same host, under a standing grant: the copy needs nothing from the stopped receiver
        await asyncio.wait_for(task, 10)
        decode_peer.signal(signal.SIGCONT)
    else:
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.sleep(0.1)
        if transport == "tcp":
            assert not task.done()  # bytes already on the wire are drained before CancelledError is let out
        decode_peer.signal(signal.SIGCONT)
        with pytest.raises(asyncio.CancelledError):
            await task
    assert 2 in engine.links
    fill(src, seed=13)
    await engine.cache_manager.push_blocks(key, src, [7, 8], [40, 41])
    after = await decode_peer.asnapshot("kv", tmp_path)
    assert np.array_equal(after[:, [40, 41]], raw(src)[:, [7, 8]])


async def test_cancelled_pull_never_writes_after_cancellation(transport: str,
                                                              make_engine: EngineFactory, decode_peer: Peer,
                                                              tmp_path: Any) -> None:
    engine = await make_engine(1, kvpush__transport=transport, kvpush__keepalive_timeout_ms="10000")
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


@pytest.mark.parametrize("merge", ["default", "0"])
async def test_small_layers_of_one_transfer_go_as_one_request(transport: str, make_engine: EngineFactory,
                                                              decode_peer: Peer, tmp_path: Any, merge: str) -> None:
    """Four layers of 2 x 8 x 4 KiB: one request each way by default (kvpush.layer_merge_bytes 2 MiB),
    one per layer with 0; the same bytes land either way, in both directions."""
    options = {} if merge == "default" else {"kvpush__layer_merge_bytes": merge}
    engine, src = await prefill(make_engine, decode_peer, transport, **options)
    key = BlocksCacheKey(2, 0)
    before = await decode_peer.asnapshot("kv", tmp_path)
    src_blocks, dst_blocks = random_blocks(5, count=8)
    await engine.cache_manager.push_blocks(key, src, src_blocks, dst_blocks)
    after = await decode_peer.asnapshot("kv", tmp_path)
    assert np.array_equal(after, expected_after(before, raw(src), src_blocks, dst_blocks, 2))
    local = engine.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 1))
    back = list(range(8))
    await engine.cache_manager.pull_blocks(key, local, dst_blocks, back)
    assert np.array_equal(raw(local)[:, back], raw(src)[:, src_blocks])
    assert not raw(local)[:, 8:].any()
    stats = engine.link_stats()[2]
    layers = TENSORS // 2
    assert (stats["write_requests"], stats["read_requests"]) == ((1, 1) if merge == "default" else (layers, layers))


async def test_local_cache_released_mid_transfer(transport: str, make_engine: EngineFactory, decode_peer: Peer,
                                                 tmp_path: Any) -> None:
    # one request per layer (kvpush.layer_merge_bytes 0), so that two of the four are in flight
    engine, src = await prefill(make_engine, decode_peer, transport, llm__SyncKvCacheWaitTime="5000",
                                kvpush__layer_merge_bytes="0")
    key = BlocksCacheKey(2, 0)
    await engine.cache_manager.push_blocks(key, src, [0], [0])
    before = await decode_peer.asnapshot("kv", tmp_path)
    original = raw(src).copy()
    blocks = list(range(8))
    decode_peer.signal(signal.SIGSTOP)
    try:
        task = asyncio.create_task(engine.cache_manager.push_blocks(key, src, blocks, blocks))
        await asyncio.sleep(0.1)
        engine.cache_manager.deallocate_cache(src)  # layers 0 and 1 are in flight
    finally:
        decode_peer.signal(signal.SIGCONT)
    if transport == "cma":  # under a standing grant the copies needed nothing from the stopped peer
        await task
        after = await decode_peer.asnapshot("kv", tmp_path)
        assert np.array_equal(after[:, blocks], original[:, blocks])
        return
    with pytest.raises(LLMException) as caught:
        await task
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert caught.value.completed_layers == [0, 1]
    after = await decode_peer.asnapshot("kv", tmp_path)
    assert np.array_equal(after[:4, blocks], original[:4, blocks])  # the layers that went are the real bytes
    assert np.array_equal(after[4:], before[4:])                      # the rest never went


async def test_nothing_lands_from_source_memory_changed_after_a_timeout(transport: str, make_engine: EngineFactory,
                                                                        tmp_path: Any) -> None:
    big = {"num_tensors": 2, "shape": [512, 16384], "model_id": 0}  # one layer = 32 MiB: more than socket buffers
    with Peer(2, options=peer_options(transport)) as peer:
        peer.call("allocate", name="big", **big)
        engine = await make_engine(1, kvpush__transport=transport, kvpush__keepalive_timeout_ms="10000",
                                   llm__SyncKvCacheWaitTime="300")
        src = engine.cache_manager.allocate_blocks_cache(CacheDesc(2, (512, 16384), DataType.DT_FLOAT16))
        fill(src, seed=17)
        original = raw(src).copy()
        await link(engine, 2, peer.port)
        blocks = list(range(512))
        peer.signal(signal.SIGSTOP)
        try:
            with pytest.raises(LLMException) as caught:
                await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, blocks, blocks)
            assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT
            for tensor in src.tensors:  # the caller reuses its blocks right after the error
                tensor.view(np.uint8)[:] = 0xEE
        finally:
            peer.signal(signal.SIGCONT)
        await asyncio.sleep(0.5)
        landed = await peer.asnapshot("big", tmp_path)
        late = (landed == 0xEE) & (original != 0xEE)
        assert not late.any(), f"{int(late.sum())} bytes written after the exception landed"
        assert ((landed == original) | (landed == 0)).all()
        if 2 not in engine.links:  # a half-sent layer closes the link rather than leave half a frame
            await link(engine, 2, peer.port)
        fill(src, seed=18)
        await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [5], [9])
        assert np.array_equal((await peer.asnapshot("big", tmp_path))[:, 9], raw(src)[:, 5])


def test_a_writer_killed_mid_push_never_takes_the_receiver_down(transport: str, decode_peer: Peer) -> None:
    """The receiving process survives its writer's death in the middle of a big push, drops the link,
    and links with a new writer."""
    for attempt in range(3):  # kill at different points of the transfer
        with Peer(1, options=peer_options(transport, listen=False), role=1) as writer:
            writer.call("allocate", name="kv", num_tensors=TENSORS, shape=[SRC_BLOCKS, ROW], model_id=0, seed=attempt)
            assert writer.call("link", cluster_id=2, port=decode_peer.port)["codes"] == [0]
            assert writer.proc.stdin is not None
            command = {"op": "push_many", "name": "kv", "cluster_id": 2,
                       "requests": [[list(range(SRC_BLOCKS)), list(range(SRC_BLOCKS))]] * 8}
            writer.proc.stdin.write(json.dumps(command) + "\n")
            writer.proc.stdin.flush()
            time.sleep(0.01 * attempt)
            writer.kill()
        deadline = time.monotonic() + 5
        while decode_peer.call("links")["links"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert decode_peer.proc.poll() is None and decode_peer.call("links")["links"] == []
    with Peer(1, options=peer_options(transport, listen=False), role=1) as writer:
        writer.call("allocate", name="kv", num_tensors=TENSORS, shape=[SRC_BLOCKS, ROW], model_id=0, seed=9)
        assert writer.call("link", cluster_id=2, port=decode_peer.port)["codes"] == [0]
        assert writer.call("try_push", name="kv", cluster_id=2, src_blocks=[3], dst_blocks=[4])["status"] == 0
