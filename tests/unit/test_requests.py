"""kvpush.requests: ids, completion, abandonment, failing every request of a link."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.protocol import Kind
from kvpush.requests import RequestTable
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
