"""Whether a kvpush engine answers: ``probe(host, port)``, for whoever routes work to it (``kvpush proxy``).

A kernel accepts a TCP connection for a listening process that does not run - frozen, or starved of its
cores - so a connection alone proves nothing. The probe sends the first frame of a handshake marked as a
probe; the engine answers it from its event loop (and makes no link), so an answer means that loop runs
now. The prober holds no token and learns nothing else.
"""

from __future__ import annotations

import asyncio
import time

from transports import registry as transport_registry
from transports.base import PayloadSink, TransportError

from .handshake import probe_hello
from .protocol import FrameHeader, Kind, ProtocolError, decode_json
from .status import LLMException, LLMStatusCode

__all__ = ["probe"]


class _Answer:
    """The probe's stream handler: the listener's first frame settles ``answered``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.answered: asyncio.Future[str] = loop.create_future()

    def on_frame(self, header: FrameHeader, meta: bytes, in_hand: bool = False) -> PayloadSink | None:
        if not self.answered.done():
            try:
                body = decode_json(header.kind, meta) if header.kind == Kind.BYE else {}
            except ProtocolError:
                body = {}
            if body.get("probe") is True:
                self.answered.set_result("")
            else:
                self.answered.set_result(f"it answered {header.kind.name}, not a probe's answer (an older kvpush?)")
        return None

    def on_close(self, reason: str) -> None:
        if not self.answered.done():
            self.answered.set_result(f"the connection closed unanswered: {reason}")


async def probe(host: str, port: int, timeout: float = 1.0) -> float:
    """Ask the kvpush engine listening at ``host:port`` whether its event loop runs; the seconds its answer
    took. Raises ``LLMException``: ``LLM_TIMEOUT`` when no answer came within ``timeout`` seconds (the
    engine's process does not run, or the host does not answer), ``LLM_LINK_FAILED`` when nothing listens
    there or something else answered. Cancellation, like the timeout, closes the connection at once."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    answer = _Answer(loop)
    stream = None
    try:
        async with asyncio.timeout(timeout):
            connection = await transport_registry.control().connect(host, port)
            stream = connection.open(answer, loop)
            stream.send(probe_hello())
            problem = await answer.answered
    except TimeoutError:
        raise LLMException(LLMStatusCode.LLM_TIMEOUT, f"probe {host}:{port}: no answer within {timeout:g} s") from None
    except (TransportError, OSError) as error:
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED, f"probe {host}:{port}: {error}") from None
    finally:
        if stream is not None:
            stream.close("probe over")
    if problem:
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED, f"probe {host}:{port}: {problem}")
    return time.monotonic() - started
