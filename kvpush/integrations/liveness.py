"""Whether a serving engine's peer process still listens where it did: what a transfer backend asks when its
kvpush link to that peer closed, or before it waits on a peer it holds no link to.

A refused connection means nothing listens at that address any more: the process exited (or closed the
socket on its way out), on this host or another. No answer within the timeout means the host is gone or cut
off. Either way nothing the peer was asked to do will be done, and whatever waits on it can end now instead
of at a timeout. A connection that is accepted proves only that the process lives, which is all that is
asked here (``kvpush.probe`` asks more of a kvpush engine: that its event loop runs).
"""

from __future__ import annotations

import asyncio
import socket

__all__ = ["PROBE_TIMEOUT_S", "gone", "gone_async", "split_host_port"]

PROBE_TIMEOUT_S = 1.0  # a live peer on a working network answers a connect in well under a millisecond to a few


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
