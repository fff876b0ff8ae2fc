"""Registered memory: the per-instance registry of caches, and what each registered cache carries.

No network I/O here. The regions a cache is made of (user objects checked against the descriptor, or
kvpush's own page-aligned allocation) come from ``kvpush.regions``, whose entry points are named here too
(``region_of``, ``allocate_regions``).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .access import BlockGrants
from .regions import (
    Region,
    accelerator_runtime,
    allocate_regions,
    check_placement,
    mapped_writable,
    prefault,
    region_of,
)
from .status import LLMException, LLMStatusCode, param_invalid
from .types import REQUEST_KEY, Cache, CacheDesc, CacheKey, DataType, KeyName, RemoteAccess

__all__ = ["CacheEntry", "CacheRegistry", "MemoryMapper", "Region", "accelerator_runtime", "allocate_regions",
           "mapped_writable", "region_of"]


@dataclass
class CacheEntry:
    """A registered cache plus what the engine needs to move its bytes safely."""

    cache: Cache
    model_id: int | None
    regions: list[Region]
    addrs: np.ndarray[Any, np.dtype[np.uint64]]
    mapping: mmap.mmap | None = None
    pins: int = 0
    removed: bool = False
    mapper: MemoryMapper | None = None
    maps: list[tuple[Any, bytes]] = field(default_factory=list)  # per tensor: (handle, packed rkey)
    owned: bool = False  # kvpush allocated the memory (allocate_*), not the caller
    keys: dict[KeyName, int] = field(default_factory=dict)  # cache keys naming batch slots: name -> slot
    pulled: dict[KeyName, set[int]] = field(default_factory=dict)  # tensors of a keyed slot pulled so far
    deallocated: bool = False  # its owner let go of it; kept (for peers only) while cache keys name its slots
    access: RemoteAccess = RemoteAccess.OPEN
    grants: BlockGrants | None = None  # which peer may write or read which blocks (RemoteAccess.GRANTED)
    # the sealed descriptor's geometry as plain ints (a transfer's checks read them without a call)
    num_blocks: int = field(init=False)
    block_bytes: int = field(init=False)
    tensor_bytes: int = field(init=False)
    num_tensors: int = field(init=False)
    data_type: DataType = field(init=False)

    def __post_init__(self) -> None:
        desc = self.cache.cache_desc  # sealed at registration: these stay true
        self.num_blocks = desc.num_blocks
        self.block_bytes = desc.block_bytes
        self.tensor_bytes = desc.size
        self.num_tensors = desc.num_tensors
        self.data_type = desc.data_type

    @property
    def desc(self) -> CacheDesc:
        return self.cache.cache_desc

    def released_on_pull(self, name: KeyName) -> bool:
        """A request key of a cache kvpush allocated is a reference a peer's pull consumes (LLM-DataDist):
        once every tensor of its slot was pulled the key goes. Prefix keys (shared by many requests) and
        keys of caller-owned memory stay until ``remove_cache_key``."""
        return self.owned and name[0] == REQUEST_KEY and name in self.keys

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1
        if self.pins == 0 and self.removed:
            self.release()

    def release(self) -> None:
        """Drop kvpush's references. Memory kvpush allocated is unmapped when the last view of it
        (including any ``cache.tensors`` a caller kept) is gone, so no view ever dangles."""
        self.cache.tensors = []
        self.regions = []
        self.mapping = None
        if self.mapper is not None:
            for handle, _ in self.maps:
                self.mapper.unmap(handle)
        self.maps = []

    def describe(self, with_addresses: bool = False, with_rkeys: bool = False) -> dict[str, Any]:
        """The description peers receive; tensor addresses (and UCX rkeys) only for peers that
        may move bytes one-sided, on authenticated links."""
        desc = self.desc
        extra: dict[str, Any] = {"addrs": self.cache.tensor_addrs} if with_addresses else {}
        if with_rkeys and self.maps:
            extra["rkeys"] = [rkey.hex() for _, rkey in self.maps]
        if self.keys:  # [kind, id, model_id, batch slot, 1 when a pull releases it]
            extra["keys"] = [[*name, slot, int(self.released_on_pull(name))] for name, slot in self.keys.items()]
        return {**extra,
            "id": self.cache.cache_id,
            "model": self.model_id,
            "blocks": self.cache.is_blocks_cache,
            "n": desc.num_tensors,
            "shape": list(desc.shape),
            "dtype": int(desc.data_type),
        }


class MemoryMapper(Protocol):
    """Registers memory with a one-sided transport (UCX): a handle and a packed remote key."""

    def map(self, address: int, length: int) -> tuple[Any, bytes]: ...

    def unmap(self, handle: Any) -> None: ...


class CacheRegistry:
    """The caches of one engine instance. Ids count from 1 and are never reused. With a
    ``mapper`` every registered tensor is also registered with it (and unregistered on release)."""

    def __init__(self) -> None:
        self.mapper: MemoryMapper | None = None
        self._entries: dict[int, CacheEntry] = {}
        self._by_model: dict[int, int] = {}
        self._by_key: dict[KeyName, int] = {}  # cache key name -> cache id
        self._next_id = 1
        self.version = 0
        # ``get(cache_id)``: the entry, or None. The table's own ``get`` (every transfer looks a cache up on
        # both sides, and a method of ours would add a Python call to each)
        self.get: Callable[[int], CacheEntry | None] = self._entries.get

    def __len__(self) -> int:
        return len(self._entries)

    def table(self, with_addresses: bool = False, with_rkeys: bool = False) -> list[dict[str, Any]]:
        """What peers are told of this engine's caches (private ones are left out)."""
        return [entry.describe(with_addresses, with_rkeys) for entry in self._entries.values()
                if entry.access is not RemoteAccess.PRIVATE]

    def drop_grants(self, peer: int) -> None:
        """Every grant to ``peer`` ends (its link closed: a grant never outlives the link it was made for)."""
        for entry in self._entries.values():
            if entry.grants is not None:
                entry.grants.drop(peer)

    def add(
        self,
        desc: CacheDesc,
        regions: list[Region],
        is_blocks_cache: bool,
        model_id: int | None,
        mapping: mmap.mmap | None = None,
        cache_keys: Sequence[CacheKey] = (),
        access: RemoteAccess = RemoteAccess.OPEN,
    ) -> Cache:
        """Register a cache; ``cache_keys[i]`` names batch slot i (contiguous caches; placeholders name
        nothing); ``access`` says what peers may do with it (only an ``OPEN`` cache is registered with a
        one-sided transport that hands out remote keys). LLMException(LLM_PARAM_INVALID /
        LLM_FEATURE_NOT_ENABLED) before anything is kept."""
        check_placement(desc, regions)
        if desc.num_tensors < 1 or not desc.shape or min(desc.shape) < 1:
            raise param_invalid(f"{desc!r} describes no memory (num_tensors and every dim must be >= 1)")
        if model_id is not None and model_id in self._by_model:
            raise param_invalid(f"a blocks cache with model_id={model_id} is already registered")
        keys = self.check_keys(desc, is_blocks_cache, cache_keys)
        self._check_overlap(regions)
        if mapping is None:
            for region in regions:
                prefault(region.address, region.nbytes)
        desc = desc.sealed_copy()  # the geometry its bounds checks read can no longer change under them
        cache = Cache(
            cache_id=self._next_id,
            cache_desc=desc,
            tensor_addrs=[r.address for r in regions],
            is_blocks_cache=is_blocks_cache,
            tensors=[r.flat().view(desc.data_type.numpy_dtype).reshape(desc.shape) for r in regions],
        )
        self._next_id += 1
        entry = CacheEntry(cache, model_id, regions, np.array(cache.tensor_addrs, np.uint64), mapping, access=access,
                           grants=BlockGrants(desc.num_blocks) if access is RemoteAccess.GRANTED else None)
        if self.mapper is not None and access is RemoteAccess.OPEN:
            entry.mapper = self.mapper
            try:
                for region in regions:
                    entry.maps.append(self.mapper.map(region.address, region.nbytes))
            except Exception as error:
                entry.release()
                raise LLMException(LLMStatusCode.LLM_FAILED, f"cannot register the memory with UCX: {error}") from None
        entry.owned = mapping is not None
        entry.keys = keys
        self._entries[cache.cache_id] = entry
        if model_id is not None:
            self._by_model[model_id] = cache.cache_id
        for name in keys:
            self._by_key[name] = cache.cache_id
        self.version += 1
        return cache

    def check_keys(self, desc: CacheDesc, is_blocks_cache: bool, cache_keys: Sequence[CacheKey]) -> dict[KeyName, int]:
        """The slots ``cache_keys`` name (``{name: batch slot}``), checked as LLM-DataDist checks them: at
        most one key per batch slot, none twice, none already naming a slot here; placeholders (neither a
        request nor a prefix id) keep their slot unnamed. Stricter: a key with both ids is refused (no pull
        could address it), and a blocks cache takes no cache keys (its BlocksCacheKey names it)."""
        if not cache_keys:
            return {}
        if is_blocks_cache:
            raise param_invalid("a blocks cache is named by its BlocksCacheKey, not by cache keys")
        if len(cache_keys) > desc.num_blocks:
            raise param_invalid(f"{len(cache_keys)} cache keys for {desc.num_blocks} batch slots")
        names: dict[KeyName, int] = {}
        for slot, key in enumerate(cache_keys):
            if not isinstance(key, CacheKey):
                raise TypeError(f"cache_keys[{slot}] must be a CacheKey, got {type(key).__name__}")
            if key.is_placeholder:
                continue
            if not key.has_one_id:
                raise param_invalid(f"cache_keys[{slot}] {key!r}: exactly one of req_id and prefix_id may be an id")
            name = key.name()
            if name in names:
                raise param_invalid(f"cache_keys[{slot}] {key!r} repeats cache_keys[{names[name]}]")
            if name in self._by_key:
                raise param_invalid(f"cache_keys[{slot}] {key!r} already names a slot of cache {self._by_key[name]}")
            names[name] = slot
        return names

    def slot_of(self, name: KeyName) -> tuple[CacheEntry, int] | None:
        """The cache and batch slot a key names here, or None."""
        cache_id = self._by_key.get(name)
        entry = None if cache_id is None else self._entries.get(cache_id)
        return None if entry is None else (entry, entry.keys[name])

    def remove_key(self, name: KeyName) -> bool:
        """The key no longer names its slot (False: it named none). A cache its owner let go of
        (``deallocate``) is removed with its last key."""
        found = self.slot_of(name)
        if found is None:
            return False
        entry = found[0]
        del self._by_key[name]
        del entry.keys[name]
        entry.pulled.pop(name, None)
        self.version += 1
        if entry.deallocated and not entry.keys:
            self.remove(entry.cache.cache_id)
        return True

    def note_pulled(self, name: KeyName, cache_id: int, slot: int, first_tensor: int, num_tensors: int) -> bool:
        """A peer pulled tensors ``[first_tensor, first_tensor + num_tensors)`` of slot ``slot`` of cache
        ``cache_id`` by (or at) key ``name``. A request key of a cache kvpush allocated goes once every
        tensor of its slot was pulled. True when a key went (the table changed). A key that no longer
        names that slot (removed or pulled meanwhile) is left alone."""
        found = self.slot_of(name)
        if found is None or found[0].cache.cache_id != cache_id or found[1] != slot:
            return False
        entry = found[0]
        if not entry.released_on_pull(name):
            return False
        pulled = entry.pulled.setdefault(name, set())
        pulled.update(range(first_tensor, first_tensor + num_tensors))
        if len(pulled) < entry.desc.num_tensors:
            return False
        return self.remove_key(name)

    def deallocate(self, cache_id: int) -> bool:
        """The owner lets go of a cache; True when it was removed now (like ``remove``). Memory kvpush
        allocated whose slots cache keys still name stays for the peers that pull them and goes with the
        last key (LLM-DataDist's reference counting): False, nothing changed for peers."""
        entry = self._entries.get(cache_id)
        if entry is None or entry.deallocated:
            return False
        if entry.owned and entry.keys:
            entry.deallocated = True
            return False
        return self.remove(cache_id) is not None

    def remove(self, cache_id: int) -> CacheEntry | None:
        """Forget a cache now (and the cache keys naming its slots); its memory is released once no
        transfer holds it."""
        entry = self._entries.pop(cache_id, None)
        if entry is None:
            return None
        if entry.model_id is not None:
            self._by_model.pop(entry.model_id, None)
        for name in entry.keys:
            self._by_key.pop(name, None)
        entry.keys = {}
        entry.pulled = {}
        entry.removed = True
        if entry.pins == 0:
            entry.release()
        self.version += 1
        return entry

    def _check_overlap(self, regions: list[Region]) -> None:
        spans = sorted(
            [(r.address, r.address + r.nbytes) for r in regions]
            + [(r.address, r.address + r.nbytes) for entry in self._entries.values() for r in entry.regions]
        )
        for (_, end), (next_start, _) in zip(spans, spans[1:]):
            if end > next_start:
                raise param_invalid("the memory overlaps a tensor already registered (or another of this call)")

    def clear(self) -> None:
        for cache_id in list(self._entries):
            self.remove(cache_id)
