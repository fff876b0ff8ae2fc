"""Reading kvpush frames off a plain blocking socket: for tests that speak the wire by hand."""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

import numpy as np

from kvpush.layout import pack_runs
from kvpush.protocol import HEADER_SIZE, FrameHeader, Kind, decode_header, encode_json, encode_transfer


def read_exact(sock: socket.socket, count: int) -> bytes:
    """Exactly ``count`` bytes; ConnectionError when the peer closes first."""
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def read_frame(sock: socket.socket) -> tuple[FrameHeader, bytes]:
    """One whole frame: its header and meta (the payload is read and dropped)."""
    header = decode_header(read_exact(sock, HEADER_SIZE))
    meta = read_exact(sock, header.meta_len)
    read_exact(sock, header.payload_len)
    return header, meta


class RawPeer:
    """A blocking client that does the handshake itself and then sends whatever the test says."""

    def __init__(self, port: int, cluster_id: int = 66) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.cluster_id = cluster_id

    def handshake(self) -> dict[str, Any]:
        self.send(encode_json(Kind.HELLO, 0, {"version": 1, "cluster_id": self.cluster_id, "role": 1,
                                              "nonce": os.urandom(32).hex(), "auth": False}))
        assert self.read()[0] == Kind.HELLO
        self.send(encode_json(Kind.AUTH, 0, {"proof": ""}))
        assert self.read()[0] == Kind.READY
        kind, table = self.read()
        assert kind == Kind.TABLE
        self.send(encode_json(Kind.TABLE, 0, {"version": 0, "caches": []}))
        return table

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> tuple[Kind, Any]:
        header, meta = read_frame(self.sock)
        if header.kind in (Kind.DONE, Kind.READ_DATA):
            return header.kind, struct.unpack_from("<I", meta)[0]
        return header.kind, json.loads(meta) if meta else {}

    def read_until(self, kind: Kind) -> Any:
        for _ in range(50):
            got, body = self.read()
            if got == kind:
                return body
        raise AssertionError(f"no {kind.name}")

    def closed_by_peer(self) -> bool:
        try:
            while True:
                if not self.sock.recv(1 << 16):
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def write_frame(cache_id: int, first: int, count: int, offsets: list[int], lengths: list[int],
                request_id: int = 1, payload: bytes | None = None, budget_ms: int = 0) -> bytes:
    runs = pack_runs(np.array(offsets, np.uint64), np.array(lengths, np.uint64))
    size = count * sum(lengths) if payload is None else len(payload)
    body = payload if payload is not None else b"\xAB" * size
    return encode_transfer(Kind.WRITE, request_id, cache_id, first, count, runs, size, budget_ms) + body
