"""Links between this process and engines in other OS processes (the transfer cases every
transport must pass live in tests/conformance): keepalive, unlink, link codes, links made by the
peer, and two engines in one process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvtest import (
    DST_BLOCKS,
    ROW,
    SRC_BLOCKS,
    TENSORS,
    TRANSPORTS,
    EngineFactory,
    cluster,
    decode_peer_with_kv,
    desc,
    fill,
    link,
    prefill,
    raw,
    wait_for,
)
from peer import Peer, pattern

from kvpush import BlocksCacheKey, LLMException, LLMRole, LLMStatusCode

LEASING = [t for t in TRANSPORTS if t in ("cma", "ucx")]  # the one-sided transports with standing grants


@pytest.fixture
def decode_peer() -> Iterator[Peer]:
    with decode_peer_with_kv() as peer:
        yield peer


async def test_a_stopped_peer_is_late_not_gone(make_engine: EngineFactory, decode_peer: Peer, tmp_path: Any) -> None:
    """A peer whose process does not run (stopped here; starved of its cores in a crowded host) is silent for
    kvpush but its host still acknowledges: keepalive keeps the link, a transfer to it ends at its own
    deadline, and the same link carries the next one once the peer runs again."""
    engine, src = await prefill(make_engine, decode_peer, kvpush__keepalive_interval_ms="50",
                                kvpush__keepalive_timeout_ms="400", llm__SyncKvCacheWaitTime="600")
    link = engine.links[2]
    decode_peer.signal(signal.SIGSTOP)
    try:
        await wait_for(lambda: link.counters["late"] == 1, seconds=5)
        await asyncio.sleep(1.0)  # more than twice the keepalive's timeout
        assert engine.links.get(2) is link and link.ready
        with pytest.raises(LLMException) as caught:
            await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0], [1])
        assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT  # the transfer's deadline, not keepalive
    finally:
        decode_peer.signal(signal.SIGCONT)
    await wait_for(lambda: engine.links.get(2) is not None and engine.links[2].ready)
    await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [2], [3])
    assert np.array_equal((await decode_peer.asnapshot("kv", tmp_path))[:, 3], raw(src)[:, 2])


async def test_a_peer_that_exits_is_gone_at_once(make_engine: EngineFactory, decode_peer: Peer) -> None:
    engine, _ = await prefill(make_engine, decode_peer)  # a keepalive timeout of 10 s: not what notices it
    decode_peer.kill()
    await wait_for(lambda: 2 not in engine.links, seconds=2)


async def test_this_sides_own_stall_is_not_blamed_on_the_peer(make_engine: EngineFactory, decode_peer: Peer) -> None:
    """This engine's event loop blocked for longer than the keepalive's timeout (its process not scheduled):
    the peer, which answered every ping it got, is not counted late, and the link carries the next push."""
    engine, src = await prefill(make_engine, decode_peer, kvpush__keepalive_interval_ms="50",
                                kvpush__keepalive_timeout_ms="400")
    link = engine.links[2]
    await asyncio.sleep(0.3)
    time.sleep(1.2)  # blocks this loop: no ping leaves, no answer is read
    await asyncio.sleep(0.5)
    assert engine.loop_lag.stalls >= 1 and engine.loop_lag.worst_s >= 1.0
    assert link.counters["late"] == 0 and engine.links.get(2) is link
    await engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [4], [5])


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
    assert codes == [LLMStatusCode.LLM_SUCCESS]  # SPEC 3: linked by the peer is linked (was ALREADY_LINK)
    stats = left.link_stats()[2]
    assert stats["transport"] == "cma"  # same host: one-sided, even within one process
    assert stats["write_requests"] == 1 and stats["bytes_served"] == 4 * 4096  # its 4 small layers: one request


async def test_both_ends_linking_each_other_at_once_keep_one_link(make_engine: EngineFactory) -> None:
    for _ in range(3):
        left = await make_engine(1, listen=True)
        right = await make_engine(2, listen=True)
        results = await asyncio.gather(left.link_clusters([cluster(2, right.listen_address[1])]),
                                       right.link_clusters([cluster(1, left.listen_address[1])]))
        assert all(status in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK) for status, _ in results)
        await asyncio.sleep(0.05)
        assert list(left.links) == [2] and list(right.links) == [1]
        a = left.cache_manager.allocate_blocks_cache(desc(4, 2), BlocksCacheKey(1, 0))
        b = right.cache_manager.allocate_blocks_cache(desc(4, 2), BlocksCacheKey(2, 0))
        fill(a, 1)
        await left.cache_manager.push_blocks(BlocksCacheKey(2, 0), a, [0], [3])
        await right.cache_manager.pull_blocks(BlocksCacheKey(1, 0), b, [1], [2])
        assert np.array_equal(raw(b)[:, 3], raw(a)[:, 0]) and np.array_equal(raw(b)[:, 2], raw(a)[:, 1])
        await left.finalize()
        await right.finalize()


async def test_finalize_stops_a_link_in_progress(make_engine: EngineFactory, decode_peer: Peer) -> None:
    engine = await make_engine(1)
    decode_peer.signal(signal.SIGSTOP)  # the handshake cannot finish
    try:
        task = asyncio.create_task(engine.link_clusters([cluster(2, decode_peer.port)], timeout=10000))
        await asyncio.sleep(0.2)
        await engine.finalize()
        async with asyncio.timeout(5):
            status, codes = await task
    finally:
        decode_peer.signal(signal.SIGCONT)
    assert codes == [LLMStatusCode.LLM_LINK_FAILED] and engine.links == {}


async def test_kernel_refusal_falls_back_to_tcp_and_says_why(make_engine: EngineFactory, tmp_path: Any,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to start a peer that then drops to another user")
    decode = await make_engine(2, listen=True, role=LLMRole.DECODER)
    dst = decode.cache_manager.allocate_blocks_cache(desc(DST_BLOCKS), BlocksCacheKey(2, 0))
    with Peer(1, options={}, role=1) as prefill:
        prefill.call("allocate", name="kv", num_tensors=TENSORS, shape=[SRC_BLOCKS, ROW], model_id=0, seed=19)
        prefill.call("drop_privileges", uid=65534)  # may not ptrace a root process any more
        linked = await prefill.acall("link", cluster_id=2, port=decode.listen_address[1])
        assert linked["codes"] == [0]
        info = (await prefill.acall("link_info"))["links"]["2"]
        assert info["transport"] == "tcp"
        assert "refused" in info["fallback_reason"] and "Operation not permitted" in info["fallback_reason"]
        await prefill.acall("push", name="kv", cluster_id=2, src_blocks=[1, 2], dst_blocks=[7, 30])
        for tensor in range(TENSORS):
            source = pattern(19, tensor, SRC_BLOCKS * ROW * 2).reshape(SRC_BLOCKS, -1)
            assert np.array_equal(raw(dst)[tensor][[7, 30]], source[[1, 2]])
        assert decode.links[1].transport == "cma"  # root may still reach the peer: each side picks its own path


async def test_granted_memory_stays_pinned_until_a_silent_writer_is_gone(make_engine: EngineFactory) -> None:
    """A same-host writer holds grants (a prepared layer pusher) and goes silent: its link is dropped, but
    the granted cache stays mapped, even when deallocated, until the writer's process has exited —
    a stopped writer could still resume in the middle of a copy. ``settled`` (nothing of the peer's closed
    links can land any more) waits for the same moment."""
    decode = await make_engine(2, listen=True, role=LLMRole.DECODER, kvpush__transport="cma")
    dst = decode.cache_manager.allocate_blocks_cache(desc(DST_BLOCKS), BlocksCacheKey(2, 0))
    entry = decode.registry.get(dst.cache_id)
    assert entry is not None
    with Peer(1, options={"kvpush.transport": "cma"}, role=1) as prefill:
        prefill.call("allocate", name="kv", num_tensors=TENSORS, shape=[SRC_BLOCKS, ROW], model_id=0)
        assert (await prefill.acall("link", cluster_id=2, port=decode.listen_address[1]))["codes"] == [0]
        assert (await prefill.acall("hold_pusher", name="kv", cluster_id=2, src_blocks=[0], dst_blocks=[1]))[
            "layers"] == TENSORS // 2
        await wait_for(lambda: entry.pins >= TENSORS // 2)  # every layer granted (and a standing lease, maybe)
        held_pins = entry.pins
        prefill.signal(signal.SIGSTOP)
        # keepalive finds it late, not gone; the deadline of its granted transfer drops the silent writer
        await wait_for(lambda: 1 not in decode.links, seconds=5)
        settled = asyncio.ensure_future(decode.settled(1))
        await asyncio.wait_for(decode.settled(99), 1)  # a cluster that never linked: at once
        decode.cache_manager.deallocate_cache(dst)
        await asyncio.sleep(0.3)
        assert entry.removed and entry.pins >= TENSORS // 2 and entry.regions  # still mapped: it may still be written
        assert entry.pins >= held_pins - 1  # at most a lease revoked, never the grants
        assert not settled.done()
        prefill.kill()
        await asyncio.wait_for(settled, 5)
        await wait_for(lambda: entry.pins == 0, seconds=5)
        assert not entry.regions  # released once the writer could not write any more


@pytest.mark.parametrize("leasing", LEASING)
async def test_a_standing_grant_is_revoked_when_the_cache_is_released(make_engine: EngineFactory,
                                                                      leasing: str) -> None:
    """Writes under a lease need no round trip; unregistering the cache revokes the lease, and its
    memory is released only after the writer confirmed."""
    decode = await make_engine(2, listen=True, role=LLMRole.DECODER, kvpush__transport=leasing)
    dst = decode.cache_manager.allocate_blocks_cache(desc(DST_BLOCKS), BlocksCacheKey(2, 0))
    entry = decode.registry.get(dst.cache_id)
    assert entry is not None
    prefill = await make_engine(1, kvpush__transport=leasing)
    src = prefill.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    fill(src, seed=5)
    await link(prefill, 2, decode.listen_address[1])
    key = BlocksCacheKey(2, 0)
    sender = prefill.links[2].onesided
    assert sender is not None
    for _ in range(100):  # a write asks for the lease once the writer has its proof (UCX reads it one-sided)
        await prefill.cache_manager.push_blocks(key, src, [0], [0])
        if sender.leases.get(dst.cache_id) == "active":
            break
        await asyncio.sleep(0.02)
    assert sender.leases.get(dst.cache_id) == "active"
    pushed = prefill.link_stats()[2]["bytes_pushed"]
    await wait_for(lambda: decode.link_stats()[1].get("bytes_received", 0) == pushed)  # every push counted
    stats = decode.link_stats()[1]
    grants, leased = stats.get("grants", 0), stats.get("leased_writes", 0)
    assert grants >= 1  # the first write, at least, asked (the lease came during or after it)
    await prefill.cache_manager.push_blocks(key, src, [1, 2], [30, 31])  # copied at once, then noticed
    assert np.array_equal(raw(dst)[:, [30, 31]], raw(src)[:, [1, 2]])
    # noticed: one notice for the four small layers (one request: kvpush.layer_merge_bytes; cma would
    # merge them under its lease anyway)
    await wait_for(lambda: decode.link_stats()[1].get("leased_writes", 0) == leased + 1)
    assert decode.link_stats()[1].get("grants", 0) == grants  # no intent/grant round trip under the lease
    await wait_for(lambda: decode.link_stats()[1].get("bytes_received", 0) == pushed + 2 * TENSORS * ROW * 2)
    decode.cache_manager.deallocate_cache(dst)
    await wait_for(lambda: sender.leases.get(dst.cache_id) == "done")
    await wait_for(lambda: entry.pins == 0 and not entry.regions)  # released after the writer confirmed
    with pytest.raises(LLMException) as caught:
        await prefill.cache_manager.push_blocks(key, src, [0], [0])
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.parametrize("leasing", LEASING)
async def test_a_graceful_unlink_lets_leased_caches_go(make_engine: EngineFactory, leasing: str) -> None:
    decode = await make_engine(2, listen=True, role=LLMRole.DECODER, kvpush__transport=leasing)
    dst = decode.cache_manager.allocate_blocks_cache(desc(DST_BLOCKS), BlocksCacheKey(2, 0))
    entry = decode.registry.get(dst.cache_id)
    assert entry is not None
    prefill = await make_engine(1, kvpush__transport=leasing)
    src = prefill.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    await link(prefill, 2, decode.listen_address[1])
    for _ in range(3):
        await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0], [0])
    await wait_for(lambda: entry.pins == 1)  # the standing grant
    status, _ = await prefill.unlink_clusters([cluster(2, decode.listen_address[1])])
    assert status == LLMStatusCode.LLM_SUCCESS
    await wait_for(lambda: entry.pins == 0)  # the writer lives on, but said no copy runs any more
    decode.cache_manager.deallocate_cache(dst)
    assert not entry.regions


async def test_no_leased_copy_starts_once_an_unlink_has_begun(make_engine: EngineFactory) -> None:
    """A request prepared under a standing grant, released while a graceful unlink is under way (the
    peer's answer delayed on purpose), must not copy: the peer let the cache go already."""
    decode = await make_engine(2, listen=True, role=LLMRole.DECODER, kvpush__transport="cma")
    prefill = await make_engine(1, kvpush__transport="cma")
    dst = decode.cache_manager.allocate_blocks_cache(desc(DST_BLOCKS), BlocksCacheKey(2, 0))
    src = prefill.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0))
    fill(src, seed=3)
    entry = decode.registry.get(dst.cache_id)
    assert entry is not None
    await link(prefill, 2, decode.listen_address[1])
    for _ in range(3):
        await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0], [0])
    sender = prefill.links[2].onesided
    assert sender is not None
    await wait_for(lambda: sender.leases.get(dst.cache_id) == "active")
    pusher = prefill.cache_manager.layer_pusher(BlocksCacheKey(2, 0), src, [0, 1], [5, 6])
    peer_side = decode.links[1]
    answer = peer_side.ack_bye
    peer_side.ack_bye = lambda *args: asyncio.get_running_loop().call_later(0.2, answer, *args)  # type: ignore
    unlinking = asyncio.create_task(prefill.unlink_clusters([cluster(2, decode.listen_address[1])]))
    await wait_for(lambda: entry.pins == 0)  # the peer has let the cache go...
    decode.cache_manager.deallocate_cache(dst)
    other = decode.cache_manager.allocate_blocks_cache(desc(DST_BLOCKS))  # ...and may reuse the memory
    with pytest.raises(LLMException):
        await pusher.push_layer(0)  # ...so nothing may be copied there any more
    assert not any(t.view(np.uint8).any() for t in other.tensors)
    assert (await unlinking)[0] == LLMStatusCode.LLM_SUCCESS


async def test_a_layer_pusher_over_tcp_to_this_host_says_this_side_copies(make_engine: EngineFactory) -> None:
    """Over loopback TCP the prefill's kernel copies every byte (and runs the receiving half of TCP): a
    caller whose computation keeps its cores busy learns it (``copies_here``) and pushes after computing.
    The pusher works the same either way."""
    with decode_peer_with_kv("tcp") as decode:
        engine, src = await prefill(make_engine, decode, "tcp")
        assert engine.links[2].stream.local
        async with engine.cache_manager.layer_pusher(BlocksCacheKey(2, 0), src, [0], [1]) as pusher:
            assert pusher.copies_here
            for layer in range(pusher.num_layers):
                pusher.push_layer(layer)
        assert len(pusher.landed) == pusher.num_layers
