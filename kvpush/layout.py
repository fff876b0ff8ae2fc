"""Pure layout: block lists -> merged byte runs -> scatter/gather vectors, in three value types.

``Blocks`` (block ids), ``Runs`` (byte runs within one tensor) and ``IoVec`` (address/length entries for
the kernel) each choose their own storage: up to ``FEW`` items as plain Python ints, more as numpy
arrays. A short transfer (a decode-time push, a short prompt's layer) then goes from the call to the
kernel without a numpy call - each costs microseconds on the cold cache a wakeup finds, more than the
work itself - and a long one never loops in Python per block. Callers use the methods and never ask
which storage a value holds: the choice is made here, once, by size.

A run is ``(offset, ..., length)`` in bytes relative to the start of one tensor (two offsets in a plan:
source and destination; one on the wire); the same runs apply to every tensor of a layer, so a layer's
request carries them once. Runs are merged where both the source and the destination block ids are
consecutive. An ``IoVec`` is laid out exactly like Linux's ``struct iovec`` array (base address,
length), so a transport hands it to ``readv``/``writev``/``process_vm_writev`` in one native call.
"""

from __future__ import annotations

import array
import ctypes
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

#: Values of up to this many items (block ids, runs, iovec entries) are kept as Python ints.
FEW = 16

RUN_DTYPE = np.dtype("<u8")
U64 = np.uint64
# _PACK[n]: n uint64s, for a few entries (and a head or spill entry beside them) in one struct call
_PACK = [struct.Struct(f"<{count}Q") for count in range(2 * (FEW + 2) + 1)]


# -- block ids -----------------------------------------------------------------------------------------
class Blocks:
    """Checked block ids (``kvpush.validate.check_blocks`` makes them): a tuple of ints for a few, a uint64
    array for more. ``top`` is the largest id (-1 for none): a bounds check reads it, and only a failing
    one looks for the offending id (``first_at_least``)."""

    __slots__ = ("_ids", "_array", "count", "top")

    def __init__(self, ids: tuple[int, ...] | None, ids_array: np.ndarray[Any, Any] | None, count: int,
                 top: int) -> None:
        self._ids = ids
        self._array = ids_array
        self.count = count
        self.top = top

    @classmethod
    def of(cls, ids: Blocks | Sequence[int] | np.ndarray[Any, Any]) -> Blocks:
        """Non-negative int ids in any sequence or integer array (already checked)."""
        if isinstance(ids, Blocks):
            return ids
        if len(ids) <= FEW:
            few = tuple([int(block) for block in ids])
            return cls(few, None, len(few), max(few) if few else -1)
        array = np.asarray(ids).astype(U64)
        return cls(None, array, int(array.shape[0]), int(array.max()) if array.shape[0] else -1)

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"Blocks({self.tolist()})"

    def tolist(self) -> list[int]:
        return list(self._ids) if self._ids is not None else [int(block) for block in self.array().tolist()]

    def ints(self) -> tuple[int, ...]:
        """The ids as ints (for many, a conversion: use ``array`` there)."""
        return self._ids if self._ids is not None else tuple(self.array().tolist())

    def array(self) -> np.ndarray[Any, Any]:
        if self._array is None:
            self._array = np.array(self._ids, U64)
        return self._array

    def first_at_least(self, limit: int) -> tuple[int, int] | None:
        """(index, id) of the first id ``>= limit``, or None."""
        if self.top < limit:
            return None
        if self._ids is not None:
            return next((index, block) for index, block in enumerate(self._ids) if block >= limit)
        index = int(np.flatnonzero(self.array() >= limit)[0])
        return index, int(self.array()[index])

    def repeated(self) -> int | None:
        """An id that appears twice, or None."""
        if self._ids is not None:
            if len(set(self._ids)) == len(self._ids):  # the common case, at C level
                return None
            seen: set[int] = set()
            for block in self._ids:
                if block in seen:
                    return block
                seen.add(block)
            return None
        ordered = np.sort(self.array())
        twice = np.flatnonzero(ordered[1:] == ordered[:-1])
        return None if not twice.shape[0] else int(ordered[twice[0]])


# -- runs ------------------------------------------------------------------------------------------------
class Runs:
    """Byte runs within one tensor, in transfer order: each ``width`` offsets then a length. Up to ``FEW``
    runs as a tuple of int tuples, more as numpy columns; the columns of either are laid out on demand."""

    __slots__ = ("_rows", "_columns", "width", "count", "bytes_per_tensor")

    def __init__(self, rows: tuple[tuple[int, ...], ...] | None, columns: tuple[np.ndarray[Any, Any], ...] | None,
                 width: int, count: int, bytes_per_tensor: int) -> None:
        self._rows = rows
        self._columns = columns
        self.width = width  # offsets per run
        self.count = count
        self.bytes_per_tensor = bytes_per_tensor  # the bytes one tensor moves

    @classmethod
    def of_rows(cls, rows: Sequence[tuple[int, ...]], width: int) -> Runs:
        """Runs from int tuples ``(offset, ..., length)``."""
        if len(rows) > FEW:
            table = np.array(rows, U64).reshape(-1, width + 1)
            return cls.of_columns(*[table[:, column] for column in range(width + 1)])
        return cls(tuple(rows), None, width, len(rows), sum([row[-1] for row in rows]))

    @classmethod
    def of_columns(cls, *columns: np.ndarray[Any, Any]) -> Runs:
        """Runs from arrays: the offsets, then the lengths."""
        arrays = tuple(np.asarray(column).astype(U64, copy=False) for column in columns)
        count = int(arrays[-1].shape[0])
        if count <= FEW:
            return cls.of_rows(list(zip(*[column.tolist() for column in arrays])), len(arrays) - 1)
        return cls(None, arrays, len(arrays) - 1, count, int(arrays[-1].sum()))

    def __len__(self) -> int:
        return self.count

    def rows(self) -> tuple[tuple[int, ...], ...]:
        if self._rows is None:
            self._rows = tuple(zip(*[column.tolist() for column in self._columns or ()]))
        return self._rows

    def column(self, index: int) -> np.ndarray[Any, Any]:
        """One column as a uint64 array (``-1``: the lengths)."""
        if self._columns is None:
            table = np.array(self._rows or (), U64).reshape(-1, self.width + 1)
            self._columns = tuple(table[:, column].copy() for column in range(self.width + 1))
        return self._columns[index]

    @property
    def src_offset(self) -> np.ndarray[Any, Any]:
        return self.column(0)

    @property
    def dst_offset(self) -> np.ndarray[Any, Any]:
        return self.column(1)

    @property
    def length(self) -> np.ndarray[Any, Any]:
        return self.column(-1)

    def wire(self, column: int) -> bytes:
        """``(offset, length)`` of every run, packed for a transfer frame (``pack_runs``)."""
        rows = self._rows
        if rows is not None:
            if self.count == 1:
                return _PACK[2].pack(rows[0][column], rows[0][-1])
            return _PACK[2 * self.count].pack(*[value for row in rows for value in (row[column], row[-1])])
        return pack_runs(self.column(column), self.length)

    def vector(self, addrs: Sequence[int] | np.ndarray[Any, Any], first: int, count: int, column: int) -> IoVec:
        """The iovec of these runs in tensors ``[first, first + count)`` of ``addrs`` (their base addresses),
        tensor-major (the wire order)."""
        entries = count * self.count
        if entries <= FEW and self._rows is not None:
            if entries == 1:  # one run of one tensor (a decode-time push)
                row = self._rows[0]
                return IoVec((int(addrs[first]) + row[column], row[-1]), None, 1, self.bytes_per_tensor)
            flat: list[int] = []
            for base in (addrs[first:first + count].tolist() if isinstance(addrs, np.ndarray)
                         else addrs[first:first + count]):
                for row in self._rows:
                    flat += (base + row[column], row[-1])
            return IoVec(tuple(flat), None, entries, count * self.bytes_per_tensor)
        return IoVec.of_array(scatter_vector(addrs[first:first + count], self.column(column), self.length),
                              count * self.bytes_per_tensor)

    def within(self, limit: int) -> bool:
        """Every run lies inside ``[0, limit)`` of column 0, is not empty and does not overflow."""
        if self._rows is not None:
            for row in self._rows:
                if row[-1] <= 0 or row[0] + row[-1] > limit:
                    return False
            return True
        return runs_in_bounds(self.column(0), self.length, limit)


def block_runs(src: Blocks, dst: Blocks, block_bytes: int) -> Runs:
    """Pairs ``(src[i], dst[i])`` -> runs ``(src offset, dst offset, length)``, ordered by source (the pairs
    are independent: the order of writes to distinct destination blocks does not matter) and merged where
    both ids step by one."""
    ids = src._ids
    if ids is not None:
        if src.count == 1:  # one block (decode-time pushes): one run, nothing to sort or merge
            dst_ids = dst._ids if dst._ids is not None else dst.ints()
            return Runs(((ids[0] * block_bytes, dst_ids[0] * block_bytes, block_bytes),), None, 2, 1, block_bytes)
        pairs = sorted(zip(ids, dst.ints()))
        merged: list[list[int]] = []
        for s, d in pairs:
            if merged and s == merged[-1][0] + merged[-1][2] and d == merged[-1][1] + merged[-1][2]:
                merged[-1][2] += 1
            else:
                merged.append([s, d, 1])
        return Runs.of_rows([(s * block_bytes, d * block_bytes, n * block_bytes) for s, d, n in merged], 2)
    src_start, dst_start, counts = merge_block_runs(src.array(), dst.array())
    unit = U64(block_bytes)
    return Runs.of_columns(src_start.astype(U64) * unit, dst_start.astype(U64) * unit, counts.astype(U64) * unit)


def contiguous_runs(src_offset: int, dst_offset: int, length: int) -> Runs:
    """One run (the contiguous-cache transfers: one batch slot per tensor)."""
    return Runs.of_rows([(src_offset, dst_offset, length)], 2)


def merge_block_runs(
    src_blocks: np.ndarray[Any, Any], dst_blocks: np.ndarray[Any, Any]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``block_runs`` in block ids, with numpy: runs ``(src_start, dst_start, count)``."""
    src = np.asarray(src_blocks, dtype=np.int64)
    dst = np.asarray(dst_blocks, dtype=np.int64)
    if src.shape[0] <= 1:
        return src, dst, np.ones(src.shape[0], np.int64)
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    breaks = np.ones(src.shape[0], dtype=bool)
    breaks[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(breaks)
    counts = np.diff(np.append(starts, src.shape[0]))
    return src[starts], dst[starts], counts


def pack_runs(offset: np.ndarray[Any, Any], length: np.ndarray[Any, Any]) -> bytes:
    pairs = np.empty((offset.shape[0], 2), RUN_DTYPE)
    pairs[:, 0] = offset
    pairs[:, 1] = length
    return pairs.tobytes()


def unpack_runs(data: bytes | memoryview) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Inverse of ``pack_runs``; ``len(data)`` must be a multiple of 16."""
    pairs = np.frombuffer(data, RUN_DTYPE).reshape(-1, 2)
    return pairs[:, 0].astype(U64), pairs[:, 1].astype(U64)


def unpack_wire_runs(data: bytes | bytearray | memoryview, offset: int, count: int) -> Runs:
    """``count`` packed ``(offset, length)`` pairs at ``offset`` of ``data`` (a transfer frame's meta)."""
    if count == 1:  # one run (a decode-time push)
        run_offset, length = _PACK[2].unpack_from(data, offset)
        return Runs(((run_offset, length),), None, 1, 1, length)
    if count <= FEW:
        flat = _PACK[2 * count].unpack_from(data, offset)
        return Runs(tuple(zip(flat[0::2], flat[1::2])), None, 1, count, sum(flat[1::2]))
    pairs = np.frombuffer(data, RUN_DTYPE, count=2 * count, offset=offset).reshape(-1, 2)
    return Runs(None, (pairs[:, 0].astype(U64), pairs[:, 1].astype(U64)), 1, count,
                int(pairs[:, 1].sum(dtype=np.float64)))  # float: an overflow shows as a huge number


def scatter_vector(
    tensor_addrs: np.ndarray[Any, Any] | Sequence[int],
    offsets: np.ndarray[Any, Any],
    lengths: np.ndarray[Any, Any],
) -> np.ndarray[Any, Any]:
    """The ``(n, 2)`` uint64 iovec array for ``len(tensor_addrs)`` tensors x runs, tensor-major."""
    bases = np.asarray(tensor_addrs, dtype=U64)
    iov = np.empty((bases.shape[0], offsets.shape[0], 2), U64)
    iov[:, :, 0] = bases[:, None] + offsets.astype(U64, copy=False)[None, :]  # (uint64 + int64 -> float64)
    iov[:, :, 1] = lengths.astype(U64, copy=False)[None, :]
    return iov.reshape(-1, 2)


def runs_in_bounds(offsets: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any], limit: int) -> bool:
    """True when every run lies inside ``[0, limit)`` and none overflows (receiver-side fence)."""
    if offsets.shape[0] == 0:
        return True
    off = offsets.astype(U64)
    ln = lengths.astype(U64)
    end = off + ln
    overflow = end < off
    return bool(not overflow.any() and (end <= U64(limit)).all() and (ln > 0).all())


# -- scatter/gather vectors ------------------------------------------------------------------------------
# The process's memory as one buffer: ``MEMORY[address:address + length]`` is a buffer over those bytes,
# made without a copy or a foreign call, which CPython's own I/O (``os.writev``, ``recv_into``) and slice
# assignment take. Making or slicing it touches no memory, only what a call then reads or writes, so an
# address is as trusted as it was before (it comes from a registered cache or a buffer held meanwhile).
# A ctypes call costs 3-4 us on the cold cache a wakeup finds, a slice 0.2 us (docs/perf/notes.md).
MEMORY = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B")


class IoVec:
    """``(address, length)`` entries over memory, as the kernel reads them. Up to ``FEW`` entries as flat
    ints ``(address, length, address, length, ...)``, more as an ``(n, 2)`` uint64 array. ``entries`` and
    ``nbytes`` are plain ints. A transport that owns a vector (a payload sink's) may not change it: its
    progress is a ``transports.iovec.Cursor``'s."""

    __slots__ = ("_flat", "_array", "_native", "entries", "nbytes")

    def __init__(self, flat: tuple[int, ...] | None, iov_array: np.ndarray[Any, Any] | None, entries: int,
                 nbytes: int) -> None:
        self._flat = flat
        self._array = iov_array
        self._native: Any = None
        self.entries = entries
        self.nbytes = nbytes

    @classmethod
    def of(cls, value: IoVec | Sequence[int] | np.ndarray[Any, Any], nbytes: int | None = None) -> IoVec:
        """A vector from an ``IoVec`` (itself), flat ints ``(address, length, ...)`` or an ``(n, 2)`` array."""
        if isinstance(value, IoVec):
            return value
        if isinstance(value, np.ndarray):
            return cls.of_array(value, nbytes)
        return cls.of_ints(tuple(value), nbytes)

    @classmethod
    def of_ints(cls, flat: tuple[int, ...], nbytes: int | None = None) -> IoVec:
        if len(flat) > 2 * FEW:
            return cls.of_array(np.array(flat, U64).reshape(-1, 2), nbytes)
        return cls(flat, None, len(flat) >> 1, sum(flat[1::2]) if nbytes is None else nbytes)

    @classmethod
    def of_array(cls, iov: np.ndarray[Any, Any], nbytes: int | None = None) -> IoVec:
        rows = int(iov.shape[0])
        if rows <= FEW:
            flat = tuple(iov.reshape(-1).tolist())
            return cls(flat, None, rows, sum(flat[1::2]) if nbytes is None else nbytes)
        iov = np.ascontiguousarray(iov, U64)
        return cls(None, iov, rows, int(iov[:, 1].sum()) if nbytes is None else nbytes)

    def __len__(self) -> int:
        return self.entries

    def __repr__(self) -> str:
        return f"<IoVec {self.entries} entries, {self.nbytes} bytes>"

    def tolist(self) -> list[list[int]]:
        """``[[address, length], ...]``."""
        if self._flat is not None:
            flat = self._flat
            return [[flat[index], flat[index + 1]] for index in range(0, len(flat), 2)]
        return self.array().tolist()  # type: ignore[no-any-return]

    def ints(self) -> tuple[int, ...]:
        """The entries as flat ints (for many entries, a conversion: use ``array`` there)."""
        return self._flat if self._flat is not None else tuple(self.array().reshape(-1).tolist())

    def array(self) -> np.ndarray[Any, Any]:
        """The entries as a contiguous ``(n, 2)`` uint64 array (laid out once)."""
        if self._array is None:
            self._array = np.array(self._flat or (), U64).reshape(-1, 2)
        return self._array

    def rows(self, start: int, stop: int) -> IoVec:
        """Entries ``[start, stop)`` as a vector of their own."""
        if self._flat is not None:
            return IoVec.of_ints(self._flat[2 * start:2 * stop])
        return IoVec.of_array(self.array()[start:stop])

    def pack_into(self, buffer: memoryview, head: tuple[int, ...] = (), tail: tuple[int, ...] = ()) -> int:
        """Write ``head`` (flat entries), every entry, then ``tail`` into ``buffer`` (a struct iovec array
        with room for them); the entries written."""
        rows = self.entries + (len(head) + len(tail)) // 2
        if self._flat is not None:
            _PACK[2 * rows].pack_into(buffer, 0, *head, *self._flat, *tail)
            return rows
        table = np.frombuffer(buffer, U64, count=2 * rows).reshape(rows, 2)
        first = len(head) // 2
        table[:first] = np.array(head, U64).reshape(-1, 2)
        table[first:first + self.entries] = self.array()
        table[first + self.entries:] = np.array(tail, U64).reshape(-1, 2)
        return rows

    def copy_from(self, source: int) -> None:
        """Copy ``nbytes`` contiguous bytes at address ``source`` into the entries, in order."""
        flat, memory = self._flat or self.ints(), MEMORY
        for index in range(0, len(flat), 2):
            address, length = flat[index], flat[index + 1]
            memory[address:address + length] = memory[source:source + length]
            source += length

    def buffers(self, head: bytes) -> list[Any]:
        """``head``, then a buffer over each entry (``MEMORY``'s), for ``os.writev``: for a few entries."""
        flat, memory = self._flat, MEMORY
        if flat is None:
            flat = self.ints()
        elif len(flat) <= 2:
            return [head, memory[flat[0]:flat[0] + flat[1]]] if flat else [head]
        return [head, *[memory[flat[index]:flat[index] + flat[index + 1]] for index in range(0, len(flat), 2)]]

    def native(self) -> tuple[int, Any]:
        """(address, owner) of the entries as one contiguous ``struct iovec`` array: the owner keeps the
        memory valid and exposes the buffer protocol. Made once."""
        if self._native is None:
            if self._flat is not None:
                owner: Any = array.array("Q", self._flat)
                self._native = (owner.buffer_info()[0], owner)
            else:
                self._native = (int(self.array().ctypes.data), self.array())
        return self._native  # type: ignore[no-any-return]

    def chunks(self, limit: int) -> Iterable[tuple[int, int, int]]:
        """``(address, entries, bytes)`` of consecutive pieces of at most ``limit`` entries, over ``native``."""
        address = self.native()[0]
        if self.entries <= limit:
            return ((address, self.entries, self.nbytes),)
        lengths = self.array()[:, 1]
        return ((address + 16 * start, min(limit, self.entries - start), int(lengths[start:start + limit].sum()))
                for start in range(0, self.entries, limit))
