"""kvpush as an SGLang PD-disaggregation transfer backend: ``KvpushKVManager``, ``KvpushKVSender``,
``KvpushKVReceiver`` and ``KvpushKVBootstrapServer``, subclasses of SGLang's ``Common*`` classes
(``sglang.srt.disaggregation.common.conn``) that replace only the data movement.

SGLang keeps its meaning for everything else: the bootstrap server (HTTP registration, rank mapping, the
per-request ``bootstrap_room``), its ZMQ control messages (a decode rank registers once with each prefill
rank it pairs with, then sends each room's destination pages and aux slot; a prefill reports failures),
the aux (metadata) buffers and the ``KVPoll`` states. What moves differs:

- Pages: the prefill pushes them with kvpush's ``push_blocks`` over a kvpush link it opens to the decode
  rank's engine (cma on one host; TCP or UCX between hosts; ``KVPUSH_TRANSPORT``), one push per prefill
  chunk, each buffer one kvpush "layer" (see ``core`` for the blocks of a buffer).
- Least privilege, as in the vLLM connector: the decode registers its pool ``RemoteAccess.GRANTED`` and, before
  it sends a room's pages to a prefill rank, grants that rank's cluster the blocks of those pages only, until
  the room ends (success, failure, abort); the prefill registers its pool ``PRIVATE``. Every link proves
  ``KVPUSH_AUTH_TOKEN``; a decode refuses to listen off loopback without one (``KVPUSH_INSECURE=1`` to allow).
- Completion: the last push carries the room's aux row as kvpush's ``notify``, delivered after every byte
  landed; the decode writes it into the aux slot it chose for the room itself and only then reports
  ``KVPoll.Success`` for that prefill rank. Failures travel as SGLang's status messages.
- Failure detection: a kvpush link that closes fails, at once, the rooms it was carrying; a peer whose process
  no longer listens is gone, and every room waiting on it ends at once, whatever its stage (``decode``,
  ``prefill``); SGLang's heartbeat also runs. kvpush bounds every layer by ``KVPUSH_SYNC_KV_TIMEOUT_MS``.

Threads: SGLang calls these classes on its scheduler thread and runs one ZMQ control thread per manager;
every kvpush call runs on the manager's own event-loop thread (a ``kvpush.portal.Portal``).

This module holds what both sides share (the engine, the pool's registration, the control messages' format)
and SGLang's four classes; ``prefill`` and ``decode`` hold each side's transfers.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVReceiver, CommonKVSender
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress

from kvpush import BlocksCacheKey, Cache, CacheDesc, DataType, LLMDataDist, LLMRole, RemoteAccess
from kvpush.portal import Portal
from kvpush.scope import TaskScope

from ..errors import describe_error
from . import core
from .decode import DecodeSide
from .prefill import PrefillSide

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0


class KvpushKVManager(PrefillSide, DecodeSide):
    """One SGLang rank's kvpush engine and every transfer of that rank (see the module docstring).

    Aborts follow SGLang's deferred KV release (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``, on by
    default): a decode that aborts a room keeps its pages until each prefill rank acknowledges that no byte of
    the room can still land; the prefill counts a room's pushes in ``_staging_outstanding`` (SGLang's counter
    for this) and acknowledges once the cancelled ones drained.
    """

    supports_deferred_decode_kv_release = True
    kv_status_msg_carries_reason = True  # a decode learns why a prefill failed a room (a refused link, ...)

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        try:
            self.states = core.state_pools(args, self.attn_tp_size, self.attn_tp_rank)
        except core.LayoutError as error:
            raise NotImplementedError(f"kvpush SGLang backend: {error}") from None
        self.settings = core.BackendSettings.from_env()
        if not is_mla_backend and getattr(args, "kv_head_num", None) is None:
            # SGLang 0.5.23's decode does not fill in KVArgs' head counts (its prefill does): read the model's
            args.total_kv_head_num = _total_kv_heads(server_args)
            args.kv_head_num = max(1, args.total_kv_head_num // self.attn_tp_size)
        self.layout = core.PoolLayout.of(args, self.attn_tp_size, self.attn_tp_rank, bool(is_mla_backend))
        self.cluster_id = core.cluster_id_of(self.local_ip, self.rank_port)
        self.is_decode = disaggregation_mode == DisaggregationMode.DECODE
        self._stopped = False
        self._worker_threads: list[threading.Thread] = []
        self.portal = Portal(f"kvpush-sglang-{self.rank_port}", yields=self.settings.loop_yields)
        self.dd = LLMDataDist(LLMRole.DECODER if self.is_decode else LLMRole.PROMPT, self.cluster_id)
        self._tasks = TaskScope(f"kvpush-sglang-{self.cluster_id}")
        self.cache: Cache | None = None
        self.state_caches: list[list[Cache]] = []  # each state pool's caches (``core.state_model_ids``)
        self._init_prefill_side()
        self._init_decode_side()
        listen = (self.local_ip, 0) if self.is_decode else None
        if listen is not None:
            self.settings.check_listener(listen[0])
        self.portal.run(self._start(listen), timeout=_START_TIMEOUT_S)
        self.listen_address = self.dd.listen_address
        if self.is_decode:
            thread = threading.Thread(target=self._decode_thread, name="kvpush-sglang-decode", daemon=True)
            thread.start()
            self._worker_threads += [thread, self._start_heartbeat_checker_thread()]
        else:
            thread = threading.Thread(target=self._prefill_thread, name="kvpush-sglang-prefill", daemon=True)
            thread.start()
            self._worker_threads.append(thread)
        log.info("kvpush SGLang backend: %s rank %d of %d, cluster %d, %d KV buffers of %d pages (%d tokens x %d "
                 "heads x %d bytes per page)%s", "decode" if self.is_decode else "prefill", self.layout.tp_rank,
                 self.layout.tp_size, self.cluster_id, self.layout.buffers, self.layout.pages, self.layout.page_size,
                 self.layout.local_heads, self.layout.slab_bytes,
                 f", listening on {self.listen_address}" if self.listen_address else "")
        if self.states:
            log.info("kvpush SGLang backend: state pools beside the KV: %s",
                     "; ".join(pool.describe() for pool in self.states))

    async def _start(self, listen: tuple[str, int] | None) -> None:
        await self.dd.init(self.settings.engine_options(listen))
        desc = CacheDesc(self.layout.buffers, (self.layout.blocks, self.layout.slab_bytes), DataType.DT_UINT8)
        access = RemoteAccess.GRANTED if self.is_decode else RemoteAccess.PRIVATE
        self.cache = self.dd.cache_manager.register_blocks_cache(desc, list(self.kv_args.kv_data_ptrs),
                                                                 BlocksCacheKey(self.cluster_id, core.MODEL_ID),
                                                                 remote_access=access)
        for index, (pool, ids) in enumerate(zip(self.states, core.state_model_ids(self.states))):
            pointers = list(self.kv_args.state_data_ptrs[index])
            shapes = [(pool.window.buffers, (pool.window.blocks, pool.window.slab_bytes), pointers)] if pool.window \
                else [(len(g.members), (g.slots, g.slot_bytes), [pointers[m] for m in g.members]) for g in pool.groups]
            self.state_caches.append([
                self.dd.cache_manager.register_blocks_cache(CacheDesc(count, shape, DataType.DT_UINT8), buffers,
                                                            BlocksCacheKey(self.cluster_id, model_id),
                                                            remote_access=access)
                for (count, shape, buffers), model_id in zip(shapes, ids)])
        if self.is_decode:
            self.dd.add_link_listener(self._on_link)
            self._tasks.spawn(self._read_done(self.dd.notifications))
        else:
            self.dd.add_link_listener(self._on_decode_link)

    def teardown(self) -> None:
        """Stop the control threads and the engine (SGLang calls it on a role switch; also at exit)."""
        self._stopped = True
        if getattr(self, "_heartbeat_shutdown", None) is not None:
            self._heartbeat_shutdown.set()

        async def finalize() -> None:
            self._tasks.cancel()
            await self.dd.finalize()
        try:
            self.portal.run(finalize(), timeout=10)
        except Exception as error:  # noqa: BLE001 - shutting down: log, never raise into SGLang's shutdown
            log.warning("kvpush SGLang backend: finalize: %s", describe_error(error))
        self.portal.close()

    # -- the messages both sides exchange over SGLang's ZMQ control sockets ------------------------
    def _registration(self) -> core.Registration:
        host, port = self.listen_address or (self.local_ip, 0)
        return core.Registration(host, port, self.cluster_id, self.layout, tuple(self.kv_args.aux_item_lens),
                                 self.states)

    def build_receiver_registration_message(self) -> list[bytes]:
        return [core.REGISTER_ROOM, self.local_ip.encode("ascii"), str(self.rank_port).encode("ascii"),
                self._session().encode("ascii"), self._registration().encode()]

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,  # noqa: PLR0913
                                        kv_indices: np.ndarray[Any, Any], aux_index: int | None,
                                        state_indices: list[Any] | None, decode_prefix_len: int | None,
                                        is_dummy: bool, device_kv_indices: Any = None) -> list[bytes]:
        return [str(bootstrap_room).encode("ascii"), self.local_ip.encode("ascii"),
                str(self.rank_port).encode("ascii"), self._session().encode("ascii"),
                b"" if is_dummy else np.asarray(kv_indices, dtype=np.int32).tobytes(),
                b"" if is_dummy else str(aux_index).encode("ascii"),
                str(required_dst_info_num).encode("ascii"), str(decode_prefix_len or 0).encode("ascii"),
                b"" if is_dummy or not state_indices else core.encode_state_indices(state_indices)]

    def _session(self) -> str:
        return str(NetworkAddress(self.local_ip, self.rank_port).to_host_port_str())


def _total_kv_heads(server_args: Any) -> int:
    """The model's KV heads, from its Hugging Face config (as SGLang's ModelConfig reads them)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(server_args.model_path,
                                        trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    if not heads:
        raise NotImplementedError(f"kvpush SGLang backend: no KV head count in {server_args.model_path}'s config")
    return int(heads)


class KvpushKVSender(CommonKVSender):
    """SGLang's sender; an abort on the prefill also stops the room's pushes and tells the decode."""

    supports_host_tensor_indices = False
    kv_mgr: KvpushKVManager

    def __init__(self, mgr: KvpushKVManager, bootstrap_addr: str, bootstrap_room: int, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        mgr.fail_if_aborted_by_decode(bootstrap_room)

    def abort(self) -> None:
        succeeded = self.kv_mgr.request_status.get(self.bootstrap_room) == KVPoll.Success
        super().abort()
        if not succeeded:  # a room the decode already has needs no word
            self.kv_mgr.abort_own_room(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_room(self.bootstrap_room)


class KvpushKVReceiver(CommonKVReceiver):
    """SGLang's receiver; grants a room's pages before sending them, revokes them when the room ends; the
    manager learns the room's prefill ranks from its bootstrap, and acknowledges its abort for those that are
    gone."""

    kv_mgr: KvpushKVManager
    conclude_state: KVPoll | None
    bootstrap_infos: list[dict[str, Any]] | None
    _abort_generation: int | None

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        if self.conclude_state != KVPoll.Failed and getattr(self, "bootstrap_infos", None):
            assert self.bootstrap_infos is not None
            self.kv_mgr.track_prefill(self.bootstrap_addr, self.bootstrap_infos)

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        super()._send_abort_notification(force_arm=force_arm)
        assert self.bootstrap_room is not None and self.bootstrap_infos is not None
        self.kv_mgr.armed(self.bootstrap_room, self._abort_generation, self.bootstrap_addr, self.bootstrap_infos)

    def send_metadata(self, kv_indices: np.ndarray[Any, Any], aux_index: int | None = None,  # noqa: PLR0913 (SGLang's)
                      state_indices: list[Any] | None = None, decode_prefix_len: int | None = None,
                      *args: Any, **kwargs: Any) -> None:
        if self.bootstrap_infos is not None and self.conclude_state is None:
            problem = self.kv_mgr.grant(self.bootstrap_room, self.bootstrap_infos, kv_indices, aux_index,
                                        state_indices)
            if problem is not None:
                self.kv_mgr.record_failure(self.bootstrap_room, problem)
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.conclude_state = KVPoll.Failed
                return
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, *args, **kwargs)

    def abort(self) -> None:
        self.kv_mgr.release(self.bootstrap_room)
        super().abort()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.release(self.bootstrap_room)


class KvpushKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap server, unchanged."""
