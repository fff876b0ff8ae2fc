"""TCP, sending: frames queue in order and leave whole.

The pump ``writev``s header, meta and payload iovec together straight from the source memory, resuming
after partial writes, and waits with ``add_writer`` when the socket is full. A frame of a few entries is
written through the stream's scratch vector (no vector of its own); a frame that does not leave whole
gets a cursor. A frame that has started is always finished (or the stream closed), so the byte stream
never holds half a frame.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import os

from kvpush.layout import IoVec

from .base import OutgoingFrame
from .iovec import SCRATCH_ROWS, Cursor, Scratch, address_of, check, writev

# Frames up to this size are written by the call that queues them: deferring a write of a few hundred
# microseconds to the next loop pass costs a layer more than the write itself. Bigger ones leave from the
# loop, so starting a transfer costs the caller microseconds.
SEND_NOW_BYTES = 1 << 20
_NO_PAYLOAD = IoVec.of_ints(())
# A first write of up to this many payload entries goes through ``os.writev`` over ``MEMORY`` buffers (a
# slice each); more are packed into the scratch vector for one ctypes ``writev``, cheaper from about 8.
BUFFER_ENTRIES = 8


def write_whole(fd: int, head: bytes, payload: IoVec, scratch: Scratch) -> int:
    """One write of a whole frame whose payload has fewer than ``SCRATCH_ROWS`` entries: the bytes written
    (``BlockingIOError`` when the socket is full)."""
    entries = payload.entries
    if not entries:  # a control frame
        return os.write(fd, head)
    if entries <= BUFFER_ENTRIES:
        return os.writev(fd, payload.buffers(head))
    rows = payload.pack_into(scratch.view, (address_of(head), len(head)))
    return check(writev(fd, scratch.address, rows))


class TcpFrame:
    """One queued outgoing frame (see ``transports.base.OutgoingFrame``). Its cursor is made only when it
    does not leave whole through the stream's scratch vector at once, and its ``sent`` future only when
    someone asks for it (``left`` says the same without one)."""

    __slots__ = ("head", "payload", "total", "_cursor", "future", "_loop", "left", "started", "abandoned", "full")

    def __init__(self, head: bytes, payload: IoVec | None, loop: asyncio.AbstractEventLoop,
                 nbytes: int | None = None) -> None:
        self.head = head  # referenced here: the iovec points into it
        self.payload = _NO_PAYLOAD if payload is None else payload
        self.total = len(head) + (self.payload.nbytes if nbytes is None else nbytes)
        self._cursor: Cursor | None = None
        self._loop = loop
        self.future: asyncio.Future[None] | None = None  # ``sent``, once asked for
        self.left = False  # every byte was handed to the kernel
        self.started = False  # some of it was written: it is always finished (or the stream closed)
        self.abandoned = False
        self.full = False  # the last write was offered the whole rest of the frame and took less

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

    def failed(self, error: BaseException) -> None:
        """The stream closed before every byte left."""
        if not self.sent.done():
            self.sent.set_exception(error)
            self.sent.exception()  # retrieved: callers check the link's state

    def write(self, fd: int, scratch: Scratch) -> int:
        """One ``writev`` of what is left; the bytes written (``BlockingIOError`` when the socket is full).
        ``full`` says whether the call was offered every byte left and took fewer: the socket's buffer is
        full, and trying again before it drains would only fail (a system call per layer saved)."""
        self.started = True
        if self._cursor is None and self.payload.entries < SCRATCH_ROWS:  # the first write, few entries
            written = write_whole(fd, self.head, self.payload, scratch)
            self.full = written < self.total
            return written
        cursor = self.cursor
        address, count = cursor.pointer()
        written = check(writev(fd, address, count))
        self.full = cursor.index + count >= cursor.rows and written < cursor.total - cursor.done
        return written

    @property
    def cursor(self) -> Cursor:
        if self._cursor is None:
            self._cursor = Cursor(self.payload, head=(address_of(self.head), len(self.head)))
        return self._cursor

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


class FrameSender(abc.ABC):
    """The sending half of a ``TcpFrameStream`` (its base class): ``enqueue(prepare(...))``, in order.
    A write that fails stops the sending (later frames fail at once) and hands the error to
    ``send_failed``, the stream's: it closes the stream once what the peer sent before is delivered."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = fd
        self.loop = loop
        self.closed = False
        self.close_reason = ""
        self.send_error = ""  # set when a write failed: nothing more is sent
        self.bytes_out = 0
        self._queue: collections.deque[TcpFrame] = collections.deque()
        self._writer_armed = False
        self._pump_scheduled = False
        self._tx_scratch = Scratch()
        self._left = TcpFrame(b"", None, loop)  # what ``send`` returns for a frame it wrote whole at once
        self._left.left = self._left.started = True

    @abc.abstractmethod
    def close(self, reason: str, abort: bool = False) -> None:
        """The stream's: it stops the sending with ``_stop_sending``."""

    def send_failed(self, reason: str) -> None:
        """A write failed: close (a stream that also receives first hands over what it already has)."""
        self.close(reason)

    def prepare(self, head: bytes, payload: IoVec | None = None, nbytes: int | None = None) -> TcpFrame:
        """A frame ready to ``enqueue`` (nothing is sent yet). ``payload``: an ``IoVec`` (or what
        ``IoVec.of`` takes)."""
        if payload is not None and type(payload) is not IoVec:
            payload = IoVec.of(payload, nbytes)
        return TcpFrame(head, payload, self.loop, nbytes)

    def enqueue(self, frame: OutgoingFrame) -> None:
        """Queue a prepared frame behind everything sent so far. On an idle stream a frame up to
        ``SEND_NOW_BYTES`` leaves from here (its first write, at least); a bigger one from the loop."""
        assert isinstance(frame, TcpFrame)
        if self.closed or self.send_error:
            frame.failed(ConnectionError(f"stream closed: {self.close_reason or self.send_error}"))
            return
        self._queue.append(frame)
        if self._writer_armed or self._pump_scheduled:
            return  # it leaves behind the frames already waiting
        if frame.total <= SEND_NOW_BYTES:
            self._pump()
        else:
            self._pump_scheduled = True
            self.loop.call_soon(self._scheduled_pump)

    def send(self, head: bytes, payload: IoVec | None = None) -> TcpFrame:
        """``enqueue(prepare(head, payload))``. On an idle stream (nothing queued or being written) a frame
        that the pump would write whole at once (a few payload entries, up to ``SEND_NOW_BYTES``) is written
        here, by the pump's own ``write_whole``, and once it left whole the frame returned is one that says
        so (shared: it left, there is nothing to track): a small frame, such as every answer and a one-block
        write, leaves with no frame, queue or pump of its own. Whatever did not leave is queued as usual."""
        if not (self._queue or self._writer_armed or self._pump_scheduled or self.closed or self.send_error):
            if payload is not None and type(payload) is not IoVec:
                payload = IoVec.of(payload)
            vector = _NO_PAYLOAD if payload is None else payload
            total = len(head) + vector.nbytes
            if vector.entries < SCRATCH_ROWS and total <= SEND_NOW_BYTES:
                try:
                    written = write_whole(self.fd, head, vector, self._tx_scratch)
                except OSError:  # (full, or failing: the pump's own write meets it again and handles it)
                    written = 0
                if written:
                    self.bytes_out += written
                    if written == total:
                        return self._left
                    frame = self.prepare(head, payload)
                    frame.started = True  # the rest follows from the queue: never abandoned now
                    frame.advance(written)
                    self.enqueue(frame)
                    return frame
        frame = self.prepare(head, payload)
        self.enqueue(frame)
        return frame

    def _scheduled_pump(self) -> None:
        self._pump_scheduled = False
        if not self._writer_armed:
            self._pump()

    def _pump(self) -> None:
        queue, scratch = self._queue, self._tx_scratch
        while queue and not self.closed and not self.send_error:
            frame = queue[0]
            if frame.abandoned:
                queue.popleft()
                if not frame.sent.done():
                    frame.sent.cancel()
                continue
            try:
                written = frame.write(self.fd, scratch)
            except (BlockingIOError, InterruptedError):
                self._arm_writer()
                return
            except OSError as error:
                self.send_error = f"send failed: {error.strerror or error}"
                self._disarm_writer()
                self.send_failed(self.send_error)
                return
            self.bytes_out += written
            if written != frame.total and not frame.advance(written):  # (whole in one write: no call)
                if frame.full:  # the kernel took what it had room for: wait until the socket is writable
                    self._arm_writer()
                    return
                continue
            queue.popleft()
            frame.finished()
        if self._writer_armed:
            self._disarm_writer()

    def _arm_writer(self) -> None:
        if not self._writer_armed:
            self.loop.add_writer(self.fd, self._pump)
            self._writer_armed = True

    def _disarm_writer(self) -> None:
        if self._writer_armed:
            self.loop.remove_writer(self.fd)
            self._writer_armed = False

    def _stop_sending(self) -> None:
        """The stream closed (``closed``, ``close_reason`` set): the queued frames fail."""
        self._disarm_writer()
        error = ConnectionError(f"stream closed: {self.close_reason}")
        while self._queue:
            self._queue.popleft().failed(error)
