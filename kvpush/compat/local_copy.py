"""The facade's local copies between caches named by addresses: ``swap_blocks`` and ``copy_cache``.

Checks as LLM-DataDist makes them, then one vectorised numpy copy per tensor between byte views of
the two caches' memory. Every byte is first checked to be mapped read-write in this process
(``/proc/self/maps``): a wrong address is LLM_PARAM_INVALID, never a crash.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush import Cache, LLMException, LLMStatusCode, Placement

from .types import check_uint, require


@dataclass(frozen=True)
class CopyPlan:
    """dst bytes ``[d*dst_unit + offset, + length)`` <- src bytes ``[s*src_unit + offset, + length)`` for
    every ``(s, d)`` of ``pairs``, in every tensor."""

    src: Cache
    dst: Cache
    pairs: list[tuple[int, int]]
    length: int
    src_unit: int
    dst_unit: int
    offset: int = 0


def _flat(cache: Cache, name: str) -> None:
    if cache.cache_desc.batch_dim_index != 0:
        raise LLMException(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                           f"{name} has batch_dim_index={cache.cache_desc.batch_dim_index}: kvpush copies blocks and "
                           f"batch slots along dimension 0 only")


def swap_plan(src: Cache, dst: Cache, src_to_dst: object) -> CopyPlan:
    require(src.is_blocks_cache, "param check failed, src cache should be blocks cache.")
    require(dst.is_blocks_cache, "param check failed, dst cache should be blocks cache.")
    if not isinstance(src_to_dst, dict):
        raise TypeError(f"src_to_dst only support ['dict'], but got {type(src_to_dst)}.")
    for pair in src_to_dst.items():
        if any(isinstance(item, bool) or not isinstance(item, int) for item in pair):
            raise TypeError(f"src_to_dst inner type only support [<class 'int'>], but got {pair!r}.")
    _flat(src, "src")
    _flat(dst, "dst")
    src_desc, dst_desc = src.cache_desc, dst.cache_desc
    src_block, dst_block = src_desc.size // src_desc.batch_size, dst_desc.size // dst_desc.batch_size
    require(src_block == dst_block, f"src block size:{src_block} and dst block size:{dst_block} must be equal")
    require(src_desc.num_tensors == dst_desc.num_tensors,
            f"src num_tensors:{src_desc.num_tensors} and dst num_tensors:{dst_desc.num_tensors} must be equal")
    for s, d in src_to_dst.items():
        require(0 <= s < src_desc.batch_size, f"src_block_index:{s} must be in [0, {src_desc.batch_size})")
        require(0 <= d < dst_desc.batch_size, f"dst_block_index:{d} must be in [0, {dst_desc.batch_size})")
    placements = (src_desc.placement, dst_desc.placement)
    require(placements in ((Placement.HOST, Placement.DEVICE), (Placement.DEVICE, Placement.HOST)),
            f"swap src placement:{placements[0]} to dst placement:{placements[1]} is not support")
    return CopyPlan(src, dst, list(src_to_dst.items()), src_block, src_block, dst_block)


def copy_cache_plan(dst: Cache, src: Cache, dst_batch_index: object, src_batch_index: object, offset: object,
                    size: object, req_id: object) -> CopyPlan:
    check_uint("dst_batch_index", dst_batch_index, 32)
    check_uint("src_batch_index", src_batch_index, 32)
    check_uint("offset", offset, 64)
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"size only support ['int'], but got {type(size)}.")
    require(not src.is_blocks_cache, "param check failed, src cache can not be blocks cache.")
    require(not dst.is_blocks_cache, "param check failed, dst cache can not be blocks cache.")
    require(size == -1 or size > 0, f"[copy_cache] param check failed, size ({size}) is invalid, should be = -1 or > 0")
    if req_id is not None:
        check_uint("req_id", req_id, 64)
    _flat(src, "src")
    _flat(dst, "dst")
    assert isinstance(dst_batch_index, int) and isinstance(src_batch_index, int) and isinstance(offset, int)
    require(src.cache_desc.num_tensors == dst.cache_desc.num_tensors,
            f"src num_tensors:{src.cache_desc.num_tensors} and dst num_tensors:{dst.cache_desc.num_tensors} must "
            f"be equal")
    src_slot, dst_slot = src.cache_desc.block_bytes, dst.cache_desc.block_bytes
    length = src_slot - offset if size == -1 else size
    require(length > 0 and offset + length <= min(src_slot, dst_slot),
            f"copy_cache: offset {offset} + size {length} exceeds a slot (src {src_slot}, dst {dst_slot} bytes)")
    require(src_batch_index < src.cache_desc.batch_size,
            f"copy_cache: src_batch_index {src_batch_index} out of range [0, {src.cache_desc.batch_size})")
    require(dst_batch_index < dst.cache_desc.batch_size,
            f"copy_cache: dst_batch_index {dst_batch_index} out of range [0, {dst.cache_desc.batch_size})")
    return CopyPlan(src, dst, [(src_batch_index, dst_batch_index)], length, src_slot, dst_slot, offset)


def _writable_ranges() -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            span, perms = line.split(maxsplit=2)[:2]
            if perms.startswith("rw"):
                first, _, last = span.partition("-")
                ranges.append((int(first, 16), int(last, 16)))
    ranges.sort()
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def check_mapped(api: str, spans: list[tuple[str, int, int]]) -> None:
    """Every ``(name, address, nbytes)`` lies in memory mapped read-write here, else LLM_PARAM_INVALID."""
    ranges = _writable_ranges()
    for name, address, nbytes in spans:
        if address <= 0 or not any(start <= address and address + nbytes <= end for start, end in ranges):
            raise LLMException(LLMStatusCode.LLM_PARAM_INVALID,
                               f"{api}: {name} at {address:#x} (+{nbytes} bytes) is not memory mapped read-write "
                               f"in this process")


def _bytes(address: int, nbytes: int) -> np.ndarray[Any, Any]:
    view: np.ndarray[Any, Any] = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    return view


def run(api: str, plan: CopyPlan) -> None:
    """Do the copy (on the engine's loop thread, so no registration changes under it)."""
    src, dst = plan.src, plan.dst
    spans = [(f"src tensor {i}", addr, src.cache_desc.size) for i, addr in enumerate(src.tensor_addrs)]
    spans += [(f"dst tensor {i}", addr, dst.cache_desc.size) for i, addr in enumerate(dst.tensor_addrs)]
    check_mapped(api, spans)
    src_rows = np.array([s for s, _ in plan.pairs], dtype=np.intp)
    dst_rows = np.array([d for _, d in plan.pairs], dtype=np.intp)
    window = slice(plan.offset, plan.offset + plan.length)
    for src_addr, dst_addr in zip(src.tensor_addrs, dst.tensor_addrs):
        source = _bytes(src_addr, src.cache_desc.size).reshape(-1, plan.src_unit)
        target = _bytes(dst_addr, dst.cache_desc.size).reshape(-1, plan.dst_unit)
        target[dst_rows, window] = source[src_rows, window]
