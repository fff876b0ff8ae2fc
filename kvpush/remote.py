"""What a link knows about its peer and about its own outstanding requests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from transports import tcp
from transports.base import PayloadSink

from .layout import IoVec
from .protocol import Kind, ProtocolError
from .types import U64_MAX, CacheDesc, DataType


@dataclass(frozen=True)
class RemoteCache:
    """A peer's cache as its table describes it. ``addrs`` (tensor base addresses) is present only
    on same-host links that may copy one-sided; nothing else about the peer's memory is known."""

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


class PendingOp:
    """A request waiting for its reply. ``future`` resolves with None or an LLMException.

    One-sided requests also carry both iovecs, the local cache they pin (``release`` unpins it
    exactly once) and, once granted, the worker-thread ``copy``."""

    __slots__ = ("request_id", "kind", "future", "frame", "sink", "expected", "local_iov", "remote_iov",
                 "copy", "move_args", "held", "granted", "notice", "_release")

    def __init__(self, request_id: int, kind: Kind, future: asyncio.Future[Any]) -> None:
        self.request_id = request_id
        self.kind = kind
        self.future = future
        self.frame: tcp.TcpFrame | None = None
        self.sink: PayloadSink | None = None
        self.expected = 0
        self.local_iov: IoVec | None = None
        self.remote_iov: IoVec | None = None
        self.copy: asyncio.Future[Any] | None = None
        self.held = False      # prepared (and, one-sided, granted) but waiting for release_held
        self.granted = False
        self.notice: bytes | None = None  # set for a write under a lease: the WRITE_NOTICE to send after the copy
        self.move_args: tuple[int, int, tuple[bytes, ...] | None, int] = (0, 0, None, 0)
        self._release: Callable[[], None] | None = None

    def hold(self, release: Callable[[], None]) -> None:
        self._release = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    @property
    def bytes_may_land(self) -> bool:
        """True when part of this request may already be in (or on its way to) its destination."""
        if self.copy is not None:
            return True
        return self.kind == Kind.WRITE and self.frame is not None and self.frame.started
