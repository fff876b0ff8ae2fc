"""Which peer may write or read which blocks of one cache registered with ``RemoteAccess.GRANTED``. Pure.

A grant names a peer cluster, blocks of the cache and a direction. The receiver checks every request a
peer makes against the grants in force when it arrives (``BlockGrants.covers``): all of the request's
byte runs must lie in blocks granted to that peer for that direction. Grants nest - they are counted per
block - so a block granted twice stays granted until both are revoked.

Costs scale with the request, never with the cache: a grant or a revocation of k blocks is O(k) (numpy), and
a check reads the count of every block its runs touch, O(those blocks), never more than O(the cache) however
the runs overlap (numpy; a run of one block, one read).
A serving engine's pool is one cache of millions of blocks and a request opens a few thousand of them, so
nothing here walks the cache. (A prefix sum over it, rebuilt per grant and per revocation, made a grant and its
revocation take 5-6 ms at a million blocks and 32-35 ms at eight million: ``python bench/grants.py``.) Memory:
one ``uint32`` count per block of the cache, per peer and direction granted, kept until ``drop``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_Key = tuple[int, bool]  # (peer cluster id, write)
_ONE = np.uint32(1)  # (the counts' own type: numpy's fast ``ufunc.at`` path; a Python 1 takes a 50x slower one)


class BlockGrants:
    """The grants of one cache of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._counts: dict[_Key, np.ndarray[Any, np.dtype[np.uint32]]] = {}  # live grants holding each block
        self._live: dict[_Key, int] = {}  # grants (``add``s) not yet removed, per key
        self._epochs: dict[int, int] = {}  # peer -> how many times its grants were dropped

    def __bool__(self) -> bool:
        return any(self._live.values())

    def add(self, peer: int, blocks: np.ndarray[Any, Any], write: bool) -> None:
        """Grant ``blocks`` (valid block ids; repeats count once each) to ``peer``."""
        key = (peer, write)
        counts = self._counts.get(key)
        if counts is None:  # (the first grant to this peer in this direction: kept until ``drop``)
            counts = self._counts[key] = np.zeros(self.num_blocks, np.uint32)
        np.add.at(counts, blocks, _ONE)
        self._live[key] = self._live.get(key, 0) + 1

    def epoch(self, peer: int) -> int:
        """Changes when ``drop`` ends every grant to ``peer``: an ``add`` made before must not be removed after."""
        return self._epochs.get(peer, 0)

    def drop(self, peer: int) -> None:
        """End every grant to ``peer``."""
        for key in [key for key in self._counts if key[0] == peer]:
            del self._counts[key], self._live[key]
        self._epochs[peer] = self.epoch(peer) + 1

    def remove(self, peer: int, blocks: np.ndarray[Any, Any], write: bool) -> None:
        """Revoke one ``add`` of exactly these blocks (made in the current ``epoch``)."""
        key = (peer, write)
        counts = self._counts.get(key)
        if counts is None or not self._live[key]:
            return
        np.subtract.at(counts, blocks, _ONE)
        self._live[key] -= 1

    def granted(self, peer: int, write: bool) -> int:
        """How many blocks ``peer`` holds a grant on, in that direction (O(blocks of the cache): for tests and
        reports, not for the transfer path)."""
        counts = self._counts.get((peer, write))
        return 0 if counts is None else int(np.count_nonzero(counts))

    def covers(self, peer: int, write: bool, block_bytes: int, runs: Sequence[tuple[int, ...]] | None,
               offsets: np.ndarray[Any, Any] | None = None, lengths: np.ndarray[Any, Any] | None = None) -> bool:
        """Every byte run (offset, length within a tensor) lies in blocks granted to ``peer``: a few runs as
        Python pairs (``runs``), many as arrays (``offsets``, ``lengths``). A run that is empty or reaches outside
        the cache is not covered. The cost is bounded by the blocks the runs touch and by the cache, whatever the
        runs: overlapping ones (a peer's choice) are read as the union of what they touch."""
        key = (peer, write)
        if not self._live.get(key):
            return False
        counts = self._counts[key]
        limit = self.num_blocks
        if runs is not None:
            for offset, length in runs:
                start, stop = offset // block_bytes, -(-(offset + length) // block_bytes)
                if length <= 0 or start < 0 or stop > limit or not (counts[start] if stop - start == 1
                                                                    else counts[start:stop].all()):
                    return False
            return True
        assert offsets is not None and lengths is not None
        first = offsets.astype(np.int64)  # (an offset or length past 2^63 turns negative here: refused below)
        starts = first // block_bytes
        stops = -(-(first + lengths.astype(np.int64)) // block_bytes)
        spans = stops - starts
        if not len(starts) or int(spans.min()) < 1 or int(starts.min()) < 0 or int(stops.max()) > limit \
                or int(lengths.min()) <= 0:
            return False
        total = int(spans.sum())
        if total == len(spans):  # every run within one block
            return bool(counts[starts].all())
        if total > limit:  # runs that overlap: the blocks any of them touches, marked over the cache once
            edges = np.zeros(limit + 1, np.int64)
            np.add.at(edges, starts, 1)
            np.add.at(edges, stops, -1)
            return not bool((np.cumsum(edges[:-1]) > 0)[counts == 0].any())
        # every block of every run, in one gather: position p of run i is block starts[i] + p - (its first position)
        shift = np.repeat(starts - (np.cumsum(spans) - spans), spans)
        return bool(counts[shift + np.arange(total, dtype=np.int64)].all())


class BlockAccess:
    """A grant of some blocks of a ``RemoteAccess.GRANTED`` cache to one peer (``CacheManager.allow``).
    It ends at ``revoke()`` (idempotent; also on leaving ``with``), when the link to that peer closes, or
    when the cache is unregistered, whichever comes first. A request the peer made while it held the grant
    was checked on arrival and runs to its end; one that waits for the peer's word to start (a gated read
    offer, ``kvpush.marks``) is checked again when it starts."""

    def __init__(self, grants: BlockGrants | None, cache_id: int, peer: int, blocks: np.ndarray[Any, Any],
                 modes: tuple[bool, bool], removed: Callable[[], bool]) -> None:
        """``modes``: (write, read); ``removed``: whether the cache was unregistered."""
        assert grants is not None
        self.peer_cluster_id = peer
        self.cache_id = cache_id
        self.num_blocks = len(blocks)
        self._grants = grants
        self._removed = removed
        self._blocks = blocks
        self._modes = [mode for mode, wanted in zip((True, False), modes) if wanted]
        self._epoch = grants.epoch(peer)
        for mode in self._modes:
            grants.add(peer, blocks, mode)
        self._active = True

    @property
    def active(self) -> bool:
        return self._active and self._grants.epoch(self.peer_cluster_id) == self._epoch and not self._removed()

    def revoke(self) -> None:
        """End the grant: requests of the peer that arrive from now on are refused."""
        if self.active:
            for mode in self._modes:
                self._grants.remove(self.peer_cluster_id, self._blocks, mode)
        self._active = False

    def __enter__(self) -> BlockAccess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.revoke()

    def __repr__(self) -> str:
        return (f"<BlockAccess cache={self.cache_id} peer={self.peer_cluster_id} blocks={self.num_blocks} "
                f"{'/'.join('write' if m else 'read' for m in self._modes)}{'' if self.active else ' ended'}>")
