"""Whether a peer's request may touch this engine's memory: one pure check for every transfer a peer initiates
(``resolve``), and the second look a transfer that starts later takes (``still_open``). Nothing here pins,
sends or logs; a refusal carries the status code the peer is answered with."""

from __future__ import annotations

from .layout import FEW, IoVec
from .memory import CacheEntry, CacheRegistry
from .protocol import TransferMeta
from .status import LLMStatusCode
from .types import RemoteAccess

_PRIVATE = RemoteAccess.PRIVATE  # (bound once: every write a peer sends is checked, and an enum's attribute costs)


class Refusal(Exception):
    """Why a peer's request is refused: the status code it is answered with and the reason."""

    def __init__(self, status: LLMStatusCode, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def resolve(registry: CacheRegistry, access_allowed: bool, transfer: TransferMeta, peer: int | None = None,
            write: bool = True) -> tuple[CacheEntry, IoVec]:
    """Check a peer's transfer (``write``: into this engine's memory, else out of it) against the local
    registry: the cache and the iovec it addresses, or ``Refusal``. A private cache is refused as if it
    did not exist; a ``GRANTED`` one only where every run lies in blocks granted to ``peer`` for that
    direction. Pure: nothing is pinned, nothing is sent."""
    if not access_allowed:
        raise Refusal(LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "remote cache access is disabled")
    entry = registry.get(transfer.cache_id)
    if entry is None or entry.access is _PRIVATE:
        raise Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {transfer.cache_id} is not registered")
    first, count = transfer.first_tensor, transfer.num_tensors
    if first + count > entry.num_tensors:
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"tensors {first}..{first + count - 1} exceed the cache's {entry.num_tensors}")
    if not transfer.runs.within(entry.tensor_bytes):
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, f"a run lies outside cache {transfer.cache_id}'s tensors")
    if entry.grants is not None:
        check_grants(entry, transfer, peer, write)
    return entry, transfer.runs.vector(entry.cache.tensor_addrs, first, count, 0)


def check_grants(entry: CacheEntry, transfer: TransferMeta, peer: int | None, write: bool) -> None:
    """Refuse a transfer into or out of a ``GRANTED`` cache that strays from the blocks granted to ``peer``."""
    grants = entry.grants
    if grants is None:
        return
    runs = transfer.runs
    covered = peer is not None and (
        grants.covers(peer, write, entry.block_bytes, runs.rows()) if len(runs) <= FEW
        else grants.covers(peer, write, entry.block_bytes, None, runs.column(0), runs.length))
    if not covered:
        raise Refusal(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                      f"cache {transfer.cache_id}: the {'written' if write else 'read'} blocks are not all granted to "
                      f"cluster {peer} for {'writing' if write else 'reading'}")


def still_open(entry: CacheEntry, transfer: TransferMeta, peer: int | None) -> Refusal | None:
    """A transfer checked on arrival and started later (a gated offer): its cache is still registered and
    its blocks still granted."""
    if entry.removed:
        return Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {transfer.cache_id} was unregistered")
    try:
        check_grants(entry, transfer, peer, True)
    except Refusal as refusal:
        return refusal
    return None
