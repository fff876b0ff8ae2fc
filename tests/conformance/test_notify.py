"""SPEC 10 on every transport: completion notifications that arrive only after the transfer's bytes
landed, ordered small messages, bounded sizes and queues, and waiters that never hang."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from kvtest import DST_BLOCKS, SRC_BLOCKS, EngineFactory, cluster, desc, fill, link, raw

from kvpush import MAX_MESSAGE_BYTES, BlocksCacheKey, Cache, LLMDataDist, LLMException, LLMRole, LLMStatusCode


async def pair(make_engine: EngineFactory, transport: str,
               caches: bool = False) -> tuple[LLMDataDist, LLMDataDist]:
    decode = await make_engine(2, listen=True, role=LLMRole.DECODER, kvpush__transport=transport)
    prefill = await make_engine(1, kvpush__transport=transport)
    if caches:  # registered before the link, so the peer's table has them from the start
        decode.cache_manager.allocate_blocks_cache(desc(DST_BLOCKS), BlocksCacheKey(2, 0))
        fill(prefill.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0)), seed=4)
    assert decode.listen_address is not None
    await link(prefill, 2, decode.listen_address[1])
    assert prefill.links[2].transport == transport
    return prefill, decode


def cache_of(engine: LLMDataDist) -> Cache:
    entry = engine.registry.get(1)
    assert entry is not None
    return entry.cache


async def test_a_pushs_notification_arrives_after_its_bytes_landed(transport: str, make_engine: EngineFactory) -> None:
    prefill, decode = await pair(make_engine, transport, caches=True)
    dst, src = cache_of(decode), cache_of(prefill)
    landed_when_notified: list[bool] = []

    async def receive() -> bytes:
        delivery = await decode.notifications.get(peer=1)
        landed_when_notified.append(bool(np.array_equal(raw(dst)[:, [7, 8, 30]], raw(src)[:, [0, 1, 2]])))
        return delivery.data

    receiving = asyncio.create_task(receive())
    await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0, 1, 2], [7, 8, 30], notify=b"req-1")
    assert await asyncio.wait_for(receiving, 5) == b"req-1" and landed_when_notified == [True]
    assert decode.messages.get_nowait() is None  # notifications and messages are separate inboxes


async def test_the_receiver_has_counted_a_pushs_bytes_when_its_notification_arrives(
        transport: str, make_engine: EngineFactory) -> None:
    """Also under a standing grant (the same-host and UCX paths get one after the first writes), where
    the receiver learns of a write from its notice: the notice is ahead of the notification."""
    prefill, decode = await pair(make_engine, transport, caches=True)
    src = cache_of(prefill)
    for round_ in range(8):
        await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0, 1], [5 + round_, 20 + round_],
                                                notify=b"n%d" % round_)
        delivery = await asyncio.wait_for(decode.notifications.get(peer=1), 5)
        assert delivery.data == b"n%d" % round_
        assert decode.link_stats()[1].get("bytes_received", 0) == prefill.link_stats()[2]["bytes_pushed"]


async def test_a_layer_pushers_notification_follows_its_last_layer(transport: str, make_engine: EngineFactory) -> None:
    prefill, decode = await pair(make_engine, transport, caches=True)
    dst, src = cache_of(decode), cache_of(prefill)
    async with prefill.cache_manager.layer_pusher(BlocksCacheKey(2, 0), src, [3, 4], [10, 11],
                                                  notify=b"done") as pusher:
        for layer in range(pusher.num_layers):
            pusher.push_layer(layer)
            assert decode.notifications.get_nowait() is None  # nothing before the last layer landed
    delivery = await asyncio.wait_for(decode.notifications.get(), 5)
    assert (delivery.peer_cluster_id, delivery.data) == (1, b"done")
    assert np.array_equal(raw(dst)[:, [10, 11]], raw(src)[:, [3, 4]])


async def test_a_failed_push_sends_no_notification(transport: str, make_engine: EngineFactory) -> None:
    prefill, decode = await pair(make_engine, transport, caches=True)
    src = cache_of(prefill)
    with pytest.raises(LLMException):
        await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0], [DST_BLOCKS], notify=b"x")
    await prefill.send_message(2, b"after")  # a round trip: anything sent before has arrived
    assert decode.notifications.get_nowait() is None


async def test_messages_arrive_in_order_both_ways_and_sizes_are_bounded(transport: str,
                                                                        make_engine: EngineFactory) -> None:
    prefill, decode = await pair(make_engine, transport)
    for index in range(20):
        await prefill.send_message(2, f"m{index}".encode())
    got = [(await decode.messages.get(peer=1)).data for _ in range(20)]
    assert got == [f"m{index}".encode() for index in range(20)]
    await decode.send_message(1, b"x" * MAX_MESSAGE_BYTES)  # the limit itself is fine, either direction
    assert (await prefill.messages.get()).data == b"x" * MAX_MESSAGE_BYTES
    with pytest.raises(LLMException) as caught:
        await prefill.send_message(2, b"x" * (MAX_MESSAGE_BYTES + 1))
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as caught:
        await prefill.send_message(3, b"nobody")
    assert caught.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK


async def test_a_full_inbox_is_an_error_the_sender_sees(transport: str, make_engine: EngineFactory) -> None:
    prefill, decode = await pair(make_engine, transport)
    decode.messages._depth = 3  # noqa: SLF001 - a small bound to reach quickly
    for index in range(3):
        await prefill.send_message(2, bytes([index]))
    with pytest.raises(LLMException) as caught:
        await prefill.send_message(2, b"one too many")
    assert caught.value.status_code == LLMStatusCode.LLM_LINK_BUSY
    assert [decode.messages.get_nowait().data for _ in range(3)] == [b"\0", b"\1", b"\2"]  # type: ignore[union-attr]


async def test_waiters_end_when_the_link_closes_or_the_engine_finalizes(transport: str,
                                                                        make_engine: EngineFactory) -> None:
    prefill, decode = await pair(make_engine, transport)
    waiting = asyncio.create_task(decode.notifications.get(peer=1))
    anyone = asyncio.create_task(decode.messages.get())
    await asyncio.sleep(0.05)
    assert decode.listen_address is not None
    status, _ = await prefill.unlink_clusters([cluster(2, decode.listen_address[1])])
    assert status == LLMStatusCode.LLM_SUCCESS
    with pytest.raises(LLMException) as caught:
        await asyncio.wait_for(waiting, 5)
    assert caught.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    await decode.finalize()
    with pytest.raises(LLMException):
        await asyncio.wait_for(anyone, 5)


async def test_a_message_that_came_over_a_link_closed_since_is_told_apart_by_its_epoch(
        transport: str, make_engine: EngineFactory) -> None:
    prefill, decode = await pair(make_engine, transport)
    assert decode.listen_address is not None
    port = decode.listen_address[1]
    await prefill.send_message(2, b"over the first link")
    assert decode.links_lost(1) == 0
    status, _ = await prefill.unlink_clusters([cluster(2, port)])
    assert status == LLMStatusCode.LLM_SUCCESS
    for _ in range(250):  # bounded: the decode notices the close
        if 1 not in decode.links:
            break
        await asyncio.sleep(0.02)
    assert 1 not in decode.links and decode.links_lost(1) == 1
    await link(prefill, 2, port)
    await prefill.send_message(2, b"over the second link")
    old, new = decode.messages.get_nowait(), await asyncio.wait_for(decode.messages.get(peer=1), 5)
    assert old is not None and (old.data, old.epoch) == (b"over the first link", 0)  # still readable, but stale
    assert (new.data, new.epoch) == (b"over the second link", 1) and new.epoch == decode.links_lost(1)
