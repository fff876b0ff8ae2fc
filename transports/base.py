"""The interface between the engine (``kvpush``) and a transport.

A link's control channel is a *frame stream*: ordered frames (header, meta, optional payload)
in both directions. The engine hands a frame's payload over as an iovec over registered memory
(``kvpush.layout.IoVec``) and receives one into a ``PayloadSink`` it chooses after reading the
frame's header and meta, so a transport never interprets frames beyond their lengths and never
copies block bytes through an intermediate buffer.

The engine, not the transport, validates, times out and reports; a transport moves bytes,
reports completion, and says when the stream is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvpush.layout import IoVec
    from kvpush.protocol import FrameHeader


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do (NIXL-style): used by ``transport="auto"`` and shown per link."""

    name: str
    one_sided: bool  # bytes land without the receiver's CPU copying them
    same_host_only: bool


class PayloadSink:
    """Where an incoming payload lands. ``cancel()`` (from the event-loop thread) makes the
    transport discard the rest of the payload: no byte lands in ``iov`` after it returns."""

    __slots__ = ("iov", "on_done", "cancelled")

    def __init__(self, iov: IoVec, on_done: Callable[[], None]) -> None:
        self.iov = iov
        self.on_done = on_done
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class StreamHandler(Protocol):
    def on_frame(self, header: FrameHeader, meta: bytes) -> PayloadSink | None:
        """A frame's header and meta arrived. Return where its payload goes (None: discard it)."""

    def on_close(self, reason: str) -> None:
        """The stream is gone (EOF, error, protocol violation or a local close)."""


class OutgoingFrame(Protocol):
    """A queued frame. ``sent`` resolves when every byte is handed to the kernel."""

    sent: asyncio.Future[None]

    @property
    def started(self) -> bool: ...

    def abandon(self) -> bool:
        """Drop the frame if none of it was written yet; True when dropped."""


class FrameStream(Protocol):
    capabilities: Capabilities
    closed: bool
    last_receive: float

    def send(self, head: bytes, payload: IoVec | None = None) -> OutgoingFrame: ...

    def close(self, reason: str, abort: bool = False) -> None: ...
