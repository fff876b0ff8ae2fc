"""kvpush.requests: ids, completion, abandonment, failing every request of a link."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.protocol import Kind
from kvpush.requests import Deadlines, RequestTable
from kvpush.status import LLMException, LLMStatusCode


async def test_ids_count_from_one_and_are_never_reused() -> None:
    table = RequestTable(asyncio.get_running_loop(), lambda error: None)
    first, second = table.new(Kind.WRITE), table.new(Kind.READ)
    table.complete(first, None)
    third = table.new(Kind.WRITE)
    assert (first.request_id, second.request_id, third.request_id) == (1, 2, 3)


async def test_a_late_reply_finds_no_entry_and_a_kind_mismatch_is_not_matched() -> None:
    table = RequestTable(asyncio.get_running_loop(), lambda error: None)
    op = table.new(Kind.WRITE)
    assert table.get(op.request_id, Kind.READ) is None
    assert table.get(op.request_id, Kind.WRITE) is op
    table.abandon(op)
    assert op.future.cancelled() and table.get(op.request_id) is None and len(table) == 0


async def test_completion_happens_once_and_failures_are_reported() -> None:
    failures: list[LLMException] = []
    table = RequestTable(asyncio.get_running_loop(), failures.append)
    op = table.new(Kind.WRITE)
    table.complete(op, LLMException(LLMStatusCode.LLM_PARAM_INVALID, "no"))
    table.complete(op, None)  # ignored
    with pytest.raises(LLMException):
        await op.future
    assert [error.status_code for error in failures] == [LLMStatusCode.LLM_PARAM_INVALID]


async def test_fail_all_ends_every_request_and_releases_those_that_never_moved() -> None:
    table = RequestTable(asyncio.get_running_loop(), lambda error: None)
    released: list[int] = []
    ops = [table.new(Kind.WRITE) for _ in range(3)]
    for op in ops:
        op.hold(lambda op=op: released.append(op.request_id))
    ops[1].copy = asyncio.get_running_loop().create_future()  # a copy is running: its release is the copy's
    table.fail_all(LLMStatusCode.LLM_TIMEOUT, "link broke")
    for op in ops:
        with pytest.raises(LLMException) as caught:
            await op.future
        assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT and "link broke" in str(caught.value)
    assert released == [1, 3] and len(table) == 0
    ops[1].copy.cancel()


async def test_a_release_runs_exactly_once_even_when_handed_on() -> None:
    table = RequestTable(asyncio.get_running_loop(), lambda error: None)
    calls: list[str] = []
    op = table.new(Kind.WRITE)
    op.hold(lambda: calls.append("unpin"))
    handed = op.take_release()
    op.release()
    assert calls == [] and handed is not None
    handed()
    assert calls == ["unpin"]


async def test_deadlines_wake_only_waiters_still_pending_in_the_order_of_their_deadlines() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    woken: list[str] = []
    slow, fast, done = loop.create_future(), loop.create_future(), loop.create_future()
    for name, waiter in (("slow", slow), ("fast", fast), ("done", done)):
        waiter.add_done_callback(lambda _, name=name: woken.append(name))
    deadlines.add(0.4, slow)
    deadlines.add(0.05, fast)  # earlier than the armed timer: the timer is moved forward
    deadlines.add(0.05, done)
    done.set_result(None)  # its wait ended otherwise: no wakeup from the deadline
    deadlines.finished()
    await asyncio.wait_for(fast, 5)
    assert woken == ["done", "fast"] and not slow.done()
    await asyncio.wait_for(slow, 5)
    assert woken == ["done", "fast", "slow"] and slow.result() is None
    deadlines.finished()
    deadlines.finished()
    assert len(deadlines) == 0


async def test_deadlines_of_finished_waits_do_not_pile_up_and_close_stops_the_timer() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    keeper = loop.create_future()
    deadlines.add(0.01, keeper)  # the earliest deadline stays pending: finished ones queue behind it
    for _ in range(1000):
        waiter = loop.create_future()
        deadlines.add(3600, waiter)
        waiter.set_result(None)
        deadlines.finished()
    assert len(deadlines) == 1 and deadlines.entries <= 2 * Deadlines._REBUILD_AT
    await asyncio.wait_for(keeper, 5)  # the one pending waiter is still woken at its deadline
    deadlines.finished()
    later = loop.create_future()
    deadlines.add(0.01, later)
    deadlines.close()
    await asyncio.sleep(0.05)
    assert not later.done()  # closed: nothing fires (the link's requests wake their own waiters)
    later.cancel()
