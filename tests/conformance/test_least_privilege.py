"""Least privilege, for every transport: a ``GRANTED`` cache takes writes only into the blocks granted to
the writing peer, while the grant lasts; a ``PRIVATE`` cache is neither listed to peers nor reachable.
The writers are other OS processes (a kvpush engine, and a client speaking the wire by hand), so the
receiver's own checks are what is tested; every block that must not change is compared."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest
from kvtest import DST_BLOCKS, PATIENT, ROW, SRC_BLOCKS, TENSORS, EngineFactory, desc, fill, peer_options, raw
from peer import Peer, pattern
from wire import RawPeer, write_frame

from kvpush import BlocksCacheKey, LLMStatusCode, RemoteAccess
from kvpush.layout import pack_runs
from kvpush.protocol import Kind, encode_json, encode_transfer

REFUSED = int(LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
BLOCK_BYTES = ROW * 2


def _src_block(seed: int, tensor: int, block: int) -> np.ndarray[Any, Any]:
    """Block ``block`` of tensor ``tensor`` of a peer cache filled with ``seed`` (see peer.fill)."""
    whole = pattern(seed, tensor, SRC_BLOCKS * BLOCK_BYTES)
    return whole[block * BLOCK_BYTES:(block + 1) * BLOCK_BYTES]


async def test_a_peer_writes_only_blocks_granted_to_it_while_the_grant_lasts(
        transport: str, make_engine: EngineFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    decode = await make_engine(2, listen=True, kvpush__transport=transport,
                               kvpush__keepalive_timeout_ms=PATIENT["kvpush.keepalive_timeout_ms"])
    kv = decode.cache_manager.allocate_blocks_cache(desc(DST_BLOCKS), BlocksCacheKey(2, 0),
                                                    remote_access=RemoteAccess.GRANTED)
    assert decode.listen_address is not None
    port = decode.listen_address[1]
    with Peer(1, options=peer_options(transport)) as writer, Peer(7, options=peer_options(transport)) as other:
        for peer in (writer, other):
            await peer.acall("allocate", name="src", num_tensors=TENSORS, shape=[SRC_BLOCKS, ROW], model_id=0, seed=11)
            assert (await peer.acall("link", cluster_id=2, port=port))["status"] == 0

        async def push(peer: Peer, src: list[int], dst: list[int]) -> int:
            answer = await peer.acall("try_push", name="src", cluster_id=2, src_blocks=src, dst_blocks=dst)
            return int(answer["status"])

        assert await push(writer, [0, 1, 2], [3, 4, 9]) == REFUSED  # nothing granted yet
        assert not raw(kv).any()
        grant = decode.cache_manager.allow(kv, 1, [3, 4, 9])
        assert await push(writer, [0, 1, 2], [3, 4, 9]) == 0
        after = raw(kv)
        for src_block, dst_block in ((0, 3), (1, 4), (2, 9)):
            for tensor in range(TENSORS):
                assert np.array_equal(after[tensor, dst_block], _src_block(11, tensor, src_block))
        written = after.copy()
        await writer.acall("fill", name="src", seed=12)
        assert await push(writer, [5], [10]) == REFUSED  # a block never granted
        assert await push(writer, [5, 6], [3, 10]) == REFUSED  # partly granted: refused whole, no byte of it lands
        assert await push(other, [0], [3]) == REFUSED  # granted to cluster 1, not to cluster 7
        assert np.array_equal(raw(kv), written)
        pulled = await other.acall("try_pull", name="src", cluster_id=2, src_blocks=[3], dst_blocks=[0])
        assert pulled["status"] == REFUSED  # writing was granted, and to cluster 1; reading to nobody
        grant.revoke()
        assert await push(writer, [0], [3]) == REFUSED
        assert np.array_equal(raw(kv), written)
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert any("not all granted to cluster 1" in text for text in refusals), refusals
        assert any("not all granted to cluster 7" in text for text in refusals), refusals


async def test_a_grant_ends_with_the_link_it_was_made_for(transport: str, make_engine: EngineFactory) -> None:
    decode = await make_engine(2, listen=True, kvpush__transport=transport,
                               kvpush__keepalive_timeout_ms=PATIENT["kvpush.keepalive_timeout_ms"])
    kv = decode.cache_manager.allocate_blocks_cache(desc(DST_BLOCKS), BlocksCacheKey(2, 0),
                                                    remote_access=RemoteAccess.GRANTED)
    assert decode.listen_address is not None
    with Peer(1, options=peer_options(transport)) as writer:
        await writer.acall("allocate", name="src", num_tensors=TENSORS, shape=[SRC_BLOCKS, ROW], model_id=0, seed=11)
        assert (await writer.acall("link", cluster_id=2, port=decode.listen_address[1]))["status"] == 0
        grant = decode.cache_manager.allow(kv, 1, [5, 6])
        assert (await writer.acall("try_push", name="src", cluster_id=2, src_blocks=[0], dst_blocks=[5]))["status"] == 0
        written = raw(kv).copy()
    # the writer's process is gone (a restart): a new instance with its cluster id inherits nothing
    with Peer(1, options=peer_options(transport)) as restarted:
        await restarted.acall("allocate", name="src", num_tensors=TENSORS, shape=[SRC_BLOCKS, ROW], model_id=0, seed=13)
        assert (await restarted.acall("link", cluster_id=2, port=decode.listen_address[1]))["status"] == 0
        assert not grant.active
        pushed = await restarted.acall("try_push", name="src", cluster_id=2, src_blocks=[0], dst_blocks=[6])
        assert pushed["status"] == REFUSED
        assert np.array_equal(raw(kv), written)
    grant.revoke()  # ended already: nothing to do, never an error


async def test_a_private_cache_is_neither_listed_nor_reachable_even_by_guessing(
        transport: str, make_engine: EngineFactory) -> None:
    prefill = await make_engine(1, listen=True, kvpush__transport=transport,
                                kvpush__keepalive_timeout_ms=PATIENT["kvpush.keepalive_timeout_ms"])
    kv = prefill.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0),
                                                     remote_access=RemoteAccess.PRIVATE)
    fill(kv, seed=21)
    kept = raw(kv).copy()
    assert prefill.listen_address is not None
    port = prefill.listen_address[1]
    with Peer(2, options=peer_options(transport)) as decode:
        await decode.acall("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0)
        assert (await decode.acall("link", cluster_id=1, port=port))["status"] == 0
        not_exist = int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        pulled = await decode.acall("try_pull", name="kv", cluster_id=1, src_blocks=[0, 1], dst_blocks=[0, 1])
        assert pulled["status"] == not_exist
        pushed = await decode.acall("try_push", name="kv", cluster_id=1, src_blocks=[0], dst_blocks=[0])
        assert pushed["status"] == not_exist
    assert np.array_equal(raw(kv), kept)


async def test_a_stranger_guessing_cache_ids_gets_nothing_of_a_private_cache(make_engine: EngineFactory) -> None:
    prefill = await make_engine(1, listen=True)
    kv = prefill.cache_manager.allocate_blocks_cache(desc(SRC_BLOCKS), BlocksCacheKey(1, 0),
                                                     remote_access=RemoteAccess.PRIVATE)
    fill(kv, seed=21)
    kept = raw(kv).copy()
    assert prefill.listen_address is not None
    await asyncio.to_thread(_guess_into_private_caches, prefill.listen_address[1], kv.cache_id)
    assert np.array_equal(raw(kv), kept)


def _guess_into_private_caches(port: int, private_id: int) -> None:
    """A stranger speaking the wire by hand (its own thread: it blocks): reads and writes by guessed cache
    ids, and asks for a lease on the private cache, are all refused."""
    not_exist = int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    stranger = RawPeer(port, cluster_id=66)
    try:
        table = stranger.handshake()
        assert table["caches"] == []  # not listed
        runs = pack_runs(np.array([0], np.uint64), np.array([BLOCK_BYTES], np.uint64))
        for request_id, cache_id in enumerate(range(1, 4), start=1):
            stranger.send(encode_transfer(Kind.READ, request_id, cache_id, 0, 1, runs, 0, 0))
            assert stranger.read() == (Kind.READ_DATA, not_exist)
            stranger.send(write_frame(cache_id, 0, 1, [0], [BLOCK_BYTES], request_id=100 + request_id))
            assert stranger.read() == (Kind.DONE, not_exist)
        stranger.send(encode_json(Kind.LEASE, 0, {"op": "request", "cache": private_id, "proof": "guess"}))
        assert stranger.read_until(Kind.LEASE)["op"] == "refuse"
    finally:
        stranger.close()


def test_grants_are_checked_on_the_wire_by_a_hand_made_writer(tmp_path: Any) -> None:
    """A writer that skips its own engine's checks: frames straight on the socket, into blocks granted to
    another cluster id and next to the granted ones, are refused; the granted one lands."""
    with Peer(2, options=peer_options("tcp")) as decode:
        decode.call("allocate", name="kv", num_tensors=TENSORS, shape=[DST_BLOCKS, ROW], model_id=0, access="granted")
        decode.call("allow", name="kv", peer=66, blocks=[2])
        decode.call("allow", name="kv", peer=67, blocks=[3])
        raw_peer = RawPeer(decode.port, cluster_id=66)
        try:
            table = raw_peer.handshake()
            [entry] = table["caches"]
            assert "rkeys" not in entry  # no one-sided key opens a granted cache
            cache_id = entry["id"]
            for request_id, block in enumerate((3, 1, 4), start=1):  # another peer's, and both neighbours
                raw_peer.send(write_frame(cache_id, 0, TENSORS, [block * BLOCK_BYTES], [BLOCK_BYTES],
                                          request_id=request_id))
                assert raw_peer.read() == (Kind.DONE, REFUSED)
            raw_peer.send(write_frame(cache_id, 0, TENSORS, [2 * BLOCK_BYTES + 100], [BLOCK_BYTES],
                                      request_id=9))  # straddles into block 3
            assert raw_peer.read() == (Kind.DONE, REFUSED)
            raw_peer.send(write_frame(cache_id, 0, TENSORS, [2 * BLOCK_BYTES], [BLOCK_BYTES], request_id=10))
            assert raw_peer.read() == (Kind.DONE, 0)
        finally:
            raw_peer.close()
        after = decode.snapshot("kv", tmp_path).reshape(TENSORS, DST_BLOCKS, BLOCK_BYTES)
        assert (after[:, 2] == 0xAB).all()
        assert not np.delete(after, 2, axis=1).any()
