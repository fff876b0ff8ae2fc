"""Runs a plan's layers on a link: start, window, one shared wait (for a layer, or many), drain, clean-up.

Every layer is one request on the link, except that ``run`` sends consecutive small layers of one
transfer as one request of up to ``kvpush.layer_merge_bytes`` (0: never; under a same-host standing
grant up to ``GROUP_BYTES``). ``run`` keeps at most ``WINDOW`` requests in flight; each must complete
within ``sync_kv_timeout`` of becoming the oldest one outstanding, else LLM_TIMEOUT with the layers that
landed (those of the requests that completed). ``LayerPusher`` (``kvpush.pipeline``) uses the same
``start_layer``, ``await_layers`` (``await_layer``'s wait for several layers in one task), ``drain`` and
``give_up`` on layers it starts itself.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence

from .link import Link
from .marks import LayerMarks
from .options import EngineOptions
from .plan import Plan
from .requests import PendingOp
from .status import LLMException, LLMStatusCode
from .validate import LayerStep

WINDOW = 2  # layers in flight per transfer: keeps the wire busy across the per-layer round trip
# Under a same-host standing grant a layer's copy needs nothing from the peer (it completes here, and
# the peer only learns of it), so consecutive layers go as one request of up to this many bytes: one
# kernel copy and one notice instead of one per layer.
GROUP_BYTES = 16 << 20


def start_layer(link: Link, plan: Plan, step: LayerStep, budget_ms: int, held: bool = False,
                gate: tuple[LayerMarks, int] | None = None) -> PendingOp:
    """Start (or, ``held``, prepare) one layer's request; ``gate``: its mark, if it may go gated."""
    if plan.push:
        return link.outbound.start_write(plan, step, budget_ms, held, gate)
    return link.outbound.start_read(plan, step, budget_ms)


async def await_layer(api: str, link: Link, op: PendingOp, layer: int, timeout_ms: int,
                      completed: list[int] | None = None) -> None:
    """Wait for one layer's request (bounded by ``timeout_ms``); raise its failure as an
    ``LLMException`` naming the call and the layer (LLM_TIMEOUT when the deadline passed).

    Cancellation: cancelling the waiting task drops the wait, never the request (``drain`` still sees whether
    its bytes may land)."""
    if not op.ended:
        waiter = _watch(link, op, timeout_ms)
        try:
            await waiter
        finally:
            _unwatch(link, op, waiter)
    failure = _failure_of(api, link, op, layer, timeout_ms, completed)
    if failure is not None:
        raise failure


async def await_layers(api: str, link: Link, waits: Sequence[tuple[PendingOp, int, int]],
                       completed: list[int] | None = None) -> list[BaseException | None]:
    """``await_layer`` for several layers at once, in this one task: each ``(op, layer, timeout_ms)`` is bounded by
    its own deadline, and one that fails does not end the wait for the others. Returns each one's failure, in
    order (an ``LLMException``, or ``CancelledError`` for a request abandoned by someone else meanwhile), or None
    for a layer that landed.

    Each layer is judged as its own wait would judge it: the waits are taken in the order of their deadlines, so
    each is looked at no later than its deadline, and one that had not ended by then has timed out (noted on the
    link then), whatever its request does later. Cancellation: as ``await_layer``'s, for every one of them."""
    # all watched now: by deadline (a single layer, push_layer's, skips the sort)
    order = sorted(range(len(waits)), key=lambda index: waits[index][2]) if len(waits) > 1 else range(len(waits))
    watched = {index: _watch(link, waits[index][0], waits[index][2]) for index in order if not waits[index][0].ended}
    failures: list[BaseException | None] = [None] * len(waits)
    try:
        for index in order:
            op, layer, timeout_ms = waits[index]
            waiter = watched.get(index)
            if waiter is not None:
                await waiter  # its request ended, or its deadline passed; later ones may be done already
            failures[index] = _failure_of(api, link, op, layer, timeout_ms, completed)
    finally:
        for index, waiter in watched.items():
            _unwatch(link, waits[index][0], waiter)
    return failures


def _watch(link: Link, op: PendingOp, timeout_ms: int) -> asyncio.Future[None]:
    # ``op.waiter`` rather than ``asyncio.wait``: the table wakes the waiting task in the pass that ends the
    # request (one loop pass less per layer)
    waiter = op.waiter = link.loop.create_future()
    link.requests.deadlines.add(timeout_ms / 1000, waiter)  # one loop timer for every wait of the link
    return waiter


def _unwatch(link: Link, op: PendingOp, waiter: asyncio.Future[None]) -> None:
    waiter.cancel()  # (done already, unless the waiting task was cancelled)
    link.requests.deadlines.finished()
    op.waiter = None


def _failure_of(api: str, link: Link, op: PendingOp, layer: int, timeout_ms: int,
                completed: list[int] | None = None) -> BaseException | None:
    """A waited layer's failure, None if it landed: LLM_TIMEOUT (noted on the link) if its request has not
    ended (its deadline passed), else its ended request's (``_ended_failure``)."""
    if not op.ended:
        timed_out = LLMException(LLMStatusCode.LLM_TIMEOUT, f"{api}: layer {layer} not done within {timeout_ms} ms",
                                 completed or ())
        link.note_failure(timed_out)
        return timed_out
    return _ended_failure(api, op, layer, completed)


def _ended_failure(api: str, op: PendingOp, layer: int, completed: list[int] | None) -> BaseException | None:
    """An ended layer's request: None if it succeeded, else its failure (``CancelledError`` when it was abandoned
    by someone else meanwhile)."""
    if op.cancelled:
        return asyncio.CancelledError()
    error = op.error
    if error is not None:
        return LLMException(error.status_code, f"{api}: layer {layer}: {error}", completed or ())
    return None


def layer_outcome(api: str, op: PendingOp, layer: int, completed: list[int] | None = None) -> None:
    """An ended layer's request: return if it succeeded, else raise its failure (``CancelledError`` when it
    was abandoned by someone else meanwhile)."""
    failure = _ended_failure(api, op, layer, completed)
    if failure is not None:
        raise failure


async def run(link: Link, plan: Plan, options: EngineOptions) -> None:
    """Move every layer of ``plan``; return on remote completion of the last one. Consecutive layers (on
    both sides) go as one request while it stays within ``options.layer_merge_bytes``; a request's layers
    complete together.

    Timeout: LLM_TIMEOUT (with ``completed_layers``) when a layer misses its deadline
    (``options.sync_kv_timeout_ms``); layers not yet sent are never sent, and a started one finishes
    leaving (or the link is closed). Cancellation: no further layer is issued; ``CancelledError``
    propagates once no byte of the request can still land."""
    timeout_ms = options.sync_kv_timeout_ms
    merge_bytes = options.layer_merge_bytes
    if len(plan.steps) > 1 and merge_bytes > 0 and plan.push and link.outbound.writes_alone(plan.remote):
        merge_bytes = max(merge_bytes, GROUP_BYTES)
    groups = plan.groups(merge_bytes)
    local = plan.local
    if local.removed:
        raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                           f"{plan.api}: local cache {local.cache.cache_id} was released")
    completed: list[int] = []
    inflight: collections.deque[tuple[tuple[int, ...], PendingOp]] = collections.deque()
    issued = 0
    start = link.outbound.start_write if plan.push else link.outbound.start_read  # (``start_layer``'s choice, once)
    local.pin()  # its memory stays mapped until this call is over, whatever the caller frees meanwhile
    try:
        while True:
            while issued < len(groups) and len(inflight) < WINDOW and not local.removed:
                step, layers = groups[issued]
                try:
                    inflight.append((layers, start(plan, step, timeout_ms)))
                except LLMException as refused:
                    raise LLMException(refused.status_code, f"{plan.api}: layer {layers[0]}: {refused}",
                                       completed) from None
                issued += 1
            if not inflight:
                break
            layers, op = inflight[0]
            if not op.ended:  # (an ended one, e.g. an inline copy, needs no wait: no coroutine for it)
                await await_layer(plan.api, link, op, layers[0], timeout_ms, completed)
            elif op.cancelled or op.error is not None:
                layer_outcome(plan.api, op, layers[0], completed)
            inflight.popleft()
            completed.extend(layers)
        if issued < len(groups):  # the local cache was released: layers not issued are never sent
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                               f"{plan.api}: local cache {local.cache.cache_id} was released before layer "
                               f"{groups[issued][1][0]}", completed)
    except asyncio.CancelledError:
        await drain(link, [op for _, op in inflight], timeout_ms / 1000)
        raise
    except BaseException:
        await give_up(link, [op for _, op in inflight], timeout_ms / 1000)
        raise
    finally:
        local.unpin()


async def give_up(link: Link, ops: list[PendingOp], timeout: float) -> None:
    """After a failure: abandon ``ops`` and clean up before reporting - running copies end and
    started frames finish leaving the source memory (or the link is closed), so nothing reads or
    writes it after the caller is told."""
    for op in ops:
        link.outbound.abandon(op)
    await link.outbound.settle(ops, timeout)


async def drain(link: Link, ops: list[PendingOp], timeout: float) -> None:
    """After cancellation: drop what has not started; wait (bounded) for started writes to be
    confirmed so none of their bytes can land later; close the link if that is impossible."""
    landing = [op for op in ops if op.bytes_may_land and not op.ended]
    for op in ops:
        if op not in landing:
            link.outbound.abandon(op)
    if not landing:
        return
    try:
        _, pending = await asyncio.wait([op.future for op in landing], timeout=timeout)
    except asyncio.CancelledError:
        pending = {op.future for op in landing}
    if pending:
        link.close("a cancelled transfer could not be drained in time", abort=True)
    for op in landing:
        link.outbound.abandon(op)
    await link.outbound.settle(landing, timeout)
