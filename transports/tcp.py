"""TCP: the built-in transport and every link's control channel.

Receive path: the socket is non-blocking and watched with ``loop.add_reader``. Headers and metas
come through a staging buffer per stream (2 KiB until the peer is trusted, 64 KiB after): one
``recv`` usually brings a small frame whole (header, meta, payload), and a short read says the socket
is drained, so a wakeup costs one system call, not a read per part plus one that fails. The engine is asked where
the payload goes; the payload bytes already staged are copied there, and the rest is read straight
into registered memory with ``readv`` over the engine's iovec (one native call per up to IOV_MAX
runs, through ctypes, so no Python object is made per block and no block-sized intermediate buffer
exists), with the staging buffer as the call's last entry so the next frame's head arrives in the
same call. Measured here, asyncio streams (``readexactly``) ran 8x slower than receiving in place.

Send path: frames queue in order; the pump ``writev``s header, meta and payload iovec together
straight from the source memory, resuming after partial writes, and waits with ``add_writer``
when the socket is full. A frame that has started is always finished (or the stream closed), so
the byte stream never holds half a frame.

One idea, TCP (about 630 lines): the stream, its in-place receive state machine and its set-up
(listener, connect) belong together.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpush.layout import as_iovec, iovec_bytes
from kvpush.protocol import HEADER_SIZE, FrameHeader, ProtocolError, decode_header

from .base import (
    Capabilities,
    Connection,
    FrameStream,
    Listener,
    OutgoingFrame,
    PayloadSink,
    StreamHandler,
    TransportError,
)
from .iovec import VECTOR_STRUCTS, Cursor, FlatCursor, address_of, check, readv, writev

if TYPE_CHECKING:
    from kvpush.layout import FlatIoVec, IoVec

log = logging.getLogger(__name__)

CAPABILITIES = Capabilities(name="tcp", one_sided=False, same_host_only=False)
_READS_PER_WAKEUP = 64
# Every stream reads headers and metas through a staging buffer of this size: one recv brings a
# small frame whole (header, meta, the start of its payload) and usually the news that the socket
# is drained (a short read), so no further recv is needed to learn it. It is all a connection holds
# before its handshake is done (metas that do not fit get their own buffer, bounded by meta_limit).
STAGING_BYTES = 2048
# Once the peer is trusted (``FrameStream.trusted``) the staging buffer grows to this: a small frame
# whole (a 32 KiB block and its head) then comes in the wakeup's one recv and is copied to its sink,
# instead of a second system call reading the payload (a recv and a few calls less per small transfer).
# Reads fill all of it only while frames are small (``_rx_limit``): big payloads are read in place.
TRUSTED_STAGING_BYTES = 64 << 10
# Frames up to this size are written by the call that queues them (a 1 MiB writev costs a few hundred
# microseconds; deferring it to the next loop pass cost more than that per layer, measured on W-SHORT's
# 256 KiB layers); bigger ones leave from the loop.
_SEND_NOW_BYTES = 1 << 20
_SCRATCH_ROWS = 32  # payloads of fewer iovec entries are received through the stream's own vector (512 B)
_DISCARD = bytearray(1 << 18)
_HEAD_ENTRY = struct.Struct("<QQ")

class TcpFrame:
    """One queued outgoing frame (see ``transports.base.OutgoingFrame``). Its own iovec and cursor are
    made only when it is not written whole through the stream's scratch vector at once, and its
    ``sent`` future only when someone asks for it (``left`` says the same without one)."""

    __slots__ = ("head", "payload", "total", "_cursor", "future", "_loop", "left", "started", "abandoned")

    def __init__(self, head: bytes, payload: IoVec | FlatIoVec | None, loop: asyncio.AbstractEventLoop,
                 already_sent: int = 0, nbytes: int | None = None) -> None:
        self.head = head  # referenced here: the iovec points into it
        self.payload = payload
        self.total = len(head) + (0 if payload is None else iovec_bytes(payload) if nbytes is None else nbytes)
        self._cursor: Cursor | None = None
        if already_sent:
            self.cursor.advance(already_sent)
        self._loop = loop
        self.future: asyncio.Future[None] | None = None  # ``sent``, once asked for
        self.left = False  # every byte was handed to the kernel
        self.started = False  # some of it was written: it is always finished (or the stream closed)
        self.abandoned = False

    @property
    def sent(self) -> asyncio.Future[None]:
        future = self.future
        if future is None:
            future = self.future = self._loop.create_future()
            if self.left:
                future.set_result(None)
        return future

    def finished(self) -> None:
        """Every byte left."""
        self.left = True
        future = self.future
        if future is not None and not future.done():
            future.set_result(None)

    @property
    def cursor(self) -> Cursor:
        if self._cursor is None:
            payload = None if self.payload is None else as_iovec(self.payload)
            vec = np.empty((1 + (0 if payload is None else payload.shape[0]), 2), np.uint64)
            vec[0] = (address_of(self.head), len(self.head))
            if payload is not None:
                vec[1:] = payload
            self._cursor = Cursor(vec, total=self.total)
        return self._cursor

    def short(self) -> bool:
        """Not written yet and its vector fits the stream's scratch vector."""
        payload = self.payload
        if payload is None:
            return self._cursor is None
        rows = len(payload) // 2 if type(payload) is tuple else payload.shape[0]  # type: ignore[union-attr]
        return self._cursor is None and rows < _SCRATCH_ROWS

    def advance(self, written: int) -> bool:
        """``written`` more bytes left; True when the whole frame has."""
        if self._cursor is None and written == self.total:
            return True
        cursor = self.cursor
        cursor.advance(written)
        return cursor.done >= cursor.total

    def abandon(self) -> bool:
        if self.started:
            return False
        self.abandoned = True
        return True


class TcpFrameStream:
    """A framed, ordered byte stream over one connected TCP socket (see module docstring)."""

    capabilities = CAPABILITIES

    def __init__(self, sock: socket.socket, handler: StreamHandler, loop: asyncio.AbstractEventLoop) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.fd = sock.fileno()
        self.handler = handler
        self.loop = loop
        self.closed = False
        self.close_reason = ""
        self.last_receive = time.monotonic()
        self.bytes_in = 0
        self.bytes_out = 0
        self.meta_limit: int | None = None
        self._queue: collections.deque[TcpFrame] = collections.deque()
        self._writer_armed = False
        self._pump_scheduled = False
        # receive state: staged bytes rx[_rx_start:_rx_end]; a frame whose payload (or big meta) is due
        self._rx = bytearray(STAGING_BYTES)
        self._staging = STAGING_BYTES
        # how much of it a read may fill: all of it while frames are small; the first 2 KiB after a frame
        # bigger than the buffer (its successors are likely big too: their payloads are read in place,
        # not staged and copied - copying 64 KiB of each cost W-KV over TCP ~15%)
        self._rx_limit = STAGING_BYTES
        self._grow_to = 0  # set by ``trusted``: the staging buffer grows when no frame is being received
        self._rx_view = memoryview(self._rx)
        self._rx_addr = ctypes.addressof(ctypes.c_char.from_buffer(self._rx))
        scratch = np.empty((_SCRATCH_ROWS, 2), np.uint64)  # the iovec of a payload of a few entries
        self._rx_scratch = (scratch, int(scratch.ctypes.data))
        self._rx_flat = (scratch.data.cast("B"), int(scratch.ctypes.data))  # the same, for FlatCursor
        self._tx_scratch = np.empty((_SCRATCH_ROWS, 2), np.uint64)  # a short frame's first write
        self._tx_addr = int(self._tx_scratch.ctypes.data)
        self._tx_view = self._tx_scratch.data.cast("B")
        self._rx_start = 0
        self._rx_end = 0
        self._frame: FrameHeader | None = None
        self._meta = bytearray()  # a meta too big for the staging buffer, read into its own
        self._meta_wanted = 0
        self._got = 0
        self._payload_left = 0
        self._sink: PayloadSink | None = None
        self._cursor: Cursor | FlatCursor | None = None
        loop.add_reader(self.fd, self._on_readable)

    def __repr__(self) -> str:
        try:
            peer = self.sock.getpeername()
        except OSError:
            peer = "?"
        return f"<TcpFrameStream peer={peer} {'closed' if self.closed else 'open'}>"

    # -- sending --------------------------------------------------------------------------------
    def prepare(self, head: bytes, payload: IoVec | FlatIoVec | None = None, nbytes: int | None = None) -> TcpFrame:
        """A frame ready to ``enqueue`` later (nothing is sent yet)."""
        return TcpFrame(head, payload, self.loop, nbytes=nbytes)

    def enqueue(self, frame: OutgoingFrame) -> None:
        """Queue a prepared frame (from this stream's ``prepare``) behind everything sent so far."""
        assert isinstance(frame, TcpFrame)
        if self.closed:
            if not frame.sent.done():
                frame.sent.set_exception(ConnectionError(f"stream closed: {self.close_reason}"))
                frame.sent.exception()
            return
        if (not self._queue and not self._writer_armed and not self._pump_scheduled
                and frame.total <= _SEND_NOW_BYTES and frame.short()):
            # an idle stream and a frame of a few entries (a small transfer): one writev from here,
            # without the pump's bookkeeping; what does not leave whole is queued for the pump
            frame.started = True
            try:
                written = check(writev(self.fd, self._tx_addr, self._fill_scratch(frame)))
            except (BlockingIOError, InterruptedError):
                written = 0
            except OSError as error:
                self._queue.append(frame)
                self.close(f"send failed: {error.strerror or error}")  # fails the queued frame
                return
            self.bytes_out += written
            if written == frame.total:
                frame.finished()
                return
            self._queue.append(frame)
            if written:
                frame.advance(written)
            self._arm_writer()  # the rest leaves when the socket has room
            return
        self._queue.append(frame)
        self._kick(frame.total)

    def _kick(self, size: int) -> None:
        if self._writer_armed or self._pump_scheduled:
            return
        if size <= _SEND_NOW_BYTES:
            self._pump()  # control frames and small payloads leave at once (latency)
        else:  # big payloads leave from the loop, so starting a transfer costs the caller microseconds
            self._pump_scheduled = True
            self.loop.call_soon(self._scheduled_pump)

    def send(self, head: bytes, payload: IoVec | FlatIoVec | None = None) -> TcpFrame:
        sent = 0
        if payload is None and not self._queue and not self._writer_armed and not self.closed:
            # a control frame on an idle stream: one plain send, no iovec bookkeeping (latency)
            try:
                sent = self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as error:
                self.close(f"send failed: {error.strerror or error}")
            self.bytes_out += sent
            if sent == len(head):
                frame = TcpFrame.__new__(TcpFrame)
                frame.future, frame._loop = None, self.loop
                frame.left = frame.started = True
                frame.abandoned = False
                return frame
        frame = TcpFrame(head, payload, self.loop, sent)
        if sent:
            frame.started = True
        if self.closed:
            frame.sent.set_exception(ConnectionError(f"stream closed: {self.close_reason}"))
            frame.sent.exception()  # mark retrieved; callers check the link state first
            return frame
        self._queue.append(frame)
        self._kick(0 if payload is None else frame.total)
        return frame

    def _scheduled_pump(self) -> None:
        self._pump_scheduled = False
        if not self._writer_armed:
            self._pump()

    def _pump(self) -> None:
        while self._queue and not self.closed:
            frame = self._queue[0]
            if frame.abandoned:
                self._queue.popleft()
                if not frame.sent.done():
                    frame.sent.cancel()
                continue
            frame.started = True
            try:
                if frame.short():  # a first write of a few entries: through the scratch vector
                    written = check(writev(self.fd, self._tx_addr, self._fill_scratch(frame)))
                else:
                    address, count = frame.cursor.pointer()
                    written = check(writev(self.fd, address, count))
            except (BlockingIOError, InterruptedError):
                self._arm_writer()
                return
            except OSError as error:
                self.close(f"send failed: {error.strerror or error}")
                return
            self.bytes_out += written
            if frame.advance(written):
                self._queue.popleft()
                frame.finished()
        self._disarm_writer()

    def _fill_scratch(self, frame: TcpFrame) -> int:
        """Lay a short frame's iovec (head, payload entries) into the scratch vector; its rows."""
        payload = frame.payload
        if type(payload) is tuple:  # ints: one struct call, no numpy
            VECTOR_STRUCTS[len(payload) + 2].pack_into(self._tx_view, 0, address_of(frame.head), len(frame.head),
                                                       *payload)
            return len(payload) // 2 + 1
        _HEAD_ENTRY.pack_into(self._tx_view, 0, address_of(frame.head), len(frame.head))
        if payload is None:
            return 1
        rows: int = payload.shape[0]  # type: ignore[union-attr]
        self._tx_scratch[1:rows + 1] = payload
        return rows + 1

    def _arm_writer(self) -> None:
        if not self._writer_armed:
            self.loop.add_writer(self.fd, self._pump)
            self._writer_armed = True

    def _disarm_writer(self) -> None:
        if self._writer_armed:
            self.loop.remove_writer(self.fd)
            self._writer_armed = False

    # -- receiving ------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        heard = False
        for _ in range(_READS_PER_WAKEUP):
            if self.closed:
                return
            try:
                count, drained = self._read_once()
            except (BlockingIOError, InterruptedError):
                break
            except ProtocolError as error:
                log.warning("closing link stream %r: protocol violation: %s", self, error)
                self.close(f"protocol violation: {error}")
                return
            except OSError as error:
                self.close(f"receive failed: {error.strerror or error}")
                return
            except Exception as error:  # a bug in a handler must not take the engine down
                log.exception("closing link stream %r: unexpected error while receiving", self)
                self.close(f"internal error: {error!r}")
                return
            if count == 0:
                self.close("peer closed the connection")
                return
            self.bytes_in += count
            heard = True
            if drained:  # a short read: nothing more is waiting (the loop calls again if that changes)
                break
        if heard:
            self.last_receive = time.monotonic()

    @property
    def staging_bytes(self) -> int:
        """The size of the receive staging buffer now (what the stream holds for frame heads)."""
        return self._staging

    def trusted(self) -> None:
        """The peer is authenticated (or, without a token, done with the handshake): the stream may
        hold more for it (a staging buffer of ``TRUSTED_STAGING_BYTES``)."""
        self._grow_to = TRUSTED_STAGING_BYTES

    def _grow_staging(self) -> None:
        """Swap in the bigger staging buffer (no frame is being received: no cursor points into it)."""
        size, self._grow_to = self._grow_to, 0
        if size <= self._staging:
            return
        grown = bytearray(size)
        grown[:self._rx_end - self._rx_start] = self._rx_view[self._rx_start:self._rx_end]
        self._rx_end -= self._rx_start
        self._rx_start = 0
        self._rx, self._rx_view, self._staging = grown, memoryview(grown), size
        self._rx_limit = size
        self._rx_addr = ctypes.addressof(ctypes.c_char.from_buffer(grown))

    def _read_once(self) -> tuple[int, bool]:
        """One read; (bytes read, whether the socket is drained as far as the read can tell)."""
        if self._frame is None:  # headers and small metas come through the staging buffer
            if self._grow_to:
                self._grow_staging()
            end = self._rx_end
            limit = self._rx_limit if self._rx_limit > end else self._staging
            count = self.sock.recv_into(self._rx_view[end:limit])
            if count:
                self._rx_end = end + count
                self._parse()
            return count, count < limit - end
        if self._meta_wanted:
            want = self._meta_wanted - self._got
            count = self.sock.recv_into(memoryview(self._meta)[self._got:])
            self._got += count
            if count and self._got == self._meta_wanted:
                self._meta_wanted = 0
                self._frame_ready(self._frame, bytes(self._meta))
                self._meta = bytearray()
            return count, count < want
        return self._read_payload()

    def _parse(self) -> None:
        """Take every whole frame head (and the payload bytes behind it) out of the staging buffer."""
        view = self._rx_view
        start, end = self._rx_start, self._rx_end
        while start < end and not self.closed:
            if self._frame is not None:  # payload bytes that arrived behind their header
                take = min(end - start, self._payload_left)
                self._take_staged(start, take)
                start += take
                continue
            if end - start < HEADER_SIZE:
                break
            frame = decode_header(view[start:start + HEADER_SIZE])
            meta_len = frame.meta_len
            if self.meta_limit is not None and meta_len > self.meta_limit:
                raise ProtocolError(f"{frame.kind.name} announces {meta_len} bytes of meta; "
                                    f"at most {self.meta_limit} are accepted now")
            if HEADER_SIZE + meta_len > self._staging:  # its own buffer, read straight into
                start += HEADER_SIZE
                have = min(end - start, meta_len)
                self._meta = bytearray(meta_len)
                self._meta[:have] = view[start:start + have]
                start += have
                self._frame, self._meta_wanted, self._got = frame, meta_len, have
                if have == meta_len:
                    self._meta_wanted = 0
                    self._frame_ready(frame, bytes(self._meta))
                    self._meta = bytearray()
                continue
            if end - start < HEADER_SIZE + meta_len:
                break  # the rest of the meta is still on its way
            meta = bytes(view[start + HEADER_SIZE:start + HEADER_SIZE + meta_len])
            start += HEADER_SIZE + meta_len
            payload_len = frame.payload_len
            if not payload_len:
                self.handler.on_frame(frame, meta)
            elif end - start >= payload_len:  # its whole payload is staged too
                start += self._frame_in_hand(frame, meta, start)
            else:
                self._frame_ready(frame, meta)
        if start >= end:
            start = end = 0
        elif start:
            view[:end - start] = view[start:end]
            end -= start
            start = 0
        self._rx_start, self._rx_end = start, end

    def _frame_in_hand(self, frame: FrameHeader, meta: bytes, at: int) -> int:
        """A frame whose payload is all in the staging buffer at ``at``: the handler is told so (it
        may then skip what a payload still on its way needs) and a few entries are copied straight
        into its sink, whose ``on_done`` runs before this returns. Returns the staged bytes consumed
        (0: the payload is left for ``_parse`` to take through a cursor)."""
        self._rx_limit = self._staging  # a small frame: reads go on filling the staging buffer
        sink = self.handler.on_frame(frame, meta, True)
        payload_len = frame.payload_len
        if sink is None or sink.cancelled or self.closed:  # discarded
            return payload_len
        iov = sink.iov
        if type(iov) is not tuple:
            self._expect(frame, sink)  # an IoVec (many entries): the cursor takes them, in this same _parse
            return 0
        if sink.nbytes != payload_len:
            raise ProtocolError(f"payload of {payload_len} bytes does not fit a sink of {sink.nbytes}")
        source = self._rx_addr + at
        for index in range(0, len(iov), 2):  # a FlatIoVec: a few entries, a memmove each
            ctypes.memmove(iov[index], source, iov[index + 1])
            source += iov[index + 1]
        sink.on_done()
        return payload_len

    def _frame_ready(self, frame: FrameHeader, meta: bytes) -> None:
        self._expect(frame, self.handler.on_frame(frame, meta))

    def _expect(self, frame: FrameHeader, sink: PayloadSink | None) -> None:
        """The payload of ``frame`` comes next: into ``sink`` (None: discarded)."""
        if frame.payload_len == 0:
            self._frame = None
            return
        self._rx_limit = self._staging if frame.payload_len < self._staging else STAGING_BYTES
        self._frame = frame
        self._payload_left = frame.payload_len
        self._sink = sink
        self._cursor = None
        if sink is not None:
            if sink.nbytes != frame.payload_len:
                raise ProtocolError(f"payload of {frame.payload_len} bytes does not fit a sink of {sink.nbytes}")
            iov = sink.iov
            if type(iov) is tuple and len(iov) // 2 < _SCRATCH_ROWS:  # a few entries as ints: no numpy
                self._cursor = FlatCursor(iov, sink.nbytes, (self._rx_addr, self._rx_limit), self._rx_flat)
            else:
                self._cursor = Cursor(as_iovec(iov), total=sink.nbytes, spill=(self._rx_addr, self._rx_limit),
                                       scratch=self._rx_scratch)

    def _take_staged(self, start: int, count: int) -> None:
        """``count`` payload bytes at ``start`` of the staging buffer: into the sink (or discarded)."""
        sink, cursor = self._sink, self._cursor
        if sink is not None and cursor is not None and not sink.cancelled:
            cursor.fill(self._rx_addr + start, count)
        self._payload_left -= count
        if self._payload_left == 0:
            self._payload_done()

    def _payload_done(self) -> None:
        sink = self._sink
        self._frame = None
        self._sink = None
        self._cursor = None
        if sink is not None and not sink.cancelled:
            sink.on_done()

    def _read_payload(self) -> tuple[int, bool]:
        """Read the payload straight into the sink's memory; the read goes on into the staging
        buffer (the next frame's head) when the rest of the payload fits in one call."""
        sink, cursor, left = self._sink, self._cursor, self._payload_left
        if sink is None or cursor is None or sink.cancelled:
            want = min(left, len(_DISCARD))
            count = self.sock.recv_into(memoryview(_DISCARD)[:want])
            self._payload_left -= count
            if count and self._payload_left == 0:
                self._payload_done()
            return count, count < want
        address, entries = cursor.pointer()
        spill = cursor.index + entries > cursor.rows  # the staging buffer is the call's last entry
        count = check(readv(self.fd, address, entries))
        if count > left:  # the payload is complete and the next frame's first bytes are staged
            cursor.advance(left)
            self._payload_left = 0
            self._rx_start, self._rx_end = 0, count - left
            self._payload_done()
            self._parse()
            return count, count - left < self._rx_limit
        if count:
            cursor.advance(count)
            self._payload_left = left - count
            if self._payload_left == 0:
                self._payload_done()
                return count, spill  # the read did not reach the staging buffer: nothing is waiting
        return count, False  # mid-payload: read on (the peer is likely still writing it)

    # -- closing --------------------------------------------------------------------------------
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
        self._disarm_writer()
        try:
            self.sock.close()
        except OSError:
            pass
        self._rx_start = self._rx_end = 0
        error = ConnectionError(f"stream closed: {reason}")
        while self._queue:
            frame = self._queue.popleft()
            if not frame.sent.done():
                frame.sent.set_exception(error)
                frame.sent.exception()
        self._sink = None
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
