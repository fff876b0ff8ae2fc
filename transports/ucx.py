"""UCX for kvpush links: one worker per engine, one endpoint per link, one-sided puts and gets.

The engine's control link (TCP) carries the handshake; after authentication each side offers its
UCX worker address, and caches it has registered are mapped with ``ucp_mem_map`` (only registered
caches are ever mapped) and their packed rkeys go into the cache table the peer receives. A layer
is one native call posting a ``put_nbx`` per merged run (``get_nbx`` for pulls) and one flush;
completion of the flush is remote completion, and the engine's LANDED message then tells the
receiver.

Standing grants (leases, ``kvpush.onesided``): each engine registers a 16-byte random secret and
offers its address and rkey with the worker address; a writer reads it with one ``get_nbx`` after
the link is up and presents it when it asks for a lease, so only a peer holding a working endpoint
and rkeys into this process - which can write every cache the table names anyway - gets one. Under a
lease a layer is a put and a flush, then a one-way WRITE_NOTICE: no intent/grant round trip.

Error handling mode and transports (``shared/UCX_NOTES.md``, docs/perf/notes.md): endpoint error mode
PEER over tcp can let UCX abort a passive target whose writer died, and PEER with shared memory needs
a UCX-allocated target pool to be safe, which registered user memory is not. So
kvpush uses error mode NONE and, with the wheel's UCX, ``UCX_TLS=tcp`` unless the user set
``UCX_TLS``: on one host the same-host transport (``cma``) carries local traffic anyway, and a dead
peer is detected by the control link within milliseconds (its socket closes), after which the
endpoint is closed without waiting for the peer. On RDMA hosts (system UCX with verbs,
``KVPUSH_UCX_PREFIX``) set ``UCX_TLS`` to what the fabric offers.
"""

from __future__ import annotations

import array
import asyncio
import functools
import hmac
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpush.layout import IoVec

from . import ucp
from .base import Capabilities, MemoryRegistrar, Mover, Offer, PeerWatch, TransportError

log = logging.getLogger(__name__)

# auto_between_hosts is False: over plain TCP kvpush's own TCP path is the faster one (docs/perf), so
# ``auto`` opens UCX only when it can use RDMA (``open_transport``).
CAPABILITIES = Capabilities(name="ucx", one_sided=True, same_host_only=False, auto_between_hosts=False,
                            needs_registration=True, standing_grants=True)


@functools.lru_cache(maxsize=256)
def tensor_index(tensors: int, runs_per_tensor: int) -> array.array[int]:
    """The rkey of each entry of a layer's vectors: ``runs_per_tensor`` entries per tensor, tensor-major.
    The same few shapes recur layer after layer: made once each (read only, during one call at a time)."""
    index = array.array("I")
    for tensor in range(tensors):
        index.extend(array.array("I", (tensor,)) * runs_per_tensor)
    return index


class UcxError(TransportError):
    """A UCX call failed (the binding's ``UcpError``, or a malformed peer offer)."""


def available() -> str | None:
    """None when the UCX binding loads, else why not (naming the missing package)."""
    try:
        ucp.load()
    except ucp.UcpUnavailable as error:
        return str(error)
    return None


SECRET_BYTES = 16


class UcxOffer:
    """This worker's address and, for standing grants, where the peer can read this engine's secret
    (a small registered buffer: its address and packed rkey)."""

    def __init__(self, address: bytes, secret: bytes | None = None, secret_address: int = 0,
                 secret_rkey: bytes = b"") -> None:
        self.wire: dict[str, Any] = {"address": address.hex()}
        self._secret = secret.hex() if secret is not None else ""
        if secret is not None:
            self.wire["secret"] = [secret_address, secret_rkey.hex()]

    def proves_reach(self, proof: str) -> bool:
        """The peer read the secret with a one-sided get: it holds a working endpoint and rkey into
        this process's registered memory (as it does for every cache the table names)."""
        return bool(self._secret) and hmac.compare_digest(proof, self._secret)


class UcxService:
    """One engine's UCX worker and the memory it registered (``transports.base.OneSidedTransport``)."""

    capabilities = CAPABILITIES

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        own_choice = "UCX_TLS" in os.environ or "KVPUSH_UCX_PREFIX" in os.environ
        try:
            self.worker = ucp.Worker(loop, tls=None if own_choice else "tcp")
        except ucp.UcpError as error:
            raise UcxError(str(error)) from None
        # the secret a writer reads one-sided to be granted standing grants (``UcxOffer.proves_reach``)
        self._secret = np.frombuffer(os.urandom(SECRET_BYTES), np.uint8).copy()
        try:
            self._secret_memh, self._secret_rkey = self.worker.map(self._secret.ctypes.data, SECRET_BYTES)
        except ucp.UcpError as error:
            self.worker.close()
            raise UcxError(str(error)) from None

    @property
    def registrar(self) -> MemoryRegistrar | None:
        return self

    def offer(self) -> Offer | None:
        return UcxOffer(self.worker.address, self._secret.tobytes(), self._secret.ctypes.data, self._secret_rkey)

    def refusal(self, peer_offer: Any) -> str | None:
        return None if isinstance(peer_offer, dict) else "the peer offered no UCX endpoint"

    def map(self, address: int, length: int) -> tuple[Any, bytes]:
        try:
            return self.worker.map(address, length)
        except ucp.UcpError as error:
            raise UcxError(str(error)) from None

    def unmap(self, memh: Any) -> None:
        self.worker.unmap(memh)

    def connect(self, peer_offer: Any, peer_name: str, on_error: Callable[[str], None]) -> Mover:
        try:
            address = bytes.fromhex(str(peer_offer["address"]))
            secret = peer_offer.get("secret")
            mover = UcxMover(self.worker.connect(address, on_error))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise UcxError("UCX could not connect: malformed UCX worker address") from None
        except ucp.UcpError as error:
            raise UcxError(f"UCX could not connect: {error}") from None
        if secret is not None:
            mover.read_secret(secret)
        return mover

    def watch(self, peer_offer: Any) -> PeerWatch | None:
        return None  # not necessarily on this host: grants are kept for a grace period instead

    def close(self) -> None:
        self.worker.unmap(self._secret_memh)
        self.worker.close()


class UcxMover:
    """Moves a granted layer over one endpoint (see ``kvpush.onesided``)."""

    capabilities = CAPABILITIES

    def __init__(self, endpoint: ucp.Endpoint) -> None:
        self.endpoint = endpoint
        self._rkeys: dict[tuple[int, int], Any] = {}
        self.lease_proof = ""  # the peer's secret once ``read_secret`` got it
        self._secret_buffer = np.zeros(SECRET_BYTES, np.uint8)

    def read_secret(self, offered: Any) -> None:
        """Start a one-sided get of the peer's secret (``UcxOffer``); until it lands the link uses
        per-request grants. A malformed offer or a failed get only means no standing grants."""
        try:
            address, packed = int(offered[0]), bytes.fromhex(str(offered[1]))
            handle = self.endpoint.unpack_rkey(packed)
            local = IoVec.of_ints((self._secret_buffer.ctypes.data, SECRET_BYTES))
            got = self.endpoint.rma(True, local, IoVec.of_ints((address, SECRET_BYTES)), tensor_index(1, 1), [handle])
        except (TypeError, ValueError, IndexError, ucp.UcpError) as error:
            log.info("UCX: the peer's secret cannot be read (%s): per-request grants only", error)
            return

        def landed(future: asyncio.Future[None]) -> None:
            if not future.cancelled() and future.exception() is None:
                self.lease_proof = self._secret_buffer.tobytes().hex()

        got.add_done_callback(landed)

    def _rkey(self, cache_id: int, tensor: int, packed: bytes) -> Any:
        handle = self._rkeys.get((cache_id, tensor))
        if handle is None:
            handle = self.endpoint.unpack_rkey(packed)
            self._rkeys[(cache_id, tensor)] = handle
        return handle

    def start(self, is_read: bool, local: IoVec, remote: IoVec, cache_id: int, first_tensor: int,
              rkeys: tuple[bytes, ...] | None, runs_per_tensor: int) -> asyncio.Future[Any]:
        if rkeys is None:
            raise UcxError("the peer sent no rkeys for this cache")
        count = local.entries // runs_per_tensor
        try:
            handles = [self._rkey(cache_id, first_tensor + j, rkeys[first_tensor + j]) for j in range(count)]
            return self.endpoint.rma(is_read, local, remote, tensor_index(count, runs_per_tensor), handles)
        except ucp.UcpError as error:
            raise UcxError(str(error)) from None

    def close(self) -> None:
        self.endpoint.close()


def open_transport(loop: asyncio.AbstractEventLoop, explicit: bool) -> tuple[UcxService | None, str]:
    """This engine's UCX transport, or why there is none. Under ``auto`` (not ``explicit``) only when
    UCX can use RDMA. ``explicit`` and unavailable raises ``UcxError`` naming what is missing."""
    if not explicit and not ucp.rdma_capable():
        return None, "UCX is not enabled in this engine"
    missing = available()
    if missing is not None:
        if explicit:
            raise UcxError(f"transport 'ucx': {missing}")
        return None, f"UCX not used: {missing}"
    try:
        return UcxService(loop), ""
    except UcxError as error:
        if explicit:
            raise UcxError(f"transport 'ucx': {error}") from None
        return None, f"UCX not used: {error}"
