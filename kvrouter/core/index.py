"""What the router knows each instance holds in its prefix cache (``PrefixIndex``), learnt from its KV
events, or - for an instance that publishes none - guessed from what the router sent it (``CacheView``).

Bounded: an index keeps at most ``capacity`` block hashes, dropping the least recently stored or matched
first (a vLLM instance evicts least recently used blocks too, so the two forget alike). Pure.

A model with several KV cache groups (vLLM's hybrid KV cache manager: sliding-window or Mamba layers beside
full-attention ones) stores the same token block once per group, each stored and evicted on its own (a
window's blocks go long before the full-attention group's): the index keeps each group's blocks apart
(``group``, the events' ``group_idx``), so what one group evicts never takes another's, and a prompt's
prefix is held as far as the group that holds the most of it holds it (the full-attention group's).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_CAPACITY = 1 << 20  # block hashes per instance (~100 MB of Python ints at most)


class PrefixIndex:
    """A set of block hashes per KV cache group, bounded, in least-recently-used order."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"index capacity {capacity} must be >= 1")
        self.capacity = capacity
        self._blocks: OrderedDict[tuple[int, int], None] = OrderedDict()  # (group, hash)
        self._groups: dict[int, int] = {}  # group -> its blocks held
        self.evicted = 0  # hashes dropped to stay within capacity

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        """Held by any group."""
        return any((group, block_hash) in self._blocks for group in self._groups)

    def store(self, hashes: Iterable[int], group: int = 0) -> None:
        blocks, groups = self._blocks, self._groups
        for block_hash in hashes:
            key = (group, block_hash)
            if key not in blocks:
                groups[group] = groups.get(group, 0) + 1
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.capacity:
            (old, _), _ = blocks.popitem(last=False)
            self._forget(old)
            self.evicted += 1

    def remove(self, hashes: Iterable[int], group: int = 0) -> None:
        for block_hash in hashes:
            if self._blocks.pop((group, block_hash), 0) is None:
                self._forget(group)

    def _forget(self, group: int) -> None:
        left = self._groups[group] - 1
        if left:
            self._groups[group] = left
        else:
            del self._groups[group]

    def clear(self) -> None:
        self._blocks.clear()
        self._groups.clear()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are held, in the group that holds the most of them (vLLM reuses
        a prefix only up to the first block it lacks); those are refreshed, as vLLM refreshes the blocks a
        request reuses."""
        blocks = self._blocks
        best, best_group = 0, 0
        for group in self._groups:
            held = 0
            for block_hash in hashes:
                if (group, block_hash) not in blocks:
                    break
                held += 1
            if held > best:
                best, best_group = held, group
        for block_hash in hashes[:best]:
            blocks.move_to_end((best_group, block_hash))
        return best


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
