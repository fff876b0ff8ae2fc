"""A blocking portal: a private asyncio event loop on its own thread that runs coroutines for callers
that block (plain threads, synchronous programs).

    portal = Portal("kvpush-compat-1")
    result = portal.run(engine.link_clusters(clusters, 3000))     # blocks until done
    future = portal.submit(engine.cache_manager.push_blocks(...))  # concurrent.futures.Future
    portal.call_soon(callback, arg)                                # on the loop thread, thread-safe
    portal.close()                                                 # cancels and awaits what it runs

Guarantees:

- **Structured**: every coroutine given to ``run`` / ``submit`` becomes a task the portal tracks until
  it ends; ``close()`` cancels each one still running and waits until it has unwound, then cancels and
  awaits any other task left on the loop (tasks those coroutines started and did not end), shuts down
  async generators and the loop's default executor, stops the loop and joins the thread. Nothing is
  destroyed while pending.
- **Results and errors unchanged**: ``run`` returns the coroutine's result or raises its exception
  (the same object). A call that ``close()`` cancelled, or that arrives after ``close()``, raises
  ``PortalClosedError`` (a ``RuntimeError``); so does a call whose loop thread died.
- **Interrupts**: ``KeyboardInterrupt`` while ``run`` waits cancels the task, waits until it has
  unwound (a second interrupt stops that wait), then re-raises. ``run(..., timeout=s)`` does the same
  when ``s`` seconds pass and raises ``TimeoutError``.
- **No blocking inside an event loop**: ``run`` called from a thread that runs an event loop (the
  portal's own thread included) raises ``RuntimeError`` at once instead of stalling that loop.
- **Interpreter exit**: portals still open are closed when the interpreter exits, before
  ``concurrent.futures`` stops accepting work, so cleanup that needs an executor (e.g. a socket close
  handed to a thread) still runs and nothing logs "cannot schedule new futures after interpreter
  shutdown". ``at_exit(fn)`` runs ``fn`` in that same phase, before the portals close (the facade
  finalizes its engines there).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # noqa: F401  (imported before at_exit registers: see _register_exit)
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# A waiting caller checks this often that the loop thread is alive. Only a liveness probe: results are
# handed over the moment they exist.
_LIVENESS_POLL_S = 0.5


class PortalClosedError(RuntimeError):
    """The portal was closed (or its loop thread died) before the call could finish."""


def refuse_in_event_loop(api: str, hint: str = "") -> None:
    """Raise RuntimeError when the calling thread is running an asyncio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{api}() blocks until it is done and cannot be called from inside a running asyncio "
                       f"event loop (it would stall that loop).{' ' + hint if hint else ''}")


def yield_to_host(name: str) -> bool:
    """Put the calling thread under ``SCHED_BATCH`` (Linux): its wakeups no longer preempt the thread running on
    its core (an engine's, whose step output carries a request's first token); it runs when that one waits or
    its time slice ends, with the same share of the core as before. Threads it starts inherit it.
    False (and a log line) where the host has no such policy or refuses it."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None:
        log.info("portal %s: this host has no SCHED_BATCH; its loop thread keeps its policy", name)
        return False
    try:
        os.sched_setscheduler(0, batch, os.sched_param(0))
    except OSError as error:
        log.warning("portal %s: SCHED_BATCH refused (%s); its loop thread keeps its policy", name, error)
        return False
    return True


class Portal:
    """One private event loop on one daemon thread, and the tasks it runs for blocking callers. ``yields``:
    the thread runs under ``SCHED_BATCH`` (``yield_to_host``), for a portal embedded in a process whose own
    threads' latency comes first."""

    def __init__(self, name: str, yields: bool = False) -> None:
        self.name = name
        self._yields = yields
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._closing = False  # no new work accepted (set by close() or the loop thread dying)
        self._draining = False  # _shutdown started on the loop: a start() that runs now is refused
        self._shut_down = False
        self._tasks: dict[concurrent.futures.Future[Any], asyncio.Task[Any]] = {}  # loop thread only
        # callers' futures whose task has not ended yet -> set when it has (or never started)
        self._unsettled: dict[concurrent.futures.Future[Any], threading.Event] = {}
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        _open_portals.add(self)

    def __repr__(self) -> str:
        state = "closed" if self._closing else "running" if self._thread.is_alive() else "dead"
        return f"<Portal {self.name} {state}>"

    @property
    def alive(self) -> bool:
        """The loop runs and accepts work."""
        return self._thread.is_alive() and not self._closing

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    # -- the loop thread -------------------------------------------------------------------------------
    def _main(self) -> None:
        if self._yields:
            yield_to_host(self.name)
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        except BaseException:  # SystemExit/KeyboardInterrupt raised by a callback: the loop thread dies
            log.exception("portal %s: its event loop thread stopped on an error", self.name)
        finally:
            with self._lock:
                self._closing = True
            try:
                if not self._shut_down:
                    self._loop.run_until_complete(self._shutdown(0.0))
            except BaseException:
                log.exception("portal %s: cleaning up after its loop stopped failed", self.name)
            finally:
                self._loop.close()
                self._settle_leftovers()

    def _settle_leftovers(self) -> None:
        """Callers still waiting (their call never started, or the loop died under it) get PortalClosedError."""
        with self._lock:
            leftovers, self._unsettled = list(self._unsettled.items()), {}
        for future, settled in leftovers:
            if not future.done():
                future.set_exception(PortalClosedError(f"portal {self.name} closed before the call finished"))
            settled.set()

    async def _shutdown(self, grace: float) -> None:
        """Let tracked tasks finish for ``grace`` seconds, cancel the rest and every other task on the loop,
        and wait until all of them unwound; then async generators and the default executor."""
        self._draining = True  # every call submitted before close() was started by now (FIFO callbacks)
        current = asyncio.current_task()
        tracked = [task for task in self._tasks.values() if task is not current]
        if tracked and grace > 0:
            await asyncio.wait(tracked, timeout=grace)
        for task in tracked:
            task.cancel()
        if tracked:
            await asyncio.gather(*tracked, return_exceptions=True)
        others = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
        if others:
            log.debug("portal %s: cancelling %d task(s) nobody ended: %s", self.name, len(others),
                      ", ".join(task.get_name() for task in others))
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
        await self._loop.shutdown_asyncgens()
        await self._loop.shutdown_default_executor()
        self._shut_down = True

    # -- submitting --------------------------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` as a tracked task on the loop; its outcome arrives in the returned future.
        Cancelling that future cancels the task (which the portal still tracks until it has unwound).
        PortalClosedError once the portal is closed."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        settled = threading.Event()

        def start() -> None:  # on the loop thread
            if self._draining or future.cancelled():
                coro.close()
                self._settle(future, PortalClosedError(f"portal {self.name} is closed") if self._draining else None)
                return
            task = self._loop.create_task(coro)
            self._tasks[future] = task
            task.add_done_callback(lambda done: self._finish(future, done))

        def on_cancel(done: concurrent.futures.Future[T]) -> None:  # on whichever thread cancelled
            if done.cancelled():
                try:
                    self._loop.call_soon_threadsafe(self._cancel_task, future)
                except RuntimeError:
                    pass  # the loop is gone; so is the task

        with self._lock:
            if self._closing or not self._thread.is_alive():
                coro.close()
                raise PortalClosedError(f"portal {self.name} is closed")
            self._unsettled[future] = settled
            try:
                self._loop.call_soon_threadsafe(start)
            except RuntimeError:  # the loop closed meanwhile
                del self._unsettled[future]
                coro.close()
                raise PortalClosedError(f"portal {self.name} is closed") from None
        future.add_done_callback(on_cancel)
        return future

    def _cancel_task(self, future: concurrent.futures.Future[Any]) -> None:
        task = self._tasks.get(future)
        if task is not None:
            task.cancel()

    def _finish(self, future: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
        del self._tasks[future]
        if future.done():  # the caller cancelled it
            self._settle(future, None)
        elif task.cancelled():
            self._settle(future, PortalClosedError(f"portal {self.name} cancelled the call while closing")
                         if self._closing else concurrent.futures.CancelledError())
        elif (error := task.exception()) is not None:
            self._settle(future, error)
        else:
            future.set_result(task.result())
            self._settle(future, None)

    def _settle(self, future: concurrent.futures.Future[Any], error: BaseException | None) -> None:
        if error is not None and not future.done():
            future.set_exception(error)
        with self._lock:
            settled = self._unsettled.pop(future, None)
        if settled is not None:
            settled.set()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block until it is done; return its result or raise its exception.
        See the module docstring for interrupts, ``timeout`` and calls from inside an event loop."""
        try:
            refuse_in_event_loop("Portal.run")
        except RuntimeError:
            coro.close()
            raise
        future = self.submit(coro)
        try:
            return self._result(future, timeout)
        except BaseException:
            if not future.done() and future.cancel():  # interrupted or timed out: cancel, wait until unwound
                self._wait_settled(future)
            raise

    def _result(self, future: concurrent.futures.Future[T], timeout: float | None) -> T:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _LIVENESS_POLL_S if deadline is None else min(_LIVENESS_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"portal {self.name}: the call did not finish within {timeout} s")
            done, _ = concurrent.futures.wait([future], timeout=wait)
            if done:
                return future.result()
            if not self._thread.is_alive() and not future.done():
                raise PortalClosedError(f"portal {self.name}: its event loop thread has stopped")

    def _wait_settled(self, future: concurrent.futures.Future[Any]) -> None:
        """After cancelling a caller's future: wait until the task behind it has ended."""
        with self._lock:
            settled = self._unsettled.get(future)
        while settled is not None and not settled.wait(_LIVENESS_POLL_S) and self._thread.is_alive():
            pass

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Call ``fn(*args)`` on the loop thread soon (thread-safe). PortalClosedError once closed."""
        with self._lock:
            if self._closing or not self._thread.is_alive():
                raise PortalClosedError(f"portal {self.name} is closed")
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:
                raise PortalClosedError(f"portal {self.name} is closed") from None

    # -- closing ---------------------------------------------------------------------------------------
    def close(self, grace: float = 0.0) -> None:
        """Give tracked tasks ``grace`` seconds to finish, cancel and await the rest (and every other task
        on the loop), stop the loop and join its thread. Idempotent; not from the portal's own thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"portal {self.name}: close() cannot be called from its own loop thread")
        with self._lock:
            first = not self._closing
            self._closing = True
        _open_portals.discard(self)
        if first and self._thread.is_alive():
            try:
                done = asyncio.run_coroutine_threadsafe(self._shutdown(grace), self._loop)
            except RuntimeError:
                done = None  # the loop closed meanwhile
            if done is not None:
                while not done.done() and self._thread.is_alive():
                    concurrent.futures.wait([done], timeout=_LIVENESS_POLL_S)
                if done.done() and not done.cancelled() and done.exception() is not None:
                    log.warning("portal %s: shutting down failed: %s", self.name, done.exception())
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:
                pass  # already closed
        self._thread.join()


# -- interpreter exit ------------------------------------------------------------------------------------
_open_portals: weakref.WeakSet[Portal] = weakref.WeakSet()
_exit_hooks: list[Callable[[], None]] = []


def at_exit(hook: Callable[[], None]) -> None:
    """Run ``hook()`` at interpreter exit, before the open portals close (hooks run newest first)."""
    _exit_hooks.append(hook)


def _run_exit() -> None:
    while _exit_hooks:
        hook = _exit_hooks.pop()
        try:
            hook()
        except Exception as error:  # exiting anyway; say why this one could not run cleanly
            log.warning("exit hook %r failed: %s", hook, error)
    for portal in list(_open_portals):
        try:
            portal.close()
        except Exception as error:
            log.warning("closing %r at exit failed: %s", portal, error)


def _register_exit() -> None:
    """Run ``_run_exit`` at interpreter exit while ``concurrent.futures`` still accepts work.

    ``threading._register_atexit`` (CPython >= 3.9, stdlib-private) runs callbacks at the start of
    interpreter shutdown, newest first, before non-daemon threads are joined; ``concurrent.futures.thread``
    registers its own "no new futures" switch there on import, so importing it first (above) puts ours
    after it, which means ours runs before it. ``atexit`` is the fallback (it runs too late for an
    executor, but still closes the portals)."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_run_exit)
            return
        except RuntimeError:  # the interpreter is already shutting down
            pass
    atexit.register(_run_exit)


_register_exit()
