"""UCX for kvpush links: one worker per engine, one endpoint per link, one-sided puts and gets.

The engine's control link (TCP) carries the handshake; after authentication each side offers its
UCX worker address, and caches it has registered are mapped with ``ucp_mem_map`` (only registered
caches are ever mapped) and their packed rkeys go into the cache table the peer receives. A layer
is one native call posting a ``put_nbx`` per merged run (``get_nbx`` for pulls) and one flush;
completion of the flush is remote completion, and the engine's LANDED message then tells the
receiver.

Error handling mode and transports (measured here, ``shared/UCX_NOTES.md``): endpoint error mode
PEER over tcp let UCX abort a passive target whose writer died (6 of 9 runs), and PEER with shared
memory needs a UCX-allocated target pool to be safe, which registered user memory is not. So
kvpush uses error mode NONE and, with the wheel's UCX, ``UCX_TLS=tcp`` unless the user set
``UCX_TLS``: on one host the same-host transport (``cma``) carries local traffic anyway, and a dead
peer is detected by the control link within milliseconds (its socket closes), after which the
endpoint is closed without waiting for the peer. On RDMA hosts (system UCX with verbs,
``KVPUSH_UCX_PREFIX``) set ``UCX_TLS`` to what the fabric offers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import ucp
from .base import Capabilities, MemoryRegistrar, Mover, Offer, PeerWatch, TransportError

if TYPE_CHECKING:
    from kvpush.layout import IoVec

# auto_between_hosts is False: over plain TCP kvpush's own TCP path is faster on the hosts measured,
# so ``auto`` opens UCX only when it can use RDMA (``open_transport``).
CAPABILITIES = Capabilities(name="ucx", one_sided=True, same_host_only=False, auto_between_hosts=False,
                            needs_registration=True)


class UcxError(TransportError):
    """A UCX call failed (the binding's ``UcpError``, or a malformed peer offer)."""


def available() -> str | None:
    """None when the UCX binding loads, else why not (naming the missing package)."""
    try:
        ucp.load()
    except ucp.UcpUnavailable as error:
        return str(error)
    return None


class UcxOffer:
    def __init__(self, address: bytes) -> None:
        self.wire: dict[str, Any] = {"address": address.hex()}

    def proves_reach(self, proof: str) -> bool:
        return False  # no standing grants over UCX


class UcxService:
    """One engine's UCX worker and the memory it registered (``transports.base.OneSidedTransport``)."""

    capabilities = CAPABILITIES

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        own_choice = "UCX_TLS" in os.environ or "KVPUSH_UCX_PREFIX" in os.environ
        try:
            self.worker = ucp.Worker(loop, tls=None if own_choice else "tcp")
        except ucp.UcpError as error:
            raise UcxError(str(error)) from None

    @property
    def registrar(self) -> MemoryRegistrar | None:
        return self

    def offer(self) -> Offer | None:
        return UcxOffer(self.worker.address)

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
            return UcxMover(self.worker.connect(address, on_error))
        except (KeyError, TypeError, ValueError):
            raise UcxError("UCX could not connect: malformed UCX worker address") from None
        except ucp.UcpError as error:
            raise UcxError(f"UCX could not connect: {error}") from None

    def watch(self, peer_offer: Any) -> PeerWatch | None:
        return None  # not necessarily on this host: grants are kept for a grace period instead

    def close(self) -> None:
        self.worker.close()


class UcxMover:
    """Moves a granted layer over one endpoint (see ``kvpush.onesided``)."""

    capabilities = CAPABILITIES
    lease_proof = ""

    def __init__(self, endpoint: ucp.Endpoint) -> None:
        self.endpoint = endpoint
        self._rkeys: dict[tuple[int, int], Any] = {}

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
        count = local.shape[0] // runs_per_tensor
        try:
            handles = [self._rkey(cache_id, first_tensor + j, rkeys[first_tensor + j]) for j in range(count)]
            index = np.repeat(np.arange(count, dtype=np.uint32), runs_per_tensor)
            return self.endpoint.rma(is_read, local, remote, index, handles)
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
