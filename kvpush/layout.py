"""Pure layout math: block lists -> merged byte runs -> scatter/gather vectors.

A run is ``(src_offset, dst_offset, length)`` in bytes, relative to the start of one tensor; the
same runs apply to every tensor of a layer, so a layer's wire request carries them once. Runs are
computed once per call with numpy (no Python loop per block) and merged where both the source
and the destination block ids are consecutive.

An ``IoVec`` is an ``(n, 2)`` uint64 array laid out exactly like Linux's ``struct iovec`` array
(base address, length), so a transport can hand it to ``readv``/``writev``/``process_vm_writev``
in one native call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

IoVec = np.ndarray[Any, np.dtype[np.uint64]]
#: A few iovec entries as plain ints, flattened: ``(address, length, address, length, ...)``. Small
#: transfers use it end to end (no numpy call: each costs microseconds on a cold cache); see
#: ``as_iovec`` and ``FLAT_ENTRIES``.
FlatIoVec = tuple[int, ...]
FLAT_ENTRIES = 16  # vectors of at most this many entries are made flat


RUN_DTYPE = np.dtype("<u8")
_FEW = 16


@dataclass(slots=True)  # not frozen: made on every transfer, and a frozen __init__ sets each field slowly
class Runs:
    """Byte runs within one tensor, in transfer order."""

    src_offset: np.ndarray[Any, np.dtype[np.uint64]]
    dst_offset: np.ndarray[Any, np.dtype[np.uint64]]
    length: np.ndarray[Any, np.dtype[np.uint64]]

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def bytes_per_tensor(self) -> int:
        return int(self.length.sum())


def pack_runs(offset: np.ndarray[Any, Any], length: np.ndarray[Any, Any]) -> bytes:
    pairs = np.empty((offset.shape[0], 2), RUN_DTYPE)
    pairs[:, 0] = offset
    pairs[:, 1] = length
    return pairs.tobytes()


def unpack_runs(data: bytes | memoryview) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Inverse of ``pack_runs``; ``len(data)`` must be a multiple of 16."""
    pairs = np.frombuffer(data, RUN_DTYPE).reshape(-1, 2)
    return pairs[:, 0].astype(np.uint64), pairs[:, 1].astype(np.uint64)


def merge_block_runs(
    src_blocks: np.ndarray[Any, Any], dst_blocks: np.ndarray[Any, Any]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Pairs ``(src_blocks[i], dst_blocks[i])`` -> runs ``(src_start, dst_start, count)``.

    Pairs are first ordered by source block (the pairs are independent, the order of writes to
    distinct destination blocks does not matter), then neighbours whose source and destination
    ids both step by one are merged.
    """
    src = np.asarray(src_blocks, dtype=np.int64)
    dst = np.asarray(dst_blocks, dtype=np.int64)
    if src.shape[0] <= 1:  # a single block (decode-time pushes): nothing to sort or merge
        return src, dst, np.ones(src.shape[0], np.int64)
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    breaks = np.ones(src.shape[0], dtype=bool)
    breaks[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(breaks)
    counts = np.diff(np.append(starts, src.shape[0]))
    return src[starts], dst[starts], counts


def block_runs(src_blocks: np.ndarray[Any, Any], dst_blocks: np.ndarray[Any, Any], block_bytes: int) -> Runs:
    src_start, dst_start, counts = merge_block_runs(src_blocks, dst_blocks)
    unit = np.uint64(block_bytes)
    return Runs(
        src_start.astype(np.uint64) * unit,
        dst_start.astype(np.uint64) * unit,
        counts.astype(np.uint64) * unit,
    )


def contiguous_runs(src_offset: int, dst_offset: int, length: int) -> Runs:
    """One run (the contiguous-cache transfers: one batch slot per tensor)."""
    return Runs(
        np.array([src_offset], np.uint64), np.array([dst_offset], np.uint64), np.array([length], np.uint64)
    )


def scatter_vector(
    tensor_addrs: np.ndarray[Any, Any] | Sequence[int],
    offsets: np.ndarray[Any, Any],
    lengths: np.ndarray[Any, Any],
) -> IoVec:
    """The iovec array for ``len(tensor_addrs)`` tensors x runs, tensor-major (the wire order)."""
    if offsets.shape[0] * len(tensor_addrs) <= _FEW:  # a few entries: plain ints beat numpy's per-call cost
        bases_list = tensor_addrs.tolist() if isinstance(tensor_addrs, np.ndarray) else list(tensor_addrs)
        pairs = list(zip(offsets.tolist(), lengths.tolist()))
        return np.array([(base + offset, length) for base in bases_list for offset, length in pairs],
                        np.uint64).reshape(-1, 2)
    bases = np.asarray(tensor_addrs, dtype=np.uint64)
    iov = np.empty((bases.shape[0], offsets.shape[0], 2), np.uint64)
    iov[:, :, 0] = bases[:, None] + offsets.astype(np.uint64, copy=False)[None, :]  # uint64 + int64 -> float64
    iov[:, :, 1] = lengths.astype(np.uint64, copy=False)[None, :]
    return iov.reshape(-1, 2)


def runs_at(bases: Sequence[int], runs: Sequence[tuple[int, ...]], column: int) -> FlatIoVec:
    """A flat vector of ``runs`` (tuples: ``column`` names the item holding each run's offset, the
    last item is its length) in every tensor at ``bases``, tensor-major (the wire order). Plain loops:
    for the few runs of a small transfer they cost less than a generator or numpy."""
    vector: list[int] = []
    for base in bases:
        for run in runs:
            vector += (base + run[column], run[-1])
    return tuple(vector)


def runs_in_bounds(offsets: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any], limit: int) -> bool:
    """True when every run lies inside ``[0, limit)`` and none overflows (receiver-side fence)."""
    if offsets.shape[0] == 0:
        return True
    off = offsets.astype(np.uint64)
    ln = lengths.astype(np.uint64)
    end = off + ln
    overflow = end < off
    return bool(not overflow.any() and (end <= np.uint64(limit)).all() and (ln > 0).all())


def as_iovec(vector: IoVec | FlatIoVec) -> IoVec:
    """``vector`` as an ``IoVec`` (a flat one is laid out in one numpy call)."""
    if type(vector) is tuple:
        return np.array(vector, np.uint64).reshape(-1, 2)
    return vector  # type: ignore[return-value]


def iovec_bytes(vector: IoVec | FlatIoVec) -> int:
    """The bytes ``vector`` covers."""
    if type(vector) is tuple:
        return sum(vector[1::2])
    return int(vector[:, 1].sum())  # type: ignore[call-overload]
