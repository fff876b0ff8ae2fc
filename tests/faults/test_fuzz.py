"""Fuzzing the wire (hypothesis): the pure decoders, and a live engine fed malformed, truncated,
oversized and adversarial frames after a real handshake. The engine never crashes, never writes or
reads outside registered memory (guard regions around it stay zero), and keeps serving other links.
CI runs a bounded number of examples; ``pytest --long`` runs 10 000 per test."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire import read_frame

from kvpush import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMDataDist, LLMRole
from kvpush.layout import pack_runs
from kvpush.peer import RemoteCache
from kvpush.protocol import (
    HEADER_SIZE,
    MAGIC,
    Kind,
    ProtocolError,
    decode_header,
    decode_json,
    decode_status,
    decode_transfer,
    encode_header,
    encode_json,
    encode_transfer,
)

LONG = 10_000
SHORT = 120
BLOCK, BLOCKS, GUARD = 256, 4, 8192
U64 = st.integers(0, 2**64 - 1)


def examples(long_mode: bool) -> int:
    return LONG if long_mode else SHORT


# -- the pure decoders ----------------------------------------------------------------------------
@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
@settings(max_examples=400, deadline=None)
def test_header_decoder_raises_only_protocol_errors(data: bytes) -> None:
    try:
        decode_header(data)
    except ProtocolError:
        pass


@given(st.sampled_from(list(Kind)), st.binary(max_size=256), U64)
@settings(max_examples=400, deadline=None)
def test_meta_decoders_raise_only_protocol_errors(kind: Kind, meta: bytes, payload_len: int) -> None:
    try:
        header = decode_header(encode_header(kind, 1, len(meta), payload_len if kind in (Kind.WRITE,
                                                                                           Kind.READ_DATA) else 0))
    except ProtocolError:
        return
    for decoder in (decode_transfer, decode_status):
        try:
            decoder(header, meta)
        except ProtocolError:
            pass
    try:
        decode_json(kind, meta)
    except ProtocolError:
        pass


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                   max_size=4), max_leaves=12)


@given(st.dictionaries(st.sampled_from(["id", "model", "blocks", "n", "shape", "dtype", "addrs", "rkeys"]), JSONISH))
@settings(max_examples=400, deadline=None)
def test_cache_table_entries_raise_only_protocol_errors(item: dict[str, Any]) -> None:
    try:
        RemoteCache.from_wire(item)
    except ProtocolError:
        pass


# -- a live engine ----------------------------------------------------------------------------------
class LiveEngine:
    """An engine on its own event-loop thread, with one registered cache between guard regions."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.arena = np.zeros(GUARD + 2 * BLOCKS * BLOCK + GUARD, np.uint8)
        self.engine = self.run(self._start())

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    async def _start(self) -> LLMDataDist:
        engine = LLMDataDist(LLMRole.DECODER, 2)
        await engine.init({"llm.listenIpInfo": "127.0.0.1:0", "kvpush.transport": "tcp"})
        tensors = [self.arena[GUARD + i * BLOCKS * BLOCK: GUARD + (i + 1) * BLOCKS * BLOCK] for i in range(2)]
        self.cache_id = engine.cache_manager.register_blocks_cache(
            CacheDesc(2, (BLOCKS, BLOCK), DataType.DT_UINT8), tensors, BlocksCacheKey(2, 0)).cache_id
        return engine

    @property
    def port(self) -> int:
        address = self.engine.listen_address
        assert address is not None
        return address[1]

    def guards_clean(self) -> bool:
        return not self.arena[:GUARD].any() and not self.arena[-GUARD:].any()

    def close(self) -> None:
        self.run(self.engine.finalize())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveEngine]:
    engine = LiveEngine()
    yield engine
    engine.close()


def handshake(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(encode_json(Kind.HELLO, 0, {"version": 1, "cluster_id": 66, "nonce": os.urandom(32).hex(),
                                             "auth": False}))
    read_frame(sock)
    sock.sendall(encode_json(Kind.AUTH, 0, {"proof": ""}))
    read_frame(sock)  # READY
    read_frame(sock)  # the engine's cache table
    sock.sendall(encode_json(Kind.TABLE, 0, {"version": 0, "caches": []}))
    return sock


def raw_frame(kind: int, request_id: int, meta: bytes, payload_len: int, payload: bytes,
              meta_len: int | None) -> bytes:
    header = (MAGIC.to_bytes(2, "little") + bytes([kind & 0xFF, 0])
              + (len(meta) if meta_len is None else meta_len).to_bytes(4, "little")
              + request_id.to_bytes(8, "little") + payload_len.to_bytes(8, "little"))
    return header + meta + payload


RAW_FRAMES = st.builds(
    raw_frame,
    kind=st.integers(0, 20),
    request_id=st.sampled_from([0, 1, 1, 2, 2**63, 2**64 - 1]),  # duplicates on purpose
    meta=st.binary(max_size=96),
    payload_len=st.sampled_from([0, 0, 1, 100, 4096, 2**40, 2**64 - 1]),
    payload=st.binary(max_size=512),
    meta_len=st.none() | st.sampled_from([0, 3, 2**20, 2**31]),
)


def transfer_frames(cache_id: int) -> st.SearchStrategy[bytes]:
    def build(kind: Kind, cache: int, first: int, count: int, offsets: list[int], lengths: list[int],
              truncate: int) -> bytes:
        runs = pack_runs(np.array(offsets, np.uint64), np.array(lengths, np.uint64))
        total = min(count * sum(lengths), 1 << 16) if kind == Kind.WRITE else 0
        claimed = (count * sum(lengths)) & (2**64 - 1) if kind == Kind.WRITE else 0
        frame = encode_transfer(kind, 7, cache, first, count, runs, claimed) + b"\xCD" * total
        return frame[: len(frame) - truncate] if truncate else frame

    sizes = st.integers(1, 3)
    return sizes.flatmap(lambda n: st.builds(
        build,
        kind=st.sampled_from([Kind.WRITE, Kind.READ, Kind.WRITE_INTENT, Kind.READ_INTENT]),
        cache=st.sampled_from([cache_id, cache_id, 0, cache_id + 1, 2**64 - 1]),
        first=st.sampled_from([0, 1, 2, 2**32 - 1]),
        count=st.sampled_from([1, 2, 3, 2**32 - 1]),
        offsets=st.lists(st.sampled_from([0, BLOCK, 3 * BLOCK, 4 * BLOCK, 2**63, 2**64 - BLOCK]), min_size=n,
                         max_size=n),
        lengths=st.lists(st.sampled_from([1, BLOCK, 2 * BLOCK, 2**63]), min_size=n, max_size=n),
        truncate=st.sampled_from([0, 0, 0, 1, 50]),
    ))


def still_serving(live: LiveEngine) -> None:
    async def check() -> None:
        friend = LLMDataDist(LLMRole.PROMPT, 1)
        await friend.init({"kvpush.transport": "tcp"})
        info = LLMClusterInfo()
        info.remote_cluster_id = 2
        info.append_remote_ip_info("127.0.0.1", live.port)
        status, _ = await friend.link_clusters([info])
        await friend.finalize()
        assert status == 0

    asyncio.run(check())


def send_and_close(port: int, frames: list[bytes]) -> None:
    sock = handshake(port)
    try:
        for frame in frames:
            sock.sendall(frame)
    except OSError:
        pass  # the engine closed the link: that is one of the allowed outcomes
    finally:
        sock.close()


def test_live_engine_survives_hostile_frames(live: LiveEngine, long_mode: bool) -> None:
    @given(st.lists(RAW_FRAMES | transfer_frames(live.cache_id), min_size=1, max_size=4))
    @settings(max_examples=examples(long_mode), deadline=None, suppress_health_check=list(HealthCheck))
    def attack(frames: list[bytes]) -> None:
        send_and_close(live.port, frames)
        assert live.guards_clean()

    attack()
    still_serving(live)
    assert live.guards_clean()


def test_frames_before_the_handshake(live: LiveEngine, long_mode: bool) -> None:
    @given(st.lists(RAW_FRAMES, min_size=1, max_size=3))
    @settings(max_examples=examples(long_mode) // 2, deadline=None, suppress_health_check=list(HealthCheck))
    def attack(frames: list[bytes]) -> None:
        with socket.create_connection(("127.0.0.1", live.port), timeout=5) as sock:
            try:
                for frame in frames:
                    sock.sendall(frame)
            except OSError:
                pass
        assert live.guards_clean()

    attack()
    still_serving(live)
    deadline = time.monotonic() + 5  # no frame before a handshake ever made a link
    while 66 in live.engine.links and time.monotonic() < deadline:
        time.sleep(0.02)
    assert 66 not in live.engine.links
    assert json.dumps(live.run(_stats(live.engine)))  # plain data


async def _stats(engine: LLMDataDist) -> dict[int, dict[str, Any]]:
    return engine.link_stats()
