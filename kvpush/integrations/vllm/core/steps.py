"""What the scheduler tells the workers each step: plain data (``StepMeta`` of ``RecvSpec``,
``SendStep``, ``FinishedSend``) that may cross a process boundary, and the block geometry
(``blocks_for``) both sides compute the same way. The scheduler book writes it, the worker books read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...config import PeerAddress


def per_group(blocks: Any) -> tuple[tuple[int, ...], ...]:
    """A request's block ids, one tuple per KV cache group: ``blocks`` as vLLM gives them (one list per
    group), or one flat list for a model with a single group."""
    if not blocks:
        return ((),) if blocks is not None else ()
    if isinstance(blocks[0], Sequence) or hasattr(blocks[0], "__len__"):
        return tuple(tuple(int(b) for b in group) for group in blocks)
    return (tuple(int(b) for b in blocks),)


@dataclass(frozen=True)
class RecvSpec:
    """Decode worker: receive ``transfer_id`` into ``blocks`` (the request's blocks from ``first_block``
    on, ``num_tokens`` prompt tokens in all; with several KV cache groups, the block of every entry of
    ``families.Groups.entries``, 0 where this decode holds none). ``error``: the request cannot be received
    (report it failed at once, ``blocks`` as load errors); ``remote`` is None only then."""

    req_id: str
    transfer_id: str
    remote: PeerAddress | None
    first_block: int
    blocks: tuple[int, ...]
    num_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class SendStep:
    """Prefill worker: this step computes prompt tokens ``[computed_before, computed_after)`` of the
    request whose blocks are ``blocks`` (the whole lists, one per KV cache group, ``per_group``; new after a
    preemption: ``resumed``)."""

    req_id: str
    transfer_id: str
    blocks: tuple[tuple[int, ...], ...]
    computed_before: int
    computed_after: int
    num_prompt_tokens: int
    resumed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", per_group(self.blocks))


@dataclass(frozen=True)
class FinishedSend:
    """Prefill worker: the request finished (``ok``: normally, else aborted). ``delayed``: the
    scheduler kept its blocks, so the worker must report it in ``finished_sending``."""

    req_id: str
    transfer_id: str
    ok: bool
    delayed: bool


@dataclass
class StepMeta:
    """The connector metadata of one step (plain data: it may cross a process boundary)."""

    recv: list[RecvSpec] = field(default_factory=list)
    recv_aborted: list[str] = field(default_factory=list)
    send: list[SendStep] = field(default_factory=list)
    send_finished: list[FinishedSend] = field(default_factory=list)
    #: the step computes tokens; False: an empty step, which vLLM's engine takes while its requests wait on
    #: transfers (a decode's KV, a prefill's block ids or pushes), one after another
    computes: bool = True
    #: prefill requests are held for their decode's block ids (the worker waits for those too)
    holding: bool = False

    def __bool__(self) -> bool:
        return bool(self.recv or self.recv_aborted or self.send or self.send_finished)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
