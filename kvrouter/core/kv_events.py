"""vLLM's KV cache events as the router reads them: one message decoded (``decode``) and one instance's
stream of them followed, gaps and restarts included (``EventFeed``). Sans-I/O: bytes in, events out.

A vLLM instance started with ``--kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:PORT",
"replay_endpoint": "tcp://*:PORT2"}'`` publishes, after each engine step that changed its prefix cache, one
ZMQ message of three frames: the topic, the batch's sequence number (8 bytes, big-endian; 0 for the first
batch of an engine, so it restarts with the engine), and a msgpack array ``[ts, events, data_parallel_rank]``
whose events are maps tagged by ``"type"``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``group_idx``, ...), ``BlockRemoved`` (``block_hashes``, ``group_idx``) and
``AllBlocksCleared``. Blocks a decode loads from a prefill are stored there like its own. Hashes are uint64 ints
(the digest's last 8 bytes); ``group_idx`` is the KV cache group (a hybrid model stores each block once per
group; absent: 0).

Whatever an instance sends is checked before it counts: a message over ``MAX_MESSAGE_BYTES``, a payload
msgpack cannot read, a batch or event of another shape, a hash that is no uint64, more than
``MAX_EVENTS`` events or ``MAX_HASHES`` hashes raise ``EventError`` and change nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

MAX_MESSAGE_BYTES = 8 << 20
MAX_EVENTS = 65536  # per batch
MAX_HASHES = 1 << 20  # per batch, over its events
END_SEQ = (1 << 64) - 1  # the replay's end marker
_UINT64 = (1 << 64) - 1


@dataclass(frozen=True)
class Source:
    """Where an instance publishes its KV events: its PUB endpoint, its replay (ROUTER) endpoint or None,
    the topic."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


class EventError(ValueError):
    """A message that is not a KV event batch this router reads; says what is wrong."""


@dataclass(frozen=True)
class Stored:
    hashes: tuple[int, ...]
    block_size: int
    group: int = 0


@dataclass(frozen=True)
class Removed:
    hashes: tuple[int, ...]
    group: int = 0


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    seq: int
    ts: float  # when the engine published it (its wall clock)
    events: tuple[Event, ...]
    rank: int


def sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventError(f"a sequence number of {len(frame)} bytes (8 expected)")
    return int.from_bytes(frame, "big")


def _hashes(value: Any, budget: list[int]) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise EventError("block_hashes is not a list")
    budget[0] -= len(value)
    if budget[0] < 0:
        raise EventError(f"more than {MAX_HASHES} block hashes in one batch")
    if not all(type(h) is int and 0 <= h <= _UINT64 for h in value):
        raise EventError("a block hash that is not a uint64 (an engine with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0?)")
    return tuple(value)


def _group(raw: dict[Any, Any]) -> int:
    group = raw.get("group_idx")
    if group is None:
        return 0
    if type(group) is not int or not 0 <= group < 1 << 16:
        raise EventError(f"{raw.get('type')} with group_idx {str(group)[:40]!r}")
    return group


def _event(raw: Any, budget: list[int]) -> Event:
    if not isinstance(raw, dict):
        raise EventError("an event that is not a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        size = raw.get("block_size")
        if type(size) is not int or size < 1:
            raise EventError(f"BlockStored with block_size {size!r}")
        return Stored(_hashes(raw.get("block_hashes"), budget), size, _group(raw))
    if kind == "BlockRemoved":
        return Removed(_hashes(raw.get("block_hashes"), budget), _group(raw))
    if kind == "AllBlocksCleared":
        return Cleared()
    raise EventError(f"an event of type {str(kind)[:40]!r}")


def decode(frames: list[bytes]) -> Batch:
    """One published message (``[topic, seq, payload]``) -> its batch; ``EventError`` for anything else."""
    if len(frames) != 3:
        raise EventError(f"a message of {len(frames)} frames (3 expected)")
    _, seq, payload = frames
    if len(payload) > MAX_MESSAGE_BYTES:
        raise EventError(f"a batch of {len(payload)} bytes (at most {MAX_MESSAGE_BYTES})")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise EventError(f"a payload msgpack cannot read: {type(error).__name__}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise EventError("a batch that is not [ts, events, rank]")
    if len(raw[1]) > MAX_EVENTS:
        raise EventError(f"{len(raw[1])} events in one batch (at most {MAX_EVENTS})")
    rank = raw[2] if len(raw) > 2 and type(raw[2]) is int else 0
    ts = float(raw[0]) if isinstance(raw[0], (int, float)) else 0.0
    budget = [MAX_HASHES]
    return Batch(sequence(seq), ts, tuple(_event(event, budget) for event in raw[1]), rank)


class Step(enum.Enum):
    APPLY = "apply"  # the next batch: apply it
    GAP = "gap"  # batches were missed: replay from ``EventFeed.expected`` (or relearn), then apply
    RESTART = "restart"  # the sequence went back: the engine restarted; clear its index, then apply
    OLD = "old"  # a batch already applied (replayed, then received live): ignore it


class EventFeed:
    """One instance's sequence of batches: what each new one means (``step``). A publisher numbers its
    batches from 0, one after another, and never sends a number twice; a lower number than the next one
    expected is a batch already applied (its time no later than the last one applied: a replay overlapping
    the live stream) or a restarted engine's (a later time)."""

    def __init__(self) -> None:
        self.expected: int | None = None  # the next sequence number (None: nothing applied yet)
        self.last_ts = 0.0

    def step(self, seq: int, ts: float) -> Step:
        expected = self.expected
        if expected is None or seq == expected:
            return Step.APPLY
        if seq > expected:
            return Step.GAP
        return Step.OLD if ts <= self.last_ts else Step.RESTART

    def applied(self, seq: int, ts: float) -> None:
        self.expected = seq + 1
        self.last_ts = max(self.last_ts, ts)

    def forget(self) -> None:
        self.expected, self.last_ts = None, 0.0
