"""The kvpush engine of one vLLM worker and every call KvpushConnector makes on it (``EngineBridge``).

Every kvpush call runs on one private event-loop thread (a ``kvpush.portal.Portal``); results and inbound
messages go back to vLLM's thread as events on a queue, which ``WorkerSide`` (``worker``) drains
first in every hook. Works without vLLM or torch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np

from kvpush import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    RemoteAccess,
)
from kvpush.portal import Portal
from kvpush.scope import TaskScope

from ..errors import describe_error
from . import core

log = logging.getLogger(__name__)

MODEL_ID = 0  # the one blocks cache of an instance: BlocksCacheKey(cluster_id, MODEL_ID)
_RETRYABLE = (LLMStatusCode.LLM_LINK_BUSY, LLMStatusCode.LLM_PROCESSING_LINK)


# -- every kvpush call, in one place ---------------------------------------------------------------

class _Push:
    def __init__(self, pipelined: bool) -> None:
        self.pipelined = pipelined
        self.pusher: Any = None
        self.error: str | None = None
        self.task: asyncio.Task[None] | None = None
        self.closed = False  # no more layers: finished or cancelled
        # every layer goes once the forward is over (the pusher would copy them here, to this host)
        self.deferred = False


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
        self.thread = Portal(f"kvpush-{cluster_id}", yields=config.loop_yields)
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
        #: ``pushes_deferred``: pipelined pushes whose layers went after the forward; ``pushes_marked``: those
        #: whose layers vLLM's thread marked ready itself (``_start_push``). Its keys exist from the start:
        #: vLLM's thread reads it while the loop's thread counts.
        #: ``bytes_pushed``: what the pushes started were asked to move (every layer of every block).
        self.stats: Counter[str] = Counter(pushes_deferred=0, pushes_marked=0, bytes_pushed=0)
        self._block_bytes = 0  # one kvpush block over every layer (``register``)
        self._deferred: set[int] = set()  # deferred pushes (``_start_push``): vLLM's thread reads it
        self._gated: dict[int, Any] = {}  # pushes whose layers vLLM's thread marks ready itself (``_start_push``)

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
        self._block_bytes = desc.block_bytes * desc.num_tensors
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
        assert remote is not None  # a spec without a prefill is refused by the consumer book
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
        held = np.asarray(blocks, np.int64)
        if self.geometry is not None:
            held = held[self.geometry.groups.held(held)]  # not the null block of a window position it dropped
        ids = core.dst_ids(target.leg, held, target.info.dst_local)
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
        self.stats["bytes_pushed"] += len(src) * self._block_bytes
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
            return
        if push.pusher.copies_here:
            # This process's own CPU would move the layers to the decode (TCP to this host, or a decode that
            # cannot read this process), and vLLM's forward keeps every core it may use busy: a layer pushed
            # during the forward costs the forward what it costs after it, and its caches besides. They go
            # once the forward is over.
            push.deferred = True
            self._deferred.add(push_id)  # from now on vLLM's thread hands none of its layers over
            self.stats["pushes_deferred"] += 1
        elif push.pusher.gated:
            # The decode copies each layer once it reads the layer's ready mark in this process's memory:
            # from now on vLLM's thread marks the layers itself (``push_layer``), and this loop does not
            # wake during the forward (each wake is a turn of Python taken from the forward's core).
            self._gated[push_id] = push.pusher
            self.stats["pushes_marked"] += 1

    def push_layer(self, push_id: int, layer: int) -> None:
        gated = self._gated.get(push_id)
        if gated is not None:
            try:
                gated.mark_ready(layer)  # two stores; the decode reads them
                return
            except LLMException:
                pass  # the loop's push_layer raises it again, and the push fails with it
        if push_id not in self._deferred:  # a deferred push takes no layer before the forward is over
            self.thread.call_soon(self._push_layer, push_id, layer)

    def _push_layer(self, push_id: int, layer: int) -> None:
        push = self._pushes.get(push_id)
        if push is None or push.closed or push.error is not None or push.pusher is None:
            return
        if push.deferred:
            return  # it goes with the others once the forward is over
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
        self._gated.pop(push_id, None)  # its wait() takes the layers vLLM's thread marked
        if push.deferred:  # the forward is over: every layer goes now
            push.deferred = False
            self._deferred.discard(push_id)
            for layer in range(push.pusher.num_layers):
                self._push_layer(push_id, layer)
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
            push.deferred = False  # what was kept for after the forward never starts
            self._deferred.discard(push_id)
            self._finish_push(push_id)
        assert push.task is not None
        task = push.task
        asyncio.get_running_loop().call_soon(task.cancel)  # once it waits: cancelling wait() drains its layers

    def _push_ended(self, push_id: int, task: asyncio.Task[None]) -> None:
        self._pushes.pop(push_id, None)
        self._deferred.discard(push_id)
        self._gated.pop(push_id, None)
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
