"""kvpush/portal.py: a private event loop that runs coroutines for blocking callers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from kvpush.portal import Portal, PortalClosedError


@pytest.fixture
def portal() -> Iterator[Portal]:
    made = Portal("test-portal")
    yield made
    made.close()
    assert not made.thread.is_alive()


def test_run_returns_the_result_and_raises_the_coroutines_own_exception(portal: Portal) -> None:
    async def add(a: int, b: int) -> tuple[int, str]:
        await asyncio.sleep(0)
        return a + b, threading.current_thread().name

    assert portal.run(add(2, 3)) == (5, "test-portal")  # it ran on the portal's thread
    error = ValueError("mine")

    async def fail() -> None:
        raise error

    with pytest.raises(ValueError) as caught:
        portal.run(fail())
    assert caught.value is error


async def test_run_inside_a_running_event_loop_is_refused_at_once() -> None:
    portal = Portal("refusing")
    try:
        started = asyncio.Event()

        async def never() -> None:
            started.set()

        coro = never()
        with pytest.raises(RuntimeError, match="running asyncio event loop"):
            portal.run(coro)
        assert coro.cr_frame is None  # closed, never run: no "never awaited" warning either
        assert not started.is_set()
    finally:
        await asyncio.to_thread(portal.close)


def test_run_from_the_portals_own_thread_is_refused(portal: Portal) -> None:
    async def inner() -> None:
        return None

    async def outer() -> str:
        try:
            portal.run(inner())
        except RuntimeError as error:
            return str(error)
        return "ran"

    assert "running asyncio event loop" in portal.run(outer())


def test_submit_gives_a_future_and_cancelling_it_cancels_the_task(portal: Portal) -> None:
    unwound = threading.Event()

    async def slow() -> int:
        try:
            await asyncio.sleep(30)
        finally:
            unwound.set()
        return 1

    future = portal.submit(slow())
    time.sleep(0.05)
    assert not future.done()
    assert future.cancel()
    assert unwound.wait(5)
    assert portal.submit(asyncio.sleep(0, result=7)).result(5) == 7


def test_timeout_cancels_waits_until_unwound_then_raises(portal: Portal) -> None:
    order: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # cleanup that takes time
            order.append("unwound")
            raise

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        portal.run(slow(), timeout=0.3)
    order.append("raised")
    assert order == ["unwound", "raised"]
    assert 0.45 < time.monotonic() - started < 3


def test_call_soon_runs_on_the_loop_thread(portal: Portal) -> None:
    seen: list[str] = []
    done = threading.Event()
    portal.call_soon(lambda name: (seen.append(f"{name}@{threading.current_thread().name}"), done.set()), "cb")
    assert done.wait(5) and seen == ["cb@test-portal"]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_a_yielding_portal_runs_its_loop_under_sched_batch_and_threads_it_starts_inherit_it() -> None:
    """``yields``: the loop thread's wakeups do not preempt its host's threads; the host's thread and a plain
    portal's keep their policy, and a thread the loop starts (an executor's) inherits the loop's."""
    yielding, plain = Portal("yielding", yields=True), Portal("plain")
    try:
        async def policies() -> tuple[int, int]:
            here = os.sched_getscheduler(0)
            spawned = await asyncio.get_running_loop().run_in_executor(None, os.sched_getscheduler, 0)
            return here, spawned

        assert yielding.run(policies(), timeout=10) == (os.SCHED_BATCH, os.SCHED_BATCH)
        assert plain.run(policies(), timeout=10) == (os.SCHED_OTHER, os.SCHED_OTHER)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        yielding.close()
        plain.close()


def test_close_cancels_and_awaits_every_task_then_is_idempotent() -> None:
    portal = Portal("closing")
    cleaned: list[str] = []
    running = threading.Event()

    async def tracked() -> None:
        running.set()
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.05)  # its cleanup awaits, and still completes before close() returns
            cleaned.append("tracked")

    async def spawn_untracked() -> None:
        async def orphan() -> None:
            try:
                await asyncio.sleep(30)
            finally:
                cleaned.append("orphan")

        asyncio.get_running_loop().create_task(orphan())  # a task nobody owns: close() ends it too

    future = portal.submit(tracked())
    portal.run(spawn_untracked())
    assert running.wait(5)
    waiter_error: list[BaseException] = []
    waiter = threading.Thread(target=lambda: waiter_error.append(_error_of(lambda: future.result(10))))
    waiter.start()
    portal.close()
    assert sorted(cleaned) == ["orphan", "tracked"]
    assert not portal.thread.is_alive() and not portal.alive
    waiter.join(5)
    assert isinstance(waiter_error[0], PortalClosedError)
    portal.close()  # idempotent
    with pytest.raises(PortalClosedError):
        portal.run(asyncio.sleep(0))
    with pytest.raises(PortalClosedError):
        portal.submit(asyncio.sleep(0))
    with pytest.raises(PortalClosedError):
        portal.call_soon(print)


def test_close_with_grace_lets_tasks_finish_on_their_own() -> None:
    portal = Portal("graceful")

    async def short() -> str:
        await asyncio.sleep(0.2)
        return "finished"

    future = portal.submit(short())
    portal.close(grace=5)
    assert future.result(0) == "finished"


def test_close_from_the_portals_own_thread_is_refused(portal: Portal) -> None:
    async def close_inside() -> str:
        try:
            portal.close()
        except RuntimeError as error:
            return str(error)
        return "closed"

    assert "own loop thread" in portal.run(close_inside())


def test_a_dead_loop_thread_fails_waiting_callers_instead_of_hanging() -> None:
    portal = Portal("dying")
    future = portal.submit(asyncio.sleep(30))

    def die() -> None:
        raise SystemExit("simulated crash of the loop thread")

    portal.call_soon(die)
    with pytest.raises(PortalClosedError):
        future.result(10)
    portal.thread.join(5)
    assert not portal.thread.is_alive()
    with pytest.raises(PortalClosedError):
        portal.run(asyncio.sleep(0))
    portal.close()


def _error_of(call: object) -> BaseException:
    try:
        call()  # type: ignore[operator]
    except BaseException as error:
        return error
    raise AssertionError("no error")


_EXIT_WITHOUT_CLOSE = textwrap.dedent("""
    import asyncio, sys, time
    from kvpush.portal import Portal

    portal = Portal("left-open")

    async def holds_a_resource():
        try:
            await asyncio.sleep(3600)
        finally:
            # cleanup that needs the loop's default executor, as a socket close handed to a thread does
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, 0.01)
            print("cleaned up", flush=True)

    portal.submit(holds_a_resource())
    time.sleep(0.1)
    print("exiting", flush=True)
""")


def test_an_open_portal_is_closed_cleanly_at_interpreter_exit() -> None:
    result = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["exiting", "cleaned", "up"]
    assert result.stderr == ""  # no "cannot schedule new futures after interpreter shutdown", no pending tasks
