"""Whether a serving engine's peer process still listens where it did: what a transfer backend asks when its
kvpush link to that peer closed, or before it waits on a peer it holds no link to.

A refused connection means nothing listens at that address any more: the process exited (or closed the
socket on its way out), on this host or another. No answer within the timeout means the host is gone or cut
off. Either way nothing the peer was asked to do will be done, and whatever waits on it can end now instead
of at a timeout. A connection that is accepted proves only that the process lives, which is all that is
asked here (``kvpush.probe`` asks more of a kvpush engine: that its event loop runs).

Right after a link closed, one accepted connection proves less: a process that dies closes its sockets one
after another (and the processes of a server exit one after another), so the address asked about can still
accept a connection a moment, or longer on a slow shutdown, after the link to that process closed. So does one
that has no link yet and dies before it makes one. ``gone_after_close`` watches such a peer while something
waits on it; ``Watches`` keeps one watch per peer.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Coroutine, Hashable
from typing import Any

__all__ = ["PROBE_TIMEOUT_S", "WAIT_S", "WATCH_S", "Watches", "gone", "gone_after_close", "gone_async",
           "split_host_port"]

PROBE_TIMEOUT_S = 1.0  # a live peer on a working network answers a connect in well under a millisecond to a few
WATCH_S = 10.0  # how long a watched peer is asked again at short intervals (a dying process's last moments)
WAIT_S = 300.0  # the longest watch by default (SGLang's own bootstrap and waiting timeouts, by default)
_FIRST_RETRY_S = 0.02  # the first wait before asking again; it doubles, up to _LONGEST_RETRY_S, for WATCH_S
_LONGEST_RETRY_S = 1.0
_SLOW_RETRY_S = 2.0  # after WATCH_S
# a connection this host could not even try: it says nothing of the peer (out of descriptors, ports, memory)
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})

log = logging.getLogger(__name__)


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port). ValueError if it is neither."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


def _verdict(host: str, port: int, error: OSError | TimeoutError, timeout: float) -> str | None:
    if isinstance(error, ConnectionRefusedError):
        return f"nothing listens at {host}:{port} any more (connection refused)"
    if isinstance(error, TimeoutError | socket.timeout):
        return f"{host}:{port} did not answer a connection within {timeout:g} s"
    return f"{host}:{port} cannot be reached: {error}"


def gone(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the process that listened at ``host:port`` is gone, or None if it accepts a connection. Blocks for at
    most ``timeout`` seconds (a refusal, the usual answer for a dead process, comes at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except (OSError, TimeoutError) as error:
        return _verdict(host, port, error, timeout)


async def _attempt(host: str, port: int, timeout: float) -> OSError | TimeoutError | None:
    """One connection to ``host:port``, closed at once: None if it was accepted, else why not."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as error:
        return error
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return None


async def gone_async(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """``gone`` on the running loop. Cancelling it closes the attempt; the timeout ends it with a verdict."""
    error = await _attempt(host, port, timeout)
    return None if error is None else _verdict(host, port, error, timeout)


async def gone_after_close(host: str, port: int, relinked: Callable[[], bool],  # noqa: PLR0913
                           waiting: Callable[[], bool], *, within: float = WATCH_S, until: float = WAIT_S,
                           accepted: bool = False, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the process that listened at ``host:port`` is gone, or None: it lives on, as far as this watch saw.
    For a peer whose link just closed, or which has none yet.

    It is asked at once and, while it still accepts a connection, again: after 20 ms, then at doubling
    intervals of up to a second for ``within`` seconds (a dying process's last moments), then every two seconds
    while ``waiting()`` says something still waits on it, for ``until`` seconds in all. It ends with None as soon
    as ``relinked()`` says a link to it is up (it lives), or once nothing waits after ``within``. Once it accepted
    a connection (``accepted``: the caller saw it do so), only a refused one makes it gone: a time-out then says
    more of the network than of the process. A connection this host could not even try (out of descriptors or
    ports) says nothing of the peer either. ``relinked`` and ``waiting`` are called on this loop. Returns at most
    ``until`` plus a probe's ``timeout`` after it started; a watch that ran out while something still waits says
    so in the log. Cancelling it stops the watch and closes the attempt in flight."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    pause = _FIRST_RETRY_S
    while True:  # bounded by ``until``
        error = await _attempt(host, port, timeout)
        local = isinstance(error, OSError) and error.errno in _LOCAL_ERRNOS
        if error is not None and not local and (not accepted or isinstance(error, ConnectionRefusedError)):
            return _verdict(host, port, error, timeout)
        accepted = accepted or error is None
        elapsed = loop.time() - started
        if relinked() or (elapsed >= within and not waiting()):
            return None
        if elapsed >= until:
            log.warning("%s:%d still accepts connections after %.0f s of watching, with no link to it and "
                        "requests still waiting on it: left to the serving engine's own timeouts", host, port,
                        elapsed)
            return None
        await asyncio.sleep(min(pause if elapsed < within else _SLOW_RETRY_S, until - elapsed))
        pause = min(2 * pause, _LONGEST_RETRY_S)


class Watches:
    """At most one running watch per peer (a key): a watch asked for while one runs is not started again.
    Loop thread only; ``spawn`` runs a coroutine as a task (a ``TaskScope``'s, so that teardown cancels it)."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]) -> None:
        self._spawn = spawn
        self._running: dict[Hashable, asyncio.Task[None]] = {}

    def start(self, key: Hashable, watch: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``watch()`` for ``key`` unless a watch of it runs."""
        running = self._running.get(key)
        if running is not None and not running.done():
            return
        task = self._running[key] = self._spawn(watch())
        task.add_done_callback(lambda ended: self._ended(key, ended))

    def _ended(self, key: Hashable, task: asyncio.Task[None]) -> None:
        if self._running.get(key) is task:
            del self._running[key]

    def __len__(self) -> int:
        """The watches running."""
        return sum(not task.done() for task in self._running.values())
