"""A peer that speaks the wire by hand: malformed, truncated and out-of-bounds frames close that
link (or are refused) with a logged reason, never crash the engine, and never write outside the
registered memory (checked with guard regions around it)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import numpy as np
import pytest
from kvtest import EngineFactory, link
from wire import RawPeer, write_frame

from kvpush import BlocksCacheKey, CacheDesc, DataType, LLMDataDist
from kvpush.layout import pack_runs
from kvpush.protocol import (
    Kind,
    encode_header,
    encode_json,
    encode_transfer,
)

BLOCK = 256
GUARD = 4096


@pytest.fixture
async def guarded(make_engine: EngineFactory) -> tuple[LLMDataDist, np.ndarray[Any, Any], int]:
    """An engine whose only cache (2 tensors x 4 blocks x 256 B) sits between guard regions."""
    engine = await make_engine(2, listen=True)
    arena = np.zeros(GUARD + 2 * 4 * BLOCK + GUARD, np.uint8)
    tensors = [arena[GUARD + i * 4 * BLOCK: GUARD + (i + 1) * 4 * BLOCK] for i in range(2)]
    cache = engine.cache_manager.register_blocks_cache(CacheDesc(2, (4, BLOCK), DataType.DT_UINT8), tensors,
                                                       BlocksCacheKey(2, 0))
    return engine, arena, cache.cache_id


def untouched(arena: np.ndarray[Any, Any]) -> bool:
    return not arena.any()


@pytest.mark.parametrize("junk", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64,
    encode_header(Kind.WRITE, 1, 0, 0),                               # transfer before the handshake
    encode_json(Kind.TABLE, 0, {"caches": []}),                         # table before the handshake
    encode_header(Kind.HELLO, 0, 1 << 30, 0),                           # oversized meta
    encode_header(Kind.HELLO, 0, 10, 0) + b"not json!!",               # malformed handshake
    encode_header(Kind.HELLO, 0, 54, 0)
    + b'{"version":1,"cluster_id":Infinity,"nonce":"00","a":1}',        # non-finite number
])
async def test_garbage_before_handshake_closes_only_that_connection(
        guarded: tuple[LLMDataDist, np.ndarray[Any, Any], int], make_engine: EngineFactory,
        caplog: pytest.LogCaptureFixture, junk: bytes) -> None:
    engine, arena, _ = guarded
    caplog.set_level(logging.WARNING)

    def attack() -> bool:
        peer = RawPeer(engine.listen_address[1])
        peer.send(junk)
        closed = peer.closed_by_peer()
        peer.close()
        return closed

    assert await asyncio.to_thread(attack)
    assert untouched(arena) and engine.links == {}
    assert any("protocol" in r.message or "refused" in r.message or "handshake" in r.message
               for r in caplog.records)
    friend = await make_engine(1)
    await link(friend, 2, engine.listen_address[1])  # still serving


async def test_out_of_bounds_writes_are_refused_and_write_nothing(
        guarded: tuple[LLMDataDist, np.ndarray[Any, Any], int]) -> None:
    engine, arena, cache_id = guarded

    def attack() -> list[int]:
        peer = RawPeer(engine.listen_address[1])
        table = peer.handshake()
        assert [c["id"] for c in table["caches"]] == [cache_id]
        assert "addr" not in json.dumps(table)  # no address ever crosses the wire
        codes = []
        frames = [
            write_frame(cache_id, 0, 1, [3 * BLOCK], [2 * BLOCK], 1),          # past the end of the tensor
            write_frame(cache_id, 1, 2, [0], [BLOCK], 2),                      # tensor 2 does not exist
            write_frame(cache_id + 7, 0, 1, [0], [BLOCK], 3),                  # unknown cache
            write_frame(cache_id, 0, 1, [2**64 - 16], [32], 4),                # offset + length overflows
            write_frame(cache_id, 0, 1, [0], [0], 5, payload=b""),             # zero-length run
        ]
        for frame in frames:
            peer.send(frame)
            codes.append(peer.read_until(Kind.DONE))
        # the link is still good: an in-bounds write lands
        peer.send(write_frame(cache_id, 1, 1, [BLOCK], [BLOCK], 6))
        codes.append(peer.read_until(Kind.DONE))
        peer.close()
        return codes

    codes = await asyncio.to_thread(attack)
    assert codes == [0x5010B005, 0x5010B005, 0x5010B002, 0x5010B005, 0x5010B005, 0]
    inside = arena[GUARD + 4 * BLOCK + BLOCK: GUARD + 4 * BLOCK + 2 * BLOCK]
    assert (inside == 0xAB).all()
    inside[:] = 0
    assert untouched(arena)


@pytest.mark.parametrize("frame", [
    write_frame(1, 0, 1, [0], [BLOCK], payload=b"\xAB" * (BLOCK + 8)),    # payload_len != runs
    encode_header(Kind.WRITE, 1, 7, 0) + b"\x00" * 7,                    # truncated transfer meta
    encode_header(Kind.DONE, 1, 2, 0) + b"\x00\x00",                      # truncated status meta
    encode_header(Kind.HELLO, 0, 2, 0) + b"{}",                            # a second handshake
    b"\x4b\x50" + b"\xff" * 22,                                          # bad magic on a ready link
    encode_transfer(Kind.WRITE_NOTICE, 1, 1, 0, 1, pack_runs(np.array([0], np.uint64),
                                                             np.array([BLOCK], np.uint64)), 0),  # no lease held
])
async def test_malformed_frames_on_a_ready_link_close_it(
        guarded: tuple[LLMDataDist, np.ndarray[Any, Any], int], make_engine: EngineFactory,
        frame: bytes) -> None:
    engine, arena, _ = guarded

    def attack() -> bool:
        peer = RawPeer(engine.listen_address[1])
        peer.handshake()
        peer.send(frame)
        closed = peer.closed_by_peer()
        peer.close()
        return closed

    assert await asyncio.to_thread(attack)
    assert untouched(arena)
    friend = await make_engine(1)
    await link(friend, 2, engine.listen_address[1])


async def test_truncated_payload_then_disconnect(guarded: tuple[LLMDataDist, np.ndarray[Any, Any], int],
                                                 make_engine: EngineFactory) -> None:
    engine, arena, cache_id = guarded

    def attack() -> None:
        peer = RawPeer(engine.listen_address[1])
        peer.handshake()
        peer.send(write_frame(cache_id, 0, 1, [0], [BLOCK])[:-100])  # the frame never completes
        peer.close()

    await asyncio.to_thread(attack)
    for _ in range(100):
        if 66 not in engine.links:
            break
        await asyncio.sleep(0.02)
    assert 66 not in engine.links
    assert not arena[:GUARD].any() and not arena[-GUARD:].any()
    friend = await make_engine(1)
    await link(friend, 2, engine.listen_address[1])
