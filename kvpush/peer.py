"""What this side knows of a peer's caches: its cache table, replaced whole on every TABLE.

Other modules read it through ``PeerTable`` (lookups by model id or cache id, the table version
counter); only the link that owns it applies new tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Any

from .protocol import ProtocolError
from .types import U64_MAX, CacheDesc, DataType


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

    @cached_property
    def desc(self) -> CacheDesc:
        return CacheDesc(self.num_tensors, self.shape, self.data_type)

    @cached_property
    def tensor_bytes(self) -> int:
        return self.desc.size

    @property
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
        return cache


class PeerTable:
    """The peer's caches by id and by model id (read-only for everyone but the owning link)."""

    def __init__(self) -> None:
        self._caches: dict[int, RemoteCache] = {}
        self._by_model: dict[int, int] = {}
        self.updates = 0  # how many tables were applied

    @property
    def caches(self) -> Mapping[int, RemoteCache]:
        return MappingProxyType(self._caches)

    def by_model(self, model_id: int) -> RemoteCache | None:
        cache_id = self._by_model.get(model_id)
        return None if cache_id is None else self._caches.get(cache_id)

    def by_id(self, cache_id: int) -> RemoteCache | None:
        return self._caches.get(cache_id)

    def apply(self, body: dict[str, Any]) -> None:
        """Replace the table with a TABLE frame's body; ``ProtocolError`` if it is malformed."""
        caches = body.get("caches")
        if not isinstance(caches, list):
            raise ProtocolError("TABLE without a cache list")
        entries = [RemoteCache.from_wire(item) for item in caches]
        self._caches = {c.cache_id: c for c in entries}
        self._by_model = {c.model_id: c.cache_id for c in entries if c.model_id is not None}
        self.updates += 1
