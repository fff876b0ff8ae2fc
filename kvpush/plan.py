"""Pure planning: a transfer call -> a ``Plan`` (what moves where, per layer), in one pass.

Checks run in SPEC order. The part that needs nothing of the peer (types, block lists, N, ranges on
the local side) is ``check_block_args`` / ``check_cache_args``; the caller then looks up the link,
the local cache and the peer's cache (which may take one bounded table refresh: I/O, not here) and
hands both to ``plan_blocks`` / ``plan_cache``, which finish the checks (bounds, compatibility,
duplicates) and lay the runs out once with numpy. Nothing is validated twice.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import validate as v
from .layout import Runs, block_runs, contiguous_runs, pack_runs
from .memory import CacheEntry
from .peer import RemoteCache
from .protocol import Kind
from .status import param_invalid
from .types import BlocksCacheKey, Cache, CacheKey, CacheKeyByIdAndIndex, KeyName, check_int

_EMPTY: np.ndarray[Any, Any] = np.zeros(0, np.uint64)


class Plan:
    """A validated transfer: what moves where, computed once per call.

    The runs within each tensor are ``local_offset``/``remote_offset``/``length`` (numpy). A plan of
    a short plain block list (``plain_plan``) holds them as Python ints (``small``: (local offset,
    remote offset, length) per run) and lays out the arrays only if asked, so a small transfer over a
    stream makes no numpy call to plan."""

    __slots__ = ("api", "kind", "local", "remote", "remote_wire", "steps", "bytes_per_tensor", "small",
                 "local_iov", "local_span", "_local_offset", "_remote_offset", "_length")

    def __init__(self, api: str, kind: Kind, local: CacheEntry, remote: RemoteCache,
                 local_offset: np.ndarray[Any, Any] | None, remote_offset: np.ndarray[Any, Any] | None,
                 remote_wire: bytes, length: np.ndarray[Any, Any] | None, steps: list[v.LayerStep],
                 bytes_per_tensor: int = 0, small: tuple[tuple[int, int, int], ...] | None = None) -> None:
        self.api = api
        self.kind = kind  # WRITE (push) or READ (pull)
        self.local = local
        self.remote = remote
        self.remote_wire = remote_wire
        self.steps = steps
        self.bytes_per_tensor = bytes_per_tensor  # one layer moves ``step.count * bytes_per_tensor`` bytes
        self.small = small
        # the local iovec of every tensor the steps touch (from tensor ``local_span``), laid out once on
        # first use by a many-layer transfer (``transfer.local_vector``)
        self.local_iov: np.ndarray[Any, Any] | None = None
        self.local_span = 0
        self._local_offset, self._remote_offset, self._length = local_offset, remote_offset, length

    def _arrays(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        if self._local_offset is None or self._remote_offset is None or self._length is None:
            columns = np.array(self.small or (), np.uint64).reshape(-1, 3).T.copy()
            self._local_offset, self._remote_offset, self._length = columns[0], columns[1], columns[2]
        return self._local_offset, self._remote_offset, self._length

    @property
    def local_offset(self) -> np.ndarray[Any, Any]:
        return self._arrays()[0]

    @property
    def remote_offset(self) -> np.ndarray[Any, Any]:
        return self._arrays()[1]

    @property
    def length(self) -> np.ndarray[Any, Any]:
        return self._arrays()[2]

    @property
    def runs_per_tensor(self) -> int:
        return len(self.small) if self.small is not None else int(self.length.shape[0])


@dataclass(slots=True)  # not frozen: made on every transfer, and a frozen __init__ sets each field slowly
class BlockArgs:
    """A blocks transfer's arguments, checked as far as they can be without the peer."""

    api: str
    kind: Kind
    cluster_id: int
    model_id: int | None   # the peer's cache by model id (BlocksCacheKey) ...
    cache_id: int | None   # ... or by cache id (the C++-style forms)
    local_name: str
    local_cache: Cache
    src: np.ndarray[Any, Any]
    dst: np.ndarray[Any, Any]
    src_range: range | None
    dst_range: range | None
    n: int
    ranges_given: bool
    small: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # both lists, when short and plain
    # The source may be a batch slot of a contiguous cache, read as consecutive blocks of the destination's
    # block size (block i of the slot -> dst_blocks[i]): the peer's slot by cache key or by (cache id, slot)
    # for a pull, the local ``src_batch_index`` for a push.
    slot_key: KeyName | None = None
    remote_slot: int | None = None
    local_slot: int | None = None

    @property
    def from_slot(self) -> bool:
        return self.slot_key is not None or self.remote_slot is not None or self.local_slot is not None


SMALL = 16  # block lists up to this long are checked and laid out in plain Python: numpy's per-call cost
# dominates for them (measured: 99 -> ~25 us for a 1-block push); anything unusual takes the numpy path,
# which raises the documented error.


_ONE_RUN = struct.Struct("<QQ")  # one run's (remote offset, length) on the wire


def _plain(blocks: object) -> tuple[int, ...] | None:
    """``blocks`` as a tuple when it is a short list/tuple of plain non-negative ints below 2^63."""
    if type(blocks) not in (list, tuple) or len(blocks) > SMALL:  # type: ignore[arg-type]
        return None
    items: tuple[int, ...] = tuple(blocks)  # type: ignore[arg-type]
    for item in items:
        if type(item) is not int or not 0 <= item < (1 << 63):
            return None
    return items


def _small_runs(src: tuple[int, ...], dst: tuple[int, ...], block_bytes: int) -> list[tuple[int, int, int]]:
    """``layout.block_runs`` for a short list, as ints: (source offset, destination offset, length)
    per run, ordered by source, neighbours merged."""
    pairs = sorted(zip(src, dst), key=lambda pair: pair[0]) if len(src) > 1 else list(zip(src, dst))
    starts: list[list[int]] = []
    for s, d in pairs:
        if starts and s == starts[-1][0] + starts[-1][2] and d == starts[-1][1] + starts[-1][2]:
            starts[-1][2] += 1
        else:
            starts.append([s, d, 1])
    return [(s * block_bytes, d * block_bytes, count * block_bytes) for s, d, count in starts]


def _names(kind: Kind) -> tuple[str, str]:
    return ("src_cache", "dst_cache_key") if kind == Kind.WRITE else ("dst_cache", "src_cache_key")


def _check_local_layers(api: str, push: bool, local_cache: Cache, src_range: range | None, dst_range: range | None,
                        n: int) -> bool:
    """SPEC §6 checks 4-5 on the local side (N, then the ranges); True when a range was given."""
    ranges_given = src_range is not None or dst_range is not None
    local_tensors = local_cache.cache_desc.num_tensors
    v.check_tensor_num(api, n, local_tensors, ranges_given)
    v.check_layer_range_values(api, "src_layer_range", src_range)
    v.check_layer_range_values(api, "dst_layer_range", dst_range)
    v.check_range_bounds(api, "src_layer_range" if push else "dst_layer_range", src_range if push else dst_range,
                         local_tensors, n)
    v.check_range_lengths(api, src_range, dst_range)
    return ranges_given


def check_block_args(api: str, kind: Kind, remote_key: object, local_cache: object, src_blocks: object,
                     dst_blocks: object, src_range_arg: object, dst_range_arg: object, n_arg: object,
                     remote_cache_id: int | None = None, local_slot: object = None) -> BlockArgs:
    """SPEC §6 checks 1-5: types, a blocks cache, block counts, N, the local side of the ranges.

    A pull's source may be a batch slot of the peer's contiguous cache (``CacheKey`` or
    ``CacheKeyByIdAndIndex``), a push's a slot of the local contiguous cache (``local_slot``, the
    call's ``src_batch_index``); ``src_blocks`` is then empty and the slot is read as consecutive blocks."""
    push = kind == Kind.WRITE
    local_name, remote_name = _names(kind)
    if remote_cache_id is None:
        v.check_type(api, remote_name, remote_key,
                     BlocksCacheKey if push else (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex))
    v.check_type(api, local_name, local_cache, Cache)
    assert isinstance(local_cache, Cache)
    slot_read = not push and remote_cache_id is None and isinstance(remote_key, (CacheKey, CacheKeyByIdAndIndex))
    slot_index = None if local_slot is None or not push else check_int("src_batch_index", local_slot)
    if slot_read or slot_index is not None:
        return _check_slot_args(api, kind, remote_key, local_cache, src_blocks, dst_blocks, src_range_arg,
                                dst_range_arg, n_arg, slot_index)
    small_src, small_dst = _plain(src_blocks), _plain(dst_blocks)
    small = (small_src, small_dst) if small_src is not None and small_dst is not None else None
    if small is not None:
        src, dst = _EMPTY, _EMPTY  # not needed on the small path (made on demand if a check fails)
        if not small[1] or len(small[0]) != len(small[1]):
            src, dst = np.array(small[0], np.uint64), np.array(small[1], np.uint64)
    else:
        src = v.check_blocks(api, "src_blocks", src_blocks)
        dst = v.check_blocks(api, "dst_blocks", dst_blocks)
    src_range = v.check_layer_range(api, "src_layer_range", src_range_arg)
    dst_range = v.check_layer_range(api, "dst_layer_range", dst_range_arg)
    n = v.check_tensor_num_type(api, n_arg)
    v.check_blocks_cache(api, local_name, local_cache)
    if small is None or src is not _EMPTY:
        v.check_block_counts(api, src, dst)
    ranges_given = _check_local_layers(api, push, local_cache, src_range, dst_range, n)
    assert isinstance(remote_key, (BlocksCacheKey, CacheKeyByIdAndIndex))
    model_id = remote_key.model_id if remote_cache_id is None and isinstance(remote_key, BlocksCacheKey) else None
    return BlockArgs(api, kind, remote_key.cluster_id, model_id, remote_cache_id, local_name, local_cache, src, dst,
                     src_range, dst_range, n, ranges_given, small)


def _check_slot_args(api: str, kind: Kind, remote_key: object, local_cache: Cache, src_blocks: object,
                     dst_blocks: object, src_range_arg: object, dst_range_arg: object, n_arg: object,
                     slot_index: int | None) -> BlockArgs:
    """``check_block_args`` when the source is a batch slot: the same checks, in the same order, with
    the slot side's: a contiguous source (push) or a blocks destination (pull), no ``src_blocks``, a
    key that names one slot."""
    push = kind == Kind.WRITE
    local_name, remote_name = _names(kind)
    src = v.check_blocks(api, "src_blocks", src_blocks)
    dst = v.check_blocks(api, "dst_blocks", dst_blocks)
    src_range = v.check_layer_range(api, "src_layer_range", src_range_arg)
    dst_range = v.check_layer_range(api, "dst_layer_range", dst_range_arg)
    n = v.check_tensor_num_type(api, n_arg)
    if push and local_cache.is_blocks_cache:
        raise param_invalid(f"{api}: src_batch_index names a batch slot, but src_cache (cache {local_cache.cache_id}) "
                            f"is a blocks cache")
    if not push:
        v.check_blocks_cache(api, local_name, local_cache)
    if src.shape[0]:
        raise param_invalid(f"{api}: src_blocks must be empty when the source is a batch slot")
    if dst.shape[0] == 0:
        raise param_invalid(f"{api}: dst_blocks is empty")
    if isinstance(remote_key, CacheKey):
        v.check_key_ids(api, remote_name, remote_key)
    ranges_given = _check_local_layers(api, push, local_cache, src_range, dst_range, n)
    assert isinstance(remote_key, (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex))
    return BlockArgs(api, kind, remote_key.cluster_id,
                     remote_key.model_id if isinstance(remote_key, BlocksCacheKey) else None,
                     remote_key.cache_id if isinstance(remote_key, CacheKeyByIdAndIndex) else None, local_name,
                     local_cache, src, dst, src_range, dst_range, n, ranges_given,
                     slot_key=remote_key.name() if isinstance(remote_key, CacheKey) else None,
                     remote_slot=remote_key.batch_index if isinstance(remote_key, CacheKeyByIdAndIndex) else None,
                     local_slot=slot_index)


def plan_blocks(args: BlockArgs, local: CacheEntry, remote: RemoteCache, remote_slot: int | None = None) -> Plan:
    """SPEC §6 checks 8-10 against the peer's cache, then the layout. ``remote_slot``: the peer's batch
    slot a cache key named (a pull from a slot by key)."""
    if args.from_slot:
        return _plan_slot(args, local, remote, args.remote_slot if remote_slot is None else remote_slot)
    api, push, n = args.api, args.kind == Kind.WRITE, args.n
    if not remote.is_blocks_cache:
        raise param_invalid(f"{api}: remote cache {remote.cache_id} is not a blocks cache")
    if args.small is not None:
        plan = _plan_small(args, args.small, local, remote)
        if plan is not None:
            return plan
        # something is wrong: the general path below raises the documented error
        args = replace(args, src=np.array(args.small[0], np.uint64), dst=np.array(args.small[1], np.uint64),
                       small=None)
    local_blocks, remote_blocks = (args.src, args.dst) if push else (args.dst, args.src)
    local_desc = local.desc
    v.check_block_bounds(api, "src_blocks" if push else "dst_blocks", local_blocks, local_desc.num_blocks, "local")
    v.check_block_bounds(api, "dst_blocks" if push else "src_blocks", remote_blocks, remote.num_blocks, "remote")
    v.check_compatible(api, local_desc.block_bytes, local_desc.data_type, remote.block_bytes, remote.data_type,
                       "block size")
    if args.ranges_given and remote.num_tensors % n:
        raise param_invalid(f"{api}: tensor_num_per_layer={n} does not divide the remote cache's "
                            f"{remote.num_tensors} tensors")
    v.check_range_bounds(api, "dst_layer_range" if push else "src_layer_range",
                         args.dst_range if push else args.src_range, remote.num_tensors, n)
    local_tensors = local_desc.num_tensors
    src_tensors, dst_tensors = (local_tensors, remote.num_tensors) if push else (remote.num_tensors, local_tensors)
    steps = v.layer_steps(api, src_tensors, dst_tensors, n, args.src_range, args.dst_range)
    v.check_no_duplicates(api, "dst_blocks", args.dst)
    return _plan(api, args.kind, local, remote, block_runs(args.src, args.dst, local_desc.block_bytes), steps)


def _plan_small(args: BlockArgs, small: tuple[tuple[int, ...], tuple[int, ...]], local: CacheEntry,
                remote: RemoteCache) -> Plan | None:
    return plain_plan(args.api, args.kind, args.n, small[0], small[1], local, remote, args.src_range, args.dst_range)


def plain_plan(api: str, kind: Kind, n: int, src: tuple[int, ...], dst: tuple[int, ...], local: CacheEntry,
               remote: RemoteCache, src_range: range | None = None, dst_range: range | None = None) -> Plan | None:
    """The plan of a short, plain block list whose arguments passed SPEC §6 checks 1-5, or None when
    any later check would fail (the caller then runs the general checks, which raise the documented
    error)."""
    push = kind == Kind.WRITE
    local_blocks, remote_blocks = (src, dst) if push else (dst, src)
    block_bytes = local.block_bytes
    if max(local_blocks) >= local.num_blocks or max(remote_blocks) >= remote.num_blocks:
        return None
    if block_bytes != remote.block_bytes or local.data_type != remote.data_type:
        return None
    ranges_given = src_range is not None or dst_range is not None
    if ranges_given and remote.num_tensors % n:
        return None
    remote_range = dst_range if push else src_range
    if remote_range is not None and remote_range.stop > remote.num_tensors // n:
        return None
    if len(dst) > 1 and len(set(dst)) != len(dst):
        return None
    local_tensors = local.num_tensors
    src_tensors, dst_tensors = (local_tensors, remote.num_tensors) if push else (remote.num_tensors, local_tensors)
    if not ranges_given and src_tensors != dst_tensors:
        return None
    steps = v.layer_steps(api, src_tensors, dst_tensors, n, src_range, dst_range)
    if len(src) == 1:  # one block: one run, no merging to do
        first, second = src[0] * block_bytes, dst[0] * block_bytes
        small: tuple[tuple[int, int, int], ...] = ((first, second, block_bytes) if push
                                                   else (second, first, block_bytes),)
        return Plan(api, kind, local, remote, None, None, _ONE_RUN.pack(small[0][1], block_bytes), None, steps,
                    block_bytes, small)
    runs = _small_runs(src, dst, block_bytes)
    small = tuple(runs) if push else tuple([(d, s, length) for s, d, length in runs])  # (local, remote, length)
    wire = struct.pack(f"<{2 * len(small)}Q", *[value for _, offset, length in small for value in (offset, length)])
    return Plan(api, kind, local, remote, None, None, wire, None, steps, sum([run[2] for run in small]), small)


def plain_args(kind: Kind, remote_key: object, local_cache: object, src_blocks: object, dst_blocks: object,
               n: object) -> tuple[BlocksCacheKey, Cache, tuple[int, ...], tuple[int, ...], int] | None:
    """The arguments of the most common transfer - a ``BlocksCacheKey``, a local blocks cache, short
    plain block lists of one length, an int N within the cache, no layer ranges - when they pass SPEC
    §6 checks 1-5 as they are; else None (the general checks then run and raise what is wrong)."""
    if type(remote_key) is not BlocksCacheKey or type(local_cache) is not Cache or type(n) is not int:
        return None
    src, dst = _plain(src_blocks), _plain(dst_blocks)
    if src is None or dst is None or not dst or len(src) != len(dst):
        return None
    if not local_cache.is_blocks_cache or not 1 <= n <= local_cache.cache_desc.num_tensors:
        return None
    return remote_key, local_cache, src, dst, n


def group_steps(steps: list[v.LayerStep], bytes_per_tensor: int,
                limit: int) -> list[tuple[v.LayerStep, tuple[int, ...]]]:
    """Consecutive steps whose tensors follow one another on both sides, merged into steps of at most
    ``limit`` bytes (one request moving several layers), each with the destination layers it covers."""
    groups: list[tuple[v.LayerStep, tuple[int, ...]]] = []
    for step in steps:
        if groups:
            last, layers = groups[-1]
            if (step.src_first == last.src_first + last.count and step.dst_first == last.dst_first + last.count
                    and (last.count + step.count) * bytes_per_tensor <= limit):
                groups[-1] = (v.LayerStep(last.dst_layer, last.src_first, last.dst_first, last.count + step.count),
                              layers + (step.dst_layer,))
                continue
        groups.append((step, (step.dst_layer,)))
    return groups


def _plan_slot(args: BlockArgs, local: CacheEntry, remote: RemoteCache, remote_slot: int | None) -> Plan:
    """A batch slot into blocks: the slot's bytes, cut into blocks of the destination's block size, go to
    ``dst_blocks`` in order (the last block may be partly filled when the slot is not a whole number of
    blocks). Checks against the peer's cache in SPEC order: the cache kinds, the slot, the blocks, the
    dtypes, the layers, no destination twice."""
    api, push, n = args.api, args.kind == Kind.WRITE, args.n
    local_desc = local.desc
    if push:
        if not remote.is_blocks_cache:
            raise param_invalid(f"{api}: remote cache {remote.cache_id} is not a blocks cache")
        slot, slot_bytes, num_slots, whose = args.local_slot, local_desc.block_bytes, local_desc.num_blocks, "local"
        block_bytes, num_blocks = remote.block_bytes, remote.num_blocks
    else:
        if remote.is_blocks_cache:
            raise param_invalid(f"{api}: remote cache {remote.cache_id} is a blocks cache; a CacheKey or "
                                f"CacheKeyByIdAndIndex source names a batch slot of a contiguous cache")
        slot, slot_bytes, num_slots, whose = remote_slot, remote.block_bytes, remote.num_blocks, "remote"
        block_bytes, num_blocks = local_desc.block_bytes, local_desc.num_blocks
    assert slot is not None
    if slot >= num_slots:
        raise param_invalid(f"{api}: {whose} batch index {slot} is out of range: the cache has {num_slots} slots")
    v.check_block_bounds(api, "dst_blocks", args.dst, num_blocks, "remote" if push else "local")
    if local_desc.data_type != remote.data_type:
        raise param_invalid(f"{api}: local dtype {local_desc.data_type.name} differs from remote "
                            f"{remote.data_type.name}")
    count, fits = int(args.dst.shape[0]), -(-slot_bytes // block_bytes)
    if count > fits:
        raise param_invalid(f"{api}: dst_blocks names {count} blocks of {block_bytes} bytes, but a batch slot holds "
                            f"{slot_bytes} bytes ({fits} blocks)")
    if args.ranges_given and remote.num_tensors % n:
        raise param_invalid(f"{api}: tensor_num_per_layer={n} does not divide the remote cache's "
                            f"{remote.num_tensors} tensors")
    v.check_range_bounds(api, "dst_layer_range" if push else "src_layer_range",
                         args.dst_range if push else args.src_range, remote.num_tensors, n)
    src_tensors, dst_tensors = ((local_desc.num_tensors, remote.num_tensors) if push
                                else (remote.num_tensors, local_desc.num_tensors))
    steps = v.layer_steps(api, src_tensors, dst_tensors, n, args.src_range, args.dst_range)
    v.check_no_duplicates(api, "dst_blocks", args.dst)
    runs = block_runs(np.arange(count, dtype=np.uint64), args.dst, block_bytes)  # in slot order, merged
    length = runs.length.copy()
    length[-1] -= np.uint64(count * block_bytes - min(count * block_bytes, slot_bytes))  # a partial last block
    runs = Runs(runs.src_offset + np.uint64(slot * slot_bytes), runs.dst_offset, length)
    return _plan(api, args.kind, local, remote, runs, steps)


@dataclass(frozen=True)
class CacheArgs:
    """A contiguous-cache transfer's arguments, checked as far as they can be without the peer."""

    api: str
    kind: Kind
    cluster_id: int
    cache_id: int | None  # the peer's cache and slot by id (CacheKeyByIdAndIndex) ...
    batch_index: int | None
    local_name: str
    local_cache: Cache
    local_slot: int
    size: int
    local_range: range | None
    remote_range: range | None
    n: int
    key: KeyName | None = None  # ... or by the cache key naming the slot (a pull by CacheKey)


def check_cache_args(api: str, kind: Kind, remote_key: object, local_cache: object, local_index: object,
                     remote_range_arg: object, local_range_arg: object, size: object, n_arg: object) -> CacheArgs:
    push = kind == Kind.WRITE
    remote_name = "dst_cache_key" if push else "src_cache_key"
    v.check_type(api, remote_name, remote_key, CacheKeyByIdAndIndex if push else (CacheKeyByIdAndIndex, CacheKey))
    assert isinstance(remote_key, (CacheKeyByIdAndIndex, CacheKey))
    local_name = "src_cache" if push else "dst_cache"
    v.check_type(api, local_name, local_cache, Cache)
    assert isinstance(local_cache, Cache)
    local_slot = check_int("src_batch_index" if push else "batch_index", local_index)
    size_value = check_int("size", size, -1)
    local_range = v.check_layer_range(api, "local layer range", local_range_arg)
    remote_range = v.check_layer_range(api, "remote layer range", remote_range_arg)
    n = v.check_tensor_num_type(api, n_arg)
    ranges_given = local_range is not None or remote_range is not None
    local_desc = local_cache.cache_desc
    v.check_tensor_num(api, n, local_desc.num_tensors, ranges_given)
    v.check_layer_range_values(api, "local layer range", local_range)
    v.check_layer_range_values(api, "remote layer range", remote_range)
    v.check_range_bounds(api, "local layer range", local_range, local_desc.num_tensors, n)
    v.check_range_lengths(api, local_range, remote_range)
    if size_value == 0:
        raise param_invalid(f"{api}: size must be > 0 or -1")
    if isinstance(remote_key, CacheKey):
        v.check_key_ids(api, remote_name, remote_key)
        return CacheArgs(api, kind, remote_key.cluster_id, None, None, local_name, local_cache, local_slot,
                         size_value, local_range, remote_range, n, remote_key.name())
    return CacheArgs(api, kind, remote_key.cluster_id, remote_key.cache_id, remote_key.batch_index, local_name,
                     local_cache, local_slot, size_value, local_range, remote_range, n)


def plan_cache(args: CacheArgs, local: CacheEntry, remote: RemoteCache, remote_slot: int | None = None) -> Plan:
    """The checks against the peer's cache, then one run per tensor. ``remote_slot``: the peer's batch
    slot a cache key named (a pull by CacheKey)."""
    api, push, n = args.api, args.kind == Kind.WRITE, args.n
    batch_index = args.batch_index if remote_slot is None else remote_slot
    assert batch_index is not None
    local_desc = local.desc
    local_slot_bytes = local_desc.block_bytes
    remote_slot_bytes = remote.block_bytes
    if local_desc.data_type != remote.data_type:
        raise param_invalid(f"{api}: local dtype {local_desc.data_type.name} differs from remote "
                            f"{remote.data_type.name}")
    length = min(local_slot_bytes, remote_slot_bytes) if args.size == -1 else args.size
    if args.size == -1 and local_slot_bytes != remote_slot_bytes:
        raise param_invalid(f"{api}: slot sizes differ (local {local_slot_bytes}, remote {remote_slot_bytes}); "
                            f"give size")
    if length > local_slot_bytes or length > remote_slot_bytes:
        raise param_invalid(f"{api}: size={length} exceeds a slot (local {local_slot_bytes}, remote "
                            f"{remote_slot_bytes} bytes)")
    if args.local_slot >= local_desc.num_blocks:
        raise param_invalid(f"{api}: local batch index {args.local_slot} is out of range: "
                            f"{local_desc.num_blocks} slots")
    if batch_index >= remote.num_blocks:
        raise param_invalid(f"{api}: remote batch_index {batch_index} is out of range: "
                            f"{remote.num_blocks} slots")
    v.check_range_bounds(api, "remote layer range", args.remote_range, remote.num_tensors, n)
    local_range, remote_range = args.local_range, args.remote_range
    src_range, dst_range = (local_range, remote_range) if push else (remote_range, local_range)
    src_tensors, dst_tensors = ((local_desc.num_tensors, remote.num_tensors) if push
                                else (remote.num_tensors, local_desc.num_tensors))
    steps = v.layer_steps(api, src_tensors, dst_tensors, n, src_range, dst_range)
    local_offset, remote_offset = args.local_slot * local_slot_bytes, batch_index * remote_slot_bytes
    if push:
        runs = contiguous_runs(local_offset, remote_offset, length)
    else:
        runs = contiguous_runs(remote_offset, local_offset, length)
    return _plan(api, args.kind, local, remote, runs, steps)


def _plan(api: str, kind: Kind, local: CacheEntry, remote: RemoteCache, runs: Runs,
          steps: list[v.LayerStep]) -> Plan:
    if kind == Kind.WRITE:
        local_offset, remote_offset = runs.src_offset, runs.dst_offset
    else:
        local_offset, remote_offset = runs.dst_offset, runs.src_offset
    return Plan(api, kind, local, remote, local_offset, remote_offset, pack_runs(remote_offset, runs.length),
                runs.length, steps, int(runs.length.sum()))
