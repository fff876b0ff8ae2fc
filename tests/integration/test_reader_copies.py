"""Same host, the layer pusher under a standing grant: the decode copies each layer out of the prefill's
memory (READ_OFFER -> the decode's process_vm_readv -> DONE), so the prefill's core only computes. Two
OS processes, real sockets and cross-memory attach; every destination byte is checked, and so are the
fences: a layer completes only once its bytes are in the decode's memory, a timed-out layer fails alone
with LLM_TIMEOUT, and a source the decode may still read stays mapped until the decode cannot any more."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
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
    decode_peer_with_kv,
    expected_after,
    peer_options,
    prefill,
    push_interleaved,
    raw,
    wait_for,
)
from peer import Peer

from kvpush import BlocksCacheKey, Cache, LLMDataDist, LLMException, LLMStatusCode
from transports import cma

pytestmark = pytest.mark.skipif(not cma.AVAILABLE, reason="cross-memory attach is not available here")

KEY = BlocksCacheKey(2, 0)
LAYERS = TENSORS // 2


async def leased(make_engine: EngineFactory, decode_peer: Peer, **options: str) -> tuple[LLMDataDist, Cache]:
    """A prefill linked over cma to ``decode_peer``, holding a standing grant on its cache: from now on
    the decode copies the layers a pusher lets go."""
    engine, src = await prefill(make_engine, decode_peer, "cma", **options)
    await engine.cache_manager.push_blocks(KEY, src, [0], [0])  # asks for the lease; its grant comes first
    sender = engine.links[2].onesided
    assert sender is not None
    await wait_for(lambda: sender.reader_copies())  # the decode's cache (its first, id 1) is leased
    return engine, src


async def mark_every_layer(pusher: Any) -> None:
    """As a computation's own thread does: every layer marked ready, one after the other, off the event loop."""
    def compute() -> None:
        for layer in range(LAYERS):
            pusher.mark_ready(layer)

    await asyncio.to_thread(compute)


async def granted(make_engine: EngineFactory, decode: Peer, allowed: list[int]) -> tuple[LLMDataDist, Cache]:
    """A prefill linked over cma to ``decode``, whose cache is ``GRANTED`` (vLLM's decode registers its KV so)
    with ``allowed`` blocks (40 among them) granted to the prefill. The first push asks for a lease, refused
    with the word that the decode reads the prefill, gated offers too."""
    decode.call("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0, access="granted")
    decode.call("allow", name="kv", peer=1, blocks=allowed)
    engine, src = await prefill(make_engine, decode, "cma")
    await engine.cache_manager.push_blocks(KEY, src, [0], [40])
    sender = engine.links[2].onesided
    assert sender is not None
    await wait_for(sender.reader_gates)
    return engine, src


@pytest.fixture
def decode_peer_cma() -> Iterator[Peer]:
    with decode_peer_with_kv("cma") as peer:
        yield peer


async def test_the_decode_copies_each_layer_and_the_bytes_land_exactly(make_engine: EngineFactory,
                                                                      decode_peer_cma: Peer, tmp_path: Any) -> None:
    engine, src = await leased(make_engine, decode_peer_cma)
    before = await decode_peer_cma.asnapshot("kv", tmp_path)
    offers = engine.link_stats()[2].get("read_offers", 0)
    src_blocks, dst_blocks = [3, 4, 5, 0, 9, 31], [10, 11, 12, 40, 2, 63]
    async with engine.cache_manager.layer_pusher(KEY, src, src_blocks, dst_blocks) as pusher:
        assert not pusher.copies_here  # the decode copies: worth letting go during a computation
        for layer in (2, 0, 3, 1):
            await pusher.push_layer(layer)  # complete: the layer is in the decode's memory now
            after = await decode_peer_cma.asnapshot("kv", tmp_path)
            layer_range = range(layer, layer + 1)
            assert np.array_equal(after[2 * layer:2 * layer + 2], expected_after(
                before, raw(src), src_blocks, dst_blocks, 2, layer_range, layer_range)[2 * layer:2 * layer + 2])
    assert sorted(pusher.landed) == list(range(LAYERS))
    assert np.array_equal(await decode_peer_cma.asnapshot("kv", tmp_path),
                          expected_after(before, raw(src), src_blocks, dst_blocks, 2))
    assert engine.link_stats()[2]["read_offers"] == offers + LAYERS  # none copied by the prefill
    decode_stats = (await decode_peer_cma.acall("stats"))["stats"]["1"]
    assert decode_stats["read_offers_copied"] == LAYERS
    assert (await decode_peer_cma.acall("pins", name="kv"))["pins"] == 1  # the lease alone: copies unpinned


async def test_a_pipelined_requests_answers_wait_for_its_next_layer_and_an_early_stop_still_ends(
        make_engine: EngineFactory, decode_peer_cma: Peer, tmp_path: Any) -> None:
    """Every layer but the last says more follow, so the decode holds its DONE for the next frame (the
    prefill's loop wakes once per layer, not twice); the last is answered at once. A pusher stopped before
    its last layer still ends at once: ``wait()`` nudges the decode, which sends what it held first."""
    engine, src = await leased(make_engine, decode_peer_cma)
    before = await decode_peer_cma.asnapshot("kv", tmp_path)
    held_before = (await decode_peer_cma.acall("stats"))["stats"]["1"].get("read_offer_answers_held", 0)
    src_blocks, dst_blocks = [7, 1, 2], [20, 21, 30]
    async with engine.cache_manager.layer_pusher(KEY, src, src_blocks, dst_blocks) as pusher:
        for layer in range(LAYERS):
            pusher.push_layer(layer)
    assert sorted(pusher.landed) == list(range(LAYERS))
    assert np.array_equal(await decode_peer_cma.asnapshot("kv", tmp_path),
                          expected_after(before, raw(src), src_blocks, dst_blocks, 2))
    held = (await decode_peer_cma.acall("stats"))["stats"]["1"]["read_offer_answers_held"] - held_before
    assert held == LAYERS - 1
    stopped = engine.cache_manager.layer_pusher(KEY, src, [3], [50])
    stopped.push_layer(1)
    stopped.push_layer(0)  # more would follow: its answer is held
    await stopped.wait()  # the others never start; the held answer still comes
    assert sorted(stopped.landed) == [0, 1]
    assert (await decode_peer_cma.acall("pins", name="kv"))["pins"] == 1  # the lease alone


async def test_many_blocks_and_requests_at_once(make_engine: EngineFactory, decode_peer_cma: Peer,
                                               tmp_path: Any) -> None:
    """Numpy-sized offers (more runs than a handful) and several pushers interleaved on one link."""
    engine, src = await leased(make_engine, decode_peer_cma)
    before = await decode_peer_cma.asnapshot("kv", tmp_path)
    scattered = list(range(0, SRC_BLOCKS, 2)), list(range(63, 63 - SRC_BLOCKS, -2))  # 16 runs of one block
    expected = await push_interleaved(engine, src, [scattered, ([1, 3], [0, 2])], LAYERS, before)
    assert np.array_equal(await decode_peer_cma.asnapshot("kv", tmp_path), expected)


async def test_a_stopped_decode_times_the_layer_out_and_the_source_stays_mapped(make_engine: EngineFactory,
                                                                                decode_peer_cma: Peer) -> None:
    """The decode cannot copy while stopped: the layer fails alone with LLM_TIMEOUT (the layers before it
    landed). It may still read the source once it runs again, so the source stays mapped, even when
    released, until the decode's process has exited."""
    engine, src = await leased(make_engine, decode_peer_cma, llm__SyncKvCacheWaitTime="300")
    entry = engine.registry.get(src.cache_id)
    assert entry is not None
    pusher = engine.cache_manager.layer_pusher(KEY, src, [1], [1])
    await pusher.push_layer(0)
    decode_peer_cma.signal(signal.SIGSTOP)
    try:
        pusher.push_layer(1)
        with pytest.raises(LLMException) as caught:
            await pusher.wait()
        assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert caught.value.completed_layers == [0]
        engine.cache_manager.deallocate_cache(src)
        await asyncio.sleep(0.2)
        # the decode may still read it: the timed-out layer's offer, and the two it was offered before their
        # layers were ready (gated; withdrawn, but not answered yet)
        assert entry.removed and entry.pins == LAYERS - 1 and entry.regions
    finally:
        decode_peer_cma.signal(signal.SIGCONT)
    decode_peer_cma.kill()
    await wait_for(lambda: entry.pins == 0, seconds=5)
    assert not entry.regions  # released once no one could read it any more


async def test_a_decode_that_dies_fails_the_layer_in_flight(make_engine: EngineFactory,
                                                           decode_peer_cma: Peer) -> None:
    engine, src = await leased(make_engine, decode_peer_cma)
    entry = engine.registry.get(src.cache_id)
    assert entry is not None
    pusher = engine.cache_manager.layer_pusher(KEY, src, [1], [1])
    await pusher.push_layer(0)
    decode_peer_cma.signal(signal.SIGSTOP)
    pusher.push_layer(1)
    await asyncio.sleep(0.05)
    decode_peer_cma.kill()
    with pytest.raises(LLMException) as caught:
        await pusher.wait()
    assert caught.value.status_code in (LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_NOT_YET_LINK)
    assert caught.value.completed_layers == [0]
    await wait_for(lambda: entry.pins == 0, seconds=5)  # the reader is gone: nothing holds the source


@pytest.mark.parametrize("let_go", ["push_layer", "mark_ready"])
async def test_cancelling_waits_until_the_decode_copied_or_the_link_is_closed(make_engine: EngineFactory,
                                                                             decode_peer_cma: Peer,
                                                                             let_go: str) -> None:
    """Cancelling lets CancelledError out only once no byte can land any more: here the decode is stopped,
    so the drain gives up after the layer's timeout and closes the link. The same whether the layer was pushed
    from the loop or marked ready from another thread (then ``wait()`` adopts it, with the marked layers' one
    task)."""
    engine, src = await leased(make_engine, decode_peer_cma, llm__SyncKvCacheWaitTime="300")
    pusher = engine.cache_manager.layer_pusher(KEY, src, [2], [2])
    decode_peer_cma.signal(signal.SIGSTOP)
    try:
        if let_go == "push_layer":
            pusher.push_layer(0)
        else:
            await asyncio.to_thread(pusher.mark_ready, 0)
        waiting = asyncio.create_task(pusher.wait())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert 2 not in engine.links or not engine.links[2].ready  # not drained in time: closed
    finally:
        decode_peer_cma.signal(signal.SIGCONT)


async def test_layers_marked_ready_time_out_each_from_its_mark_when_the_decode_is_stopped(
        make_engine: EngineFactory, decode_peer_cma: Peer) -> None:
    """Layers let go from another thread (``mark_ready``) are waited for by one task, and each is still bounded
    by its own deadline from its mark: with the decode stopped, none is copied and ``wait()`` raises LLM_TIMEOUT
    with no layer landed; the pusher is done."""
    engine, src = await leased(make_engine, decode_peer_cma, llm__SyncKvCacheWaitTime="300")
    pusher = engine.cache_manager.layer_pusher(KEY, src, [1], [1])
    decode_peer_cma.signal(signal.SIGSTOP)
    try:
        await mark_every_layer(pusher)
        with pytest.raises(LLMException) as caught:
            await pusher.wait()
        assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert caught.value.completed_layers == [] and pusher.landed == []
        with pytest.raises(LLMException) as done:
            pusher.push_layer(0)
        assert done.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    finally:
        decode_peer_cma.signal(signal.SIGCONT)


async def test_a_graceful_unlink_waits_for_the_decode_to_copy_what_it_was_offered(make_engine: EngineFactory,
                                                                                 decode_peer_cma: Peer,
                                                                                 tmp_path: Any) -> None:
    engine, src = await leased(make_engine, decode_peer_cma)
    entry = engine.registry.get(src.cache_id)
    assert entry is not None
    before = await decode_peer_cma.asnapshot("kv", tmp_path)
    pusher = engine.cache_manager.layer_pusher(KEY, src, [4], [9])
    decode_peer_cma.signal(signal.SIGSTOP)
    try:
        pusher.push_layer(0)
        unlinking = asyncio.create_task(engine.unlink_clusters([cluster(2, decode_peer_cma.port)]))
        await asyncio.sleep(0.2)
        assert not unlinking.done()  # the offered layer is not copied yet
    finally:
        decode_peer_cma.signal(signal.SIGCONT)
    status, _ = await unlinking
    assert status == LLMStatusCode.LLM_SUCCESS
    await pusher.wait()  # landed before the link went
    assert entry.pins == 0
    layer = range(0, 1)
    after = await decode_peer_cma.asnapshot("kv", tmp_path)
    assert np.array_equal(after, expected_after(before, raw(src), [4], [9], 2, layer, layer))


async def test_a_cache_open_per_request_is_read_into_by_the_decode_within_its_grants(make_engine: EngineFactory,
                                                                                    tmp_path: Any) -> None:
    """vLLM's decode registers its KV ``GRANTED`` and allows each prefill the blocks of each request. Such a
    cache is never leased, yet the decode still copies the layers itself (its refusal of the lease says it
    reads), each offer checked against the grant: the allowed blocks land exactly, and a request reaching one
    block beyond them fails with LLM_FEATURE_NOT_ENABLED, nothing of it written."""
    with Peer(2, options=peer_options("cma")) as decode:
        engine, src = await granted(make_engine, decode, [5, 6, 7, 40])
        before = await decode.asnapshot("kv", tmp_path)
        offers = engine.link_stats()[2].get("read_offers", 0)
        src_blocks, dst_blocks = [9, 1, 2], [5, 6, 7]
        async with engine.cache_manager.layer_pusher(KEY, src, src_blocks, dst_blocks) as pusher:
            for layer in range(LAYERS):
                pusher.push_layer(layer)
        assert np.array_equal(await decode.asnapshot("kv", tmp_path),
                              expected_after(before, raw(src), src_blocks, dst_blocks, 2))
        assert engine.link_stats()[2]["read_offers"] == offers + LAYERS  # the decode copied every layer
        assert (await decode.acall("stats"))["stats"]["1"]["read_offers_copied"] == LAYERS
        with pytest.raises(LLMException) as caught:
            async with engine.cache_manager.layer_pusher(KEY, src, [3, 4], [7, 8]) as refused:
                for layer in range(LAYERS):
                    refused.push_layer(layer)
        assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        assert caught.value.completed_layers == []
        assert np.array_equal(await decode.asnapshot("kv", tmp_path),
                              expected_after(before, raw(src), src_blocks, dst_blocks, 2))  # block 7 unchanged


async def test_layers_marked_ready_from_another_thread_are_copied_and_the_rest_withdrawn(make_engine: EngineFactory,
                                                                                        decode_peer_cma: Peer,
                                                                                        tmp_path: Any) -> None:
    """Every offer goes when the pusher is made, gated by a mark in the prefill's memory; the caller's own
    thread lets a layer go by marking it (no event-loop turn), and ``wait()`` waits for the marked layers.
    Layers never marked are withdrawn: the decode answers them without copying, and only then lets the
    prefill's source go."""
    engine, src = await leased(make_engine, decode_peer_cma)
    before = await decode_peer_cma.asnapshot("kv", tmp_path)
    offers = engine.link_stats()[2].get("read_offers", 0)
    src_blocks, dst_blocks = [11, 12, 30], [3, 4, 5]
    pusher = engine.cache_manager.layer_pusher(KEY, src, src_blocks, dst_blocks)
    assert pusher.gated and engine.link_stats()[2]["read_offers"] == offers + LAYERS  # all offered at once
    with pytest.raises(LLMException) as outside:
        pusher.mark_ready(LAYERS)
    assert outside.value.status_code == LLMStatusCode.LLM_PARAM_INVALID

    await mark_every_layer(pusher)  # the caller's computation, on a thread of its own
    await pusher.wait()
    assert sorted(pusher.landed) == list(range(LAYERS))
    assert np.array_equal(await decode_peer_cma.asnapshot("kv", tmp_path),
                          expected_after(before, raw(src), src_blocks, dst_blocks, 2))
    stopped = engine.cache_manager.layer_pusher(KEY, src, [0], [60])
    await asyncio.to_thread(stopped.mark_ready, 2)
    await stopped.wait()
    assert stopped.landed == [2]
    decode_stats = (await decode_peer_cma.acall("stats"))["stats"]["1"]
    assert decode_stats["read_offers_withdrawn"] == LAYERS - 1
    entry = engine.registry.get(src.cache_id)
    assert entry is not None
    await wait_for(lambda: entry.pins == 0)  # every answer came: nothing of the source is lent any more
    layer = range(2, 3)
    assert np.array_equal(await decode_peer_cma.asnapshot("kv", tmp_path), expected_after(
        expected_after(before, raw(src), src_blocks, dst_blocks, 2), raw(src), [0], [60], 2, layer, layer))


async def test_a_layer_marked_after_its_blocks_grant_ended_is_refused_and_nothing_written(make_engine: EngineFactory,
                                                                                          tmp_path: Any) -> None:
    """A gated offer waits in the decode for the prefill's mark; if the decode ends the grant of its blocks
    meanwhile (vLLM's decode aborted the request, and its blocks may go to another one), the layers marked
    afterwards are refused with LLM_FEATURE_NOT_ENABLED and not one byte is copied into those blocks."""
    with Peer(2, options=peer_options("cma")) as decode:
        engine, src = await granted(make_engine, decode, [5, 6, 40])
        before = await decode.asnapshot("kv", tmp_path)
        pins = (await decode.acall("pins", name="kv"))["pins"]
        pusher = engine.cache_manager.layer_pusher(KEY, src, [9, 1], [5, 6])
        assert pusher.gated
        for _ in range(250):  # bounded: every offer arrived, was checked against the grant and pinned
            if (await decode.acall("pins", name="kv"))["pins"] == pins + LAYERS:
                break
            await asyncio.sleep(0.02)
        assert (await decode.acall("pins", name="kv"))["pins"] == pins + LAYERS
        await decode.acall("revoke")

        await mark_every_layer(pusher)
        with pytest.raises(LLMException) as caught:
            await pusher.wait()
        assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        assert caught.value.completed_layers == [] and pusher.landed == []
        stats = (await decode.acall("stats"))["stats"]["1"]
        assert stats["read_offers_refused_late"] == LAYERS and stats.get("read_offers_withdrawn", 0) == 0
        assert (await decode.acall("pins", name="kv"))["pins"] == pins  # the offers let the cache go
        assert np.array_equal(await decode.asnapshot("kv", tmp_path), before)  # blocks 5 and 6 untouched
