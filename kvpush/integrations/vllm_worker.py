"""The vLLM-free worker side of KvpushConnector: the kvpush engine bridge and the per-worker state.

``kvpush.integrations.vllm`` turns vLLM's hooks into calls on ``WorkerSide``; everything here works
without vLLM or torch (any objects with the attributes vLLM's would have), so the whole worker path,
real kvpush engines included, is tested without vLLM (tests/integration/test_vllm_worker.py).

Threads: the books of ``vllm_core`` and ``WorkerSide`` are driven from vLLM's thread only.
``EngineBridge`` runs every kvpush call on one private event-loop thread and hands results and
inbound messages back as events on a queue, which every hook drains first.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import queue
import secrets
import time
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

import numpy as np

from kvpush import (
    AUTH_TOKEN_ENV,
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    RemoteAccess,
    is_loopback,
)
from kvpush.portal import Portal
from kvpush.scope import TaskScope

from . import vllm_core as core

log = logging.getLogger(__name__)

MODEL_ID = 0  # the one blocks cache of an instance: BlocksCacheKey(cluster_id, MODEL_ID)
_DTYPES = {"float32": DataType.DT_FLOAT, "float16": DataType.DT_FLOAT16, "bfloat16": DataType.DT_BF16}
_RETRYABLE = (LLMStatusCode.LLM_LINK_BUSY, LLMStatusCode.LLM_PROCESSING_LINK)


def describe_error(error: BaseException) -> str:
    if isinstance(error, LLMException):
        return f"{error.status_code.name}: {error}"
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    if isinstance(error, TimeoutError):
        return "timed out"
    return f"{type(error).__name__}: {error}"


# -- every kvpush call, in one place ---------------------------------------------------------------

class _Push:
    def __init__(self, pipelined: bool) -> None:
        self.pipelined = pipelined
        self.pusher: Any = None
        self.error: str | None = None
        self.task: asyncio.Task[None] | None = None
        self.closed = False  # no more layers: finished or cancelled


class EngineBridge:
    """The worker's kvpush engine and every call the connector makes on it.

    The effect methods (``send_ids`` .. ``reply``) are called from vLLM's thread, never block, and
    run on the loop thread in call order; results and inbound messages become events on
    ``events`` (tuples, see ``_Worker.drain``). Sends to one peer keep their order (ids before an
    abort) because each waits its turn on that peer's lock.
    """

    def __init__(self, cluster_id: int, listen: tuple[str, int] | None, config: core.ConnectorConfig,
                 role: LLMRole, events: queue.SimpleQueue[tuple[Any, ...]], auth_token: str | None = None) -> None:
        self.cluster_id = cluster_id
        self.listen = listen
        self.config = config
        self.auth_token = auth_token
        self.events = events
        self.thread = Portal(f"kvpush-{cluster_id}")
        self.dd = LLMDataDist(role, cluster_id)
        self.cache: Cache | None = None
        self._pushes: dict[int, _Push] = {}
        self._grants: dict[str, dict[int, Any]] = {}  # transfer id -> prefill rank -> the BlockAccess it writes under
        self.geometry: core.Geometry | None = None  # this worker's, once its KV is registered
        self._peer_geometry: dict[int, core.Geometry] = {}  # prefill workers that accepted ours (decode side)
        self._welcomes: dict[int, asyncio.Future[core.Welcome]] = {}
        self._peer_locks: dict[int, asyncio.Lock] = {}
        self._tasks = TaskScope(f"kvpush-worker-{cluster_id}")
        self._send_timeout = config.link_timeout_ms / 1000 + config.sync_kv_timeout_ms / 1000

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.run(self._start(), timeout=30)

    async def _start(self) -> None:
        await self.dd.init(self.config.engine_options_for(self.listen, self.auth_token))
        self.dd.add_link_listener(self._on_link)
        self._spawn(self._read(self.dd.messages))
        self._spawn(self._read(self.dd.notifications))
        log.info("kvpush engine cluster %d ready (listening on %s)", self.cluster_id,
                 self.dd.listen_address or "nothing: dials only")

    def register(self, desc: CacheDesc, tensors: Sequence[Any], access: RemoteAccess) -> Cache:
        """Register vLLM's KV tensors in place: ``PRIVATE`` on a prefill (no peer reads or writes them),
        ``GRANTED`` on a decode (a prefill writes only the blocks of a transfer it was sent, while it lasts)."""
        async def register() -> Cache:
            return self.dd.cache_manager.register_blocks_cache(desc, list(tensors),
                                                               BlocksCacheKey(self.cluster_id, MODEL_ID),
                                                               remote_access=access)
        self.cache = self.thread.run(register(), timeout=30)
        return self.cache

    def close(self) -> None:
        async def finalize() -> None:
            await self.dd.finalize()
        try:
            self.thread.run(finalize(), timeout=10)
        except Exception as error:  # noqa: BLE001 - shutting down: log, never raise into vLLM's shutdown
            log.warning("kvpush engine cluster %d: finalize: %s", self.cluster_id, describe_error(error))
        self.thread.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._tasks.spawn(coro)

    async def _read(self, inbox: Any) -> None:
        try:
            async for delivery in inbox:
                peer = delivery.peer_cluster_id
                if delivery.epoch != self.dd.links_lost(peer):
                    # it came over a link that closed before this task took it: its link_lost event is
                    # already queued (the books ended that peer's transfers), and the decode released
                    # its blocks, so block ids acted on now would be pushed over a newer link into
                    # memory vLLM may have reused
                    log.info("dropped a message from cluster %d that came over a link closed since", peer)
                    continue
                try:
                    message = core.decode(delivery.data)
                except core.MessageError as error:
                    log.warning("message from cluster %d ignored: %s", peer, error)
                    continue
                if isinstance(message, core.Hello):
                    self._spawn(self._welcome(peer, message))
                elif isinstance(message, core.Welcome):
                    waiter = self._welcomes.get(peer)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(message)
                else:
                    self.events.put(("inbound", peer, message))
        except LLMException:
            return  # finalized

    def _on_link(self, link: Any, reason: str | None) -> None:
        peer = getattr(link, "peer_cluster_id", None)
        if reason is not None and peer is not None:
            self._peer_geometry.pop(peer, None)  # a new link answers our geometry again
            self.events.put(("link_lost", peer, reason))

    # -- geometry, once per link -------------------------------------------------------------------
    async def _welcome(self, peer: int, hello: core.Hello) -> None:
        """Prefill side: answer a decode's geometry with ours, refusing what cannot be bridged."""
        if self.geometry is None:
            return
        if self.dd.role == LLMRole.DECODER:
            refusal: str | None = "this vLLM instance is not a KV producer"
        else:
            refusal = core.incompatibility(self.geometry, hello.geometry)
        if refusal:
            log.error("KvpushConnector: refused to send KV to cluster %d: %s", peer, refusal)
        try:
            await asyncio.wait_for(self.dd.send_notification(peer, core.encode(core.Welcome(self.geometry,
                                                                                           refusal or ""))),
                                   self._send_timeout)
        except (LLMException, TimeoutError) as error:
            log.info("answer to cluster %d's geometry not sent: %s", peer, describe_error(error))

    async def _handshake(self, address: core.PeerAddress) -> tuple[str, bool] | None:
        """Decode side: link to a prefill worker and, once per link, have it accept this worker's geometry;
        an incompatible one is unlinked, with both values named in the log and the returned reason."""
        problem = await self._ensure_link(address)
        if problem is not None or address.cluster_id in self._peer_geometry:
            return problem
        assert self.geometry is not None
        waiter: asyncio.Future[core.Welcome] = asyncio.get_running_loop().create_future()
        self._welcomes[address.cluster_id] = waiter
        try:
            await asyncio.wait_for(self.dd.send_message(address.cluster_id, core.encode(core.Hello(self.geometry))),
                                   self._send_timeout)
            welcome = await asyncio.wait_for(waiter, self._send_timeout)
        except (LLMException, TimeoutError) as error:
            retryable = isinstance(error, LLMException) and error.status_code in _RETRYABLE
            return (f"the prefill at {address.host}:{address.port} did not answer this decode's geometry: "
                    f"{describe_error(error)}", retryable)
        finally:
            self._welcomes.pop(address.cluster_id, None)
        refusal = welcome.refusal or core.incompatibility(welcome.geometry, self.geometry)
        if refusal:
            log.error("KvpushConnector: the prefill at %s:%d (cluster %d) cannot send KV to this decode: %s",
                      address.host, address.port, address.cluster_id, refusal)
            info = LLMClusterInfo()
            info.remote_cluster_id = address.cluster_id
            await self.dd.unlink_clusters([info], force=True)
            return f"incompatible prefill at {address.host}:{address.port}: {refusal}", False
        self._peer_geometry[address.cluster_id] = welcome.geometry
        return None

    def _lock(self, peer: int) -> asyncio.Lock:
        lock = self._peer_locks.get(peer)
        if lock is None:
            lock = self._peer_locks[peer] = asyncio.Lock()
        return lock

    # -- decode side -------------------------------------------------------------------------------
    def send_ids(self, spec: core.RecvSpec, block_size: int) -> None:
        self.thread.call_soon(self._spawn, self._send_ids(spec, block_size))

    async def _send_ids(self, spec: core.RecvSpec, block_size: int) -> None:
        """Send the transfer's block ids to every prefill rank with a leg to this rank (or owed word of it),
        each leg's blocks opened to that rank first; report the ranks reached (``on_ids_sent``'s peers)."""
        remote, transfer_id = spec.remote, spec.transfer_id
        async with self._lock(remote.cluster_id):
            problem = await self._handshake(remote)
        prefill = self._peer_geometry.get(remote.cluster_id)
        if problem is None and (prefill is None or self.geometry is None):
            problem = (f"the link to {remote.host}:{remote.port} closed meanwhile", True)
        if problem is not None or prefill is None or self.geometry is None:
            reason, retryable = problem or ("no geometry", False)
            self.events.put(("ids_sent", transfer_id, reason, retryable, False, ()))
            return
        plan = core.targets(prefill.sharding(), self.geometry.sharding(), self.geometry.tp_rank)
        # the book learns the legs before any id leaves: losing any of those ranks ends the transfer at once
        self.events.put(("legs", transfer_id, tuple(remote.of_rank(t.prefill_rank).cluster_id for t in plan)))
        delivered: list[int] = []
        for target in plan:
            address = remote.of_rank(target.prefill_rank)
            async with self._lock(address.cluster_id):
                problem, sent = await self._send_leg(address, spec, block_size, target, address == remote)
            if sent:
                delivered.append(address.cluster_id)
            if problem is not None:
                retryable = problem[1] and not delivered
                self.events.put(("ids_sent", transfer_id, problem[0], retryable, bool(delivered), tuple(delivered)))
                return
        self.events.put(("ids_sent", transfer_id, None, False, True, tuple(delivered)))

    async def _send_leg(self, address: core.PeerAddress, spec: core.RecvSpec, block_size: int, target: core.Target,
                        linked: bool) -> tuple[tuple[str, bool] | None, bool]:
        """One prefill rank's part: (problem, whether some of its ids may have reached it)."""
        problem = None if linked else await self._handshake(address)
        if problem is None and target.leg is not None and spec.blocks:
            problem = self._grant(address.cluster_id, spec.transfer_id, target, spec.blocks)
        if problem is not None:
            return problem, False
        try:
            frames = core.block_id_messages(spec.transfer_id, block_size, spec.num_tokens, spec.first_block,
                                            spec.blocks, leg=target.info)
        except core.MessageError as error:
            return (str(error), False), False
        for index, frame in enumerate(frames):
            try:
                await asyncio.wait_for(self.dd.send_message(address.cluster_id, frame), self._send_timeout)
            except (LLMException, TimeoutError) as error:
                retryable = isinstance(error, LLMException) and error.status_code in _RETRYABLE
                return (describe_error(error), retryable and index == 0), index > 0 or not retryable
        return None, True

    def _grant(self, peer: int, transfer_id: str, target: core.Target,
               blocks: Sequence[int]) -> tuple[str, bool] | None:
        """Open the kvpush blocks ``target``'s leg writes to ``peer`` for this transfer (again, if the link
        its grant was made on closed)."""
        grants = self._grants.setdefault(transfer_id, {})
        access = grants.get(peer)
        if access is not None and access.active:
            return None
        assert self.cache is not None and target.leg is not None
        ids = core.dst_ids(target.leg, np.asarray(blocks), target.info.dst_local)
        try:
            grants[peer] = self.dd.cache_manager.allow(self.cache, peer, ids)
        except (LLMException, TypeError, ValueError) as error:
            return f"cannot open the blocks to cluster {peer}: {describe_error(error)}", False
        return None

    def transfer_ended(self, transfer_id: str) -> None:
        self.thread.call_soon(self._end_grants, transfer_id)

    def _end_grants(self, transfer_id: str) -> None:
        for access in self._grants.pop(transfer_id, {}).values():
            access.revoke()

    async def _ensure_link(self, remote: core.PeerAddress) -> tuple[str, bool] | None:
        if remote.cluster_id in self.dd.links:
            return None
        info = LLMClusterInfo()
        info.remote_cluster_id = remote.cluster_id
        info.append_remote_ip_info(remote.host, remote.port)
        try:
            _, codes = await self.dd.link_clusters([info], timeout=self.config.link_timeout_ms)
        except LLMException as error:
            return describe_error(error), error.status_code in _RETRYABLE
        code = codes[0]
        if code in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
            return None
        return (f"link to {remote.host}:{remote.port} (cluster {remote.cluster_id}): {code.name}",
                code in _RETRYABLE)

    def send_abort(self, peer: int, data: bytes) -> None:
        self.thread.call_soon(self._spawn, self._send_abort(peer, data))

    async def _send_abort(self, peer: int, data: bytes) -> None:
        async with self._lock(peer):
            try:
                await asyncio.wait_for(self.dd.send_message(peer, data), self._send_timeout)
            except (LLMException, TimeoutError) as error:
                log.info("abort to cluster %d not sent: %s", peer, describe_error(error))

    # -- prefill side ------------------------------------------------------------------------------
    def start_push(self, push_id: int, peer: int, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   pipelined: bool) -> None:
        self.thread.call_soon(self._start_push, push_id, peer, list(src_blocks), list(dst_blocks), pipelined)

    def _start_push(self, push_id: int, peer: int, src: list[int], dst: list[int], pipelined: bool) -> None:
        push = self._pushes[push_id] = _Push(pipelined)
        assert self.cache is not None
        key = BlocksCacheKey(peer, MODEL_ID)
        if not pipelined:
            push.closed = True
            push.task = asyncio.get_running_loop().create_task(
                self.dd.cache_manager.push_blocks(key, self.cache, src, dst, tensor_num_per_layer=1))
            push.task.add_done_callback(lambda task: self._push_ended(push_id, task))
            return
        try:
            push.pusher = self.dd.cache_manager.layer_pusher(key, self.cache, src, dst, tensor_num_per_layer=1)
        except Exception as error:  # noqa: BLE001 - reported as this push's failure
            push.error = describe_error(error)

    def push_layer(self, push_id: int, layer: int) -> None:
        self.thread.call_soon(self._push_layer, push_id, layer)

    def _push_layer(self, push_id: int, layer: int) -> None:
        push = self._pushes.get(push_id)
        if push is None or push.closed or push.error is not None or push.pusher is None:
            return
        try:
            push.pusher.push_layer(layer)
        except LLMException as error:
            push.error = describe_error(error)

    def finish_push(self, push_id: int) -> None:
        self.thread.call_soon(self._finish_push, push_id)

    def _finish_push(self, push_id: int) -> None:
        push = self._pushes.get(push_id)
        if push is None or push.task is not None:
            return
        push.closed = True
        push.task = asyncio.get_running_loop().create_task(self._wait(push))
        push.task.add_done_callback(lambda task: self._push_ended(push_id, task))

    async def _wait(self, push: _Push) -> None:
        if push.pusher is not None:
            await push.pusher.wait()
        if push.error is not None:
            raise RuntimeError(push.error)

    def cancel_push(self, push_id: int) -> None:
        self.thread.call_soon(self._cancel_push, push_id)

    def _cancel_push(self, push_id: int) -> None:
        push = self._pushes.get(push_id)
        if push is None:
            return
        if push.task is None:  # a pipelined push still taking layers: wait for what started, cancelled
            self._finish_push(push_id)
        assert push.task is not None
        task = push.task
        asyncio.get_running_loop().call_soon(task.cancel)  # once it waits: cancelling wait() drains its layers

    def _push_ended(self, push_id: int, task: asyncio.Task[None]) -> None:
        self._pushes.pop(push_id, None)
        if task.cancelled():
            error: str | None = "cancelled"
        else:
            failure = task.exception()
            error = None if failure is None else describe_error(failure)
        self.events.put(("push_done", push_id, error))

    def notify(self, peer: int, data: bytes, transfer_id: str) -> None:
        self.thread.call_soon(self._spawn, self._notify(peer, data, transfer_id))

    async def _notify(self, peer: int, data: bytes, transfer_id: str | None) -> None:
        error = None
        try:
            await asyncio.wait_for(self.dd.send_notification(peer, data), self._send_timeout)
        except (LLMException, TimeoutError) as failure:
            error = describe_error(failure)
        if transfer_id is not None:
            self.events.put(("notified", transfer_id, error, peer))
        elif error is not None:
            log.debug("reply to cluster %d not sent: %s", peer, error)

    def reply(self, peer: int, data: bytes) -> None:
        self.thread.call_soon(self._spawn, self._notify(peer, data, None))


class WorkerSide:
    """One vLLM worker's connector state: its engine and its books, driven from vLLM's thread."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.engine: EngineBridge | None = None
        self.producer: core.ProducerBook | None = None
        self.consumer: core.ConsumerBook | None = None
        self.layer_index: dict[str, int] = {}
        self.load_errors: set[int] = set()

    def register(self, names: Sequence[str], tensors: Sequence[Any]) -> None:
        """Start the engine and register ``tensors`` (one per layer, in layer order) in place, each layer
        ``[num_blocks, heads, ...]`` as ``num_blocks * heads`` kvpush blocks of one head each (see
        ``vllm_core.topology``)."""
        s = self.settings
        desc = cache_desc(names, tensors)
        num_blocks, local_heads = desc.shape[0], desc.shape[1] if len(desc.shape) == 4 else 1
        if s.tp_size > 1 and len(desc.shape) != 4:
            raise NotImplementedError(f"KvpushConnector: KV layout {tuple(desc.shape)} with tensor parallelism; "
                                      f"[num_blocks, kv_heads, block_size, 2*head_size] is supported")
        geometry = s.geometry(len(names), local_heads, int(desc.shape[-1]) // 2 if len(desc.shape) == 4 else 0,
                              desc.data_type.name)
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
        engine = EngineBridge(s.cluster_id, s.listen, s.config, s.engine_role, self.events, s.auth_token)
        engine.geometry = geometry
        engine.start()
        engine.register(head_desc, views, RemoteAccess.GRANTED if s.consume else RemoteAccess.PRIVATE)
        self.engine = engine
        self.layer_index = {name: i for i, name in enumerate(names)}
        clock = time.monotonic
        if s.produce:
            self.producer = core.ProducerBook(s.block_size, len(names), s.config, clock, engine, local_heads)
        if s.consume:
            self.consumer = core.ConsumerBook(s.block_size, s.config, clock, engine)
        log.info("KvpushConnector worker: %d layers of %s %s registered in place as cluster %d (%s, TP rank %d of "
                 "%d, KV heads %s)", len(names), tuple(desc.shape), desc.data_type.name, s.cluster_id, s.role,
                 s.tp_rank, s.tp_size, list(geometry.sharding().heads(s.tp_rank)))

    def drain(self) -> None:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
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
        if self.producer is not None:
            self.producer.begin_step(meta.send, meta.send_finished)
        if self.consumer is not None:
            self.consumer.begin_step(meta.recv, meta.recv_aborted)

    def layer_saved(self, layer_name: str) -> None:
        """vLLM's save_kv_layer: that layer's KV of this step is in memory."""
        if self.producer is not None:
            index = self.layer_index.get(layer_name)
            if index is not None:
                self.producer.layer_saved(index)

    def end_step(self) -> None:
        """vLLM's wait_for_save: the forward pass is over."""
        if self.producer is not None:
            self.producer.end_step()

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of this step; each request once."""
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
        return counts

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def cache_desc(names: Sequence[str], tensors: Sequence[Any]) -> CacheDesc:
    """One blocks cache, one tensor per layer (each layer's ``[num_blocks, ...]`` view registered in
    place). Refuses what kvpush cannot move, naming the layer and the reason."""
    if not tensors:
        raise ValueError("KvpushConnector: vLLM registered no KV cache tensors")
    first = tensors[0]
    for name, tensor in zip(names, tensors):
        device = str(getattr(tensor, "device", "cpu"))
        if not device.startswith("cpu"):
            raise NotImplementedError(
                f"KvpushConnector: layer {name}'s KV cache is on {device}; kvpush moves host memory only "
                f"(registering GPU memory, e.g. through UCX with CUDA support, is not implemented yet)")
        if tuple(tensor.shape) != tuple(first.shape) or tensor.dtype != first.dtype:
            raise NotImplementedError(
                f"KvpushConnector: layer {name} has KV {tuple(tensor.shape)} {tensor.dtype}, layer {names[0]} "
                f"{tuple(first.shape)} {first.dtype}; one shape and dtype for every layer is required")
        contiguous = tensor.is_contiguous() if hasattr(tensor, "is_contiguous") else tensor.flags.c_contiguous
        if not contiguous:
            raise NotImplementedError(f"KvpushConnector: layer {name}'s KV cache view is not contiguous")
    dtype = _DTYPES.get(str(first.dtype).removeprefix("torch."))
    if dtype is None:
        raise NotImplementedError(f"KvpushConnector: KV cache dtype {first.dtype} is not supported "
                                  f"(float32, float16, bfloat16 are)")
    return CacheDesc(len(tensors), tuple(int(d) for d in first.shape), dtype)


class ConnectorSettings:
    """What both sides derive from the vLLM config: role, addresses, cluster id, deadlines, and this
    worker's place in its instance (``tp_rank`` of ``tp_size``; the scheduler's settings are rank 0's).

    Rank ``r`` listens on ``port + 2 * r`` (``port``: ``kv_connector_extra_config``'s, else vLLM's
    ``kv_port``, ``+ 1`` for a decode), with the cluster id derived from that address, or the configured
    ``cluster_id + r``."""

    def __init__(self, vllm_config: Any, tp_rank: int = 0) -> None:
        transfer = vllm_config.kv_transfer_config
        self.role: str = transfer.kv_role
        if self.role not in core.ROLES:
            raise core.ParamsError(f"kv_role {self.role!r} is not one of {', '.join(core.ROLES)}")
        self.config = core.ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        self.block_size: int = int(vllm_config.cache_config.block_size)
        self.produce = self.role in ("kv_producer", "kv_both")
        self.consume = self.role in ("kv_consumer", "kv_both")
        #: vLLM's answer to a request whose KV did not come ("fail" or "recompute"; None: a vLLM without it)
        self.load_failure_policy: str | None = getattr(transfer, "kv_load_failure_policy", None)
        self.engine_role = {"kv_producer": LLMRole.PROMPT, "kv_consumer": LLMRole.DECODER}.get(self.role, LLMRole.MIX)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise NotImplementedError("KvpushConnector: pipeline parallelism (pipeline_parallel_size="
                                      f"{parallel.pipeline_parallel_size}) is not built yet; tensor parallelism is")
        self.tp_size = int(parallel.tensor_parallel_size)
        self.tp_rank = tp_rank
        rank = int(getattr(parallel, "data_parallel_index", 0) or 0) * self.tp_size + tp_rank
        self.kv_heads: int | None = _total_kv_heads(vllm_config)
        self.model = _model_fingerprint(vllm_config)
        kv_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
        model_dtype = str(getattr(getattr(vllm_config, "model_config", None), "dtype", ""))
        #: the KV geometry's fingerprint in a fleet registry: instances with another one are never paired
        self.compat = hashlib.blake2b(f"{self.model}|{self.block_size}|{kv_dtype}|{model_dtype}".encode(),
                                      digest_size=8).hexdigest()
        host = self.config.host or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
        self.listen: tuple[str, int] | None = None
        if self.produce or self.config.port is not None or self.config.host is not None:
            port = self.config.port + 2 * rank if self.config.port else core.listen_port(transfer.kv_port, self.role,
                                                                                            rank)
            self.listen = (host, port)
        if self.config.cluster_id is not None:
            self.cluster_id = self.config.cluster_id + rank
        elif self.listen is not None:
            self.cluster_id = core.derive_cluster_id(*self.listen)
        else:  # a decode that only dials: any id no address derives to (those are < 2**48 or >= 2**63)
            self.cluster_id = (1 << 48) + secrets.randbelow((1 << 62) - (1 << 48))
        self.local = core.PeerAddress(self.listen[0], self.listen[1], self.cluster_id) if self.listen else None
        #: the shared secret of this deployment's links: the config's, else the environment's
        self.auth_token: str | None = self.config.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None
        self.insecure_listener = self.listen is not None and not self.auth_token and not is_loopback(self.listen[0])
        if self.insecure_listener and not self.config.insecure:
            assert self.listen is not None
            raise core.ParamsError(
                f"KvpushConnector: its kvpush engine would listen on {self.listen[0]}:{self.listen[1]}, which other "
                f"hosts may reach, with no auth token: any of them could link to it. Give every prefill and decode "
                f"the same secret in the environment variable {AUTH_TOKEN_ENV} (or \"auth_token\" in "
                f"kv_connector_extra_config, which shows in process listings), or run it unauthenticated on a "
                f"private network with \"insecure\": true in kv_connector_extra_config")
        default_host = os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
        self.default_remote = core.PeerAddress.of(default_host, core.listen_port(transfer.kv_port, "kv_producer"))
        self.name = f"kvpush-{str(transfer.engine_id)[:8]}"

    def geometry(self, layers: int, local_heads: int, head_size: int, dtype: str) -> core.Geometry:
        """This worker's geometry, once its KV tensors are known."""
        kv_heads = self.kv_heads or local_heads * self.tp_size
        return core.Geometry(self.model, dtype, self.block_size, head_size, layers, kv_heads, self.tp_size,
                             self.tp_rank)


def _total_kv_heads(vllm_config: Any) -> int | None:
    model = getattr(vllm_config, "model_config", None)
    try:
        return int(model.get_total_num_kv_heads()) if model is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


def _model_fingerprint(vllm_config: Any) -> str:
    """The model's architecture, not where it was loaded from: a hash of its Hugging Face config without
    paths and versions (two hosts may keep one model under different paths)."""
    model = getattr(vllm_config, "model_config", None)
    config = getattr(model, "hf_config", None)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        return str(getattr(model, "model", "unknown"))
    fields = {key: value for key, value in to_dict().items()
              if key not in ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")}
    text = json.dumps(fields, sort_keys=True, default=str)
    return f"{fields.get('model_type', 'model')}-{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"


def scheduled_requests(scheduler_output: Any) -> Iterable[core.Scheduled]:
    counts = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        yield core.Scheduled(new.req_id, tuple(new.block_ids[0]), False, new.num_computed_tokens, counts[new.req_id])
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        groups = cached.new_block_ids[i]
        blocks = tuple(groups[0]) if groups is not None else None
        yield core.Scheduled(req_id, blocks, req_id in cached.resumed_req_ids, cached.num_computed_tokens[i],
                             counts.get(req_id, 0))

