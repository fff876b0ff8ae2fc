"""``kvpush.transfer.await_layers``: one task waits for many layers' requests, each on its own deadline."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush import transfer
from kvpush.protocol import Kind
from kvpush.requests import RequestTable
from kvpush.status import LLMException, LLMStatusCode


def link_of(table: RequestTable, noted: list[LLMException]) -> Any:
    """What ``await_layers`` uses of a link: its loop, its request table and where failures are noted."""
    return SimpleNamespace(loop=asyncio.get_running_loop(), requests=table, note_failure=noted.append)


async def test_each_layer_ends_on_its_own_and_one_failing_does_not_end_the_wait() -> None:
    """Four layers in one wait: one lands, one fails, one is abandoned by someone else, one misses its 50 ms
    deadline (and only it: the others' deadlines are a minute). The wait returns once every one ended or timed
    out, with each one's outcome in order; the timeout is noted on the link; no waiter is left behind."""
    table, noted = RequestTable(asyncio.get_running_loop(), lambda error: None), []
    link = link_of(table, noted)
    landed, failed, abandoned, late = (table.new(Kind.WRITE) for _ in range(4))
    waits = [(landed, 0, 60_000), (failed, 1, 60_000), (abandoned, 2, 60_000), (late, 3, 50)]
    waiting = asyncio.create_task(transfer.await_layers("push_layer", link, waits))
    await asyncio.sleep(0)
    table.complete(failed, LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "gone"))
    table.complete(landed, None)
    table.abandon(abandoned)
    outcomes = await asyncio.wait_for(waiting, 5)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], LLMException) and outcomes[1].status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert "layer 1" in str(outcomes[1])
    assert isinstance(outcomes[2], asyncio.CancelledError)
    assert isinstance(outcomes[3], LLMException) and outcomes[3].status_code == LLMStatusCode.LLM_TIMEOUT
    assert "layer 3 not done within 50 ms" in str(outcomes[3]) and noted == [outcomes[3]]
    assert not late.ended  # a timeout ends the wait, never the request (the caller gives it up)
    assert all(op.waiter is None for op, _, _ in waits) and len(table.deadlines) == 0


async def test_layers_ended_before_the_wait_need_no_waiter_and_cancelling_drops_only_the_waiters() -> None:
    table, noted = RequestTable(asyncio.get_running_loop(), lambda error: None), []
    link = link_of(table, noted)
    done, pending = table.new(Kind.WRITE), table.new(Kind.WRITE)
    table.complete(done, None)
    assert await transfer.await_layers("push_layer", link, [(done, 0, 10)]) == [None]
    waiting = asyncio.create_task(transfer.await_layers("push_layer", link, [(done, 0, 60_000), (pending, 1, 60_000)]))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not pending.ended and pending.waiter is None and len(table.deadlines) == 0 and noted == []
    table.complete(pending, None)  # the request itself goes on, and ends as it would have
    assert pending.ended and pending.error is None


async def test_a_layer_past_its_deadline_has_timed_out_even_if_it_ends_while_another_is_awaited() -> None:
    """One layer with a minute's allowance ends at 0.3 s; another with 50 ms ends at 0.2 s, after its deadline. It
    timed out, as its own wait would have said (the waits are taken in the order of their deadlines), and the
    timeout is noted when it happened, not when the slower layer ended."""
    table, noted = RequestTable(asyncio.get_running_loop(), lambda error: None), []
    link = link_of(table, noted)
    slow, late = table.new(Kind.WRITE), table.new(Kind.WRITE)
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, table.complete, slow, None)
    loop.call_later(0.2, table.complete, late, None)
    noted_at: list[int] = []
    waiting = asyncio.create_task(transfer.await_layers("push_layer", link, [(slow, 0, 60_000), (late, 1, 50)]))
    await asyncio.sleep(0.15)
    noted_at.append(len(noted))  # the 50 ms deadline passed: noted already
    outcomes = await asyncio.wait_for(waiting, 5)
    assert outcomes[0] is None and slow.ended and late.ended
    assert isinstance(outcomes[1], LLMException) and outcomes[1].status_code == LLMStatusCode.LLM_TIMEOUT
    assert noted == [outcomes[1]] and noted_at == [1]
    with pytest.raises(LLMException) as alone:  # what the layer's own wait says on the same schedule
        late_alone = table.new(Kind.WRITE)
        loop.call_later(0.2, table.complete, late_alone, None)
        await transfer.await_layer("push_layer", link, late_alone, 1, 50)
    assert alone.value.status_code == LLMStatusCode.LLM_TIMEOUT
