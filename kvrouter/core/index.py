"""What the router knows each instance holds in its prefix cache (``PrefixIndex``), learnt from its KV
events, or - for an instance that publishes none - guessed from what the router sent it (``CacheView``).

Bounded: an index keeps at most ``capacity`` block hashes, dropping the least recently stored or matched
first (a vLLM instance evicts least recently used blocks too, so the two forget alike). Pure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_CAPACITY = 1 << 20  # block hashes per instance (~100 MB of Python ints at most)


class PrefixIndex:
    """A set of block hashes, bounded, in least-recently-used order."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"index capacity {capacity} must be >= 1")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0  # hashes dropped to stay within capacity

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def store(self, hashes: Iterable[int]) -> None:
        blocks = self._blocks
        for block_hash in hashes:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
            self.evicted += 1

    def remove(self, hashes: Iterable[int]) -> None:
        for block_hash in hashes:
            self._blocks.pop(block_hash, None)

    def clear(self) -> None:
        self._blocks.clear()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are held (vLLM reuses a prefix only up to the first block it
        lacks); those are refreshed, as vLLM refreshes the blocks a request reuses."""
        blocks = self._blocks
        held = 0
        for block_hash in hashes:
            if block_hash not in blocks:
                break
            blocks.move_to_end(block_hash)
            held += 1
        return held


class CacheView:
    """One instance's prefix cache as the router sees it: ``exact`` while its KV events are followed (they
    say what it stored and evicted), else ``guessed`` from the requests the router sent it (every prompt
    block it computed or loaded, forgotten least recently used first)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.exact = PrefixIndex(capacity)
        self.guessed = PrefixIndex(capacity)
        self.following = False  # its events are followed: ``exact`` is what it holds

    def match(self, hashes: Sequence[int]) -> int:
        return (self.exact if self.following else self.guessed).match(hashes)

    def sent(self, hashes: Sequence[int]) -> None:
        """The router sent it a request with these prompt blocks (to compute, or to load from a prefill)."""
        if not self.following:
            self.guessed.store(hashes)

    def follow(self) -> None:
        """Its events are followed from now on (its index starts from what they say)."""
        self.following = True

    def unfollow(self) -> None:
        """Its events stopped being followed (their socket went away, a gap that could not be replayed):
        the router guesses again, from scratch."""
        self.following = False
        self.exact.clear()
        self.guessed.clear()
