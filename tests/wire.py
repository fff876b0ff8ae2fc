"""Reading kvpush frames off a plain blocking socket: for tests that speak the wire by hand."""

from __future__ import annotations

import socket

from kvpush.protocol import HEADER_SIZE, FrameHeader, decode_header


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
