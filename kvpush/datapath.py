"""How one link may move bytes one-sided, in both directions, decided from the handshake's offers.

This side offers, per link, what a peer needs to reach this process through each one-sided
transport the engine opened (sent only after authentication); the peer does the same. From the two:
- what this side may tell the peer (tensor addresses, one-sided descriptors) in its cache table:
  only what a transport the peer can actually use into this process needs;
- whether a standing-grant request proves the writer can reach this process;
- which mover this side uses (the registry's order: same host first), or why none, in which case
  the bytes go in the link's stream (TCP).
Transports are handed in (``transports.base``); none is named here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transports.base import Mover, Offer, OneSidedTransport, PeerWatch, TransportError

from .status import LLMException, LLMStatusCode


class DataPaths:
    """One link's one-sided offers (both sides') and the choice made from them."""

    def __init__(self, transports: Sequence[OneSidedTransport], unavailable: Sequence[str] = ()) -> None:
        self._transports = list(transports)
        self._unavailable = list(unavailable)
        self._mine: dict[str, Offer] = {}
        self.peer_offers: dict[str, Any] = {}

    def make_offers(self) -> dict[str, Any]:
        """This side's offers for the link (called once, after the peer authenticated)."""
        wire: dict[str, Any] = {}
        for transport in self._transports:
            offer = transport.offer()
            if offer is not None:
                self._mine[transport.capabilities.name] = offer
                wire[transport.capabilities.name] = offer.wire
        return wire

    def take_peer_offers(self, offers: dict[str, Any]) -> None:
        self.peer_offers = dict(offers)

    def _reachable(self) -> list[OneSidedTransport]:
        """Transports through which the peer can reach this process: we offered, it can use it."""
        return [t for t in self._transports if t.capabilities.name in self._mine
                and t.refusal(self.peer_offers.get(t.capabilities.name)) is None]

    @property
    def share_addresses(self) -> bool:
        """The peer may learn this process's tensor addresses (it can move bytes one-sided into them)."""
        return bool(self._reachable())

    @property
    def share_descriptors(self) -> bool:
        """The peer needs the public descriptors of this process's registered memory."""
        return any(t.capabilities.needs_registration for t in self._reachable())

    def proves_reach(self, proof: str) -> bool:
        """A standing-grant request's proof shows the writer read this process's in-memory secret
        through a transport that allows standing grants."""
        return any(t.capabilities.standing_grants and self._mine[t.capabilities.name].proves_reach(proof)
                   for t in self._reachable())

    def watch_writer(self) -> PeerWatch | None:
        """A handle on the peer process when it may write into this process from this host."""
        for transport in self._reachable():
            watch = transport.watch(self.peer_offers.get(transport.capabilities.name))
            if watch is not None:
                return watch
        return None

    def choose(self, wanted: str, peer_cluster_id: int, on_error: Callable[[str], None]) -> tuple[Mover | None, str]:
        """The mover this side uses, in the registry's order, and why the others were not used. An
        explicit transport that cannot reach the peer raises LLMException(LLM_FEATURE_NOT_ENABLED)."""
        if not self._transports and not self._unavailable:
            return None, ""  # the stream itself was asked for
        reasons = list(self._unavailable)
        for transport in self._transports:
            name = transport.capabilities.name
            offer = self.peer_offers.get(name)
            refusal = transport.refusal(offer)
            if refusal is not None:
                reasons.append(refusal)
                continue
            try:
                return transport.connect(offer, str(peer_cluster_id), on_error), ""
            except TransportError as error:
                reasons.append(error.strerror or str(error))
        reason = "; ".join(reasons)
        if wanted != "auto":
            raise LLMException(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                               f"transport {wanted!r} cannot reach cluster {peer_cluster_id}: {reason}")
        return None, reason
