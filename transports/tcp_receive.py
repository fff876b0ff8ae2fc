"""TCP, receiving: frames out of the byte stream, payloads straight into the memory the engine names.

The socket is non-blocking and watched with ``loop.add_reader``. Headers and metas come through a
staging buffer per stream (``STAGING_BYTES`` until the peer is trusted, ``TRUSTED_STAGING_BYTES``
after): one ``recv`` usually brings a small frame whole (header, meta, payload), and a short read says
the socket is drained, so a wakeup costs one system call, not a read per part plus one that fails.
The handler is asked where the payload goes. A payload staged whole with its head is copied there before
the stream returns to the loop (``in_hand``); otherwise the bytes already staged are copied and the rest
is read straight into registered memory with ``readv`` over the sink's iovec (one native call per up to
IOV_MAX entries, no Python object per block, no block-sized intermediate buffer), with the staging buffer
as the call's last entry so the next frame's head arrives in the same call.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import time
from collections.abc import Callable

from kvpush.layout import IoVec
from kvpush.protocol import HEADER_SIZE, FrameHeader, ProtocolError, decode_header

from .base import PayloadSink, StreamHandler
from .iovec import Cursor, Scratch, check, readv

log = logging.getLogger(__name__)

_READS_PER_WAKEUP = 64
# Every stream reads headers and metas through a staging buffer of this size: one recv brings a small
# frame whole (header, meta, the start of its payload) and usually the news that the socket is drained (a
# short read). It is all a connection holds before its handshake is done (metas that do not fit get their
# own buffer, bounded by ``meta_limit``).
STAGING_BYTES = 2048
# Once the peer is trusted the staging buffer grows to this: a small frame whole (a block and its head)
# then comes in the wakeup's one recv and is copied to its sink, instead of a second system call reading
# the payload. Reads fill all of it only while frames are small (``_rx_limit``): big payloads are read in
# place, not staged and copied.
TRUSTED_STAGING_BYTES = 64 << 10
_DISCARD = bytearray(1 << 18)


class FrameReceiver:
    """The receiving half of a ``TcpFrameStream`` (see the module docstring). ``fail`` closes the stream."""

    def __init__(self, sock: socket.socket, handler: StreamHandler, fail: Callable[[str], None]) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.handler = handler
        self.fail = fail
        self.closed = False
        self.last_receive = time.monotonic()
        self.bytes_in = 0
        self.meta_limit: int | None = None
        # staged bytes rx[_rx_start:_rx_end]; how much of the buffer a read may fill: all of it while frames
        # are small, its first STAGING_BYTES after a frame bigger than the buffer (its successors are likely
        # big too: their payloads are then read in place, not staged and copied)
        self._rx = bytearray(STAGING_BYTES)
        self._staging = STAGING_BYTES
        self._rx_limit = STAGING_BYTES
        self._grow_to = 0  # set by ``trusted``: the buffer grows when no frame is being received
        self._rx_view = memoryview(self._rx)
        self._rx_addr = ctypes.addressof(ctypes.c_char.from_buffer(self._rx))
        self._rx_start = 0
        self._rx_end = 0
        self._scratch = Scratch()  # the iovec of a payload of a few entries
        # the frame whose payload (or meta too big for the staging buffer) is due
        self._frame: FrameHeader | None = None
        self._meta = bytearray()
        self._meta_wanted = 0
        self._got = 0
        self._payload_left = 0
        self._sink: PayloadSink | None = None
        self._cursor: Cursor | None = None

    @property
    def staging_bytes(self) -> int:
        """The size of the staging buffer now (what the stream holds for frame heads)."""
        return self._staging

    def trusted(self) -> None:
        """The peer may make the stream hold more (``TRUSTED_STAGING_BYTES``)."""
        self._grow_to = TRUSTED_STAGING_BYTES

    def close(self) -> None:
        self.closed = True
        self._rx_start = self._rx_end = 0
        self._sink = None

    def on_readable(self) -> None:
        """The loop's reader callback: read until the socket is drained (or a bound of reads)."""
        heard = False
        for _ in range(_READS_PER_WAKEUP):
            if self.closed:
                return
            try:
                count, drained = self._read_once()
            except (BlockingIOError, InterruptedError):
                break
            except ProtocolError as error:
                log.warning("closing link stream %r: protocol violation: %s", self.handler, error)
                self.fail(f"protocol violation: {error}")
                return
            except OSError as error:
                self.fail(f"receive failed: {error.strerror or error}")
                return
            except Exception as error:  # a bug in a handler must not take the engine down
                log.exception("closing link stream %r: unexpected error while receiving", self.handler)
                self.fail(f"internal error: {error!r}")
                return
            if count == 0:
                self.fail("peer closed the connection")
                return
            self.bytes_in += count
            heard = True
            if drained:  # a short read: nothing more is waiting (the loop calls again if that changes)
                break
        if heard:
            self.last_receive = time.monotonic()

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
        start, end = self._rx_start, self._rx_end
        while start < end and not self.closed:
            if self._frame is not None:  # payload bytes that arrived behind their header
                take = min(end - start, self._payload_left)
                self._take_staged(start, take)
                start += take
                continue
            if end - start < HEADER_SIZE:
                break
            taken = self._parse_frame(start, end)
            if not taken:
                break  # the rest of the meta is still on its way
            start += taken
        view = self._rx_view
        if start >= end:
            start = end = 0
        elif start:
            view[:end - start] = view[start:end]
            end -= start
            start = 0
        self._rx_start, self._rx_end = start, end

    def _parse_frame(self, start: int, end: int) -> int:
        """The frame whose head starts at ``start``: the staged bytes it took (0: its meta is not all here)."""
        view = self._rx_view
        frame = decode_header(view[start:start + HEADER_SIZE])
        meta_len = frame.meta_len
        if self.meta_limit is not None and meta_len > self.meta_limit:
            raise ProtocolError(f"{frame.kind.name} announces {meta_len} bytes of meta; "
                                f"at most {self.meta_limit} are accepted now")
        if HEADER_SIZE + meta_len > self._staging:  # its own buffer, read straight into
            have = min(end - start - HEADER_SIZE, meta_len)
            self._meta = bytearray(meta_len)
            self._meta[:have] = view[start + HEADER_SIZE:start + HEADER_SIZE + have]
            self._frame, self._meta_wanted, self._got = frame, meta_len, have
            if have == meta_len:
                self._meta_wanted = 0
                self._frame_ready(frame, bytes(self._meta))
                self._meta = bytearray()
            return HEADER_SIZE + have
        if end - start < HEADER_SIZE + meta_len:
            return 0
        meta = bytes(view[start + HEADER_SIZE:start + HEADER_SIZE + meta_len])
        taken = HEADER_SIZE + meta_len
        payload_len = frame.payload_len
        if not payload_len:
            self.handler.on_frame(frame, meta)
        elif end - start - taken >= payload_len:  # its whole payload is staged too
            taken += self._frame_in_hand(frame, meta, start + taken)
        else:
            self._frame_ready(frame, meta)
        return taken

    def _frame_in_hand(self, frame: FrameHeader, meta: bytes, at: int) -> int:
        """A frame whose payload is all in the staging buffer at ``at``: the handler is told so (it may then
        skip what a payload still on its way needs), and the payload is copied into its sink, whose
        ``on_done`` runs before this returns. Returns the staged bytes consumed."""
        self._rx_limit = self._staging  # a small frame: reads go on filling the staging buffer
        sink = self.handler.on_frame(frame, meta, True)
        payload_len = frame.payload_len
        if sink is None or sink.cancelled or self.closed:  # discarded
            return payload_len
        if sink.nbytes != payload_len:
            raise ProtocolError(f"payload of {payload_len} bytes does not fit a sink of {sink.nbytes}")
        iov = sink.iov
        (iov if type(iov) is IoVec else IoVec.of(iov, sink.nbytes)).copy_from(self._rx_addr + at)
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
            self._cursor = Cursor(IoVec.of(sink.iov, sink.nbytes), spill=(self._rx_addr, self._rx_limit),
                                  scratch=self._scratch)

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
        """Read the payload straight into the sink's memory; the read goes on into the staging buffer
        (the next frame's head) when the rest of the payload fits in one call."""
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
