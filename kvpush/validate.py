"""Pure argument checks, each raising the documented class and status code (SPEC §1 and §6).

The transfer coroutines call these in the SPEC's order, all before any byte moves:
types -> the local cache kind -> block list lengths -> tensor_num_per_layer -> layer ranges ->
(link) -> (caches exist) -> block bounds -> local/remote compatibility -> duplicate destinations.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .layout import FEW, Blocks
from .status import LLMException, LLMStatusCode, param_invalid
from .types import U64_MAX, Cache, CacheDesc, CacheKey, DataType, LLMClusterInfo


def check_type(api: str, name: str, value: object, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TypeError(f"{api}: {name} must be {expected}, got {type(value).__name__}")


def check_batch_dim(api: str, desc: CacheDesc) -> None:
    """kvpush addresses blocks and batch slots along dimension 0 (a slot is a run of bytes): a descriptor
    whose batch dimension is elsewhere would make every slot strided, so it is refused, not read as if
    ``shape[0]`` were the batch (LLM-DataDist accepts the field)."""
    if desc.batch_dim_index != 0:
        raise LLMException(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                           f"{api}: batch_dim_index={desc.batch_dim_index}: kvpush moves blocks and batch slots "
                           f"along dimension 0 only")


def check_key_ids(api: str, name: str, key: CacheKey) -> None:
    """A key that addresses a slot has exactly one of req_id and prefix_id (LLM-DataDist's rule)."""
    if not key.has_one_id:
        raise param_invalid(f"{api}: {name} {key!r}: exactly one of req_id and prefix_id must be an id in "
                            f"[0, 2**64-1)")


def check_blocks(api: str, name: str, blocks: object) -> Blocks:
    """A list/tuple (or 1-D integer array) of block ids -> ``Blocks``. TypeError for non-int items,
    ValueError for ids outside [0, 2^64). A short list of plain ints is checked item by item (no numpy
    call); anything else by numpy in one call, and only ids beyond int64 item by item."""
    if type(blocks) in (list, tuple) and len(blocks) <= FEW:  # type: ignore[arg-type]
        items: tuple[Any, ...] = tuple(blocks)  # type: ignore[arg-type]
        for item in items:  # a loop, not all(generator): this runs on every small transfer
            if type(item) is not int or not 0 <= item <= U64_MAX:
                break
        else:
            return Blocks(items, None, len(items), max(items) if items else -1)
    return Blocks.of(_checked_array(api, name, blocks))


def _checked_array(api: str, name: str, blocks: object) -> np.ndarray[Any, Any]:
    if not isinstance(blocks, (list, tuple, np.ndarray)):
        raise TypeError(f"{api}: {name} must be a list or tuple of int, got {type(blocks).__name__}")
    if len(blocks) == 0:
        return np.zeros(0, np.uint64)
    if not isinstance(blocks, np.ndarray) and bool in map(type, blocks):  # C-level scan; numpy would take True as 1
        raise TypeError(f"{api}: {name} must contain int, not bool")
    try:
        array = np.asarray(blocks)
    except (TypeError, ValueError, OverflowError):
        array = np.asarray(blocks, dtype=object)
    if array.dtype.kind == "f" and not isinstance(blocks, np.ndarray):
        array = np.asarray(blocks, dtype=object)  # ints beyond int64 next to negatives: check one by one
    if array.ndim != 1:
        raise TypeError(f"{api}: {name} must be a flat list of int")
    if array.dtype.kind == "i" and int(array.min()) < 0:
        index = int(np.argmin(array))
        raise ValueError(f"{api}: {name}[{index}]={int(array[index])} is negative")
    if array.dtype.kind in "iu":
        return array.astype(np.uint64)
    if array.dtype.kind != "O":
        raise TypeError(f"{api}: {name} must contain int, got {array.dtype}")
    return _each_id(api, name, array)


def _each_id(api: str, name: str, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Ids numpy could not type (beyond int64, mixed): checked one by one."""
    for index, value in enumerate(array):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{api}: {name}[{index}] must be an int, got {type(value).__name__}")
        if not 0 <= int(value) <= U64_MAX:
            raise ValueError(f"{api}: {name}[{index}]={int(value)} is out of range [0, 2^64)")
    return array.astype(np.uint64)


def check_layer_range(api: str, name: str, value: object) -> range | None:
    """The type checks of a layer range (TypeError, ValueError); its values come later, in order."""
    if value is None:
        return None
    if not isinstance(value, range):
        raise TypeError(f"{api}: {name} must be a range or None, got {type(value).__name__}")
    if value.start < 0:
        raise ValueError(f"{api}: {name}={value} starts below 0")
    return value


def check_layer_range_values(api: str, name: str, value: range | None) -> None:
    if value is None:
        return
    if value.step != 1:
        raise param_invalid(f"{api}: {name}={value} must have step 1")
    if value.stop <= value.start:
        raise param_invalid(f"{api}: {name}={value} is empty")


def check_tensor_num_type(api: str, value: object) -> int:
    if type(value) is int and value >= 0:  # the common case, before numpy's slower isinstance
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{api}: tensor_num_per_layer must be an int, got {type(value).__name__}")
    if int(value) < 0:
        raise ValueError(f"{api}: tensor_num_per_layer={int(value)} is negative")
    return int(value)


def check_blocks_cache(api: str, name: str, cache: Cache) -> None:
    if not cache.is_blocks_cache:
        raise param_invalid(f"{api}: {name} (cache {cache.cache_id}) is not a blocks cache")


def check_block_counts(api: str, src: Blocks, dst: Blocks) -> None:
    if not dst.count:
        raise param_invalid(f"{api}: dst_blocks is empty")
    if src.count != dst.count:
        raise param_invalid(f"{api}: src_blocks has {src.count} ids but dst_blocks has {dst.count}")


def check_tensor_num(api: str, n: int, num_tensors: int, ranges_given: bool) -> None:
    if not 1 <= n <= num_tensors:
        raise param_invalid(f"{api}: tensor_num_per_layer={n} must be in [1, {num_tensors}]")
    if ranges_given and num_tensors % n:
        raise param_invalid(
            f"{api}: tensor_num_per_layer={n} must divide the cache's {num_tensors} tensors when a layer "
            f"range is given"
        )


def check_range_bounds(api: str, name: str, layer_range: range | None, num_tensors: int, n: int) -> None:
    if layer_range is not None and layer_range.stop > num_tensors // n:
        raise param_invalid(
            f"{api}: {name}={layer_range} exceeds the cache's {num_tensors // n} layers "
            f"({num_tensors} tensors / {n} per layer)"
        )


def check_range_lengths(api: str, src: range | None, dst: range | None) -> None:
    if src is not None and dst is not None and len(src) != len(dst):
        raise param_invalid(f"{api}: src_layer_range={src} and dst_layer_range={dst} differ in length")


def check_block_bounds(api: str, name: str, blocks: Blocks, num_blocks: int, whose: str) -> None:
    if blocks.top >= num_blocks:
        bad = blocks.first_at_least(num_blocks)
        assert bad is not None
        raise param_invalid(f"{api}: {name}[{bad[0]}]={bad[1]} is out of range: {whose} cache has {num_blocks} blocks")


def check_no_duplicates(api: str, name: str, blocks: Blocks) -> None:
    repeated = blocks.repeated()
    if repeated is not None:
        raise param_invalid(f"{api}: {name} repeats block {repeated}")


def check_compatible(api: str, local_unit: int, local_dtype: DataType, remote_unit: int,
                     remote_dtype: DataType, unit_name: str) -> None:
    if local_unit != remote_unit:
        raise param_invalid(f"{api}: local {unit_name} is {local_unit} bytes but remote is {remote_unit}")
    if local_dtype != remote_dtype:
        raise param_invalid(f"{api}: local dtype {local_dtype.name} differs from remote {remote_dtype.name}")


@dataclass(slots=True)  # not frozen: made on every transfer, and a frozen __init__ sets each field slowly
class LayerStep:
    """One layer of a transfer: ``count`` tensors from ``src_first`` to ``dst_first``; reported as
    destination layer ``dst_layer`` in ``completed_layers``."""

    dst_layer: int
    src_first: int
    dst_first: int
    count: int


def layer_steps(api: str, src_tensors: int, dst_tensors: int, n: int,
                src_range: range | None, dst_range: range | None) -> Sequence[LayerStep]:
    """The layers to move. ``None`` means all layers from 0; with both ``None`` every tensor moves,
    grouped N at a time (the last group may be shorter when N does not divide the count)."""
    if src_range is None and dst_range is None:
        if src_tensors != dst_tensors:
            raise param_invalid(f"{api}: local cache has {src_tensors} tensors, remote {dst_tensors}; "
                                f"give layer ranges to move a subset")
        return _all_layers(src_tensors, n)  # shared and never changed: no copy
    src = src_range if src_range is not None else range(0, src_tensors // n)
    dst = dst_range if dst_range is not None else range(0, dst_tensors // n)
    check_range_lengths(api, src, dst)
    return [LayerStep(d, s * n, d * n, n) for s, d in zip(src, dst)]


@functools.lru_cache(maxsize=64)
def _all_layers(tensors: int, n: int) -> tuple[LayerStep, ...]:
    """Every tensor, N at a time: the same few shapes on every transfer, laid out once each (the steps are
    read, never changed)."""
    return tuple(LayerStep(i, first, first, min(n, tensors - first)) for i, first in enumerate(range(0, tensors, n)))


def ext_param_range(api: str, name: str, pair: tuple[int, int], num_tensors: int, n: int) -> range | None:
    """KvCacheExtParam's inclusive (first, second) -> a range (None for (-1, -1))."""
    first, second = pair
    if (first, second) == (-1, -1):
        return None
    last_layer = num_tensors // n - 1
    if first < 0 or second < 0 or first > second or second > last_layer:
        raise param_invalid(f"{api}: {name}={pair} must satisfy 0 <= first <= second <= {last_layer}")
    return range(first, second + 1)


MAX_CLUSTERS_PER_CALL = 16  # LLM-DataDist's limit for one link_clusters / unlink_clusters call


def check_timeout(api: str, timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{api}: timeout must be an int (ms), got {type(timeout).__name__}")
    if timeout <= 0:
        raise param_invalid(f"{api}: timeout={timeout} must be > 0 ms")
    return float(timeout) / 1000


def check_clusters(api: str, clusters: object) -> list[LLMClusterInfo]:
    if not isinstance(clusters, (list, tuple)):
        raise TypeError(f"{api}: clusters must be a list of LLMClusterInfo, got {type(clusters).__name__}")
    for index, info in enumerate(clusters):
        if not isinstance(info, LLMClusterInfo):
            raise TypeError(f"{api}: clusters[{index}] must be an LLMClusterInfo, got {type(info).__name__}")
        if info.remote_cluster_id is None:
            raise param_invalid(f"{api}: clusters[{index}].remote_cluster_id is not set")
    if len(clusters) > MAX_CLUSTERS_PER_CALL:
        raise LLMException(LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
                           f"{api}: {len(clusters)} clusters in one call (at most {MAX_CLUSTERS_PER_CALL})")
    return list(clusters)
