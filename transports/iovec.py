"""Vectored I/O over ``kvpush.layout.IoVec``: the libc calls, the most entries one call takes, a cursor that
resumes after partial reads or writes, a stream's scratch vector, and where a bytes object's contents are.
Shared by the TCP stream and the same-host mover; no I/O of its own."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

import numpy as np

from kvpush.layout import FEW, MEMORY, IoVec

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

LIBC = ctypes.CDLL(None, use_errno=True)  # readv/writev here; cma binds process_vm_*
readv = LIBC.readv
readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
readv.restype = ctypes.c_ssize_t
writev = LIBC.writev
writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
writev.restype = ctypes.c_ssize_t

_ENTRY = struct.Struct("<QQ")


SCRATCH_ROWS = FEW + 1  # the rows of a ``Scratch``


class Scratch:
    """A stream's own ``struct iovec`` array for a vector of a few entries and one more (a frame's head
    before them, or a spill buffer behind them): a short frame or payload needs no vector of its own."""

    def __init__(self) -> None:
        self.table = np.zeros((SCRATCH_ROWS, 2), np.uint64)
        self.address = int(self.table.ctypes.data)
        self.view = self.table.data.cast("B")


class Cursor:
    """Progress through an ``IoVec`` (after an optional ``head`` entry), resumable after partial reads or
    writes: a call that stops inside an entry shortens that entry in the kernel's vector.

    ``spill``: (address, size) of a buffer appended as one more entry behind the vector, so that a read
    that finishes the vector goes on into it (the next frame's first bytes) in the same call. ``scratch``:
    the stream's ``Scratch``, used when everything fits (one stream moves one vector at a time).

    A few entries are tracked as ints (no numpy call); many with numpy (no Python loop per entry)."""

    __slots__ = ("vec", "rows", "total", "done", "index", "base", "_entries", "_ints", "_view")

    def __init__(self, iov: IoVec, head: tuple[int, int] | None = None, spill: tuple[int, int] | None = None,
                 scratch: Scratch | None = None) -> None:
        first = () if head is None else head
        tail = () if spill is None else spill
        self.rows = iov.entries + (head is not None)
        self.total = iov.nbytes + (0 if head is None else head[1])
        self.done = 0
        self.index = 0
        self._entries = self.rows + (spill is not None)  # in the kernel's vector
        if scratch is not None and self._entries <= SCRATCH_ROWS:
            iov.pack_into(scratch.view, first, tail)
            self.vec, self.base, self._view = scratch.table, scratch.address, scratch.view
            self._ints: list[int] | None = [*first, *iov.ints()]
            return
        self.vec = np.empty((self.rows + (spill is not None), 2), np.uint64)
        self.base = int(self.vec.ctypes.data)
        self._view = self.vec.data.cast("B")
        self._ints = None
        offset = 0 if head is None else 1
        if head is not None:
            self.vec[0] = head
        self.vec[offset:self.rows] = iov.array()
        if spill is not None:
            self.vec[self.rows] = spill

    def advance(self, count: int) -> None:
        """``count`` more bytes of the vector (not of the spill) were moved."""
        self.done += count
        if self.done >= self.total:
            self.index = self.rows
            return
        if self._ints is not None:
            self._advance_ints(count)
            return
        vec, index = self.vec, self.index
        address, length = vec[index].tolist()
        if count < length:  # still inside the current entry
            vec[index] = (address + count, length - count)
            return
        cum = np.cumsum(vec[index:self.rows, 1])
        step = int(np.searchsorted(cum, count, side="right"))
        consumed = count - (int(cum[step - 1]) if step else 0)
        index += step
        vec[index, 0] += np.uint64(consumed)
        vec[index, 1] -= np.uint64(consumed)
        self.index = index

    def _advance_ints(self, count: int) -> None:
        entries, index = self._ints, self.index
        assert entries is not None
        while count >= entries[2 * index + 1]:  # whole entries (the vector is not finished: one is left)
            count -= entries[2 * index + 1]
            index += 1
        if count:
            address, length = entries[2 * index] + count, entries[2 * index + 1] - count
            entries[2 * index], entries[2 * index + 1] = address, length
            _ENTRY.pack_into(self._view, 16 * index, address, length)
        self.index = index

    def pointer(self) -> tuple[int, int]:
        """(address of the current entry, entries to pass) for readv/writev; the spill entry is passed
        only when the rest of the vector fits in the same call."""
        return self.base + 16 * self.index, min(IOV_MAX, self._entries - self.index)

    def fill(self, source: int, count: int) -> None:
        """Copy ``count`` bytes (at most the rest of the vector) from address ``source`` into it: the few
        bytes of a payload that arrived in the staging buffer behind their header."""
        while count > 0:
            if self._ints is not None:
                base, length = self._ints[2 * self.index], self._ints[2 * self.index + 1]
            else:
                base, length = self.vec[self.index].tolist()
            step = min(count, length)
            MEMORY[base:base + step] = MEMORY[source:source + step]
            source += step
            count -= step
            self.advance(step)


def address_by_cast(data: bytes) -> int:
    """Where a bytes object's contents are (it is immutable and referenced by the frame)."""
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert address is not None
    return address


def _bytes_offset() -> int | None:
    """Where CPython keeps a bytes object's contents relative to the object (``id``): a fixed offset,
    much cheaper to add than a ctypes cast, paid by every frame. Checked here on objects of several sizes
    against the cast; None (use the cast) if it does not hold."""
    offset = sys.getsizeof(b"") - 1
    for probe in (b"\x01", b"kvpush" * 7, bytes(range(256)) * 9):
        if id(probe) + offset != address_by_cast(probe) or ctypes.string_at(id(probe) + offset, len(probe)) != probe:
            return None
    return offset


BYTES_OFFSET = _bytes_offset()


def address_of(data: bytes) -> int:
    """Where a bytes object's contents are (it is immutable and referenced by the frame)."""
    if BYTES_OFFSET is not None and type(data) is bytes:
        return id(data) + BYTES_OFFSET
    return address_by_cast(data)


def check(result: int) -> int:
    if result >= 0:
        return result
    code = ctypes.get_errno()
    if code in (errno.EAGAIN, errno.EWOULDBLOCK):
        raise BlockingIOError(code, os.strerror(code))
    if code == errno.EINTR:
        raise InterruptedError(code, os.strerror(code))
    raise OSError(code, os.strerror(code))
