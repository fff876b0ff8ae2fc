"""The receiving side of TCP transfers: every WRITE or READ a peer sends is checked against this
engine's registry again (cache registered, tensors and every run inside it, remote access allowed)
before a byte is written or read; a refusal is answered with its status code and logged."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from transports.base import PayloadSink

from .layout import IoVec, runs_in_bounds, scatter_vector
from .memory import CacheEntry
from .protocol import FrameHeader, Kind, decode_transfer, encode_status
from .status import LLMStatusCode

if TYPE_CHECKING:
    from .link import Link

log = logging.getLogger(__name__)


def resolve(link: Link, header: FrameHeader, meta: bytes) -> tuple[CacheEntry, IoVec] | str:
    """Check a peer's WRITE/READ against the local registry: the iovec, or why it is refused."""
    transfer = decode_transfer(header, meta)
    if not link.owner.options.enable_remote_cache_accessible:
        return f"{LLMStatusCode.LLM_FEATURE_NOT_ENABLED.value}:remote cache access is disabled"
    entry = link.owner.registry.get(transfer.cache_id)
    if entry is None:
        return f"{LLMStatusCode.LLM_KV_CACHE_NOT_EXIST.value}:cache {transfer.cache_id} is not registered"
    desc = entry.desc
    if transfer.first_tensor + transfer.num_tensors > desc.num_tensors:
        return (f"{LLMStatusCode.LLM_PARAM_INVALID.value}:tensors {transfer.first_tensor}.."
                f"{transfer.first_tensor + transfer.num_tensors - 1} exceed the cache's {desc.num_tensors}")
    if not runs_in_bounds(transfer.offsets, transfer.lengths, desc.size):
        return f"{LLMStatusCode.LLM_PARAM_INVALID.value}:a run lies outside cache {transfer.cache_id}'s tensors"
    addrs = entry.addrs[transfer.first_tensor:transfer.first_tensor + transfer.num_tensors]
    return entry, scatter_vector(addrs, transfer.offsets, transfer.lengths)

def serve_write(link: Link, header: FrameHeader, meta: bytes) -> PayloadSink | None:
    resolved = resolve(link, header, meta)
    if isinstance(resolved, str):
        code, _, reason = resolved.partition(":")
        log.warning("refused a write from cluster %s: %s", link.peer_cluster_id, reason)
        link.stream.send(encode_status(Kind.DONE, header.request_id, int(code), reason))
        return None
    entry, iov = resolved
    entry.pin()
    request_id = header.request_id
    link.inbound_pins[request_id] = entry

    def landed() -> None:
        link.inbound_pins.pop(request_id, None)
        entry.unpin()
        link.counters["bytes_received"] += header.payload_len
        link.stream.send(encode_status(Kind.DONE, request_id, 0))

    return PayloadSink(iov, landed)

def serve_read(link: Link, header: FrameHeader, meta: bytes) -> None:
    resolved = resolve(link, header, meta)
    if isinstance(resolved, str):
        code, _, reason = resolved.partition(":")
        log.warning("refused a read from cluster %s: %s", link.peer_cluster_id, reason)
        link.stream.send(encode_status(Kind.READ_DATA, header.request_id, int(code), reason))
        return
    entry, iov = resolved
    entry.pin()
    payload_len = int(iov[:, 1].sum())
    frame = link.stream.send(encode_status(Kind.READ_DATA, header.request_id, 0, "", payload_len), iov)
    frame.sent.add_done_callback(lambda _: entry.unpin())
    link.counters["bytes_served"] += payload_len
