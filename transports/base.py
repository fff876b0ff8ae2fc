"""Every interface the engine (``kvpush``) calls on a transport, and nothing else.

Two kinds of transport (NIXL's backend model, ``shared/DESIGN.md``):

- a **control transport** carries a link's ordered *frame stream* (header, meta, optional payload) in
  both directions: handshake, cache tables, completions, keepalive, and - for a stream transport such
  as TCP - the block bytes themselves. The engine hands a frame's payload over as an iovec over
  registered memory (``kvpush.layout.IoVec``) and receives one into a ``PayloadSink`` it chooses after
  reading the frame's header and meta, so a transport never interprets frames beyond their lengths and
  never copies block bytes through an intermediate buffer;
- a **one-sided transport** moves granted bytes without the receiver's CPU: per engine it may register
  memory and hand out the *public descriptor* a peer needs (UCX rkeys); per link it makes an *offer*
  (what a peer needs to reach this process, sent only after authentication), judges a peer's offer,
  and connects to it, giving a ``Mover`` that posts one layer at a time and completes a future.

The engine, not the transport, validates, times out and reports; a transport moves bytes, reports
completion, says when the stream is gone, and raises ``TransportError`` (the one error type the
engine catches) for everything else. ``Capabilities`` are read by the engine: ``transports.registry``
orders ``auto`` from them and the engine picks its request flow from them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvpush.layout import IoVec
    from kvpush.protocol import FrameHeader

HOST_MEMORY = "host"
DEVICE_MEMORY = "device"  # designed for (a GPU-capable transport declares it), not built


class TransportError(OSError):
    """Anything a transport could not do. ``peer_gone``: the peer process no longer exists (the
    engine then closes the link instead of reporting a failed copy)."""

    @property
    def peer_gone(self) -> bool:
        return False


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; every field is read by the engine or the registry.

    - ``one_sided``: bytes land without the receiver's CPU copying them (intent -> grant -> move ->
      landed); otherwise the bytes travel in the frame stream;
    - ``same_host_only``: works only between processes of one host (``auto`` tries these first: the
      cheapest path when it applies);
    - ``auto_between_hosts``: ``auto`` may open it for peers on other hosts (UCX only with RDMA);
    - ``needs_registration``: memory must be registered with it and its public descriptors (rkeys)
      sent to the peer in the cache table;
    - ``standing_grants``: a writer may hold a standing write grant (lease) on a destination cache;
    - ``memory_kinds``: what memory it reaches (``"host"``; ``"device"`` is reserved for later).
    """

    name: str
    one_sided: bool
    same_host_only: bool
    auto_between_hosts: bool = True
    needs_registration: bool = False
    standing_grants: bool = False
    memory_kinds: frozenset[str] = field(default_factory=lambda: frozenset({HOST_MEMORY}))


# -- the control stream ----------------------------------------------------------------------------

class PayloadSink:
    """Where an incoming payload lands: ``iov``, an ``IoVec`` (or what ``IoVec.of`` takes, with ``nbytes``
    given). ``cancel()`` (from the event-loop thread) makes the transport discard the rest of the payload:
    no byte lands in ``iov`` after it returns. ``nbytes`` is its total."""

    __slots__ = ("iov", "on_done", "cancelled", "nbytes")

    def __init__(self, iov: IoVec, on_done: Callable[[], None], nbytes: int | None = None) -> None:
        self.iov = iov
        self.on_done = on_done
        self.cancelled = False
        self.nbytes = iov.nbytes if nbytes is None else nbytes  # (an attribute: this module imports no kvpush)

    def cancel(self) -> None:
        self.cancelled = True


class StreamHandler(Protocol):
    def on_frame(self, header: FrameHeader, meta: bytes, in_hand: bool = False) -> PayloadSink | None:
        """A frame's header and meta arrived. Return where its payload goes (None: discard it).

        ``in_hand``: the whole payload arrived with them; the sink returned is filled, and its
        ``on_done`` called, before the stream returns to the event loop (nothing else runs on the
        loop in between, so the handler need not guard the sink's memory across loop passes)."""

    def on_close(self, reason: str) -> None:
        """The stream is gone (EOF, error, protocol violation or a local close)."""


class OutgoingFrame(Protocol):
    """A queued frame. ``sent`` resolves when every byte is handed to the kernel; ``left`` is True
    from then on (checking it makes no future)."""

    @property
    def sent(self) -> asyncio.Future[None]: ...

    @property
    def left(self) -> bool: ...

    @property
    def started(self) -> bool: ...

    def abandon(self) -> bool:
        """Drop the frame if none of it was written yet; True when dropped."""


class FrameStream(Protocol):
    """One link's ordered frames. A frame that has started is always finished (or the stream closed)."""

    capabilities: Capabilities
    closed: bool
    # The peer is a process of this host (a connection between two of its addresses): what is written
    # here is copied by this host's CPUs at both ends, none of it by a network card.
    local: bool

    @property
    def last_receive(self) -> float:
        """``time.monotonic()`` of the last byte received (keepalive)."""

    def peer_acknowledges(self, within_s: float) -> bool | None:
        """Whether the peer's host acknowledged what this side sent, none of it waiting longer than
        ``within_s`` (the transport's own acknowledgements, TCP's ACKs, which its kernel sends whether or
        not the peer process runs): True (the host is up and the connection open), False (it stopped:
        down or unreachable), None (this transport cannot tell)."""

    @property
    def bytes_in(self) -> int: ...

    @property
    def bytes_out(self) -> int: ...

    # The largest frame meta accepted now (None: the protocol's own limits). A frame announcing more is
    # a protocol violation that closes the stream at once, before anything is allocated for it: before
    # a peer is authenticated it can make the engine hold only this much.
    meta_limit: int | None

    def trusted(self) -> None:
        """The peer is authenticated (or, without a token, done with the handshake): from now on the
        stream may hold more for it than the few KiB a stranger can make it hold."""

    def prepare(self, head: bytes, payload: IoVec | None = None, nbytes: int | None = None) -> OutgoingFrame:
        """A frame ready to ``enqueue``; nothing is sent yet. ``nbytes``: the payload's total, when the
        caller knows it."""

    def enqueue(self, frame: OutgoingFrame) -> None:
        """Queue a prepared frame behind everything sent so far (a small frame on an idle stream leaves
        before this returns)."""

    def send(self, head: bytes, payload: IoVec | None = None) -> OutgoingFrame:
        """``enqueue(prepare(head, payload))``. Without a payload, ``head`` may hold several frames back
        to back: they leave in order, as one frame does. A frame that left before this returned may be
        answered by a frame object shared by such frames (``left``, ``started``; nothing to abandon)."""

    def close(self, reason: str, abort: bool = False) -> None:
        """Close; ``abort`` discards bytes still queued in this host's kernel. Idempotent."""


class Connection(Protocol):
    """A connected control channel before it is framed."""

    peer: str  # for logs

    def open(self, handler: StreamHandler, loop: asyncio.AbstractEventLoop) -> FrameStream: ...

    def close(self) -> None: ...


class Listener(Protocol):
    address: tuple[str, int]  # what was actually bound (port 0 picks a free port)

    async def accept(self) -> Connection:
        """The next incoming connection; ``TransportError`` for a failed accept (the caller goes on)."""

    def close(self) -> None: ...


class ControlTransport(Protocol):
    capabilities: Capabilities

    def listen(self, host: str, port: int) -> Listener:
        """Raises ``TransportError`` when the address cannot be bound."""

    async def connect(self, host: str, port: int) -> Connection:
        """No timeout here: the caller bounds it, and cancelling closes the half-made connection.
        Raises ``TransportError`` when the peer cannot be reached."""


# -- one-sided transports --------------------------------------------------------------------------

class Mover(Protocol):
    """Moves granted bytes of one link. ``start`` posts one layer: ``local`` and ``remote`` iovecs pair
    up entry by entry, ``runs_per_tensor`` entries per tensor of the peer's cache ``cache_id`` from
    ``first_tensor``; ``rkeys`` are the peer's public descriptors of that cache's tensors (None when the
    transport needs none). The future completes when every byte is in the destination (remote completion)
    or fails with ``TransportError``."""

    capabilities: Capabilities
    lease_proof: str  # non-empty when this mover read the peer's in-memory secret (standing grants)

    def start(self, is_read: bool, local: IoVec, remote: IoVec, cache_id: int, first_tensor: int,
              rkeys: tuple[bytes, ...] | None, runs_per_tensor: int) -> asyncio.Future[Any]: ...

    def close(self) -> None: ...


class Offer(Protocol):
    """What this side offered one peer (per link): ``wire`` is sent after authentication."""

    wire: dict[str, Any]

    def proves_reach(self, proof: str) -> bool:
        """True when ``proof`` shows the peer read this offer's in-memory secret (it can reach this
        process), which is what a standing grant requires."""


class PeerWatch(Protocol):
    """A handle on a peer process: after a link broke, grants stay pinned while it may still write.
    ``fileno()`` turns readable when the process exits (the engine waits on it, no polling)."""

    def alive(self) -> bool: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class MemoryRegistrar(Protocol):
    """Registers memory with a one-sided transport: a handle and the public descriptor a peer needs."""

    def map(self, address: int, length: int) -> tuple[Any, bytes]: ...

    def unmap(self, handle: Any) -> None: ...


class OneSidedTransport(Protocol):
    """One engine's instance of a one-sided transport (opened by ``transports.registry``)."""

    capabilities: Capabilities

    @property
    def registrar(self) -> MemoryRegistrar | None:
        """Set when memory must be registered (``capabilities.needs_registration``)."""

    def offer(self) -> Offer | None:
        """A fresh offer for one new link (None: nothing to offer)."""

    def refusal(self, peer_offer: Any) -> str | None:
        """Why the peer's offer cannot work from this process (e.g. another host), or None."""

    def connect(self, peer_offer: Any, peer_name: str, on_error: Callable[[str], None]) -> Mover:
        """A mover to the peer; ``TransportError`` when it cannot be reached. ``on_error`` is called
        (with a reason) if the transport notices later that the peer is gone."""

    def watch(self, peer_offer: Any) -> PeerWatch | None:
        """For a same-host peer, a handle that tells when its process has exited (None: the engine
        keeps grants for a grace period instead)."""

    def close(self) -> None: ...
