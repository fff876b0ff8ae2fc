"""Model families' KV layouts, engine-neutral and pure: which of a request's cache blocks (or pages) move.

A model's KV cache is one or more groups of layers, each with its own block list per request:

- ``full``: full attention (MHA/GQA, or MLA's latent): every block of the prompt moves.
- ``window``: sliding-window attention: only the blocks the last ``window`` tokens touch move (plus one, for a
  window that does not start on a block boundary); the ones before it are never read again.
- ``state``: recurrent state (Mamba, linear attention, GDN): one block per request holds the state after the
  prompt, and it moves once the whole prompt is computed. Because a state cannot be rewound, the prefill stops
  one token short (``Groups.backoff``) and the decode computes the last prompt token from that state.

A transfer is the list of (group, position) *entries* both sides derive from the same numbers (the prompt's
blocks, the first block the decode does not hold), in one canonical order: by position, then group. The
entries ready after a prefill step are always a prefix of it, so pushing layer by layer as the prompt is
computed needs nothing per group. A destination of 0 is vLLM's null block: the decode holds no block there
(a window position it already dropped) and the entry is skipped; in the plain layout (one full-attention
group) every id is a block, 0 included.

vLLM's connector (``SupportsHMA``: one block list per KV cache group) and SGLang's backend (its SWA and state
pools) both take their layouts from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: vLLM's null block: a placeholder in a block list, never a destination (``BlockPool.null_block``)
NULL_BLOCK = 0

KINDS = ("full", "window", "state")


class LayoutError(ValueError):
    """Block lists that do not fit the layout (the two sides disagree, or a block is missing)."""


@dataclass(frozen=True)
class Group:
    """One KV cache group: ``kind`` (``KINDS``); ``window_blocks``: a window group's blocks per request (the
    window's, plus one); ``spare_blocks``: a state group's trailing scratch blocks (speculative decoding),
    after its running state."""

    kind: str = "full"
    window_blocks: int = 0
    spare_blocks: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"KV cache group kind {self.kind!r}; one of {', '.join(KINDS)}")
        if (self.kind == "window") != (self.window_blocks > 0) or self.spare_blocks < 0 \
                or (self.spare_blocks and self.kind != "state"):
            raise LayoutError(f"bad KV cache group {self}")

    @classmethod
    def window(cls, tokens: int, block_size: int) -> Group:
        """A sliding window of ``tokens`` over blocks of ``block_size``."""
        return cls("window", -(-tokens // block_size) + 1)

    def __str__(self) -> str:
        if self.kind == "window":
            return f"window:{self.window_blocks}"
        return f"state:{self.spare_blocks}" if self.spare_blocks else self.kind


@dataclass(frozen=True)
class Groups:
    """A model's KV cache groups, in the engine's order (both sides of a transfer must agree on them)."""

    groups: tuple[Group, ...] = (Group(),)

    def __post_init__(self) -> None:
        if not self.groups:
            raise LayoutError("a model with no KV cache group")

    @property
    def plain(self) -> bool:
        """One full-attention group: every block of the prompt, the classic layout."""
        return len(self.groups) == 1 and self.groups[0].kind == "full"

    @property
    def backoff(self) -> int:
        """Prompt tokens the prefill leaves to the decode: 1 when a group holds a state, else 0."""
        return int(any(group.kind == "state" for group in self.groups))

    def to_wire(self) -> list[str]:
        return [str(group) for group in self.groups]

    @classmethod
    def from_wire(cls, body: Any) -> Groups:
        """Raises LayoutError for anything but a list of group names (``to_wire``)."""
        if not isinstance(body, list) or not body or not all(isinstance(item, str) for item in body):
            raise LayoutError(f"KV cache groups {body!r}")
        found = []
        for item in body:
            kind, _, count = item.partition(":")
            try:
                number = int(count) if count else 0
            except ValueError:
                raise LayoutError(f"KV cache group {item!r}") from None
            found.append(Group(kind, number if kind == "window" else 0, number if kind == "state" else 0))
        return cls(tuple(found))

    def __str__(self) -> str:
        return "[" + ", ".join(self.to_wire()) + "]"

    # -- entries -----------------------------------------------------------------------------------
    def entries(self, num_blocks: int, first_block: int = 0) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(group, position) of every entry of a prompt of ``num_blocks`` blocks the decode holds from
        ``first_block`` on, sorted by position then group; a state's entry sits at the last position."""
        if num_blocks < 0 or not 0 <= first_block <= num_blocks:
            raise LayoutError(f"blocks {first_block}..{num_blocks}")
        parts_g, parts_p = [], []
        for index, group in enumerate(self.groups):
            if group.kind == "state":
                positions = np.arange(num_blocks - 1, num_blocks) if first_block < num_blocks else np.arange(0)
            else:
                start = first_block if group.kind == "full" else max(first_block, num_blocks - group.window_blocks)
                positions = np.arange(start, num_blocks)
            parts_p.append(positions)
            parts_g.append(np.full(len(positions), index))
        groups, positions = np.concatenate(parts_g).astype(np.int64), np.concatenate(parts_p).astype(np.int64)
        order = np.lexsort((groups, positions))
        return groups[order], positions[order]

    def count(self, num_blocks: int, first_block: int = 0) -> int:
        """How many entries ``entries`` gives."""
        return len(self.entries(num_blocks, first_block)[0])

    def select(self, blocks: Sequence[Sequence[int]], groups: np.ndarray[Any, Any],
               positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The block ids of the entries ``(groups, positions)`` in ``blocks`` (one list per group, by position;
        a state group's list ends with its running state and ``spare_blocks`` scratch blocks). Raises
        LayoutError when a list is too short for an entry."""
        if len(blocks) != len(self.groups):
            raise LayoutError(f"{len(blocks)} block lists for {len(self.groups)} KV cache groups {self}")
        out = np.zeros(len(groups), np.int64)
        for index, group in enumerate(self.groups):
            mask = groups == index
            if not mask.any():
                continue
            ids = np.asarray(blocks[index], np.int64)
            if group.kind == "state":
                if len(ids) <= group.spare_blocks:
                    raise LayoutError(f"KV cache group {index} ({group}) holds {len(ids)} blocks: no state")
                out[mask] = ids[len(ids) - 1 - group.spare_blocks]
                continue
            wanted = positions[mask]
            if len(wanted) and int(wanted.max()) >= len(ids):
                what = f"KV cache group {index} ({group}): " if len(self.groups) > 1 else ""
                raise LayoutError(f"{what}{len(ids)} blocks allocated; block {int(wanted.max())} is wanted")
            out[mask] = ids[wanted]
        return out

    def held(self, ids: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Which of ``ids`` are blocks: all of them in the plain layout, where 0 is a block id like any other;
        else all but ``NULL_BLOCK`` (a window position the side holds no block for)."""
        ids = np.asarray(ids, np.int64)
        return np.ones(len(ids), bool) if self.plain else ids != NULL_BLOCK

    def known(self, blocks: Sequence[Sequence[int]]) -> int:
        """Positions every positional group's list covers (a prefill's lists grow step by step)."""
        lengths = [len(ids) for ids, group in zip(blocks, self.groups) if group.kind != "state"]
        return min(lengths) if lengths else (1 << 62)


PLAIN = Groups()


def pair_tail(src: Any, dst: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """A sliding window's pages as each side names them, paired from the end (the newest pages are the ones a
    window keeps): when one side names more (its window starts a page earlier), its oldest extra pages stay out."""
    src, dst = np.asarray(src, np.int64).ravel(), np.asarray(dst, np.int64).ravel()
    count = min(len(src), len(dst))
    return src[len(src) - count:], dst[len(dst) - count:]


def window_start(num_tokens: int, window: int, page_size: int, held_tokens: int = 0) -> int:
    """The first token of the page-aligned sliding window a decode needs after ``num_tokens`` prompt tokens,
    never before the ``held_tokens`` it already holds (SGLang's SWA pool: ``[window_start, num_tokens)``)."""
    start = max(held_tokens, num_tokens - window, 0)
    return start - start % page_size
