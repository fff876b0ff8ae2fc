"""The engine's listener: where it listens, the accept loop, and the connections still in their handshake.

Connections in handshake at once are bounded (``MAX_PENDING_HANDSHAKES``): past it the oldest one is
dropped to make room, so a flood of idle or slow connections can never keep a real peer out (its
handshake takes a few round trips; a flood would have to open this many connections within them), and
each one holds at most a handshake frame. Every task here is one of the engine's (its ``TaskScope``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from transports.base import Connection, ControlTransport, Listener, TransportError

from .scope import TaskScope
from .status import LLMException, LLMStatusCode

log = logging.getLogger(__name__)

MAX_PENDING_HANDSHAKES = 64


class Listening:
    """One engine's listener. ``handshake(connection)`` runs for every accepted connection, as a task of
    ``tasks``; ``started(host, port)`` is told of every address bound."""

    def __init__(self, control: ControlTransport, tasks: TaskScope,
                 handshake: Callable[[Connection], Coroutine[Any, Any, None]],
                 started: Callable[[str, int], None]) -> None:
        self._control = control
        self._tasks = tasks
        self._handshake = handshake
        self._started = started
        self._listener: Listener | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._accepting: dict[asyncio.Task[Any], Connection] = {}  # in handshake, oldest first
        self.max_pending_handshakes = MAX_PENDING_HANDSHAKES

    @property
    def address(self) -> tuple[str, int] | None:
        """The ``(host, port)`` actually bound, or None when not listening."""
        return self._listener.address if self._listener is not None else None

    def start(self, host: str, port: int) -> None:
        """Bind and start accepting (LLM_PARAM_INVALID naming the address when it cannot be bound)."""
        try:
            self._listener = self._control.listen(host, port)
        except TransportError as error:
            raise LLMException(LLMStatusCode.LLM_PARAM_INVALID,
                               f"cannot listen on {host}:{port}: {error.strerror or error}") from None
        self._accept_task = self._tasks.spawn(self._accept_loop(self._listener), "kvpush-accept")
        self._started(host, port)

    def stop(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            self._accept_task = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def move(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` instead (see ``LLMDataDist.listen``): the new address is bound first,
        then the old listener stops; moving to another host address on the same port lets go of the port
        first and, when the new bind fails, binds the old address again."""
        current = self.address
        if current is not None and current[0] == host and port in (0, current[1]):
            return current
        if current is not None and current[1] == port:  # the port is taken by the old listener
            self.stop()
            try:
                self.start(host, port)
            except LLMException:
                try:
                    self.start(*current)
                except LLMException as error:
                    log.warning("listen: could not listen on %s:%d again: %s", *current, error)
                raise
        else:
            old_listener, old_task = self._listener, self._accept_task
            self._listener, self._accept_task = None, None
            try:
                self.start(host, port)
            except BaseException:
                self._listener, self._accept_task = old_listener, old_task
                raise
            if old_task is not None:
                old_task.cancel()
            if old_listener is not None:
                old_listener.close()
        bound = self.address
        assert bound is not None
        return bound

    async def _accept_loop(self, listener: Listener) -> None:
        while True:
            try:
                connection = await listener.accept()
            except TransportError as error:
                log.warning("accept failed on %s: %s", listener.address, error)
                await asyncio.sleep(0.05)
                continue
            while len(self._accepting) >= self.max_pending_handshakes:
                oldest = next(iter(self._accepting))
                dropped = self._accepting.pop(oldest)
                log.warning("too many connections in handshake (%d): dropping the oldest, from %s",
                            len(self._accepting) + 1, dropped.peer)
                oldest.cancel()
                dropped.close()
            task = self._tasks.spawn(self._handshake(connection), "kvpush-handshake")
            self._accepting[task] = connection
            task.add_done_callback(self._accept_done)

    def _accept_done(self, task: asyncio.Task[Any]) -> None:
        connection = self._accepting.pop(task, None)
        if task.cancelled() and connection is not None:
            connection.close()  # dropped before its handshake ran: nothing else owns the socket
