"""A task scope: the one owner of a set of background tasks (the engine's, a link's, a worker's).

    scope = TaskScope("kvpush-link-2")
    scope.spawn(keepalive(), "keepalive")   # runs until it returns, fails or the scope ends
    scope.cancel()                          # synchronous: every task still running is cancelled
    await scope.aclose()                    # cancel, then wait until each one has unwound

Guarantees: a task spawned here is tracked until it ends, and nothing is fire-and-forget: ``aclose``
returns only when every task has finished unwinding. After ``cancel``/``aclose`` the scope refuses new
tasks, so work that reaches a closed owner late (a frame handler, a callback) cannot outlive it. Like
``asyncio.TaskGroup`` without its "one failure cancels the rest": a background task's failure is its
own (a keepalive that ends does not end the link's other work); its result or error is for whoever
awaits the task that ``spawn`` returns, and asyncio reports an error nobody retrieved, as usual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class ScopeClosedError(RuntimeError):
    """``spawn`` on a scope that was cancelled or closed."""


class TaskScope:
    """The background tasks of one owner (see the module docstring)."""

    __slots__ = ("name", "_tasks", "_closed")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def __repr__(self) -> str:
        return f"<TaskScope {self.name} tasks={len(self._tasks)}{' closed' if self._closed else ''}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run ``coro`` as a task of this scope (on the running loop). ``ScopeClosedError`` (and the
        coroutine closed, never started) once the scope was cancelled or closed."""
        if self._closed:
            coro.close()
            raise ScopeClosedError(f"task scope {self.name} is closed")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel(self) -> None:
        """Refuse new tasks and cancel every running one except the calling task (which is unwinding
        the owner itself). Synchronous: for owners that close from a callback."""
        self._closed = True
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()

    async def aclose(self) -> None:
        """``cancel``, then wait until every task (but the calling one) has ended. Cancelling the caller
        meanwhile stops the wait, not the cancellation of the tasks."""
        self.cancel()
        current = asyncio.current_task()
        pending = [task for task in self._tasks if task is not current]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
