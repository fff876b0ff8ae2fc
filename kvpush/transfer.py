"""Runs a plan's layers on a link: start, window, one shared per-layer wait, drain, clean-up.

Every layer is one request on the link, except that ``run`` sends consecutive small layers of one
transfer as one request of up to ``merge_bytes`` (``kvpush.layer_merge_bytes``, 0: never; under a
same-host standing grant up to ``GROUP_BYTES``). ``run`` keeps at most ``WINDOW`` requests in flight; each must
complete within ``sync_kv_timeout`` of becoming the oldest one outstanding, else LLM_TIMEOUT with the
layers that landed (those of the requests that completed). ``LayerPusher`` (``kvpush.pipeline``)
uses the same ``start_layer``, ``await_layer``, ``drain`` and ``give_up`` on layers it starts itself.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Coroutine
from typing import Any

from .config import LAYER_MERGE_BYTES
from .layout import FLAT_ENTRIES, FlatIoVec, IoVec, as_iovec, runs_at, scatter_vector
from .link import Link
from .plan import Plan, group_steps
from .protocol import Kind
from .requests import PendingOp
from .status import LLMException, LLMStatusCode
from .validate import LayerStep

WINDOW = 2  # layers in flight per transfer: keeps the wire busy across the per-layer round trip
# Under a same-host standing grant a layer's copy needs nothing from the peer (it completes here, and
# the peer only learns of it), so consecutive layers go as one request of up to this many bytes: one
# kernel copy and one notice instead of one per layer.
GROUP_BYTES = 16 << 20


def start_layer(link: Link, plan: Plan, step: LayerStep, budget_ms: int, held: bool = False) -> PendingOp:
    """Start (or, ``held``, prepare) one layer's request."""
    local_first = step.src_first if plan.kind == Kind.WRITE else step.dst_first
    remote_first = step.dst_first if plan.kind == Kind.WRITE else step.src_first
    iov = local_vector(plan, local_first, step.count)
    if plan.kind == Kind.WRITE:
        return link.start_write(plan.remote, remote_first, step.count, plan.remote_wire, plan, iov, plan.local,
                                budget_ms, held, step.count * plan.bytes_per_tensor)
    return link.start_read(plan.remote, remote_first, step.count, plan.remote_wire, plan, iov, plan.local, budget_ms)


def local_vector(plan: Plan, first: int, count: int) -> IoVec | FlatIoVec:
    """The local iovec of tensors ``[first, first + count)``: for a transfer of many layers, a slice of
    one vector laid out (numpy, once) for every tensor its steps touch, so a layer costs no layout; for
    a few runs of a few tensors, flat ints (no numpy call at all)."""
    if len(plan.steps) == 1:
        if plan.small is not None:  # a few runs as ints
            flat = runs_at(plan.local.cache.tensor_addrs[first:first + count], plan.small, 0)
            return flat if len(flat) <= 2 * FLAT_ENTRIES else as_iovec(flat)
        return scatter_vector(plan.local.addrs[first:first + count], plan.local_offset, plan.length)
    if plan.local_iov is None:
        write = plan.kind == Kind.WRITE
        low = min(s.src_first if write else s.dst_first for s in plan.steps)
        high = max((s.src_first if write else s.dst_first) + s.count for s in plan.steps)
        plan.local_iov = scatter_vector(plan.local.addrs[low:high], plan.local_offset, plan.length)
        plan.local_span = low
    runs = plan.runs_per_tensor
    return plan.local_iov[(first - plan.local_span) * runs:(first - plan.local_span + count) * runs]


async def await_layer(api: str, link: Link, op: PendingOp, layer: int, timeout_ms: int,
                      completed: list[int] | None = None) -> None:
    """Wait for one layer's request (bounded by ``timeout_ms``); raise its failure as an
    ``LLMException`` naming the call and the layer (LLM_TIMEOUT when the deadline passed)."""
    if not op.ended:
        # ``op.waiter`` rather than ``asyncio.wait``: the table wakes this task in the pass that ends the
        # request (one loop pass less per layer), and cancelling this task cancels the waiter, never the
        # request (``drain`` still sees whether the layer's bytes may land)
        waiter = op.waiter = link.loop.create_future()
        deadlines = link.requests.deadlines  # one loop timer for every wait of the link, not one per layer
        deadlines.add(timeout_ms / 1000, waiter)
        try:
            await waiter
        finally:
            deadlines.finished()
            op.waiter = None
        if not op.ended:
            timed_out = LLMException(LLMStatusCode.LLM_TIMEOUT, f"{api}: layer {layer} not done within {timeout_ms} ms",
                                     completed or ())
            link.note_failure(timed_out)
            raise timed_out
    if op.cancelled:  # abandoned by someone else meanwhile
        raise asyncio.CancelledError()
    error = op.error
    if error is not None:
        raise LLMException(error.status_code, f"{api}: layer {layer}: {error}", completed or ())


def run(link: Link, plan: Plan, timeout_ms: int, merge_bytes: int = LAYER_MERGE_BYTES) -> Coroutine[Any, Any, None]:
    """Move every layer of ``plan`` (await it); returns on remote completion of the last one.
    Consecutive layers (on both sides) go as one request while it stays within ``merge_bytes`` (0: a
    request per layer); a request's layers complete together. A plan of one step is the coroutine
    of ``_run_one`` itself (no coroutine around it: a small transfer's latency).

    Timeout: LLM_TIMEOUT (with ``completed_layers``) when a layer misses its deadline; layers not yet
    sent are never sent, and a started one finishes leaving (or the link is closed). Cancellation: no
    further layer is issued; ``CancelledError`` propagates once no byte of the request can still land."""
    if len(plan.steps) == 1:
        return _run_one(link, plan, timeout_ms)
    return _run_many(link, plan, timeout_ms, merge_bytes)


async def _run_many(link: Link, plan: Plan, timeout_ms: int, merge_bytes: int) -> None:
    timeout = timeout_ms / 1000
    completed: list[int] = []
    inflight: collections.deque[tuple[tuple[int, ...], PendingOp]] = collections.deque()
    if merge_bytes > 0:
        if plan.kind == Kind.WRITE and link.writes_alone(plan.remote):
            merge_bytes = max(merge_bytes, GROUP_BYTES)
        groups = group_steps(plan.steps, plan.bytes_per_tensor, merge_bytes)
    else:
        groups = [(step, (step.dst_layer,)) for step in plan.steps]
    next_group = 0
    local = plan.local
    if local.removed:
        raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                           f"{plan.api}: local cache {local.cache.cache_id} was released")
    local.pin()  # its memory stays mapped until this call is over, whatever the caller frees meanwhile
    released: int | None = None  # the first layer not issued because the local cache was released
    try:
        while (next_group < len(groups) and released is None) or inflight:
            while next_group < len(groups) and len(inflight) < WINDOW and released is None:
                step, layers = groups[next_group]
                if local.removed:  # stop issuing; layers already in flight still finish
                    released = layers[0]
                    break
                try:
                    inflight.append((layers, start_layer(link, plan, step, timeout_ms)))
                except LLMException as refused:
                    raise LLMException(refused.status_code, f"{plan.api}: layer {layers[0]}: {refused}",
                                       completed) from None
                next_group += 1
            if not inflight:
                break
            layers, op = inflight[0]
            await await_layer(plan.api, link, op, layers[0], timeout_ms, completed)
            inflight.popleft()
            completed.extend(layers)
        if released is not None:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                               f"{plan.api}: local cache {local.cache.cache_id} was released before layer "
                               f"{released}", completed)
    except asyncio.CancelledError:
        await drain(link, [op for _, op in inflight], timeout)
        raise
    except BaseException:
        await give_up(link, [op for _, op in inflight], timeout)
        raise
    finally:
        local.unpin()


async def _run_one(link: Link, plan: Plan, timeout_ms: int) -> None:
    """``run`` for a plan of one layer step (one request): the same checks, deadline, cancellation and
    clean-up, without the window's bookkeeping (a small push's latency)."""
    local = plan.local
    if local.removed:
        raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                           f"{plan.api}: local cache {local.cache.cache_id} was released")
    step = plan.steps[0]
    local.pin()
    try:
        try:
            op = start_layer(link, plan, step, timeout_ms)
        except LLMException as refused:
            raise LLMException(refused.status_code, f"{plan.api}: layer {step.dst_layer}: {refused}", []) from None
        try:
            await await_layer(plan.api, link, op, step.dst_layer, timeout_ms)
        except asyncio.CancelledError:
            await drain(link, [op], timeout_ms / 1000)
            raise
        except BaseException:
            await give_up(link, [op], timeout_ms / 1000)
            raise
    finally:
        local.unpin()


async def give_up(link: Link, ops: list[PendingOp], timeout: float) -> None:
    """After a failure: abandon ``ops`` and clean up before reporting - running copies end and
    started frames finish leaving the source memory (or the link is closed), so nothing reads or
    writes it after the caller is told."""
    for op in ops:
        link.abandon(op)
    await link.settle(ops, timeout)


async def drain(link: Link, ops: list[PendingOp], timeout: float) -> None:
    """After cancellation: drop what has not started; wait (bounded) for started writes to be
    confirmed so none of their bytes can land later; close the link if that is impossible."""
    landing = [op for op in ops if op.bytes_may_land and not op.ended]
    for op in ops:
        if op not in landing:
            link.abandon(op)
    if not landing:
        return
    try:
        _, pending = await asyncio.wait([op.future for op in landing], timeout=timeout)
    except asyncio.CancelledError:
        pending = {op.future for op in landing}
    if pending:
        link.close("a cancelled transfer could not be drained in time", abort=True)
    for op in landing:
        link.abandon(op)
    await link.settle(landing, timeout)
