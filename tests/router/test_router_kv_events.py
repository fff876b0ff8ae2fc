"""kvrouter.core.kv_events and kvrouter.core.index: vLLM's KV event messages read, followed and bounded."""

from __future__ import annotations

import msgpack
import pytest

from kvrouter.core.index import CacheView, PrefixIndex
from kvrouter.core.kv_events import (
    MAX_MESSAGE_BYTES,
    Batch,
    Cleared,
    EventError,
    EventFeed,
    Removed,
    Step,
    Stored,
    decode,
)


def message(seq: int, events: list[object], topic: bytes = b"kv") -> list[bytes]:
    """As vLLM 0.32 publishes: topic, 8-byte big-endian sequence, msgpack [ts, events, rank] with events as
    maps tagged by "type"."""
    return [topic, seq.to_bytes(8, "big"), msgpack.packb([1700000000.0, events, 0])]


STORED = {"type": "BlockStored", "block_hashes": [1, (1 << 64) - 1], "parent_block_hash": None,
          "token_ids": list(range(64)), "block_size": 32, "lora_id": None, "medium": "GPU", "lora_name": None,
          "group_idx": 0}


def test_a_batch_as_vllm_sends_it() -> None:
    batch = decode(message(7, [STORED, {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
                               {"type": "AllBlocksCleared"}]))
    assert batch == Batch(7, 1700000000.0, (Stored((1, (1 << 64) - 1), 32), Removed((1,)), Cleared()), 0)


@pytest.mark.parametrize("frames", [
    [b"kv", b"\x00" * 8],  # two frames
    [b"kv", b"\x00" * 4, msgpack.packb([0.0, [], 0])],  # a short sequence number
    [b"kv", b"\x00" * 8, b"\xc1garbage"],  # not msgpack
    [b"kv", b"\x00" * 8, msgpack.packb({"ts": 0})],  # not a batch
    [b"kv", b"\x00" * 8, msgpack.packb([0.0, [["BlockStored", [1]]], 0])],  # an older vLLM's array events
    [b"kv", b"\x00" * 8, msgpack.packb([0.0, [{"type": "Bogus"}], 0])],
    [b"kv", b"\x00" * 8, msgpack.packb([0.0, [{**STORED, "block_hashes": [-1]}], 0])],
    [b"kv", b"\x00" * 8, msgpack.packb([0.0, [{**STORED, "block_hashes": [b"\x00" * 32]}], 0])],  # bytes hashes
    [b"kv", b"\x00" * 8, msgpack.packb([0.0, [{**STORED, "block_size": 0}], 0])],
    [b"kv", b"\x00" * 8, b"\x00" * (MAX_MESSAGE_BYTES + 1)],  # oversized
    [b"kv", b"\x00" * 8, msgpack.packb([0.0, [{**STORED, "block_hashes": list(range(1 << 20 | 1))}], 0])],
])
def test_what_is_not_a_batch_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(EventError):
        decode(frames)


def test_a_hybrid_model_s_groups_are_read_and_kept_apart() -> None:
    """vLLM's hybrid KV cache manager stores a token block once per KV cache group (``group_idx``), and a
    sliding-window group evicts its blocks long before the full-attention group does: an eviction in one group
    leaves the others' blocks, and a prefix counts as far as the group that holds most of it holds it."""
    batch = decode(message(1, [{**STORED, "block_hashes": [1, 2, 3], "group_idx": 1},
                               {"type": "BlockRemoved", "block_hashes": [1], "group_idx": 2}]))
    assert batch.events == (Stored((1, 2, 3), 32, 1), Removed((1,), 2))
    with pytest.raises(EventError, match="group_idx"):
        decode(message(1, [{**STORED, "group_idx": -1}]))
    index = PrefixIndex(capacity=100)
    index.store([1, 2, 3], group=0)  # full attention
    index.store([1, 2, 3], group=1)  # a window
    index.remove([1, 2], group=1)  # the window moved on
    assert index.match([1, 2, 3, 4]) == 3 and 1 in index and len(index) == 4
    index.remove([1], group=0)
    assert index.match([1, 2, 3]) == 0 and index.match([2, 3]) == 2


def test_a_feed_applies_in_order_asks_for_what_it_missed_and_sees_a_restart() -> None:
    feed = EventFeed()
    assert feed.step(5, 10.0) == Step.APPLY  # the first one seen: whatever its number
    feed.applied(5, 10.0)
    assert feed.step(6, 11.0) == Step.APPLY
    feed.applied(6, 11.0)
    assert feed.step(9, 12.0) == Step.GAP and feed.expected == 7  # replay from 7
    assert feed.step(6, 11.0) == Step.OLD  # applied already (a replay, then the same batch live)
    assert feed.step(0, 13.0) == Step.RESTART  # a lower number, published later: the engine started again
    feed.forget()
    assert feed.step(0, 13.0) == Step.APPLY


def test_an_index_is_bounded_and_matches_leading_blocks() -> None:
    index = PrefixIndex(capacity=4)
    index.store([1, 2, 3])
    assert index.match([1, 2, 3, 4]) == 3 and index.match([2, 3]) == 2 and index.match([9, 1]) == 0
    index.store([4, 5])  # over capacity: the least recently used goes (1 was matched before 2 and 3)
    assert len(index) == 4 and 1 not in index and index.evicted == 1
    index.remove([2, 42])
    assert index.match([2]) == 0 and len(index) == 3
    index.clear()
    assert len(index) == 0


def test_a_view_guesses_until_it_follows_events_and_guesses_again_from_scratch() -> None:
    view = CacheView(capacity=100)
    view.sent([1, 2])
    assert view.match([1, 2, 3]) == 2
    view.follow()
    assert view.match([1, 2]) == 0  # the events say nothing yet
    view.exact.store([1])
    view.sent([2])  # while following, routing is no evidence
    assert view.match([1, 2]) == 1
    view.unfollow()
    assert view.match([1, 2]) == 0
