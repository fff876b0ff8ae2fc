"""Layer-pipelined pushing (SPEC §7): prefill computes layer l+1 while layer l is on the wire.

    async with cm.layer_pusher(BlocksCacheKey(2, 0), kv, src_blocks, dst_blocks) as pusher:
        for layer in range(num_layers):
            compute(layer)              # the model's forward pass for this layer
            pusher.push_layer(layer)    # microseconds: validate, queue, return
    # leaving the block waited for every layer (remote completion) and raised the first error

Each layer is one request on the link, bounded by ``sync_kv_timeout`` from the moment
``push_layer`` started it. Layers may be started in any order, and several pushers may run on one
link at once: every layer carries its own destination, so bytes of different requests never mix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from . import transfer
from .link import Link
from .marks import LayerMarks
from .notify import NOTIFICATION
from .plan import Plan
from .protocol import Kind
from .requests import PendingOp
from .status import LLMException, LLMStatusCode, param_invalid
from .types import check_int
from .validate import LayerStep

log = logging.getLogger(__name__)


class LayerPusher:
    """One request's layers, pushed as they become ready. Obtain from ``CacheManager.layer_pusher``.

    ``push_layer(l)`` returns an awaitable (an ``asyncio.Task``) for that layer alone; ``wait()`` (or
    leaving ``async with``) waits for all started layers and raises the first error as an
    ``LLMException`` whose ``completed_layers`` lists every layer that landed. A pusher is single
    use: after ``wait()``, or once a layer failed, ``push_layer`` raises LLM_PARAM_INVALID.

    A layer's task ends once its bytes are in the peer's memory and the peer said so. On the same host the
    peer copies them itself: every layer is offered when the pusher is made, gated by a ready mark in this
    process's memory (``gated``; ``kvpush.marks``), and ``push_layer`` - or ``mark_ready``, from any thread,
    without this loop waking - only writes the mark. The peer holds its answers while more of the request's
    offers wait or copy there (at most ``read_offers.HOLD_S``, and a quarter of the layer's deadline), so the
    loop wakes about once per request; ``wait()`` withdraws the layers never let go and has the peer read
    the marks and answer at once. Layers marked after ``wait()`` began are not waited for.

    Timeout: each layer fails with LLM_TIMEOUT if not in the peer's memory within ``sync_kv_timeout``
    of its ``push_layer`` (or ``mark_ready``) call; the other layers go on. Cancellation: cancelling ``wait()`` (or the
    task around ``async with``) cancels every layer still in flight, each cleaning up like a
    cancelled ``push_blocks`` before the cancellation propagates.
    """

    def __init__(self, link: Link, plan: Plan, timeout_ms: int, notify: bytes | None = None) -> None:
        self._link = link
        self._notify = None if notify is None else bytes(notify)
        self._plan = plan
        self._steps: dict[int, LayerStep] = {step.dst_layer: step for step in plan.steps}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self.landed: list[int] = []
        self._failure: LLMException | None = None
        self._finished = False
        self._timeout_ms = timeout_ms
        plan.local.pin()  # the source cache stays mapped until the pusher is done
        self._pinned = True
        # Every layer is prepared now (iovecs, frames; one-sided requests are even granted by the
        # peer), so push_layer only lets bytes go: microseconds on the prefill's critical path. To a peer
        # that copies the layers itself, every offer goes now, gated by a mark in ``_marks``: letting a layer
        # go is one store, which any thread may make (``mark_ready``), without this loop waking.
        self._slots = {layer: slot for slot, layer in enumerate(self._steps)}
        self._layers = list(self._steps)  # slot -> layer
        self._marks = LayerMarks(len(self._steps))
        self._prepared: dict[int, PendingOp] = {
            layer: transfer.start_layer(link, plan, step, timeout_ms, held=True, gate=(self._marks, self._slots[layer]))
            for layer, step in self._steps.items()}
        #: Every layer is offered gated: ``mark_ready`` lets one go from any thread.
        self.gated = all(op.gate is not None for op in self._prepared.values())
        self._offered = any(op.gate is not None for op in self._prepared.values())
        #: This side's CPU moves the layers to a peer on this host: stream writes (over loopback the kernel's
        #: copy and the receiving half of TCP both run here) or this side's own same-host copies, rather than
        #: offers the peer copies itself. A layer let go while the caller computes then costs the computation
        #: as many cycles as pushing it afterwards, and its caches besides; a caller whose computation keeps
        #: every core it may use busy (a vLLM forward) pushes such layers after it. False on another host.
        self.copies_here = link.stream.local and any(op.kind != Kind.READ_OFFER for op in self._prepared.values())

    @property
    def num_layers(self) -> int:
        return len(self._steps)

    def mark_ready(self, layer: int) -> None:
        """Any thread (a gated pusher's, ``gated``): layer ``layer``'s bytes are final, the peer may copy
        them now. Two stores into this process's memory (under an uncontended lock); this pusher's event loop does
        not wake. ``wait()`` then waits for the layer as for one ``push_layer`` started, its deadline counted
        from this call. Marking a layer again, or one ``push_layer`` started, changes nothing; nor does marking one
        once ``wait()`` began (it was withdrawn: the peer never copies it)."""
        if not self.gated:
            raise param_invalid("mark_ready: this pusher's layers are not offered gated (see LayerPusher.gated)")
        slot = self._slots.get(layer)
        if slot is None:
            raise param_invalid(f"mark_ready: layer {layer} is outside the request's {self.num_layers} layers")
        self._marks.open(slot)

    def push_layer(self, layer: int) -> asyncio.Task[None]:
        """Start layer ``layer`` now and return at once. Raises (moving no byte) for a layer outside
        the request, a layer already started, or a pusher already finished or failed."""
        layer = check_int("layer", layer, 0)
        if self._finished:
            raise param_invalid("push_layer: this pusher already finished (wait() was called)")
        if self._failure is not None:
            raise LLMException(LLMStatusCode.LLM_PARAM_INVALID,
                               f"push_layer: this pusher's request already failed: {self._failure}")
        step = self._steps.get(layer)
        if step is None:
            raise param_invalid(f"push_layer: layer {layer} is outside the request's {self.num_layers} layers")
        if layer in self._tasks:
            raise param_invalid(f"push_layer: layer {layer} was already started")
        plan = self._plan
        if plan.local.removed:
            raise LLMException(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                               f"push_layer: local cache {plan.local.cache.cache_id} was released")
        op = self._prepared.pop(layer)
        self._link.outbound.release_held(op, last=not self._prepared)  # the others' offers say more follow
        return self._start([(step, op, self._timeout_ms)])

    def _start(self, batch: list[tuple[LayerStep, PendingOp, int]]) -> asyncio.Task[None]:
        """One task waits for the layers of ``batch`` (step, op, its allowance in ms): one layer ``push_layer``
        started, or every layer marked ready that ``wait()`` adopted at once."""
        first = batch[0][0].dst_layer
        task = asyncio.get_running_loop().create_task(
            self._finish(batch), name=f"kvpush-layer-{first}" if len(batch) == 1 else f"kvpush-layers-{first}+")
        task.add_done_callback(self._retrieve)
        for step, _, _ in batch:
            self._tasks[step.dst_layer] = task
        return task

    @staticmethod
    def _retrieve(task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            task.exception()  # reported by wait(); never "exception was never retrieved"

    async def _finish(self, batch: list[tuple[LayerStep, PendingOp, int]]) -> None:
        """Wait for ``batch``'s layers; each lands or fails on its own deadline, and the first failure is raised once
        every one ended (the failed ones given up first). Cancelled: the layers that landed meanwhile count, the
        others are drained (no byte of them may still land) before the cancellation propagates."""
        link, ops = self._link, [op for _, op, _ in batch]
        timeout = self._timeout_ms / 1000
        try:
            failures = await transfer.await_layers("push_layer", link,
                                                   [(op, step.dst_layer, ms) for step, op, ms in batch])
        except asyncio.CancelledError:
            self.landed += [step.dst_layer for step, op, _ in batch if op.ended and op.error is None
                            and not op.cancelled]
            await transfer.drain(link, ops, timeout)
            raise
        except BaseException:
            await transfer.give_up(link, ops, timeout)
            raise
        failed = [op for op, failure in zip(ops, failures) if failure is not None]
        if failed:
            await transfer.give_up(link, failed, timeout)
        self.landed += [step.dst_layer for (step, _, _), failure in zip(batch, failures) if failure is None]
        if self._failure is None:
            self._failure = next((f for f in failures if isinstance(f, LLMException)), None)
        first = next((f for f in failures if f is not None), None)
        if first is not None:
            raise first

    async def wait(self) -> None:
        """Wait for every started (or marked) layer; raise the first error with ``completed_layers``."""
        self._adopt_marked()
        if self._tasks and (self._prepared or self._offered):  # more were said to follow: none will
            self._withdraw(final=False)
            self._adopt_marked()  # marked while being withdrawn: the peer copies them
            self._link.nudge()  # the peer answers what it held, and reads the marks now
        try:
            results = await asyncio.gather(*dict.fromkeys(self._tasks.values()), return_exceptions=True)
        finally:
            self._close()
        for result in results:
            if isinstance(result, BaseException):
                if isinstance(result, LLMException):
                    raise LLMException(result.status_code, str(result), sorted(self.landed))
                raise result
        if self._notify is not None and len(self.landed) == len(self._steps):
            await self._link.send_message(NOTIFICATION, self._notify)  # every layer landed

    def _adopt_marked(self) -> None:
        """Layers marked ready from another thread (``mark_ready``) are waited for like pushed ones, each
        within ``sync_kv_timeout`` of its mark: all of them by one task (a model's every layer, marked during
        its forward, is adopted at once when it ended, and a task per layer would cost this loop, and the
        thread that marked them, as much as the rest of the wait)."""
        marks, now = self._marks, time.monotonic()
        batch: list[tuple[LayerStep, PendingOp, int]] = []
        opened = marks.open_slots()
        for slot, marked_at in zip(opened, marks.marked_at[opened].tolist()):
            layer = self._layers[slot]
            op = self._prepared.get(layer)
            if op is None or op.gate is None:
                continue  # adopted already, or started by push_layer
            del self._prepared[layer]
            op.held = False
            left_ms = self._timeout_ms - int((now - marked_at) * 1000)
            batch.append((self._steps[layer], op, max(1, left_ms)))
        if batch:
            self._start(batch)

    def _withdraw(self, final: bool) -> None:
        """Layers never pushed: nothing of them moves (a gated offer's mark says so to the peer, which
        answers it; its source stays pinned until then). A layer marked before its mark could be withdrawn
        stays (the peer copies it) unless ``final``: the pusher is done, and its answer goes unheard."""
        for layer, op in list(self._prepared.items()):
            if op.gate is not None and not self._marks.withdraw(self._slots[layer]) and not final:
                continue
            self._link.outbound.abandon(op)
            del self._prepared[layer]

    def _close(self) -> None:
        self._finished = True
        self._withdraw(final=True)
        if self._pinned:
            self._pinned = False
            self._plan.local.unpin()

    async def __aenter__(self) -> LayerPusher:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            await self.wait()
            return
        tasks = list(dict.fromkeys(self._tasks.values()))  # (one task may wait for several layers)
        for task in tasks:  # the body failed: stop what is in flight, then let its error out
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._close()
