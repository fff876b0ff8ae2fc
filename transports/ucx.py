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
from typing import TYPE_CHECKING, Any

import numpy as np

from . import ucp
from .base import Capabilities

if TYPE_CHECKING:
    from kvpush.layout import IoVec

CAPABILITIES = Capabilities(name="ucx", one_sided=True, same_host_only=False)


def available() -> str | None:
    """None when the UCX binding loads, else why not (naming the missing package)."""
    try:
        ucp.load()
    except ucp.UcpUnavailable as error:
        return str(error)
    return None


class UcxService:
    """One engine's UCX worker and the memory it registered."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        own_choice = "UCX_TLS" in os.environ or "KVPUSH_UCX_PREFIX" in os.environ
        self.worker = ucp.Worker(loop, tls=None if own_choice else "tcp")

    def offer(self) -> dict[str, Any]:
        return {"address": self.worker.address.hex()}

    def map(self, address: int, length: int) -> tuple[Any, bytes]:
        return self.worker.map(address, length)

    def unmap(self, memh: Any) -> None:
        self.worker.unmap(memh)

    def connect(self, offer: dict[str, Any], on_error: Any) -> UcxMover:
        try:
            address = bytes.fromhex(str(offer["address"]))
        except (KeyError, ValueError):
            raise ucp.UcpError("ucp_ep_create", -1, "malformed UCX worker address") from None
        return UcxMover(self.worker.connect(address, on_error))

    def close(self) -> None:
        self.worker.close()


class UcxMover:
    """Moves a granted layer over one endpoint (see ``kvpush.onesided``)."""

    capabilities = CAPABILITIES

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
            raise ucp.UcpError("rma", -1, "the peer sent no rkeys for this cache")
        count = local.shape[0] // runs_per_tensor
        handles = [self._rkey(cache_id, first_tensor + j, rkeys[first_tensor + j]) for j in range(count)]
        index = np.repeat(np.arange(count, dtype=np.uint32), runs_per_tensor)
        return self.endpoint.rma(is_read, local, remote, index, handles)

    def close(self) -> None:
        self.endpoint.close()
