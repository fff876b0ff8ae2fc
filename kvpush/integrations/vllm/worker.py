"""The vLLM-free worker side of KvpushConnector: the per-worker state (``WorkerSide``).

``kvpush.integrations.vllm`` turns vLLM's hooks into calls on ``WorkerSide``; everything here works
without vLLM or torch (any objects with the attributes vLLM's would have), so the whole worker path,
real kvpush engines included, is tested without vLLM (tests/integration/test_vllm_worker.py).

Threads: the books of ``core`` and ``WorkerSide`` are driven from vLLM's thread only.
``EngineBridge`` (``bridge``) runs every kvpush call on one private event-loop thread and hands
results and inbound messages back as events on a queue, which every hook drains first.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Sequence
from typing import Any

from kvpush import CacheDesc, RemoteAccess

from ..sched_group import confine
from . import core
from .bridge import EngineBridge
from .settings import ConnectorSettings, cache_desc

log = logging.getLogger(__name__)


class WorkerSide:
    """One vLLM worker's connector state: its engine and its books, driven from vLLM's thread."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.engine: EngineBridge | None = None
        self.producer: core.ProducerBook | None = None
        self.consumer: core.ConsumerBook | None = None
        self.layer_index: dict[str, int] = {}  # layer name -> its slot in the registered cache
        self.slot_layers: list[int] = []  # layers per slot
        self.step_saves: list[int] = []  # layers per slot saved in this step
        self.load_errors: set[int] = set()
        self.step_computes = True
        self.step_holding = False

    def register(self, names: Sequence[str], tensors: Sequence[Any], slot_of: Sequence[int] | None = None) -> None:
        """Start the engine and register ``tensors`` (one per layer, in layer order) in place, each layer
        ``[num_blocks, heads, ...]`` as ``num_blocks * heads`` kvpush blocks of one head each (see
        ``..topology``); an MLA model's ``[num_blocks, (1,) block_size, latent]`` layers as they are, one
        block per KV block (the latent is one head every rank holds whole).

        A model with several KV cache groups (``settings.groups`` not plain) shares each block of memory between
        the layers of different groups: ``tensors`` are then its distinct layer slots, ``[num_blocks, page]``
        bytes each (one page per block), and ``slot_of[i]`` is the slot of layer ``names[i]``; a slot is pushed
        once every layer in it was saved in the step."""
        s = self.settings
        paged = not s.groups.plain
        if paged and (slot_of is None or len(slot_of) != len(names)):
            raise ValueError("KvpushConnector: a model with several KV cache groups registers its layer slots")
        slots = [names[slot_of.index(i)] for i in range(len(tensors))] if paged and slot_of else list(names)
        desc = cache_desc(slots, tensors)
        shape = tuple(desc.shape)
        local_heads, head_size, page = self._layout(shape, desc.data_type.itemsize)
        num_blocks = shape[0]
        geometry = s.geometry(len(tensors), local_heads, head_size, desc.data_type.name, page)
        if geometry.sharding().local != local_heads:
            raise NotImplementedError(f"KvpushConnector: this worker holds {local_heads} KV heads per block; "
                                      f"{geometry.kv_heads} heads over {s.tp_size} ranks would be "
                                      f"{geometry.sharding().local}")
        head_desc = CacheDesc(len(tensors), (num_blocks * local_heads, desc.size // num_blocks // local_heads
                                             // desc.data_type.itemsize), desc.data_type)
        views = [tensor.reshape(num_blocks * local_heads, -1) for tensor in tensors]
        if s.insecure_listener:
            log.warning("KvpushConnector: insecure: this engine listens on %s:%d, which other hosts may reach, with no "
                        "auth token: any of them can link to it", *(s.listen or ("?", 0)))
        if s.config.own_sched_group:
            log.info("KvpushConnector worker (TP rank %d): %s", s.tp_rank, confine())
        engine = EngineBridge(s.cluster_id, s.listen, s.config, s.engine_role, self.events, s.auth_token)
        engine.geometry = geometry
        engine.start()
        engine.register(head_desc, views, RemoteAccess.GRANTED if s.consume else RemoteAccess.PRIVATE)
        self.engine = engine
        self.layer_index = dict(zip(names, slot_of)) if paged and slot_of else {name: i for i, name in enumerate(names)}
        self.slot_layers = [0] * len(tensors)
        for slot in self.layer_index.values():
            self.slot_layers[slot] += 1
        self.step_saves = [0] * len(tensors)
        clock = time.monotonic
        if s.produce:
            self.producer = core.ProducerBook(s.block_size, len(tensors), s.config, clock, engine, local_heads,
                                              s.groups)
        if s.consume:
            self.consumer = core.ConsumerBook(s.block_size, s.config, clock, engine, s.groups)
        log.info("KvpushConnector worker: %d %s of %s %s registered in place as cluster %d (%s, TP rank %d of "
                 "%d, %s)", len(tensors), "layer slots" if paged else "layers", tuple(desc.shape), desc.data_type.name,
                 s.cluster_id, s.role, s.tp_rank, s.tp_size,
                 f"KV cache groups {s.groups}" if paged else f"KV heads {list(geometry.sharding().heads(s.tp_rank))}")

    def _layout(self, shape: tuple[int, ...], itemsize: int) -> tuple[int, int, int]:
        """(KV heads per block, head size, page bytes) of the registered tensors' ``shape``; refuses what it
        cannot move."""
        s = self.settings
        if not s.groups.plain:
            if len(shape) != 2:
                raise NotImplementedError(f"KvpushConnector: layer slots {shape}; [num_blocks, page] is supported")
            return 1, 1, int(shape[1]) * itemsize
        if s.mla:
            if not (len(shape) == 3 or (len(shape) == 4 and shape[1] == 1)):
                raise NotImplementedError(f"KvpushConnector: an MLA model's KV layout {shape}; "
                                          f"[num_blocks, (1,) block_size, latent] is supported")
            return 1, int(shape[-1]), 0
        if s.tp_size > 1 and len(shape) != 4:
            raise NotImplementedError(f"KvpushConnector: KV layout {shape} with tensor parallelism; "
                                      f"[num_blocks, kv_heads, block_size, 2*head_size] is supported")
        return (int(shape[1]), int(shape[-1]) // 2, 0) if len(shape) == 4 else (1, 0, 0)

    def drain(self) -> None:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            self._handle(event)

    def _handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "inbound":
            self._inbound(event[1], event[2])
        elif kind == "push_done" and self.producer is not None:
            self.producer.on_push_done(event[1], event[2])
        elif kind == "notified" and self.producer is not None:
            self.producer.on_notified(event[1], event[2], event[3])
        elif kind == "legs" and self.consumer is not None:
            self.consumer.on_legs(event[1], event[2])
        elif kind == "ids_sent" and self.consumer is not None:
            self.consumer.on_ids_sent(event[1], event[2], event[3], event[4], event[5] or None)
        elif kind == "link_lost":
            for book in (self.producer, self.consumer):
                if book is not None:
                    book.on_link_lost(event[1], event[2])

    def _inbound(self, peer: int, message: core.Message) -> None:
        if isinstance(message, core.Done):
            if self.consumer is not None:
                self.consumer.on_message(peer, message)
        elif self.producer is not None:
            self.producer.on_message(peer, message)
        elif self.engine is not None:
            self.engine.reply(peer, core.encode(core.Done(message.transfer_id, core.Outcome.UNKNOWN, 0,
                                                          "this vLLM instance is not a KV producer")))

    def begin_step(self, meta: core.StepMeta) -> None:
        self.drain()
        self.step_computes, self.step_holding = meta.computes, meta.holding
        self.step_saves = [0] * len(self.slot_layers)
        if self.producer is not None:
            self.producer.begin_step(meta.send, meta.send_finished)
        if self.consumer is not None:
            self.consumer.begin_step(meta.recv, meta.recv_aborted)

    def layer_saved(self, layer_name: str) -> None:
        """vLLM's save_kv_layer: that layer's KV of this step is in memory. A decode's block ids that came
        meanwhile are taken first: their request joins the forward from this layer on."""
        if self.producer is not None:
            if not self.events.empty():
                self.drain()
            slot = self.layer_index.get(layer_name)
            if slot is not None:
                self.step_saves[slot] += 1
                if self.step_saves[slot] == self.slot_layers[slot]:  # every layer sharing its memory is in
                    self.producer.layer_saved(slot)

    def end_step(self) -> None:
        """vLLM's wait_for_save: the forward pass is over."""
        if self.producer is not None:
            self.producer.end_step()

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of this step; each request once.

        An empty step with transfers open and nothing to report waits up to ``idle_wait_ms`` for news
        (a transfer that landed or failed, block ids in, a push done) instead of returning at once. vLLM's
        engine takes such steps back to back while its requests wait on transfers, and its worker spins
        between them: that ping-pong kept a waiting instance's processes running and waking hundreds of
        times a second, which took the shared core from the very instance it waited for (docs/perf/notes.md,
        "instances in their own sessions")."""
        found = self._collect()
        wait_s = self.settings.config.idle_wait_ms / 1e3
        if self.step_computes or wait_s <= 0 or any(found) or not (self.step_holding or self._open()):
            return found
        deadline = time.monotonic() + wait_s
        while not (any(found) or self._ids_in_pending()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                self._handle(self.events.get(timeout=left))
            except queue.Empty:
                break
            more = self._collect()
            found = (found[0] | more[0], found[1] | more[1], found[2] | more[2])
        return found

    def _open(self) -> bool:
        return any(book is not None and len(book) > 0 for book in (self.producer, self.consumer))

    def _ids_in_pending(self) -> bool:
        return self.producer is not None and self.producer.ids_in_pending

    def _collect(self) -> tuple[set[str], set[str], set[str]]:
        self.drain()
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self.producer is not None:
            self.producer.poll()
            sending = self.producer.take_finished_sending()
        if self.consumer is not None:
            self.consumer.poll()
            received = self.consumer.take_finished()
            recving, failed = received.finished, received.failed
            self.load_errors |= received.load_errors
        return sending, recving, failed

    def take_ids_in(self) -> list[str]:
        """Transfers whose decode's block ids came before their request ran here (each once), for the
        scheduler that holds such a request until they did."""
        self.drain()
        return self.producer.take_ids_in() if self.producer is not None else []

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def gauges(self) -> dict[str, int]:
        """Now: ``open`` transfers in the books, the engine's ``links`` and ``held_caches`` (pinned for
        links that closed while their peer might still write). Cheap; callable from vLLM's thread."""
        transfers = sum(len(book) for book in (self.producer, self.consumer) if book is not None)
        dd = self.engine.dd if self.engine is not None else None
        return {"open": transfers, "links": dd.link_count if dd is not None else 0,
                "held_caches": dd.held_caches if dd is not None else 0}

    def stats(self) -> dict[str, int]:
        """Counters of both books (``producer.pushes_pipelined``, ``consumer.landed``, ...)."""
        counts: dict[str, int] = {}
        for side, book in (("producer", self.producer), ("consumer", self.consumer)):
            if book is not None:
                counts.update({f"{side}.{key}": value for key, value in book.stats.items()})
        if self.producer is not None and self.engine is not None:
            counts.update({f"producer.{key}": value for key, value in self.engine.stats.items()})
        return counts

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
