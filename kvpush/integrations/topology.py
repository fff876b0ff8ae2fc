"""Tensor parallelism and compatibility: which KV heads each rank holds, which prefill rank pushes which
heads to which decode rank, and whether two instances can exchange KV at all (``Geometry``). Pure.

vLLM shards a layer's K and V heads over the ranks of an instance: with ``K`` KV heads and ``tp`` ranks,
each rank holds ``local = max(1, K // tp)`` consecutive heads, and when ``tp > K`` each head is held by
``tp // K`` consecutive ranks (replicas). On CPU a layer is ``[num_blocks, local, block_size, 2*head_size]``,
so one head of one block is one contiguous slab: a worker registers each layer as ``num_blocks * local``
kvpush blocks of one slab each (block ``b``, local head ``h`` -> kvpush block ``b * local + h``), and a
leg's share of a transfer is plain block ids (``Leg.block_ids``), computed with numpy, merged into runs by
kvpush where they touch.

A transfer from a prefill of ``P`` ranks to a decode of ``D`` ranks is a set of ``Leg``s: for every head
of every decode rank, exactly one prefill rank holding it pushes it (replicas take turns over the decode
ranks); consecutive heads between the same two ranks form one leg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .families import PLAIN, Groups, LayoutError


class TopologyError(ValueError):
    """Head counts or TP sizes that cannot be sharded (vLLM would not run them either)."""


@dataclass(frozen=True)
class Sharding:
    """How one instance (``tp_size`` ranks) shards ``total_heads`` KV heads."""

    total_heads: int
    tp_size: int

    def __post_init__(self) -> None:
        if self.total_heads < 1 or self.tp_size < 1:
            raise TopologyError(f"{self.total_heads} KV heads over {self.tp_size} ranks")
        if self.total_heads % self.tp_size and self.tp_size % self.total_heads:
            raise TopologyError(f"{self.total_heads} KV heads cannot be sharded over {self.tp_size} ranks "
                                f"(one must divide the other)")

    @property
    def local(self) -> int:
        """Heads per rank."""
        return max(1, self.total_heads // self.tp_size)

    @property
    def replicas(self) -> int:
        """Ranks holding each head."""
        return max(1, self.tp_size // self.total_heads)

    def first_head(self, rank: int) -> int:
        return (rank // self.replicas) * self.local

    def heads(self, rank: int) -> range:
        """The global head ids rank ``rank`` holds."""
        if not 0 <= rank < self.tp_size:
            raise TopologyError(f"rank {rank} of {self.tp_size}")
        first = self.first_head(rank)
        return range(first, first + self.local)

    def holders(self, head: int) -> range:
        """The ranks holding global head ``head``."""
        first = (head // self.local) * self.replicas
        return range(first, first + self.replicas)


@dataclass(frozen=True)
class Leg:
    """Prefill rank ``prefill_rank`` pushes ``heads`` consecutive heads to decode rank ``decode_rank``: its
    local heads from ``src_head`` on, into the decode rank's local heads from ``dst_head`` on."""

    prefill_rank: int
    decode_rank: int
    src_head: int
    dst_head: int
    heads: int

    def block_ids(self, src_blocks: np.ndarray[Any, Any], dst_blocks: np.ndarray[Any, Any], src_local: int,
                  dst_local: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """The kvpush block ids (see the module docstring) this leg moves for a request whose blocks are
        ``src_blocks`` on the prefill and ``dst_blocks`` on the decode (vLLM block ids, pairwise)."""
        step = np.arange(self.heads, dtype=np.int64)
        src = (np.asarray(src_blocks, np.int64)[:, None] * src_local + self.src_head + step).ravel()
        dst = (np.asarray(dst_blocks, np.int64)[:, None] * dst_local + self.dst_head + step).ravel()
        return src, dst


@dataclass(frozen=True)
class LegInfo:
    """Which heads of the blocks this prefill rank pushes to the sending decode rank (``topology.Leg``): its
    local heads ``src_head`` .. ``src_head + heads - 1`` into the decode rank's ``dst_head`` on, of
    ``dst_local`` heads per block there; ``heads`` 0: nothing (the rank is told so, to release at once).
    ``legs``: how many decode ranks send this prefill rank block ids for the transfer (it is done when
    every one of them is)."""

    src_head: int
    dst_head: int
    heads: int
    dst_local: int
    legs: int = 1


@dataclass(frozen=True)
class Target:
    """A prefill rank a decode rank sends a transfer's block ids to, and what its ``BlockIds`` say
    (``info``); ``leg`` None: that rank pushes nothing to anyone and is told so, to release at once."""

    prefill_rank: int
    info: LegInfo
    leg: Leg | None


def targets(prefill: Sharding, decode: Sharding, decode_rank: int) -> list[Target]:
    """The prefill ranks decode rank ``decode_rank`` sends a transfer's block ids to: every one with a leg
    to it, plus the prefill ranks with no leg to any decode rank whose turn it is to tell them (rank ``p``
    is told by decode rank ``p % D``), so that every prefill rank hears of every transfer."""
    legs = plan_legs(prefill, decode)
    counts = [senders(legs, p) for p in range(prefill.tp_size)]
    found = [Target(leg.prefill_rank, LegInfo(leg.src_head, leg.dst_head, leg.heads, decode.local,
                                              counts[leg.prefill_rank]), leg)
             for leg in legs_to(legs, decode_rank)]
    found += [Target(p, LegInfo(0, 0, 0, decode.local, 1), None) for p in range(prefill.tp_size)
              if not counts[p] and p % decode.tp_size == decode_rank]
    return sorted(found, key=lambda target: target.prefill_rank)


def dst_ids(leg: Leg | LegInfo, dst_blocks: np.ndarray[Any, Any], dst_local: int) -> np.ndarray[Any, Any]:
    """The decode's kvpush block ids a leg writes, for ``dst_blocks`` (vLLM block ids)."""
    step = np.arange(leg.heads, dtype=np.int64)
    return (np.asarray(dst_blocks, np.int64)[:, None] * dst_local + leg.dst_head + step).ravel()


def plan_legs(prefill: Sharding, decode: Sharding) -> list[Leg]:
    """Every leg of a transfer between the two instances (sorted by decode rank, then prefill rank)."""
    if prefill.total_heads != decode.total_heads:
        raise TopologyError(f"KV heads: prefill {prefill.total_heads}, decode {decode.total_heads}")
    legs: list[Leg] = []
    for d in range(decode.tp_size):
        d_first = decode.first_head(d)
        current: Leg | None = None
        for head in decode.heads(d):
            holders = prefill.holders(head)
            p = holders[d % len(holders)]  # decode replicas of a head take the prefill replicas in turn
            src, dst = head - prefill.first_head(p), head - d_first
            if current is not None and current.prefill_rank == p and current.src_head + current.heads == src:
                current = Leg(p, d, current.src_head, current.dst_head, current.heads + 1)
            else:
                if current is not None:
                    legs.append(current)
                current = Leg(p, d, src, dst, 1)
        if current is not None:
            legs.append(current)
    return sorted(legs, key=lambda leg: (leg.decode_rank, leg.prefill_rank, leg.dst_head))


def legs_to(legs: list[Leg], decode_rank: int) -> list[Leg]:
    return [leg for leg in legs if leg.decode_rank == decode_rank]


def senders(legs: list[Leg], prefill_rank: int) -> int:
    """How many legs of a transfer start at ``prefill_rank`` (0: it pushes nothing of it)."""
    return sum(1 for leg in legs if leg.prefill_rank == prefill_rank)


@dataclass(frozen=True)
class Geometry:
    """What a worker's KV looks like, exchanged when a decode links to a prefill (``Hello``/``Welcome``):
    ``model`` fingerprints the model's architecture (not its path), ``kv_heads`` is the model's total.

    ``mla``: the layers hold one compressed latent per token (DeepSeek's multi-head latent attention), which
    every tensor-parallel rank holds whole: one "head" replicated on every rank, so each decode rank reads one
    prefill rank's latent (``plan_legs`` on ``Sharding(1, tp)``), never a share of it. A peer that says nothing
    of it is MHA (``from_wire``).

    ``groups``: the model's KV cache groups (``families.Groups``; a peer that names none has one full-attention
    group). A model with any other layout (sliding windows, recurrent state) registers whole pages of
    ``page`` bytes, one per block and layer slot, and moves between equal TP sizes only, rank to rank
    (``sharding``: every rank holds one "head", its own)."""

    model: str
    dtype: str
    block_size: int
    head_size: int
    layers: int
    kv_heads: int
    tp_size: int
    tp_rank: int
    mla: bool = False
    groups: Groups = PLAIN
    page: int = 0

    @property
    def paged(self) -> bool:
        return not self.groups.plain

    def sharding(self) -> Sharding:
        return Sharding(self.tp_size, self.tp_size) if self.paged else Sharding(self.kv_heads, self.tp_size)

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "block_size": self.block_size, "head_size": self.head_size,
                "layers": self.layers, "kv_heads": self.kv_heads, "tp_size": self.tp_size, "tp_rank": self.tp_rank,
                "mla": self.mla, "groups": self.groups.to_wire(), "page": self.page}

    @classmethod
    def from_wire(cls, body: Any) -> Geometry:
        """Raises ValueError for anything but a complete, well-typed geometry."""
        if not isinstance(body, dict):
            raise ValueError(f"a geometry is an object, got {type(body).__name__}")
        try:
            block_size, head_size, layers, kv_heads, tp_size, tp_rank = (int(body[key]) for key in (
                "block_size", "head_size", "layers", "kv_heads", "tp_size", "tp_rank"))
            groups = Groups.from_wire(body["groups"]) if "groups" in body else PLAIN
            geometry = cls(str(body["model"]), str(body["dtype"]), block_size, head_size, layers, kv_heads, tp_size,
                           tp_rank, body.get("mla", False), groups, int(body.get("page", 0)))
        except (KeyError, TypeError, ValueError, LayoutError) as error:
            raise ValueError(f"bad geometry {body!r}: {error}") from None
        if min(geometry.block_size, geometry.head_size, geometry.layers, geometry.kv_heads, geometry.tp_size) < 1 \
                or not 0 <= geometry.tp_rank < geometry.tp_size or not isinstance(geometry.mla, bool) \
                or (geometry.mla and geometry.kv_heads != 1) or geometry.page < 0 \
                or (geometry.paged and geometry.page < 1):
            raise ValueError(f"bad geometry {body!r}")
        return geometry


def incompatibility(prefill: Geometry, decode: Geometry) -> str | None:
    """Why a decode with ``decode``'s KV cannot take ``prefill``'s (each differing value named on both
    sides), or None. Different TP sizes are bridged; every other difference is not."""
    attention = {True: "MLA (one latent per token)", False: "MHA (KV heads)"}
    problems = [f"attention: prefill {attention[prefill.mla]}, decode {attention[decode.mla]}"] \
        if prefill.mla != decode.mla else []
    problems += [f"{what}: prefill {getattr(prefill, key)}, decode {getattr(decode, key)}"
                 for key, what in (("model", "model"), ("groups", "KV cache groups"), ("dtype", "KV dtype"),
                                   ("block_size", "block size"), ("head_size", "head size"), ("page", "page bytes"),
                                   ("layers", "layers"), ("kv_heads", "KV heads"))
                 if getattr(prefill, key) != getattr(decode, key)]
    if not problems and prefill.paged and prefill.tp_size != decode.tp_size:
        problems.append(f"tensor parallelism: prefill {prefill.tp_size} ranks, decode {decode.tp_size}: a model with "
                        f"KV cache groups {prefill.groups} moves between equal TP sizes only")
    if not problems:
        try:
            plan_legs(prefill.sharding(), decode.sharding())
        except TopologyError as error:
            problems.append(f"tensor parallelism: prefill {prefill.tp_size} ranks, decode {decode.tp_size}: {error}")
    return "; ".join(problems) or None
