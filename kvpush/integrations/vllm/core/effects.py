"""What the worker books ask of the world, injected so the books stay pure: the engine effects of the
prefill side (``ProducerEffects``) and of the decode side (``ConsumerEffects``), and the ``Clock``.
``..bridge.EngineBridge`` implements both effect protocols; tests pass recording fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from .steps import RecvSpec


class ProducerEffects(Protocol):
    """What the prefill worker's book asks the engine to do. Results come back as calls on the book:
    ``on_push_done(push_id, error)`` for every started push, ``on_notified(transfer_id, error)`` for
    every ``notify``."""

    def start_push(self, push_id: int, peer: int, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   pipelined: bool) -> None:
        """Pipelined: a layer pusher whose layers come by ``push_layer`` and end with ``finish_push``;
        else push every layer now."""

    def push_layer(self, push_id: int, layer: int) -> None: ...

    def finish_push(self, push_id: int) -> None:
        """Every layer was pushed: wait for all of them, then report ``on_push_done``."""

    def cancel_push(self, push_id: int) -> None:
        """Stop the push; ``on_push_done`` follows once no byte of it can still land."""

    def notify(self, peer: int, data: bytes, transfer_id: str) -> None:
        """Send ``data`` on the peer's notification inbox, after every transfer that already ended."""

    def reply(self, peer: int, data: bytes) -> None:
        """Best-effort answer to the peer, on its notification inbox (about transfers this side does
        not have)."""


class ConsumerEffects(Protocol):
    """What the decode worker's book asks the engine to do; ``send_ids`` reports
    ``on_ids_sent(transfer_id, error, retryable, delivered_any)``."""

    def send_ids(self, spec: RecvSpec, block_size: int) -> None:
        """Send the transfer's block ids to the prefill at ``spec.remote`` - to each of its ranks with a leg
        to this rank (linking, and checking the two geometries, first) - each after opening the blocks that
        rank writes to it, in order after anything sent to it before."""

    def transfer_ended(self, transfer_id: str) -> None:
        """The transfer ended here (landed, failed or aborted): its blocks are no longer open to the
        prefill, whatever it sends (vLLM may reuse them)."""

    def send_abort(self, peer: int, data: bytes) -> None:
        """Best effort, ordered after earlier sends to that peer."""


Clock = Callable[[], float]
