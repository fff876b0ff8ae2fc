"""Whether a serving engine's peer process still listens where it did: what a transfer backend asks when its
kvpush link to that peer closed, or before it waits on a peer it holds no link to.

A refused connection means nothing listens at that address any more: the process exited (or closed the
socket on its way out), on this host or another. No answer within the timeout means the host is gone or cut
off. Either way nothing the peer was asked to do will be done, and whatever waits on it can end now instead
of at a timeout. A connection that is accepted proves only that the process lives, which is all that is
asked here (``kvpush.probe`` asks more of a kvpush engine: that its event loop runs).

Right after a link closed, one accepted connection proves less: a process that dies closes its sockets one
after another (and the processes of a server exit one after another), so the address asked about can still
accept a connection a moment after the link to that process closed. ``gone_after_close`` asks again for a
while before it concludes that the process lives on.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

__all__ = ["PROBE_TIMEOUT_S", "WATCH_S", "gone", "gone_after_close", "gone_async", "split_host_port"]

PROBE_TIMEOUT_S = 1.0  # a live peer on a working network answers a connect in well under a millisecond to a few
WATCH_S = 10.0  # how long a peer whose link closed but which still accepted a connection is asked again
_FIRST_RETRY_S = 0.02  # the first wait before asking again; it doubles, up to _LONGEST_RETRY_S
_LONGEST_RETRY_S = 1.0


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


async def gone_async(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """``gone`` on the running loop. Cancelling it closes the attempt; the timeout ends it with a verdict."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as error:
        return _verdict(host, port, error, timeout)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return None


async def gone_after_close(host: str, port: int, relinked: Callable[[], bool], *, within: float = WATCH_S,
                           timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the process that listened at ``host:port``, whose link just closed, is gone; or None if it lives on.

    It is asked at once and, while it still accepts a connection, again after 20 ms, then at doubling intervals
    of up to a second, for ``within`` seconds: a dying process can accept one a moment after its link closed.
    It stops early, with None, once ``relinked()`` (called on this loop) is true: a link to that process came
    up again, so it lives. Returns at most ``within`` plus one probe's ``timeout`` seconds after it started.
    Cancelling it stops the watch and closes the attempt in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    pause = _FIRST_RETRY_S
    while True:  # bounded by ``deadline``
        verdict = await gone_async(host, port, timeout)
        if verdict is not None or relinked():
            return verdict
        left = deadline - loop.time()
        if left <= 0:
            return None
        await asyncio.sleep(min(pause, left))
        pause = min(2 * pause, _LONGEST_RETRY_S)
