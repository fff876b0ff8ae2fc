"""The inbound side of one link: every transfer frame a peer initiates.

Stream writes and reads (WRITE, READ), one-sided intents (WRITE_INTENT / READ_INTENT -> GRANT, then
LANDED), standing same-host write grants (LEASE), the notices of writes made under them
(WRITE_NOTICE), and the releases of cache keys whose slots the peer pulled (RELEASE_KEY); the writes
this side copies itself (READ_OFFER) go to ``read_offers``, handed what it needs of this side. Every
request is checked by one pure function, ``admission.resolve``, against this engine's registry (cache
registered, tensors and every run inside it, remote access allowed) before a byte is written or read;
a refusal is answered with its status code and logged.

``Inbound`` is handed what it needs - its engine (the registry and the options: whether remote access is
allowed, the engine's own timeout) and its link's ports (a frame sender, the counters, closing the link,
the data paths' check of a lease proof) - and knows no link.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from transports.base import PayloadSink, PeerWatch

from .admission import Refusal, resolve
from .layout import IoVec
from .memory import CacheEntry, CacheRegistry
from .options import EngineOptions
from .protocol import (
    FrameHeader,
    Kind,
    ProtocolError,
    TransferMeta,
    decode_json,
    decode_release_key,
    decode_status,
    decode_transfer,
    encode_json,
    encode_status,
)
from .read_offers import LinkPorts, OfferPorts, ReadOffers
from .status import LLMStatusCode
from .types import RemoteAccess

log = logging.getLogger(__name__)

LANDED_ABORTED = 1
# How long a receiver keeps a granted cache pinned after its link broke when the peer is not on this
# host (UCX): a transfer the sender had already posted runs to its end even when the control stream is gone.
GRANT_GRACE_S = 2.0

# Incoming requests one link may have in flight here (stream writes being received plus one-sided
# grants not yet landed); past it a request is refused with LLM_LINK_BUSY. Far above what the engine's
# own senders use (two layers per transfer), it bounds what one peer can pin.
MAX_INCOMING_IN_FLIGHT = 1024
# bound once: this runs on every transfer, and an attribute of an enum class is looked up anew on each use
_WRITES = frozenset({Kind.WRITE, Kind.WRITE_INTENT, Kind.READ_OFFER})  # requests that write this side's memory
_DONE = Kind.DONE
DEADLINE_SWEEP_S = 0.25  # how often open incoming transfers are checked against their deadlines


class InboundOwner(Protocol):
    """What the inbound side reads of its engine (``kvpush.datadist.LLMDataDist``)."""

    registry: CacheRegistry

    @property
    def options(self) -> EngineOptions: ...

    def registry_changed(self) -> None:
        """The registry changed because of a peer (it released a cache key): tell every peer."""


@dataclass
class HeldGrants:
    """Caches a closed link still keeps pinned because the peer may still be writing into them:
    released when the watched peer process exits, or after ``GRANT_GRACE_S`` without a watch. The
    engine owns the task that runs ``release_when_safe``."""

    peer: str
    entries: list[CacheEntry]
    watch: PeerWatch | None

    def release(self) -> None:
        entries, self.entries = self.entries, []
        for entry in entries:
            entry.unpin()
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    async def release_when_safe(self) -> None:
        """Cancelled (the engine finalized): caches a live same-host writer may still reach stay
        pinned (they are never unmapped under it); the others are released."""
        watch = self.watch
        try:
            if watch is None:
                await asyncio.sleep(GRANT_GRACE_S)
            elif watch.alive():
                log.info("link to cluster %s closed with %d grant(s) outstanding: the caches stay mapped until "
                         "the writer's process exits", self.peer, len(self.entries))
                await _readable(watch.fileno())
        except asyncio.CancelledError:
            self.release_now_or_keep()
            raise
        self.release()

    def release_now_or_keep(self) -> None:
        """The engine is finalizing: release what no one can write into any more; caches a live
        same-host writer may still reach stay pinned for good (never unmapped under it)."""
        if self.watch is not None and self.watch.alive():
            # INFO, not WARNING: an ordinary finalize while a same-host writer lives ends this way (the demo
            # does); the memory stays mapped until this process exits, which is what keeps it safe.
            log.info("engine finalized while cluster %s's process may still write into %d cache(s): "
                     "they stay mapped", self.peer, len(self.entries))
            self.watch.close()
            self.watch = None
            self.entries = []
            return
        self.release()


async def _readable(fd: int) -> None:
    """Wait until ``fd`` is readable (a pidfd turns readable when its process exits)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class Inbound:
    """Everything a peer asks of this engine's memory on one link."""

    def __init__(self, owner: InboundOwner, link: LinkPorts, peer: str = "?") -> None:
        self._owner = owner
        self._registry = owner.registry
        self._options = owner.options  # parsed at init, before any link
        self._link = link
        self._send = link.send
        self._counters = link.counters
        # per incoming write or grant: request id -> (monotonic time it must end by, what it is, its allowance
        # in s); one sweep timer (armed while any is open) checks them, so a request costs no timer of its own
        self._deadlines: dict[int, tuple[float, str, float]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._peer = peer
        self._writes: dict[int, CacheEntry] = {}                   # stream writes being received
        self._granted: dict[int, tuple[CacheEntry, int, str]] = {}  # one-sided grants until LANDED
        #: READ_OFFERs copied here (same host), gated or not, and the answers held for them
        self.reads = ReadOffers(OfferPorts(link, self._resolve, self._watch, self._done))
        self._leases: dict[int, CacheEntry] = {}    # standing write grants, each holding a pin
        self._revoking: dict[int, CacheEntry] = {}  # revoked, pinned until the writer says it is done
        self._ended: set[int] = set()               # leases ended by a graceful unlink: late frames are fine
        self._peer_id: int | None = None  # None until the handshake named the peer: no grant applies

    def rename(self, peer_cluster_id: int) -> None:
        """The peer's cluster id, known once the handshake is over: what grants are checked against."""
        self._peer = str(peer_cluster_id)
        self._peer_id = peer_cluster_id
        self.reads.rename(self._peer, peer_cluster_id)

    def _resolve(self, header: FrameHeader, meta: bytes, what: str,
                 transfer: TransferMeta | None = None) -> tuple[CacheEntry, IoVec, int] | Refusal:
        """The cache, the iovec and the sender's budget (ms) of a peer's request, or the refusal."""
        if transfer is None:
            transfer = decode_transfer(header, meta)
        try:
            if len(self._writes) + len(self._granted) + len(self.reads.reading) >= MAX_INCOMING_IN_FLIGHT:
                raise Refusal(LLMStatusCode.LLM_LINK_BUSY,
                              f"{MAX_INCOMING_IN_FLIGHT} requests of this link are already in flight here")
            write = header.kind in _WRITES
            entry, iov = resolve(self._registry, self._options.enable_remote_cache_accessible, transfer,
                                 self._peer_id, write)
        except Refusal as refusal:
            log.warning("refused a %s from cluster %s: %s", what, self._peer, refusal.reason)
            return refusal
        return entry, iov, transfer.budget_ms

    def _watch(self, request_id: int, budget_ms: int, what: str, at_least_s: float = 0.0) -> None:
        """Every incoming transfer ends in time: the sender's budget for it, capped by this engine's
        own ``sync_kv_timeout`` (each doubled, plus a second, since the sender's clock starts when the
        layer is its oldest in flight), or ``at_least_s``. Past it (checked every ``DEADLINE_SWEEP_S``)
        the link is closed, which unpins what it held."""
        own = self._options.sync_kv_timeout_ms
        limit_ms = min(budget_ms, own) if budget_ms > 0 else own
        seconds = max(2 * limit_ms / 1000 + 1.0, at_least_s)
        self._deadlines[request_id] = (time.monotonic() + seconds, what, seconds)  # the sweep's clock, in C
        if self._sweeper is None:
            self._sweeper = self._link.loop.call_later(DEADLINE_SWEEP_S, self._sweep)

    def _done(self, request_id: int) -> None:
        self._deadlines.pop(request_id, None)

    def _sweep(self) -> None:
        self._sweeper = None
        now = time.monotonic()
        for request_id, (when, what, seconds) in self._deadlines.items():  # at most MAX_INCOMING_IN_FLIGHT
            if when <= now:
                reason = f"an incoming {what} (request {request_id}) did not complete within {seconds:.1f} s"
                log.warning("closing the link to cluster %s: %s", self._peer, reason)
                self._link.close(reason)  # ends every request of the link (and clears this table)
                return
        if self._deadlines:
            self._sweeper = self._link.loop.call_later(DEADLINE_SWEEP_S, self._sweep)

    # -- stream transfers ---------------------------------------------------------------------------
    def serve_write(self, header: FrameHeader, meta: bytes, in_hand: bool = False) -> PayloadSink | None:
        """A WRITE: where its payload lands (checked by ``resolve``), or None after answering the
        refusal. ``in_hand`` (the stream has the whole payload and fills the sink before the loop runs
        anything else): no pin and no deadline are needed, nothing can release the cache meanwhile."""
        resolved = self._resolve(header, meta, "write")
        if isinstance(resolved, Refusal):
            self._send(encode_status(_DONE, header.request_id, int(resolved.status), resolved.reason))
            return None
        entry, iov, budget_ms = resolved
        request_id = header.request_id

        def answer() -> None:
            self._send(encode_status(_DONE, request_id, 0))  # first: the writer waits for it
            self._counters["bytes_received"] += header.payload_len

        if in_hand:
            return PayloadSink(iov, answer, header.payload_len)
        entry.pin()
        self._writes[request_id] = entry
        self._watch(request_id, budget_ms, "write")

        def landed() -> None:
            answer()
            self._done(request_id)
            if self._writes.pop(request_id, None) is not None:  # else a failed send closed us, which unpinned
                entry.unpin()

        return PayloadSink(iov, landed, header.payload_len)  # decode_transfer checked it against the runs

    def serve_read(self, header: FrameHeader, meta: bytes) -> None:
        resolved = self._resolve(header, meta, "read")
        if isinstance(resolved, Refusal):
            self._send(encode_status(Kind.READ_DATA, header.request_id, int(resolved.status), resolved.reason))
            return
        entry, iov, _ = resolved
        entry.pin()
        payload_len = iov.nbytes
        frame = self._send(encode_status(Kind.READ_DATA, header.request_id, 0, "", payload_len), iov)
        frame.sent.add_done_callback(lambda _: entry.unpin())
        self._counters["bytes_served"] += payload_len

    # -- one-sided ----------------------------------------------------------------------------------
    def on_intent(self, header: FrameHeader, meta: bytes) -> None:
        resolved = self._resolve(header, meta, f"one-sided {header.kind.name}")
        if isinstance(resolved, Refusal):
            self._send(encode_status(Kind.GRANT, header.request_id, int(resolved.status), resolved.reason))
            return
        entry, iov, budget_ms = resolved
        entry.pin()
        counter = "bytes_received" if header.kind == Kind.WRITE_INTENT else "bytes_served"
        self._granted[header.request_id] = (entry, iov.nbytes, counter)
        self._watch(header.request_id, budget_ms, "one-sided transfer")
        self._counters["grants"] += 1
        self._send(encode_status(Kind.GRANT, header.request_id, 0))

    def on_landed(self, header: FrameHeader, meta: bytes) -> None:
        status, _ = decode_status(header, meta)
        granted = self._granted.pop(header.request_id, None)
        if granted is None:
            return
        self._done(header.request_id)
        entry, size, counter = granted
        entry.unpin()
        if status == 0:
            self._counters[counter] += size

    # -- writes this side copies itself (same host): ``read_offers`` ---------------------------------
    def on_read_offer(self, header: FrameHeader, meta: bytes) -> None:
        self.reads.on_offer(header, meta)

    # -- standing grants (same host, UCX) -------------------------------------------------------------
    def on_lease(self, body: dict[str, Any]) -> None:
        op, cache_id = body.get("op"), body.get("cache")
        if not isinstance(cache_id, int):
            raise ProtocolError(f"LEASE without a cache id: {body!r}")
        if op == "request":
            entry = self._registry.get(cache_id)
            # only a writer that read our in-memory secret (it can reach this process) gets a lease
            # a lease opens the whole cache to the writer: only an OPEN cache is leased
            # either answer says whether the writer may offer layers for this side to copy (READ_OFFER, each
            # checked like a write; ``gates``: also offers gated by a mark): a cache open per request (GRANTED)
            # is never leased, yet is read into
            reads = self._link.reader() is not None
            if (entry is None or entry.access is not RemoteAccess.OPEN or cache_id in self._leases
                    or not self._link.proves_reach(str(body.get("proof", "")))
                    or not self._options.enable_remote_cache_accessible):
                self._send(encode_json(Kind.LEASE, 0, {"op": "refuse", "cache": cache_id, "reads": reads,
                                                       "gates": reads}))
                return
            entry.pin()
            self._leases[cache_id] = entry
            self._send(encode_json(Kind.LEASE, 0, {"op": "grant", "cache": cache_id, "reads": reads, "gates": reads}))
        elif op == "revoked":
            entry = self._revoking.pop(cache_id, None)
            if entry is None:
                if cache_id in self._ended:
                    return  # the revoke crossed a graceful unlink: already let go
                raise ProtocolError(f"LEASE revoked for cache {cache_id}, which was not being revoked")
            entry.unpin()
        else:
            raise ProtocolError(f"unexpected LEASE {op!r} for cache {cache_id}")

    def end_leases(self) -> None:
        """The writer said no leased copy into this process runs any more (a graceful unlink)."""
        for cache_id, entry in list(self._leases.items()) + list(self._revoking.items()):
            entry.unpin()
            self._ended.add(cache_id)
        self._leases.clear()
        self._revoking.clear()

    def revoke_released(self) -> None:
        """Caches unregistered here lose their leases (their memory stays until the writer confirms), and
        gated offers into them are refused now rather than when marked."""
        self.reads.refuse_removed()
        for cache_id, entry in list(self._leases.items()):
            if entry.removed:
                del self._leases[cache_id]
                self._revoking[cache_id] = entry
                self._send(encode_json(Kind.LEASE, 0, {"op": "revoke", "cache": cache_id}))

    def on_notice(self, header: FrameHeader, meta: bytes) -> None:
        """A leased write landed: check it lies inside the leased cache and count it."""
        transfer = decode_transfer(header, meta)
        entry = self._leases.get(transfer.cache_id) or self._revoking.get(transfer.cache_id)
        if entry is None and transfer.cache_id in self._ended:
            raise ProtocolError(f"a leased write to cache {transfer.cache_id} after the writer ended its leases")
        if entry is None:
            raise ProtocolError(f"WRITE_NOTICE for cache {transfer.cache_id}, which this link holds no lease on")
        tensors_end = transfer.first_tensor + transfer.num_tensors
        if tensors_end > entry.num_tensors or not transfer.runs.within(entry.tensor_bytes):
            raise ProtocolError(f"a leased write to cache {transfer.cache_id} lay outside it")
        self._counters["leased_writes"] += 1
        self._counters["bytes_received"] += transfer.payload_len

    # -- cache keys ---------------------------------------------------------------------------------
    def on_release_key(self, header: FrameHeader, meta: bytes) -> None:
        """The peer pulled a slot a cache key names: the key goes once every tensor of the slot was
        pulled, if it is a request key of memory kvpush allocated (``CacheRegistry.note_pulled``). A key
        that no longer names that slot is left alone (removed or re-bound meanwhile: not the peer's
        fault); tensors outside the cache are a protocol error."""
        release = decode_release_key(decode_json(header.kind, meta))
        if not self._options.enable_remote_cache_accessible:
            log.warning("ignored a cache key release from cluster %s: remote cache access is disabled", self._peer)
            return
        entry = self._registry.get(release.cache_id)
        if entry is None or entry.access is not RemoteAccess.OPEN:
            log.debug("cache key release from cluster %s for cache %d, which is gone or not open to peers", self._peer,
                      release.cache_id)
            return
        if release.first_tensor + release.num_tensors > entry.desc.num_tensors:
            raise ProtocolError(f"RELEASE_KEY names tensors {release.first_tensor}..+{release.num_tensors} of cache "
                                f"{release.cache_id}, which has {entry.desc.num_tensors}")
        if self._registry.note_pulled(release.name, release.cache_id, release.slot, release.first_tensor,
                                      release.num_tensors):
            log.debug("cache key %s of cache %d released: cluster %s pulled its slot", release.name,
                      release.cache_id, self._peer)
            self._owner.registry_changed()

    # -- closing ------------------------------------------------------------------------------------
    def close(self, watch: Callable[[], PeerWatch | None], lent: list[CacheEntry] | None = None) -> HeldGrants | None:
        """The link is gone. Stream writes being received are unpinned (the stream is closed, no
        byte of them lands any more). A granted one-sided copy may still be queued or running in the
        peer (or the peer may be stopped just before it), so those pins are handed back as
        ``HeldGrants`` for the engine to release when that is safe (None: nothing held), with ``lent``:
        this side's caches the peer may still be reading (READ_OFFERs it did not answer). Copies of read
        offers running here unpin their caches when they end."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.reads.close()  # no one to answer any more
        self._deadlines.clear()
        for entry in self._writes.values():
            entry.unpin()
        self._writes.clear()
        held = [entry for entry, _, _ in self._granted.values()] + list(self._leases.values()) + list(
            self._revoking.values()) + (lent or [])
        self._granted.clear()
        self._leases.clear()
        self._revoking.clear()
        if not held:
            return None
        return HeldGrants(self._peer, held, watch())
