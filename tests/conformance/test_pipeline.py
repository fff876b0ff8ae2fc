"""The layer pusher (SPEC §7) on every transport: layers in any order, several requests at once on
one link, per-layer timeouts, and the errors of a misused pusher. Every destination byte is checked."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import numpy as np
import pytest
from kvtest import DST_BLOCKS, TENSORS, EngineFactory, expected_after, prefill, push_interleaved, raw
from peer import Peer

from kvpush import BlocksCacheKey, LLMException, LLMStatusCode

KEY = BlocksCacheKey(2, 0)


async def test_layers_in_any_order_land_exactly(transport: str, make_engine: EngineFactory, decode_peer: Peer,
                                               tmp_path: Any) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport)
    before = await decode_peer.asnapshot("kv", tmp_path)
    src_blocks, dst_blocks = [3, 4, 5, 0, 9], [10, 11, 12, 40, 2]
    async with engine.cache_manager.layer_pusher(KEY, src, src_blocks, dst_blocks) as pusher:
        assert pusher.num_layers == TENSORS // 2
        for layer in (2, 0, 3, 1):
            pusher.push_layer(layer)
            await asyncio.sleep(0)  # the "compute" of the next layer
    assert sorted(pusher.landed) == [0, 1, 2, 3]
    after = await decode_peer.asnapshot("kv", tmp_path)
    assert np.array_equal(after, expected_after(before, raw(src), src_blocks, dst_blocks, 2))


async def test_several_requests_on_one_link_at_once(transport: str, make_engine: EngineFactory, decode_peer: Peer,
                                                    tmp_path: Any) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport)
    before = await decode_peer.asnapshot("kv", tmp_path)
    requests = [([0, 1], [0, 1]), ([2, 3, 4], [20, 30, 40]), ([5], [63])]
    expected = await push_interleaved(engine, src, requests, TENSORS // 2, before)
    assert np.array_equal(await decode_peer.asnapshot("kv", tmp_path), expected)


async def test_a_layer_that_times_out_fails_alone(transport: str, make_engine: EngineFactory,
                                                  decode_peer: Peer) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport, llm__SyncKvCacheWaitTime="300")
    pusher = engine.cache_manager.layer_pusher(KEY, src, [1], [1])
    await pusher.push_layer(0)  # lands
    await engine.links[2].refresh_table()  # a round trip on the ordered link: earlier replies (grants) are in
    decode_peer.signal(signal.SIGSTOP)
    try:
        pusher.push_layer(1)
        if transport == "cma":
            # granted when the pusher was made: a one-sided copy needs nothing from a stopped peer
            await pusher.wait()
            assert sorted(pusher.landed) == [0, 1]
            return
        with pytest.raises(LLMException) as caught:
            await pusher.wait()
    finally:
        decode_peer.signal(signal.SIGCONT)
    assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert caught.value.completed_layers == [0]
    with pytest.raises(LLMException) as caught:
        pusher.push_layer(2)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


async def test_a_pusher_made_while_the_peer_is_stopped_times_out(transport: str, make_engine: EngineFactory,
                                                                 decode_peer: Peer, tmp_path: Any) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport, llm__SyncKvCacheWaitTime="300")
    before = await decode_peer.asnapshot("kv", tmp_path)
    decode_peer.signal(signal.SIGSTOP)
    try:
        pusher = engine.cache_manager.layer_pusher(KEY, src, [1], [1])
        pusher.push_layer(3)
        with pytest.raises(LLMException) as caught:
            await pusher.wait()
    finally:
        decode_peer.signal(signal.SIGCONT)
    assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT and caught.value.completed_layers == []
    await engine.cache_manager.push_blocks(KEY, src, [0], [0])  # the link goes on; the layers never pushed
    after = await decode_peer.asnapshot("kv", tmp_path)     # (0, 1, 2) never moved a byte
    assert np.array_equal(after[:6, 1], before[:6, 1])


async def test_misuse_is_refused_without_moving_bytes(transport: str, make_engine: EngineFactory,
                                                      decode_peer: Peer, tmp_path: Any) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport)
    before = await decode_peer.asnapshot("kv", tmp_path)
    pusher = engine.cache_manager.layer_pusher(KEY, src, [0], [5])
    for bad, error in ((4, LLMException), (-1, ValueError), ("1", TypeError)):
        with pytest.raises(error):
            pusher.push_layer(bad)  # type: ignore[arg-type]
    assert np.array_equal(await decode_peer.asnapshot("kv", tmp_path), before)
    await pusher.push_layer(0)
    with pytest.raises(LLMException) as caught:
        pusher.push_layer(0)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    await pusher.wait()
    with pytest.raises(LLMException) as caught:
        pusher.push_layer(1)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "finished" in str(caught.value)
    with pytest.raises(LLMException) as caught:
        engine.cache_manager.layer_pusher(KEY, src, [0], [DST_BLOCKS])
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as caught:
        engine.cache_manager.layer_pusher(BlocksCacheKey(2, 7), src, [0], [1])
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


async def test_an_error_in_the_body_stops_the_pusher(transport: str, make_engine: EngineFactory,
                                                     decode_peer: Peer) -> None:
    engine, src = await prefill(make_engine, decode_peer, transport)
    with pytest.raises(ZeroDivisionError):
        async with engine.cache_manager.layer_pusher(KEY, src, [0], [1]) as pusher:
            pusher.push_layer(0)
            raise ZeroDivisionError  # the model's forward pass failed
    await engine.cache_manager.push_blocks(KEY, src, [2], [3])  # the link is fine
