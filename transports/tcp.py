"""TCP: the built-in transport and every link's control channel.

``TcpFrameStream`` is one connected socket framed both ways: ``transports.tcp_send`` writes frames (in
order, whole, straight from the source memory), ``transports.tcp_receive`` reads them (through a staging
buffer, payloads straight into registered memory). Here: the stream that joins the two halves, and the
set-up (listener, connect).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
from typing import Any

from .base import (
    Capabilities,
    Connection,
    FrameStream,
    Listener,
    StreamHandler,
    TransportError,
)
from .tcp_receive import STAGING_BYTES, TRUSTED_STAGING_BYTES, FrameReceiver
from .tcp_send import FrameSender

__all__ = ["CAPABILITIES", "STAGING_BYTES", "TRUSTED_STAGING_BYTES", "TcpControl", "TcpFrameStream", "is_local"]

log = logging.getLogger(__name__)

CAPABILITIES = Capabilities(name="tcp", one_sided=False, same_host_only=False)


def is_local(sock: socket.socket) -> bool:
    """True when ``sock`` connects two processes of this host: a Unix socket, a loopback address, or a
    connection from one of this host's addresses to itself."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return sock.family == socket.AF_UNIX
    try:
        peer, own = str(sock.getpeername()[0]), str(sock.getsockname()[0])
        address = ipaddress.ip_address(peer.split("%")[0])
    except (OSError, ValueError):
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or peer == own


# Linux's struct tcp_info up to tcpi_last_ack_recv: eight u8 (state .. options, the window scales), then
# u32 rto, ato, snd_mss, rcv_mss, unacked, sacked, lost, retrans, fackets, last_data_sent, last_ack_sent,
# last_data_recv, last_ack_recv (ms since the last ACK came)
_TCP_INFO = struct.Struct("=8B13I")
_UNACKED, _LAST_ACK_RECV = 12, 20


class TcpFrameStream(FrameSender):
    """A framed, ordered byte stream over one connected TCP socket (``transports.base.FrameStream``): it
    sends as a ``FrameSender`` and receives through its ``FrameReceiver``."""

    capabilities = CAPABILITIES

    def __init__(self, sock: socket.socket, handler: StreamHandler, loop: asyncio.AbstractEventLoop) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().__init__(sock.fileno(), loop)
        self.sock = sock
        self.local = is_local(sock)
        self.handler = handler
        self._receiver = FrameReceiver(sock, handler, self.close)
        loop.add_reader(self.fd, self._receiver.on_readable)

    def __repr__(self) -> str:
        try:
            peer = self.sock.getpeername()
        except OSError:
            peer = "?"
        return f"<TcpFrameStream peer={peer} {'closed' if self.closed else 'open'}>"

    # -- receiving (tcp_receive) ----------------------------------------------------------------------
    @property
    def bytes_in(self) -> int:
        return self._receiver.bytes_in

    @property
    def last_receive(self) -> float:
        return self._receiver.last_receive

    def peer_acknowledges(self, within_s: float) -> bool | None:
        """From ``TCP_INFO``: nothing sent is unacknowledged, or the last ACK came within ``within_s``
        (a peer that advertises a zero window still acknowledges the probes)."""
        try:
            raw = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
        except (OSError, AttributeError):  # closed, not TCP, or no TCP_INFO on this platform
            return None
        if len(raw) < _TCP_INFO.size:
            return None
        fields = _TCP_INFO.unpack_from(raw)
        unacked, last_ack_recv_ms = fields[_UNACKED], fields[_LAST_ACK_RECV]
        return bool(unacked == 0 or last_ack_recv_ms < within_s * 1000)

    @property
    def meta_limit(self) -> int | None:
        return self._receiver.meta_limit

    @meta_limit.setter
    def meta_limit(self, limit: int | None) -> None:
        self._receiver.meta_limit = limit

    @property
    def staging_bytes(self) -> int:
        """The size of the receive staging buffer now (what the stream holds for frame heads)."""
        return self._receiver.staging_bytes

    def trusted(self) -> None:
        """The peer is authenticated (or, without a token, done with the handshake): the stream may
        hold more for it (a staging buffer of ``TRUSTED_STAGING_BYTES``)."""
        self._receiver.trusted()

    # -- closing --------------------------------------------------------------------------------
    def send_failed(self, reason: str) -> None:
        """A write failed (the peer reset the connection, say): frames the peer sent before that may
        still wait in this host's kernel, and they are delivered first (a peer's last answer, its BYE,
        is not lost to a reply that could not be sent). The close follows from the loop, not from
        inside the write, which may run in the middle of handling a received frame."""
        self.loop.call_soon(self._close_after_reading, reason)

    def _close_after_reading(self, reason: str) -> None:
        if not self.closed:
            self._receiver.on_readable()  # what is left, up to the reset (which closes the stream)
        if not self.closed:
            self.close(reason)

    def close(self, reason: str, abort: bool = False) -> None:
        """Close now: queued frames fail, a payload being received stops landing. With ``abort``
        the connection is reset (SO_LINGER 0): unsent bytes are dropped, not delivered. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        if abort:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        try:
            self.loop.remove_reader(self.fd)
        except (ValueError, RuntimeError):
            pass
        self._stop_sending()
        try:
            self.sock.close()
        except OSError:
            pass
        self._receiver.close()
        self.handler.on_close(reason)


# -- connection set-up -----------------------------------------------------------------------------

class TcpConnection:
    """A connected socket, framed by ``open`` (``transports.base.Connection``)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        try:
            self.peer = str(sock.getpeername())
        except OSError:
            self.peer = "?"

    def open(self, handler: StreamHandler, loop: asyncio.AbstractEventLoop) -> FrameStream:
        return TcpFrameStream(self.sock, handler, loop)

    def close(self) -> None:
        self.sock.close()


class TcpListener:
    """A non-blocking listening socket (``transports.base.Listener``)."""

    def __init__(self, host: str, port: int, backlog: int = 128) -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as error:
            raise TransportError(error.errno, error.strerror or str(error)) from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
        except OSError as error:
            sock.close()
            raise TransportError(error.errno, error.strerror or str(error)) from None
        self.sock = sock
        bound: Any = sock.getsockname()
        self.address = (str(bound[0]), int(bound[1]))

    async def accept(self) -> Connection:
        try:
            sock, _ = await asyncio.get_running_loop().sock_accept(self.sock)
        except OSError as error:
            raise TransportError(error.errno, f"accept failed: {error.strerror or error}") from None
        return TcpConnection(sock)

    def close(self) -> None:
        self.sock.close()


class TcpControl:
    """TCP as the control transport (``transports.base.ControlTransport``)."""

    capabilities = CAPABILITIES

    def listen(self, host: str, port: int) -> Listener:
        return TcpListener(host, port)

    async def connect(self, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            raise TransportError(error.errno, f"cannot resolve {host}: {error.strerror or error}") from None
        last: OSError | None = None
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, address)
                return TcpConnection(sock)
            except BaseException as error:
                sock.close()
                if not isinstance(error, OSError):
                    raise
                last = error
        if last is None:
            raise TransportError(0, f"no address for {host}:{port}")
        raise TransportError(last.errno, last.strerror or str(last))
