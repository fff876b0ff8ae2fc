"""Vectored I/O over numpy iovecs (rows of (address, length), uint64): the libc calls, the most
entries one call takes, a cursor that resumes after partial reads or writes, and where a bytes
object's contents are. Shared by the TCP stream and the same-host mover; no I/O of its own."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvpush.layout import FlatIoVec, IoVec

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

LIBC = ctypes.CDLL(None, use_errno=True)  # readv/writev here; cma binds process_vm_*
readv = LIBC.readv
readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
readv.restype = ctypes.c_ssize_t
writev = LIBC.writev
writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
writev.restype = ctypes.c_ssize_t


class Cursor:
    """Progress through an iovec, resumable after partial reads or writes (numpy, no loop per
    entry): a call that stops inside an entry shortens that entry in place.

    ``spill``: (address, size) of a buffer to append as one more entry behind the vector, so that a
    read that finishes the vector goes on into it (the next frame's first bytes) in the same call.
    ``scratch``: (vector, its address) the copy may use when it fits (a stream receives one payload
    at a time), saving an allocation and an address lookup per frame."""

    __slots__ = ("vec", "rows", "total", "done", "index", "base")

    def __init__(self, iov: IoVec, total: int | None = None, spill: tuple[int, int] | None = None,
                 scratch: tuple[IoVec, int] | None = None) -> None:
        rows = iov.shape[0]
        if spill is not None:  # a copy: the sink's iovec stays as the engine made it
            if scratch is not None and rows < scratch[0].shape[0]:
                self.vec, self.base = scratch[0][:rows + 1], scratch[1]
            else:
                self.vec = np.empty((rows + 1, 2), np.uint64)
                self.base = self.vec.ctypes.data
            self.vec[:rows] = iov
            self.vec[rows] = spill
        else:  # the caller's own contiguous uint64 vector, advanced in place
            self.vec = iov
            self.base = iov.ctypes.data
        self.rows = rows
        self.total = int(self.vec[:rows, 1].sum()) if total is None else total
        self.done = 0
        self.index = 0

    def advance(self, count: int) -> None:
        """``count`` more bytes of the vector (not of the spill) were moved."""
        self.done += count
        if self.done >= self.total:
            self.index = self.rows
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

    def pointer(self) -> tuple[int, int]:
        """(address of the current iovec entry, entries to pass) for readv/writev; the spill entry
        is passed only when the rest of the vector fits in the same call."""
        return self.base + 16 * self.index, min(IOV_MAX, self.vec.shape[0] - self.index)

    def fill(self, source: int, count: int) -> None:
        """Copy ``count`` bytes (at most the rest of the vector) from address ``source`` into it. Used
        for the few bytes of a payload that arrived in the staging buffer behind their header, so it
        runs over at most a staging buffer's worth of entries, once per frame."""
        while count > 0:
            base, length = self.vec[self.index].tolist()
            step = min(count, length)
            ctypes.memmove(base, source, step)
            source += step
            count -= step
            self.advance(step)


_ENTRY = struct.Struct("<QQ")
# VECTOR_STRUCTS[n]: the compiled struct of n uint64s, for the iovec of a few entries (up to 64 rows)
VECTOR_STRUCTS = [struct.Struct(f"<{count}Q") for count in range(2 * 64 + 1)]


class FlatCursor:
    """``Cursor``'s interface over a few entries given flat (``kvpush.layout.FlatIoVec``), with no
    numpy call (each costs microseconds on the cold cache a wakeup finds): the vector and the spill
    entry behind it are written into the caller's scratch vector by one struct call, and the entry a
    call stops inside is rewritten there in place. The scratch must hold ``len(flat) // 2 + 1`` rows."""

    __slots__ = ("entries", "rows", "total", "done", "index", "base", "buffer")

    def __init__(self, flat: FlatIoVec, total: int, spill: tuple[int, int], scratch: tuple[memoryview, int]) -> None:
        self.buffer, self.base = scratch
        VECTOR_STRUCTS[len(flat) + 2].pack_into(self.buffer, 0, *flat, *spill)  # scratch: < 64 rows
        self.entries = list(flat)
        self.rows = len(flat) // 2
        self.total = total
        self.done = 0
        self.index = 0

    def advance(self, count: int) -> None:
        """``count`` more bytes of the vector (not of the spill) were moved."""
        self.done += count
        if self.done >= self.total:
            self.index = self.rows
            return
        entries, index = self.entries, self.index
        while count >= entries[2 * index + 1]:  # whole entries (the vector is not finished: one is left)
            count -= entries[2 * index + 1]
            index += 1
        if count:
            address, length = entries[2 * index] + count, entries[2 * index + 1] - count
            entries[2 * index], entries[2 * index + 1] = address, length
            _ENTRY.pack_into(self.buffer, 16 * index, address, length)
        self.index = index

    def pointer(self) -> tuple[int, int]:
        """As ``Cursor.pointer``: the spill entry goes with the rest of the vector."""
        return self.base + 16 * self.index, self.rows + 1 - self.index

    def fill(self, source: int, count: int) -> None:
        """As ``Cursor.fill``."""
        entries = self.entries
        while count > 0:
            index = self.index
            step = min(count, entries[2 * index + 1])
            ctypes.memmove(entries[2 * index], source, step)
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
    ~30x cheaper to add than a ctypes cast (~3 us on a small host, paid by every frame). Checked here
    on objects of several sizes against the cast; None (use the cast) if it does not hold."""
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
