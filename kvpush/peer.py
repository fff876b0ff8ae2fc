"""What this side knows of a peer's caches: its cache table, replaced whole on every TABLE.

Other modules read it through ``PeerTable`` (lookups by model id, cache id or cache key, the table
version counter); only the link that owns it applies new tables (and forgets a key this side consumed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

from .protocol import ProtocolError
from .types import PREFIX_KEY, REQUEST_KEY, U64_MAX, CacheDesc, DataType, KeyName


@dataclass(frozen=True)
class RemoteKey:
    """A cache key the peer's table lists: it names batch ``slot``; ``released_on_pull``: a pull of the
    whole slot consumes it (the peer drops it)."""

    name: KeyName
    slot: int
    released_on_pull: bool

    @classmethod
    def from_wire(cls, item: Any, num_slots: int) -> RemoteKey:
        if not isinstance(item, list) or len(item) != 5 or not all(type(v) is int for v in item):
            raise ProtocolError(f"bad cache key entry {item!r}")
        kind, key_id, model_id, slot, released = item
        if (kind not in (REQUEST_KEY, PREFIX_KEY) or not 0 <= key_id < U64_MAX or not 0 <= model_id <= U64_MAX
                or not 0 <= slot < num_slots or released not in (0, 1)):
            raise ProtocolError(f"bad cache key entry {item!r}")
        return cls((kind, key_id, model_id), slot, bool(released))


@dataclass(frozen=True)
class RemoteCache:
    """A peer's cache as its table describes it. ``addrs`` (tensor base addresses) is present only
    on links that may move bytes one-sided; ``rkeys`` (the one-sided transport's public descriptors)
    only when that transport needs registered memory. Nothing else about the peer's memory is known."""

    cache_id: int
    model_id: int | None
    is_blocks_cache: bool
    num_tensors: int
    shape: tuple[int, ...]
    data_type: DataType
    addrs: tuple[int, ...] | None = None
    rkeys: tuple[bytes, ...] | None = None
    keys: tuple[RemoteKey, ...] = ()  # the cache keys naming its batch slots (contiguous caches)

    @cached_property
    def desc(self) -> CacheDesc:
        return CacheDesc(self.num_tensors, self.shape, self.data_type)

    @cached_property
    def tensor_bytes(self) -> int:
        return self.desc.size

    @cached_property
    def num_blocks(self) -> int:
        return self.shape[0]

    @cached_property
    def block_bytes(self) -> int:
        return self.desc.block_bytes

    @classmethod
    def from_wire(cls, item: Any) -> RemoteCache:
        try:
            shape = tuple(int(d) for d in item["shape"])
            addrs = item.get("addrs")
            rkeys = item.get("rkeys")
            cache = cls(int(item["id"]), None if item["model"] is None else int(item["model"]),
                        bool(item["blocks"]), int(item["n"]), shape, DataType(int(item["dtype"])),
                        None if addrs is None else tuple(int(a) for a in addrs),
                        None if rkeys is None else tuple(bytes.fromhex(str(k)) for k in rkeys))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as error:
            raise ProtocolError(f"bad cache table entry {item!r}: {error}") from None
        if cache.num_tensors < 1 or not shape or min(shape) < 1:
            raise ProtocolError(f"cache table entry {item!r} describes no memory")
        if cache.addrs is not None and (len(cache.addrs) != cache.num_tensors
                                        or not all(0 < a <= U64_MAX - cache.tensor_bytes for a in cache.addrs)):
            raise ProtocolError(f"cache table entry {cache.cache_id} has bad addresses")
        if cache.rkeys is not None and (cache.addrs is None or len(cache.rkeys) != cache.num_tensors):
            raise ProtocolError(f"cache table entry {cache.cache_id} has bad rkeys")
        keys = item.get("keys")
        if keys is not None:
            if not isinstance(keys, list) or cache.is_blocks_cache:
                raise ProtocolError(f"cache table entry {cache.cache_id} has bad cache keys")
            named = tuple(RemoteKey.from_wire(key, cache.num_blocks) for key in keys)
            if len({key.name for key in named}) != len(named) or len({key.slot for key in named}) != len(named):
                raise ProtocolError(f"cache table entry {cache.cache_id} names a key or a slot twice")
            cache = replace(cache, keys=named)
        return cache


class PeerTable:
    """The peer's caches by id and by model id (read-only for everyone but the owning link)."""

    def __init__(self) -> None:
        self._caches: dict[int, RemoteCache] = {}
        self._by_model: dict[int, int] = {}
        self._by_key: dict[KeyName, tuple[int, RemoteKey]] = {}  # key name -> (cache id, the key)
        self._by_slot: dict[tuple[int, int], KeyName] = {}  # (cache id, slot) -> the key naming it
        self.updates = 0  # how many tables were applied

    @property
    def caches(self) -> Mapping[int, RemoteCache]:
        return MappingProxyType(self._caches)

    def by_model(self, model_id: int) -> RemoteCache | None:
        cache_id = self._by_model.get(model_id)
        return None if cache_id is None else self._caches.get(cache_id)

    def by_id(self, cache_id: int) -> RemoteCache | None:
        return self._caches.get(cache_id)

    def by_key(self, name: KeyName) -> tuple[RemoteCache, RemoteKey] | None:
        """The cache and the key that names one of its slots, or None."""
        found = self._by_key.get(name)
        if found is None:
            return None
        cache = self._caches.get(found[0])
        return None if cache is None else (cache, found[1])

    def key_at(self, cache_id: int, slot: int) -> RemoteKey | None:
        """The key naming slot ``slot`` of cache ``cache_id``, or None."""
        name = self._by_slot.get((cache_id, slot))
        found = None if name is None else self._by_key.get(name)
        return None if found is None else found[1]

    def forget_key(self, name: KeyName) -> None:
        """This side consumed the key (a pull released it): until the peer's next table says otherwise,
        a lookup misses and so asks the peer again. Owning link only."""
        found = self._by_key.pop(name, None)
        if found is not None:
            self._by_slot.pop((found[0], found[1].slot), None)

    def apply(self, body: dict[str, Any]) -> None:
        """Replace the table with a TABLE frame's body; ``ProtocolError`` if it is malformed."""
        caches = body.get("caches")
        if not isinstance(caches, list):
            raise ProtocolError("TABLE without a cache list")
        entries = [RemoteCache.from_wire(item) for item in caches]
        by_key = {key.name: (c.cache_id, key) for c in entries for key in c.keys}
        if len(by_key) != sum(len(c.keys) for c in entries):
            raise ProtocolError("TABLE names one cache key in two caches")
        self._caches = {c.cache_id: c for c in entries}
        self._by_model = {c.model_id: c.cache_id for c in entries if c.model_id is not None}
        self._by_key = by_key
        self._by_slot = {(cache_id, key.slot): name for name, (cache_id, key) in by_key.items()}
        self.updates += 1
