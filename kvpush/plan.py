"""Pure planning: a transfer call -> one checked ``Request`` -> one ``Plan`` (what moves where, per layer).

Checks run in SPEC order (§6), each once. ``check_block_args`` / ``check_cache_args`` /
``check_kv_block_args`` take a public call's own arguments and check what needs nothing of the peer
(types, a blocks cache, block counts, N, the local side of the layer ranges) into a ``Request``, the one
value that travels from there on. The caller then finds the link, the local cache and the peer's cache
(which may take one bounded table refresh: I/O, not here) and hands them to ``plan``, which finishes the
checks (bounds, compatibility, duplicates) and lays the runs out once (``kvpush.layout``: a few runs as
ints, many as numpy, chosen there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from . import validate as v
from .layout import U64, Blocks, IoVec, Runs, block_runs, contiguous_runs
from .memory import CacheEntry
from .peer import RemoteCache
from .protocol import Kind
from .status import param_invalid
from .types import BlocksCacheKey, Cache, CacheKey, CacheKeyByIdAndIndex, KeyName, KvCacheExtParam, check_int

_NO_BLOCKS = Blocks((), None, 0, -1)


class Shape(Enum):
    """What a request moves in each tensor."""

    BLOCKS = "blocks"        # blocks to blocks
    SLOT_BLOCKS = "slot"     # a batch slot of a contiguous cache, cut into the destination's blocks
    SLOTS = "slots"          # a batch slot to a batch slot (push_cache / pull_cache)


@dataclass(slots=True)  # not frozen: made on every transfer, and a frozen __init__ sets each field slowly
class Request:
    """A transfer call checked as far as it can be without the peer: everything the rest of the route
    needs, and nothing it has to check again."""

    api: str
    kind: Kind             # WRITE (push) or READ (pull)
    push: bool             # kind == WRITE
    shape: Shape
    cluster_id: int
    local_cache: Cache
    local_name: str        # how the call names the local cache ("src_cache" / "dst_cache"), for messages
    # the peer's cache: by model id (BlocksCacheKey), by cache id, or by a cache key naming one of its slots
    model_id: int | None = None
    cache_id: int | None = None
    key: KeyName | None = None
    src: Blocks = _NO_BLOCKS
    dst: Blocks = _NO_BLOCKS
    src_range: range | None = None
    dst_range: range | None = None
    n: int = 2
    ranges_given: bool = False
    remote_slot: int | None = None  # the peer's batch slot, when the call names it by index
    local_slot: int | None = None   # the local batch slot (a push from a slot, push_cache / pull_cache)
    size: int = -1                  # bytes per tensor of a slot to slot transfer (-1: the whole slot)
    notify: bytes | None = None     # sent to the peer's notifications once every layer landed

    @property
    def from_slot(self) -> bool:
        return self.shape is Shape.SLOT_BLOCKS

    @property
    def slot_key(self) -> KeyName | None:
        return self.key

    @property
    def batch_index(self) -> int | None:
        return self.remote_slot


class Plan:
    """A checked and laid-out transfer: the runs (``layout.Runs``: source offset, destination offset,
    length in each tensor), one ``LayerStep`` per layer, the runs' wire form for the peer's side, and
    the local vectors, laid out once per call."""

    __slots__ = ("api", "push", "local", "remote", "runs", "steps", "wire", "remote_slot",
                 "_span_vector", "_span_first")

    def __init__(self, request: Request, local: CacheEntry, remote: RemoteCache, runs: Runs,
                 steps: Sequence[v.LayerStep], remote_slot: int | None = None) -> None:
        self.api = request.api
        self.push = request.push  # a write (push) or a read (pull)
        self.local = local
        self.remote = remote
        self.runs = runs
        self.steps = steps
        self.remote_slot = remote_slot  # the peer's batch slot a pull reads (its cache key may be released)
        self.wire = runs.wire(1 if self.push else 0)  # the peer's offsets and the lengths, sent per request
        self._span_vector: IoVec | None = None
        self._span_first = 0

    @property
    def bytes_per_tensor(self) -> int:
        """One layer step moves ``step.count * bytes_per_tensor`` bytes."""
        return self.runs.bytes_per_tensor

    @property
    def local_offset(self) -> Any:
        return self.runs.column(0 if self.push else 1)

    @property
    def remote_offset(self) -> Any:
        return self.runs.column(1 if self.push else 0)

    @property
    def length(self) -> Any:
        return self.runs.length

    def firsts(self, step: v.LayerStep) -> tuple[int, int]:
        """(the first local tensor, the first remote tensor) of ``step``."""
        return (step.src_first, step.dst_first) if self.push else (step.dst_first, step.src_first)

    def local_vector(self, first: int, count: int) -> IoVec:
        """The local iovec of tensors ``[first, first + count)``. A plan of many steps lays out one vector
        for every tensor its steps touch, once, and hands out slices of it (a layer then costs no layout)."""
        if len(self.steps) == 1:
            return self.runs.vector(self.local.cache.tensor_addrs, first, count, 0 if self.push else 1)
        if self._span_vector is None:
            local_firsts = [self.firsts(step)[0] for step in self.steps]
            low = min(local_firsts)
            high = max(first + step.count for first, step in zip(local_firsts, self.steps))
            self._span_vector = self.runs.vector(self.local.addrs, low, high - low, 0 if self.push else 1)
            self._span_first = low
        runs = self.runs.count
        start = (first - self._span_first) * runs
        return self._span_vector.rows(start, start + count * runs)

    def remote_vector(self, first: int, count: int) -> IoVec:
        """The peer's iovec of tensors ``[first, first + count)`` (one-sided paths: its addresses are known)."""
        assert self.remote.addrs is not None
        return self.runs.vector(self.remote.addrs, first, count, 1 if self.push else 0)

    def groups(self, limit: int) -> list[tuple[v.LayerStep, tuple[int, ...]]]:
        """The steps as requests of at most ``limit`` bytes (``group_steps``; 0: one request per step)."""
        if len(self.steps) == 1:
            return [(self.steps[0], (self.steps[0].dst_layer,))]
        if limit <= 0:
            return [(step, (step.dst_layer,)) for step in self.steps]
        return group_steps(self.steps, self.runs.bytes_per_tensor, limit)


def group_steps(steps: Sequence[v.LayerStep], bytes_per_tensor: int,
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


# -- checking a call ----------------------------------------------------------------------------------
_NAMES = {Kind.WRITE: ("src_cache", "dst_cache_key"), Kind.READ: ("dst_cache", "src_cache_key")}
_REMOTE_KEYS: dict[bool, type | tuple[type, ...]] = {  # by push
    True: BlocksCacheKey, False: (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex)}
# bound once: this runs on every transfer, and an attribute of an enum class is looked up anew on each use
_BLOCKS, _SLOT_BLOCKS, _WRITE = Shape.BLOCKS, Shape.SLOT_BLOCKS, Kind.WRITE


def _check_local_layers(request: Request) -> None:
    """SPEC §6 checks 4-5 on the local side: N, then the ranges (when the call gave any)."""
    src_range, dst_range = request.src_range, request.dst_range
    request.ranges_given = src_range is not None or dst_range is not None
    local_tensors = request.local_cache.cache_desc.num_tensors
    v.check_tensor_num(request.api, request.n, local_tensors, request.ranges_given)
    if not request.ranges_given:
        return
    v.check_layer_range_values(request.api, "src_layer_range", src_range)
    v.check_layer_range_values(request.api, "dst_layer_range", dst_range)
    v.check_range_bounds(request.api, "src_layer_range" if request.push else "dst_layer_range",
                         src_range if request.push else dst_range, local_tensors, request.n)
    v.check_range_lengths(request.api, src_range, dst_range)


def check_block_args(api: str, kind: Kind, remote_key: object, local_cache: object,  # noqa: PLR0913
                     src_blocks: object, dst_blocks: object, src_range: object, dst_range: object, n: object,
                     remote_cache_id: int | None = None, local_slot: object = None) -> Request:
    """SPEC §6 checks 1-5 of a blocks transfer, in order: types, a blocks cache, block counts, N, the local
    side of the ranges. (The public call's own arguments: from here on one ``Request`` travels.)

    A pull's source may be a batch slot of the peer's contiguous cache (``CacheKey`` or
    ``CacheKeyByIdAndIndex``), a push's a slot of the local contiguous cache (``local_slot``, the call's
    ``src_batch_index``); ``src_blocks`` is then empty and the slot is read as consecutive blocks.
    ``remote_cache_id``: the peer's cache is named by id (the status-returning forms), not by the key."""
    push = kind is _WRITE
    local_name, remote_name = _NAMES[kind]
    # (the checks' common outcome is tested here first: this runs on every transfer, and a call costs)
    if remote_cache_id is None and not isinstance(remote_key, _REMOTE_KEYS[push]):
        v.check_type(api, remote_name, remote_key, _REMOTE_KEYS[push])
    if not isinstance(local_cache, Cache):
        v.check_type(api, local_name, local_cache, Cache)
    assert isinstance(local_cache, Cache) and isinstance(remote_key, (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex))
    slot_index = None if local_slot is None or not push else check_int("src_batch_index", local_slot)
    request = Request(api, kind, push, _BLOCKS, remote_key.cluster_id, local_cache, local_name, None, None,
                      None, v.check_blocks(api, "src_blocks", src_blocks),  # (positional: made on every transfer)
                      v.check_blocks(api, "dst_blocks", dst_blocks),
                      None if src_range is None else v.check_layer_range(api, "src_layer_range", src_range),
                      None if dst_range is None else v.check_layer_range(api, "dst_layer_range", dst_range),
                      v.check_tensor_num_type(api, n))
    if remote_cache_id is not None:
        request.cache_id = remote_cache_id
    elif isinstance(remote_key, BlocksCacheKey):
        request.model_id = remote_key.model_id
    else:  # a pull from the peer's slot
        request.shape = Shape.SLOT_BLOCKS
        request.cache_id = remote_key.cache_id if isinstance(remote_key, CacheKeyByIdAndIndex) else None
        request.remote_slot = remote_key.batch_index if isinstance(remote_key, CacheKeyByIdAndIndex) else None
        request.key = remote_key.name() if isinstance(remote_key, CacheKey) else None
    if slot_index is not None:
        request.shape = Shape.SLOT_BLOCKS
        request.local_slot = slot_index
    if request.shape is _SLOT_BLOCKS:
        _check_slot_blocks(request, remote_key, remote_name)
    elif not (local_cache.is_blocks_cache and request.dst.count and request.src.count == request.dst.count):
        v.check_blocks_cache(api, local_name, local_cache)  # (called when one fails: they raise, in order)
        v.check_block_counts(api, request.src, request.dst)
    if src_range is not None or dst_range is not None or not 1 <= request.n <= local_cache.cache_desc.num_tensors:
        _check_local_layers(request)  # (else: no ranges, and N fits the local cache)
    return request


def _check_slot_blocks(request: Request, remote_key: object, remote_name: str) -> None:
    """The slot side's checks, in ``check_block_args``'s order: a contiguous source (push) or a blocks
    destination (pull), no ``src_blocks``, a key that names one slot."""
    api, cache = request.api, request.local_cache
    if request.push and cache.is_blocks_cache:
        raise param_invalid(f"{api}: src_batch_index names a batch slot, but src_cache (cache {cache.cache_id}) "
                            f"is a blocks cache")
    if not request.push:
        v.check_blocks_cache(api, request.local_name, cache)
    if request.src.count:
        raise param_invalid(f"{api}: src_blocks must be empty when the source is a batch slot")
    if not request.dst.count:
        raise param_invalid(f"{api}: dst_blocks is empty")
    if isinstance(remote_key, CacheKey):
        v.check_key_ids(api, remote_name, remote_key)


def check_cache_args(api: str, kind: Kind, remote_key: object, local_cache: object,  # noqa: PLR0913
                     local_index: object, remote_range: object, local_range: object, size: object,
                     n: object) -> Request:
    """SPEC §6 checks of a slot to slot transfer (push_cache / pull_cache) as far as they go without the
    peer. (The public call's own arguments: from here on one ``Request`` travels.)"""
    push = kind == Kind.WRITE
    local_name, remote_name = _NAMES[kind]
    remote_name = "dst_cache_key" if push else "src_cache_key"
    v.check_type(api, remote_name, remote_key, CacheKeyByIdAndIndex if push else (CacheKeyByIdAndIndex, CacheKey))
    assert isinstance(remote_key, (CacheKeyByIdAndIndex, CacheKey))
    v.check_type(api, local_name, local_cache, Cache)
    assert isinstance(local_cache, Cache)
    local_slot = check_int("src_batch_index" if push else "batch_index", local_index)
    size_value = check_int("size", size, -1)
    local_layers = v.check_layer_range(api, "local layer range", local_range)
    remote_layers = v.check_layer_range(api, "remote layer range", remote_range)
    request = Request(api, kind, push, Shape.SLOTS, remote_key.cluster_id, local_cache, local_name,
                      src_range=local_layers if push else remote_layers,
                      dst_range=remote_layers if push else local_layers,
                      n=v.check_tensor_num_type(api, n), local_slot=local_slot, size=size_value)
    request.ranges_given = local_layers is not None or remote_layers is not None
    local_tensors = local_cache.cache_desc.num_tensors
    v.check_tensor_num(api, request.n, local_tensors, request.ranges_given)
    v.check_layer_range_values(api, "local layer range", local_layers)
    v.check_layer_range_values(api, "remote layer range", remote_layers)
    v.check_range_bounds(api, "local layer range", local_layers, local_tensors, request.n)
    v.check_range_lengths(api, local_layers, remote_layers)
    if size_value == 0:
        raise param_invalid(f"{api}: size must be > 0 or -1")
    if isinstance(remote_key, CacheKey):
        v.check_key_ids(api, remote_name, remote_key)
        request.key = remote_key.name()
    else:
        request.cache_id, request.remote_slot = remote_key.cache_id, remote_key.batch_index
    return request


def check_kv_block_args(api: str, kind: Kind, local_cache: object, remote_index: object, blocks: tuple[object, object],
                        ext_param: object) -> Request:
    """``PushKvBlocks`` / ``PullKvBlocks``: the peer's cache by ``CacheKeyByIdAndIndex`` (batch index 0),
    ``blocks`` = (src_blocks, dst_blocks), layer ranges and N from ``KvCacheExtParam`` (inclusive pairs,
    (-1, -1): all layers); then ``check_block_args``."""
    ext = KvCacheExtParam() if ext_param is None else ext_param
    v.check_type(api, "ext_param", ext, KvCacheExtParam)
    assert isinstance(ext, KvCacheExtParam)
    v.check_type(api, "cache index", remote_index, CacheKeyByIdAndIndex)
    assert isinstance(remote_index, CacheKeyByIdAndIndex)
    v.check_type(api, "cache", local_cache, Cache)
    assert isinstance(local_cache, Cache)
    if remote_index.batch_index != 0:
        raise param_invalid(f"{api}: cache index batch_index must be 0")
    src_blocks, dst_blocks = blocks
    if not len(v.check_blocks(api, "src_blocks", src_blocks)):
        raise param_invalid(f"{api}: src_blocks is empty")
    n = ext.tensor_num_per_layer
    local_tensors = local_cache.cache_desc.num_tensors
    v.check_tensor_num(api, n, local_tensors, ext.src_layer_range != (-1, -1) or ext.dst_layer_range != (-1, -1))
    local_pair, remote_pair = ((ext.src_layer_range, ext.dst_layer_range) if kind == Kind.WRITE
                               else (ext.dst_layer_range, ext.src_layer_range))
    local_range = v.ext_param_range(api, "local layer range", local_pair, local_tensors, n)
    if (remote_pair == (-1, -1)) != (local_pair == (-1, -1)):
        raise param_invalid(f"{api}: give both layer ranges or neither")
    if remote_pair != (-1, -1) and remote_pair[0] > remote_pair[1]:
        raise param_invalid(f"{api}: remote layer range {remote_pair} has first > second")
    remote_range = None if remote_pair == (-1, -1) else range(remote_pair[0], remote_pair[1] + 1)
    src_range, dst_range = (local_range, remote_range) if kind == Kind.WRITE else (remote_range, local_range)
    return check_block_args(api, kind, remote_index, local_cache, src_blocks, dst_blocks, src_range, dst_range, n,
                            remote_cache_id=remote_index.cache_id)


# -- planning against the peer's cache -------------------------------------------------------------------
def _layer_steps(request: Request, local: CacheEntry, remote: RemoteCache) -> Sequence[v.LayerStep]:
    """The peer's side of the layer checks, then the steps."""
    api, n = request.api, request.n
    if request.ranges_given:
        if remote.num_tensors % n:
            raise param_invalid(f"{api}: tensor_num_per_layer={n} does not divide the remote cache's "
                                f"{remote.num_tensors} tensors")
        remote_range = request.dst_range if request.push else request.src_range
        v.check_range_bounds(api, "dst_layer_range" if request.push else "src_layer_range", remote_range,
                             remote.num_tensors, n)
    local_tensors = local.num_tensors
    src_tensors, dst_tensors = ((local_tensors, remote.num_tensors) if request.push
                                else (remote.num_tensors, local_tensors))
    return v.layer_steps(api, src_tensors, dst_tensors, n, request.src_range, request.dst_range)


def plan(request: Request, local: CacheEntry, remote: RemoteCache, remote_slot: int | None = None) -> Plan:
    """The checks against the peer's cache (SPEC §6 checks 8-10), then the layout. ``remote_slot``: the
    peer's batch slot its table gives for the request's cache key."""
    shape = request.shape
    if shape is not _BLOCKS:
        if shape is Shape.SLOTS:
            return _plan_cache(request, local, remote, remote_slot)
        return _plan_slot(request, local, remote, request.remote_slot if remote_slot is None else remote_slot)
    api, push = request.api, request.push
    if not remote.is_blocks_cache:
        raise param_invalid(f"{api}: remote cache {remote.cache_id} is not a blocks cache")
    local_blocks, remote_blocks = (request.src, request.dst) if push else (request.dst, request.src)
    if (local_blocks.top >= local.num_blocks or remote_blocks.top >= remote.num_blocks
            or local.block_bytes != remote.block_bytes or local.data_type != remote.data_type):
        # (called when one of them fails, which each one tests again: they raise what is wrong, in order)
        v.check_block_bounds(api, "src_blocks" if push else "dst_blocks", local_blocks, local.num_blocks, "local")
        v.check_block_bounds(api, "dst_blocks" if push else "src_blocks", remote_blocks, remote.num_blocks,
                             "remote")
        v.check_compatible(api, local.block_bytes, local.data_type, remote.block_bytes, remote.data_type,
                           "block size")
    steps = _layer_steps(request, local, remote)
    if request.dst.count > 1:  # (one block cannot repeat)
        v.check_no_duplicates(api, "dst_blocks", request.dst)
    return Plan(request, local, remote, block_runs(request.src, request.dst, local.block_bytes), steps)


def _plan_slot(request: Request, local: CacheEntry, remote: RemoteCache, remote_slot: int | None) -> Plan:
    """A batch slot into blocks: the slot's bytes, cut into blocks of the destination's block size, go to
    ``dst_blocks`` in order (the last block may be partly filled when the slot is not a whole number of
    blocks). Checks against the peer's cache in SPEC order: the cache kinds, the slot, the blocks, the
    dtypes, the layers, no destination twice."""
    api, push = request.api, request.push
    if push:
        if not remote.is_blocks_cache:
            raise param_invalid(f"{api}: remote cache {remote.cache_id} is not a blocks cache")
        slot, slot_bytes, num_slots, whose = request.local_slot, local.block_bytes, local.num_blocks, "local"
        block_bytes, num_blocks = remote.block_bytes, remote.num_blocks
    else:
        if remote.is_blocks_cache:
            raise param_invalid(f"{api}: remote cache {remote.cache_id} is a blocks cache; a CacheKey or "
                                f"CacheKeyByIdAndIndex source names a batch slot of a contiguous cache")
        slot, slot_bytes, num_slots, whose = remote_slot, remote.block_bytes, remote.num_blocks, "remote"
        block_bytes, num_blocks = local.block_bytes, local.num_blocks
    assert slot is not None
    if slot >= num_slots:
        raise param_invalid(f"{api}: {whose} batch index {slot} is out of range: the cache has {num_slots} slots")
    v.check_block_bounds(api, "dst_blocks", request.dst, num_blocks, "remote" if push else "local")
    if local.data_type != remote.data_type:
        raise param_invalid(f"{api}: local dtype {local.data_type.name} differs from remote {remote.data_type.name}")
    count, fits = len(request.dst), -(-slot_bytes // block_bytes)
    if count > fits:
        raise param_invalid(f"{api}: dst_blocks names {count} blocks of {block_bytes} bytes, but a batch slot holds "
                            f"{slot_bytes} bytes ({fits} blocks)")
    steps = _layer_steps(request, local, remote)
    v.check_no_duplicates(api, "dst_blocks", request.dst)
    runs = block_runs(Blocks.of(range(count)), request.dst, block_bytes)  # in slot order, merged
    length = runs.length.copy()
    length[-1] -= U64(count * block_bytes - min(count * block_bytes, slot_bytes))  # a partial last block
    runs = Runs.of_columns(runs.src_offset + U64(slot * slot_bytes), runs.dst_offset, length)
    return Plan(request, local, remote, runs, steps, None if push else slot)


def _plan_cache(request: Request, local: CacheEntry, remote: RemoteCache, remote_slot: int | None = None) -> Plan:
    """A slot to slot request against the peer's cache: one run per tensor. ``remote_slot``: the peer's batch
    slot its table gives for the request's cache key."""
    api, push = request.api, request.push
    batch_index = request.remote_slot if remote_slot is None else remote_slot
    local_slot = request.local_slot
    assert batch_index is not None and local_slot is not None
    local_slot_bytes, remote_slot_bytes = local.block_bytes, remote.block_bytes
    if local.data_type != remote.data_type:
        raise param_invalid(f"{api}: local dtype {local.data_type.name} differs from remote {remote.data_type.name}")
    length = min(local_slot_bytes, remote_slot_bytes) if request.size == -1 else request.size
    if request.size == -1 and local_slot_bytes != remote_slot_bytes:
        raise param_invalid(f"{api}: slot sizes differ (local {local_slot_bytes}, remote {remote_slot_bytes}); "
                            f"give size")
    if length > local_slot_bytes or length > remote_slot_bytes:
        raise param_invalid(f"{api}: size={length} exceeds a slot (local {local_slot_bytes}, remote "
                            f"{remote_slot_bytes} bytes)")
    if local_slot >= local.num_blocks:
        raise param_invalid(f"{api}: local batch index {local_slot} is out of range: {local.num_blocks} slots")
    if batch_index >= remote.num_blocks:
        raise param_invalid(f"{api}: remote batch_index {batch_index} is out of range: {remote.num_blocks} slots")
    v.check_range_bounds(api, "remote layer range", request.dst_range if push else request.src_range,
                         remote.num_tensors, request.n)
    src_tensors, dst_tensors = ((local.num_tensors, remote.num_tensors) if push
                                else (remote.num_tensors, local.num_tensors))
    steps = v.layer_steps(api, src_tensors, dst_tensors, request.n, request.src_range, request.dst_range)
    local_offset, remote_offset = local_slot * local_slot_bytes, batch_index * remote_slot_bytes
    runs = (contiguous_runs(local_offset, remote_offset, length) if push
            else contiguous_runs(remote_offset, local_offset, length))
    return Plan(request, local, remote, runs, steps, None if push else batch_index)
