"""Authenticated links: an HMAC challenge-response with fresh nonces both ways; the token never
crosses the wire; nothing about caches is sent before the peer proved it knows the token."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
from typing import Any

import pytest
from kvtest import EngineFactory, cluster
from wire import read_frame

from kvpush import BlocksCacheKey, CacheDesc, DataType, LLMStatusCode
from kvpush.protocol import Kind, encode_json

TOKEN = "s3cret-token-4711"
DESC = CacheDesc(2, (4, 256), DataType.DT_UINT8)


async def test_matching_tokens_link_and_push(make_engine: EngineFactory) -> None:
    decode = await make_engine(2, listen=True, kvpush__auth_token=TOKEN)
    prefill = await make_engine(1, kvpush__auth_token=TOKEN)
    dst = decode.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 0))
    src = prefill.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
    src.tensors[0][:] = 9
    status, codes = await prefill.link_clusters([cluster(2, decode.listen_address[1])])
    assert codes == [LLMStatusCode.LLM_SUCCESS]
    await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [1], [2])
    assert (dst.tensors[0][2] == 9).all()


@pytest.mark.parametrize("dialer_token, acceptor_token", [("wrong", TOKEN), (None, TOKEN), (TOKEN, None)])
async def test_wrong_or_missing_token_fails_the_link(make_engine: EngineFactory, caplog: pytest.LogCaptureFixture,
                                                     dialer_token: str | None, acceptor_token: str | None) -> None:
    caplog.set_level(logging.WARNING)
    decode = await make_engine(2, listen=True, **({"kvpush__auth_token": acceptor_token} if acceptor_token else {}))
    prefill = await make_engine(1, **({"kvpush__auth_token": dialer_token} if dialer_token else {}))
    status, codes = await prefill.link_clusters([cluster(2, decode.listen_address[1])], timeout=3000)
    assert codes == [LLMStatusCode.LLM_LINK_FAILED] and status == LLMStatusCode.LLM_LINK_FAILED
    await asyncio.sleep(0.05)
    assert decode.links == {} and prefill.links == {}
    assert any("refused a link" in r.getMessage() and "auth" in r.getMessage() for r in caplog.records)


def _read_frame(sock: socket.socket) -> tuple[Kind, dict[str, Any]]:
    header, meta = read_frame(sock)
    return header.kind, json.loads(meta) if meta else {}


async def test_an_impostor_gets_nothing_before_authentication(make_engine: EngineFactory) -> None:
    decode = await make_engine(2, listen=True, kvpush__auth_token=TOKEN)
    decode.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 0))

    def impostor() -> list[Kind]:
        seen = []
        with socket.create_connection(("127.0.0.1", decode.listen_address[1]), timeout=5) as sock:
            sock.sendall(encode_json(Kind.HELLO, 0, {"version": 1, "cluster_id": 66, "nonce": os.urandom(32).hex(),
                                                     "auth": True}))
            kind, hello = _read_frame(sock)
            seen.append(kind)
            assert "proof" in hello and TOKEN not in json.dumps(hello)
            sock.sendall(encode_json(Kind.AUTH, 0, {"proof": "00" * 32, "offers": {}}))
            try:
                while True:
                    seen.append(_read_frame(sock)[0])
            except (ConnectionError, OSError):
                return seen

    seen = await asyncio.to_thread(impostor)
    assert Kind.TABLE not in seen and Kind.READY not in seen  # no cache table, address or rkey
    assert decode.links == {}


async def test_the_token_never_crosses_the_wire(make_engine: EngineFactory) -> None:
    """A fake acceptor records every byte the dialer sends during an authenticated handshake."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received = bytearray()

    def fake_acceptor() -> None:
        conn, _ = listener.accept()
        conn.settimeout(5)
        with conn:
            kind, hello = _read_frame(conn)
            received.extend(json.dumps(hello).encode())
            conn.sendall(encode_json(Kind.HELLO, 0, {"version": 1, "cluster_id": 2, "nonce": os.urandom(32).hex(),
                                                     "auth": True, "proof": "11" * 32}))
            try:
                while chunk := conn.recv(65536):
                    received.extend(chunk)
            except (TimeoutError, OSError):
                pass

    thread = threading.Thread(target=fake_acceptor, daemon=True)
    thread.start()
    prefill = await make_engine(1, kvpush__auth_token=TOKEN)
    status, codes = await prefill.link_clusters([cluster(2, port)], timeout=2000)
    assert codes == [LLMStatusCode.LLM_LINK_FAILED]  # the fake acceptor's proof is wrong
    await asyncio.to_thread(thread.join, 10)
    listener.close()
    assert received and TOKEN.encode() not in received
