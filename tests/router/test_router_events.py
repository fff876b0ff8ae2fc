"""kvrouter.events.Follower over real ZMQ sockets, against a publisher that speaks vLLM's wire format
(tests/router/fakepub.py): what an instance already held (replayed at start), stores and removals, a gap
replayed, a gap past the replay buffer, a restarted engine, bad messages, a publisher without a replay socket,
one that goes away."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
import zmq.asyncio
from fakepub import CLEARED, FakePublisher, removed, stored

from kvrouter.core.index import CacheView
from kvrouter.core.kv_events import Source
from kvrouter.events import Follower


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def publisher() -> AsyncIterator[FakePublisher]:
    pub = FakePublisher()
    yield pub
    await pub.close()


class Followed:
    def __init__(self, source: Source) -> None:
        self.view, self.counters = CacheView(capacity=1000), Counter[str]()
        self.context = zmq.asyncio.Context()
        self.follower = Follower("http://instance", source, self.view, self.counters, self.context)
        self.task = asyncio.get_running_loop().create_task(self.follower.run())

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.context.term()

    def held(self, *hashes: int) -> int:
        return self.view.match(list(hashes))


async def settle(pub: FakePublisher, followed: Followed) -> None:
    """Publish marker batches until the follower has seen one (a SUB socket joins a moment after connecting)."""
    async def marker() -> bool:
        await pub.publish([stored([999_999])])
        await asyncio.sleep(0.05)
        return followed.held(999_999) == 1
    for _ in range(100):
        if await marker():
            return
    raise AssertionError("the follower never received a batch")


async def test_what_an_instance_holds_before_and_after_it_is_followed(publisher: FakePublisher) -> None:
    await publisher.publish([stored([1, 2, 3])])  # before the follower: learnt from the replay buffer
    followed = Followed(Source(publisher.endpoint, publisher.replay, "kv"))
    try:
        await until(lambda: followed.held(1, 2, 3) == 3)
        await settle(publisher, followed)
        await publisher.publish([stored([4]), removed([2])])
        await until(lambda: followed.held(4) == 1 and followed.held(1, 2) == 1)
        await publisher.publish([CLEARED])
        await until(lambda: followed.held(1) == 0 and followed.held(4) == 0)
        assert followed.counters["events_batches"] >= 4 and followed.counters["events_replays"] == 1
    finally:
        await followed.stop()
    assert not followed.view.following  # a follower that stops leaves the view guessing


async def test_a_missed_batch_is_replayed_and_one_past_the_buffer_relearns(publisher: FakePublisher) -> None:
    followed = Followed(Source(publisher.endpoint, publisher.replay, "kv"))
    try:
        await settle(publisher, followed)
        gaps, relearnt = followed.counters["events_gaps"], followed.counters["events_relearnt"]
        await publisher.publish([stored([10])], send=False)  # dropped on the way (a high-water mark, say)
        await publisher.publish([stored([11])])
        await until(lambda: followed.held(10) == 1 and followed.held(11) == 1)
        assert followed.counters["events_gaps"] == gaps + 1 and followed.counters["events_relearnt"] == relearnt
        await publisher.publish([stored([12])], send=False)
        publisher.buffer.clear()  # what was missed is not buffered any more
        await publisher.publish([stored([13])])
        await until(lambda: followed.held(13) == 1)
        assert followed.counters["events_relearnt"] == relearnt + 1 and followed.held(10) == 0  # started over
    finally:
        await followed.stop()


async def test_a_restarted_engine_clears_what_the_old_one_held(publisher: FakePublisher) -> None:
    followed = Followed(Source(publisher.endpoint, publisher.replay, "kv"))
    try:
        await settle(publisher, followed)
        await publisher.publish([stored([20, 21])])
        await until(lambda: followed.held(20, 21) == 2)
        publisher.restart()
        await asyncio.sleep(0.01)  # its batches are published later than the last applied one
        await publisher.publish([stored([30])])
        await until(lambda: followed.held(30) == 1)
        assert followed.held(20) == 0 and followed.counters["events_restarts"] == 1
    finally:
        await followed.stop()


async def test_bad_messages_are_counted_and_change_nothing(publisher: FakePublisher) -> None:
    followed = Followed(Source(publisher.endpoint, publisher.replay, "kv"))
    try:
        await settle(publisher, followed)
        before = len(followed.view.exact)
        seq = publisher.seq.to_bytes(8, "big")
        for frames in ([b"kv", seq, b"\xc1not msgpack"], [b"kv", b"\x01", msgpack.packb([0.0, [], 0])],
                       [b"kv", seq, msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [-5],
                                                          "block_size": 32}], 0])],
                       [b"kv", seq, msgpack.packb([0.0, [{"type": "Bogus"}], 0])]):
            await publisher.send_raw(frames)
        await publisher.publish([stored([77], block_size=16)])  # a batch in order, of another block size
        await publisher.publish([stored([40])])
        await until(lambda: followed.held(40) == 1)
        refused = {k: v for k, v in followed.counters.items() if k.startswith("events_refused")}
        assert sum(refused.values()) >= 5, refused
        assert followed.held(77) == 0 and len(followed.view.exact) == before + 1
    finally:
        await followed.stop()


async def test_without_a_replay_socket_a_gap_starts_the_index_over(publisher: FakePublisher) -> None:
    followed = Followed(Source(publisher.endpoint, None, "kv"))
    try:
        await settle(publisher, followed)
        relearnt = followed.counters["events_relearnt"]
        await publisher.publish([stored([50])])
        await until(lambda: followed.held(50) == 1)
        await publisher.publish([stored([51])], send=False)
        await publisher.publish([stored([52])])
        await until(lambda: followed.held(52) == 1)
        assert followed.held(50) == 0 and followed.counters["events_relearnt"] == relearnt + 1
    finally:
        await followed.stop()


async def test_a_publisher_that_is_gone_leaves_the_follower_waiting_and_bounded() -> None:
    pub = FakePublisher()
    followed = Followed(Source(pub.endpoint, pub.replay, "kv"))
    try:
        await settle(pub, followed)
        await pub.close()  # the instance went away: nothing more comes, the replay socket too
        await asyncio.sleep(0.3)
        assert not followed.task.done()  # waiting (ZMQ reconnects on its own), no busy loop, nothing applied
        assert followed.held(999_999) == 1
    finally:
        await followed.stop()
