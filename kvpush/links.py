"""An engine's links by peer cluster, and what happens to the table when a link is made or closes.

Sans-I/O: ``LinkTable`` decides (which link carries this side's transfers to a cluster, which one a new
link replaces, what a closed link leaves behind) and closes the links it replaces through their own
``close``; it runs no task and touches no socket, so the crossing-link cases are tested without either.

- A link from a new instance of the peer (it restarted) replaces every older link to it.
- Both ends linked each other (at once, or one while the other's handshake was under way): the first
  link stays this side's link and the crossing one is kept beside it; neither is torn down, both carry
  transfers both ways, and unlink ends both. When the first one closes, the crossing one takes over.
- A link in the same direction as one there is from the same instance means the peer lost that one (it
  would have reused it otherwise): it replaces it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Generic, Protocol, TypeVar

log = logging.getLogger(__name__)


class Linked(Protocol):
    """What the table reads of a link (``kvpush.link.Link``)."""

    peer_cluster_id: int | None
    peer_instance: str
    dialer: bool

    @property
    def ready(self) -> bool: ...

    def close(self, reason: str, abort: bool = False) -> None: ...


L = TypeVar("L", bound=Linked)


class Adopted(Enum):
    PRIMARY = "primary"  # the cluster's link now: this side's transfers go over it
    CROSSED = "crossed"  # kept beside the primary one (both ends linked each other)


class LinkTable(Generic[L]):
    """The ready links of one engine: a primary one per peer cluster, a crossing one beside it."""

    def __init__(self) -> None:
        self._primary: dict[int, L] = {}
        self._crossed: dict[int, L] = {}
        self._losses: dict[int, int] = {}
        # ``primary(cluster_id)``: the primary link to that peer, or None (the table's own ``get``: every
        # transfer looks its link up, and a method of ours would add a Python call to each)
        self.primary: Callable[[int], L | None] = self._primary.get

    def __len__(self) -> int:
        return len(self._primary)

    @property
    def primaries(self) -> Mapping[int, L]:
        return self._primary

    def links_to(self, cluster_id: int) -> list[L]:
        """Every link to ``cluster_id``, the crossing one first."""
        return [link for link in (self._crossed.get(cluster_id), self._primary.get(cluster_id)) if link is not None]

    def all(self) -> list[L]:
        return [*self._primary.values(), *self._crossed.values()]

    def losses(self, cluster_id: int) -> int:
        """How many times the link to ``cluster_id`` closed with no other link to it left."""
        return self._losses.get(cluster_id, 0)

    def clear(self) -> None:
        """Forget every link (closed by now)."""
        self._primary.clear()
        self._crossed.clear()

    def adopt(self, link: L) -> Adopted:
        """Make ``link`` (ready, its handshake over) a link to its cluster, closing the links it replaces
        (see the module docstring)."""
        assert link.peer_cluster_id is not None
        cluster_id = link.peer_cluster_id
        existing = [old for old in self.links_to(cluster_id) if old is not link and old.ready]
        if any(old.peer_instance != link.peer_instance for old in existing):
            log.info("cluster %d linked again (peer restarted); closing its previous link", cluster_id)
            for old in existing:
                old.close("replaced by a link from a new instance of the same cluster")
            existing = []
        for old in [old for old in existing if old.dialer == link.dialer]:
            log.info("cluster %d linked again in the same direction; closing the link it left", cluster_id)
            old.close("replaced by a new link to the same cluster")
            existing.remove(old)
        primary = self._primary.get(cluster_id)
        if primary is not None and primary.ready and primary in existing:
            log.info("cluster %d linked from both ends; keeping both links", cluster_id)
            self._crossed[cluster_id] = link
            return Adopted.CROSSED
        self._primary[cluster_id] = link
        return Adopted.PRIMARY

    def closed(self, link: L) -> bool:
        """``link`` closed: forget it. True when it was its cluster's link and none is left (the peer is
        lost: counted in ``losses``); a crossing link left takes its place."""
        cluster_id = link.peer_cluster_id
        if cluster_id is None:
            return False
        if self._crossed.get(cluster_id) is link:
            del self._crossed[cluster_id]
            return False
        if self._primary.get(cluster_id) is not link:
            return False  # never adopted (closed during or right after its handshake), or replaced
        spare = self._crossed.pop(cluster_id, None)
        if spare is not None and spare.ready:  # the crossing link goes on carrying this side's transfers
            self._primary[cluster_id] = spare
            return False
        del self._primary[cluster_id]
        self._losses[cluster_id] = self._losses.get(cluster_id, 0) + 1
        return True
