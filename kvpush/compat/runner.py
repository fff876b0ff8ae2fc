"""How the blocking facade reaches its async engine: through one ``Portal``, with the exceptions a
blocking caller should see.

Every call runs on the portal's loop thread, where all engine state lives (synchronous engine calls
such as registration too), so calls from any number of threads are serialised exactly as the engine
expects. Whatever the engine raises comes out as the same object. A call the portal could not finish
(the loop thread died, or ``finalize`` closed the portal under it) raises
``LLMException(LLM_ENGINE_FINALIZED)`` after ``finalize`` and ``RuntimeError`` otherwise.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import kvpush
from kvpush import LLMException, LLMStatusCode

from ..portal import Portal, PortalClosedError, refuse_in_event_loop

T = TypeVar("T")

ASYNC_HINT = ("In async code use the async API instead: `from kvpush import LLMDataDist` and `await` its "
              "methods (e.g. `await dd.cache_manager.push_blocks(...)`).")


def refuse_blocking_in_loop(api: str) -> None:
    refuse_in_event_loop(f"kvpush.compat.llm_datadist: {api}", ASYNC_HINT)


class Runner:
    """One engine, the portal it lives on, and whether the facade finalized it."""

    def __init__(self, engine: kvpush.LLMDataDist, portal: Portal, finalized: Callable[[], bool]) -> None:
        self.engine = engine
        self.portal = portal
        self._finalized = finalized

    def gone(self, api: str) -> BaseException:
        if self._finalized():
            return LLMException(LLMStatusCode.LLM_ENGINE_FINALIZED, f"{api}: the engine was finalized")
        return RuntimeError(f"{api}: the engine's event loop thread has stopped; the call cannot complete")

    def call(self, api: str, factory: Callable[[], Awaitable[T]]) -> T:
        """Run ``factory()`` (an awaitable made on the loop thread) and block until it is done."""
        refuse_blocking_in_loop(api)

        async def body() -> T:
            return await factory()

        try:
            return self.portal.run(body())
        except PortalClosedError:
            raise self.gone(api) from None

    def call_sync(self, api: str, function: Callable[[], T]) -> T:
        """A synchronous engine call made on the loop thread, where engine state lives."""
        async def body() -> T:
            return function()

        return self.call(api, body)

    def submit(self, api: str, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting for it (its outcome arrives in the future)."""
        try:
            return self.portal.submit(coro)
        except PortalClosedError:
            raise self.gone(api) from None
