"""KvpushConnector: kvpush as vLLM's KV connector (``KVConnectorBase_V1``), decode first, layer by layer.

    KVTransferConfig(kv_connector="KvpushConnector", kv_connector_module_path="kvpush.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both", kv_connector_extra_config={...})

A prefill instance (``kv_producer``) listens on ``VLLM_HOST_IP`` (or 127.0.0.1) at ``kv_port``; a
decode instance (``kv_consumer``) dials the prefill named in a request's ``kv_transfer_params``: by
``remote_host``/``remote_port`` (kvpush proxy, vllm-router's prefill-first mode) or by ``remote_bootstrap_addr``
and ``remote_engine_id`` (the Mooncake contract: vllm-router's and llm-d's ``--kv-connector mooncake``, Dynamo),
which a prefill with ``bootstrap_port`` serves (``bootstrap``); a request that names none is refused, never
guessed. ``kv_connector_extra_config``
takes ``..config.ConnectorConfig``'s keys (other hosts, transport, auth token, deadlines). With tensor
parallelism every worker rank runs its own kvpush engine (rank ``r`` listening on ``port + 2 * r``) and
pushes its own KV heads; prefill and decode may use different TP sizes (``..topology``).

Every model family moves (``SupportsHMA``: vLLM's hybrid KV cache manager stays on): MLA's latent as it is,
sliding-window groups only the blocks of their window, Mamba and linear-attention state its one block per
request, after a prompt the prefill computes but its last token (which the decode computes from the state);
see ``families``. Such a model shares each block of memory between its groups' layers, so the worker
registers the distinct layer slots, one page per block, and its instances exchange KV between equal TP sizes.

This module is the thin part: it translates vLLM's hooks into calls on the scheduler book of
``core`` and on ``worker.WorkerSide`` (the worker's books and ``bridge.EngineBridge``, which runs
every kvpush call on one private event-loop thread); both are vLLM-free. Only host (CPU) KV caches
are supported: a CUDA cache is refused with the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

try:  # vLLM's hybrid KV cache manager (one block list per KV cache group): 0.10 on
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
        SupportsHMA,
    )
except ImportError:  # pragma: no cover - a vLLM without it
    class SupportsHMA:  # type: ignore[no-redef]
        pass
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from . import core
from .bootstrap import BootstrapResolver, BootstrapServer
from .fleet import fleet_member
from .settings import ConnectorSettings, scheduled_requests
from .worker import WorkerSide

log = logging.getLogger(__name__)

try:  # where vLLM's metrics say external hits come from (0.32: CacheHitSource.P2P)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found, unused-ignore]

    _P2P: Any = CacheHitSource.P2P
except ImportError:  # pragma: no cover - a vLLM without the enum
    _P2P = None


class KvpushMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """One step's ``core.StepMeta``, in vLLM's metadata type."""

    def __init__(self, step: core.StepMeta) -> None:
        self.step = step

    def __repr__(self) -> str:
        s = self.step
        return (f"KvpushMetadata(recv={len(s.recv)}, recv_aborted={len(s.recv_aborted)}, send={len(s.send)}, "
                f"send_finished={len(s.send_finished)})")


class KvpushWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc, unused-ignore]
    """What the workers tell the scheduler after a step: the transfers whose decode's block ids came
    before their request ran (transfer id -> worker ranks that said so; vLLM sums the ranks' with
    ``aggregate``)."""

    def __init__(self, ids_in: dict[str, int]) -> None:
        self.ids_in = ids_in

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvpushWorkerMeta:
        for transfer_id, ranks in getattr(other, "ids_in", {}).items():
            self.ids_in[transfer_id] = self.ids_in.get(transfer_id, 0) + ranks
        return self

    def __repr__(self) -> str:
        return f"KvpushWorkerMeta(ids_in={len(self.ids_in)})"


#: the stop reason of a prefill's answer computed without the prompt's last token (a model with a recurrent state)
SHORT_STOP_REASON = "kvpush: the decode computes the prompt's last token (recurrent state)"


def _log_like_vllm() -> None:
    """kvpush's log lines (links, transfers, failures) in vLLM's format and level, once per process,
    unless the application configured the ``kvpush`` logger itself."""
    ours, theirs = logging.getLogger("kvpush"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 without a TP group, e.g. in a unit test)."""
    try:
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
            get_tensor_model_parallel_rank,
        )

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        return 0


def _layer_order(kv_caches: dict[str, Any]) -> Callable[[str], tuple[int, str]]:
    try:
        from vllm.model_executor.models.utils import extract_layer_index  # type: ignore[import-not-found, unused-ignore]
    except ImportError:  # pragma: no cover - vLLM moved it: keep vLLM's own order
        order = {name: i for i, name in enumerate(kv_caches)}
        return lambda name: (order[name], name)

    def key(name: str) -> tuple[int, str]:
        try:
            return int(extract_layer_index(name)), name
        except (AssertionError, ValueError):
            return len(kv_caches), name
    return key


def _layer_slots(names: list[str], kv_caches: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """A hybrid model's layers by the memory they share (vLLM gives the layers of different KV cache groups
    views of the same bytes, a block owned by one group at a time): each layer's slot, and each slot's
    ``[num_blocks, page]`` bytes, one page per block (a Mamba layer's view covers only its state, not the
    padding that makes its page as large as an attention layer's)."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    slots: dict[int, int] = {}
    slot_of: list[int] = []
    pages: list[Any] = []
    for name in names:
        tensor = kv_caches[name]
        if isinstance(tensor, (list, tuple)):
            raise NotImplementedError(f"KvpushConnector: layer {name} registers {len(tensor)} tensors; one view of "
                                      f"its blocks per layer is supported")
        pointer = int(tensor.data_ptr())
        if pointer not in slots:
            slots[pointer] = len(pages)
            page = int(tensor.stride(0)) * int(tensor.element_size())
            pages.append(torch.empty(0, dtype=torch.int8, device=tensor.device).set_(
                tensor.untyped_storage(), int(tensor.storage_offset()) * int(tensor.element_size()),
                (int(tensor.shape[0]), page), (page, 1)))
        slot_of.append(slots[pointer])
    return slot_of, pages


# -- metrics ---------------------------------------------------------------------------------------

# counters: what ended since the last step, by (book, its counter) -> the reported key
_COUNTERS = {("producer", "landed"): "send_landed", ("producer", "failed"): "send_failed",
             ("producer", "blocks_pushed"): "blocks_pushed", ("producer", "bytes_pushed"): "bytes_pushed",
             ("consumer", "landed"): "receive_landed",
             ("consumer", "failed"): "receive_failed", ("consumer", "aborted"): "receive_aborted",
             ("producer", "pushes_pipelined"): "pushes_in_forward",
             ("producer", "pushes_after_forward"): "pushes_after_forward"}
_PUSHES = {"pushes_in_forward": "in_forward", "pushes_after_forward": "after_forward"}
_GAUGES = ("open", "links", "held_caches")


@dataclass
class KvpushStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]
    """One step's kvpush numbers (``data``: plain ints): the counters of ``_COUNTERS`` as deltas and the
    gauges of ``_GAUGES`` as values. ``aggregate`` sums (the tensor-parallel workers of a step); vLLM's log
    line shows the counters."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {key: 0 for key in (*_COUNTERS.values(), *_GAUGES)}

    def aggregate(self, other: KVConnectorStats) -> KvpushStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data.get(key, 0) for key in _COUNTERS.values()}

    def is_empty(self) -> bool:
        return not any(self.data.get(key, 0) for key in _COUNTERS.values())


class KvpushPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc, unused-ignore]
    """kvpush's numbers in vLLM's /metrics: ``vllm:kvpush_transfers_open`` (transfers this instance's
    connector tracks), ``vllm:kvpush_links`` (live kvpush links), ``vllm:kvpush_held_caches`` (caches kept
    pinned for links that closed), each as of the engine's last step; counters
    ``vllm:kvpush_transfers_total{side,outcome}``, ``vllm:kvpush_blocks_pushed_total``,
    ``vllm:kvpush_bytes_pushed_total`` and
    ``vllm:kvpush_pushes_total{when}`` (``in_forward``, ``after_forward``)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._values = per_engine_labelvalues
        docs = {"open": "KV transfers the kvpush connector tracks (as of the engine's last step)",
                "links": "live kvpush links of this instance (as of the engine's last step)",
                "held_caches": "caches kvpush keeps pinned for links that closed while their peer might still "
                               "write (as of the engine's last step)"}
        names = {"open": "vllm:kvpush_transfers_open", "links": "vllm:kvpush_links",
                 "held_caches": "vllm:kvpush_held_caches"}
        gauge: Any = self._gauge_cls
        counter: Any = self._counter_cls
        self._gauges: dict[str, Any] = {key: gauge(name=names[key], documentation=docs[key], labelnames=labelnames,
                                                   multiprocess_mode="mostrecent") for key in _GAUGES}
        self._transfers: Any = counter(name="vllm:kvpush_transfers", labelnames=[*labelnames, "side", "outcome"],
                                       documentation="kvpush transfers ended, by side (send: prefill, receive: "
                                                     "decode) and outcome")
        self._bytes: Any = counter(name="vllm:kvpush_bytes_pushed", labelnames=labelnames,
                                   documentation="bytes of KV pushed to decode instances (every layer of every block "
                                                 "a push was asked to move)")
        self._blocks: Any = counter(name="vllm:kvpush_blocks_pushed", labelnames=labelnames,
                                    documentation="KV blocks pushed to decode instances (per layer group)")
        self._pushes: Any = counter(name="vllm:kvpush_pushes", labelnames=[*labelnames, "when"],
                                    documentation="pushes of a prefill's KV to decode instances, by when: in_forward "
                                                  "(each layer as the forward computed it) or after_forward (the "
                                                  "decode's block ids came too late for that)")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self._values[engine_idx]
        for key in _GAUGES:
            self._gauges[key].labels(*labels).set(transfer_stats_data.get(key, 0))
        for key in _COUNTERS.values():
            value = transfer_stats_data.get(key, 0)
            if value and key in _PUSHES:
                self._pushes.labels(*labels, _PUSHES[key]).inc(value)
            elif value and key not in ("blocks_pushed", "bytes_pushed"):
                side, outcome = key.split("_", 1)
                self._transfers.labels(*labels, side, outcome).inc(value)
        if transfer_stats_data.get("blocks_pushed"):
            self._blocks.labels(*labels).inc(transfer_stats_data["blocks_pushed"])
        if transfer_stats_data.get("bytes_pushed"):
            self._bytes.labels(*labels).inc(transfer_stats_data["bytes_pushed"])


# -- the connector ---------------------------------------------------------------------------------

class KvpushConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, unused-ignore]
    """kvpush's vLLM KV connector; see the module docstring. Hook by hook:

    scheduler: ``on_new_request`` notes ``kv_transfer_params``; ``get_num_new_matched_tokens``
    claims a decode request's prompt as loaded asynchronously, and holds a prefill request whose decode
    sends block ids (None: vLLM asks again next step) until the workers reported them in
    (``update_connector_output`` reads ``KvpushWorkerMeta``) or ``ids_wait_ms`` passed;
    ``update_state_after_alloc`` turns the allocated blocks into the worker's RecvSpec;
    ``build_connector_meta`` adds every prefill request computing prompt tokens this step (SendStep);
    ``request_finished`` delays freeing a prefill request's blocks until ``finished_sending`` and tells
    the worker; ``update_connector_output`` clears what the workers reported.

    worker: ``register_kv_caches`` starts the kvpush engine and registers the layer tensors in
    place; ``bind_connector_metadata`` sends block ids (decode) and prepares this step's layer
    pushers (prefill); ``save_kv_layer`` pushes that layer; ``wait_for_save`` finishes the step's
    pushers (missing layers included) and serves late block ids; ``get_transfer_results`` reports
    landed transfers (finished_recving), failed ones (failed_recving, with their blocks in
    ``get_block_ids_with_load_errors``) and settled prefill requests (finished_sending);
    ``build_connector_worker_meta`` tells the scheduler which transfers' block ids came before their request.

    Block zeroing (``needs_kv_cache_zeroing``: a model with Mamba layers, whose pages other groups reuse):
    vLLM skips the loaded groups' blocks (``get_loaded_kv_cache_group_ids``), and a transfer fills each of
    them whole with the prefill's block, which vLLM zeroed before the prefill wrote into it.
    """

    if _P2P is not None:
        _cache_hit_source = _P2P

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        self._settings = ConnectorSettings(vllm_config, 0 if role == KVConnectorRole.SCHEDULER else _tp_rank(),
                                           kv_cache_config)
        self._scheduler: core.SchedulerBook | None = None
        self._worker: WorkerSide | None = None
        self._reported: dict[str, int] = {}  # the counters as of the last get_kv_connector_stats
        s = self._settings
        if role == KVConnectorRole.SCHEDULER and s.consume and s.load_failure_policy == "fail":
            log.warning("KvpushConnector: this decode runs with kv_load_failure_policy='fail': a request whose "
                        "prefill dies after accepting it fails (HTTP 500) instead of being computed here. Set "
                        "\"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config (what a deployment "
                        "should run with)")
        self._fleet = None
        self._bootstrap: BootstrapServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            resolver = BootstrapResolver(s.config.link_timeout_ms / 1e3) if s.consume else None
            self._scheduler = core.SchedulerBook(s.block_size, s.produce, s.consume, s.local, resolver, s.name,
                                                 core.IdsHold(s.config.ids_wait_ms / 1e3, time.monotonic, s.tp_size),
                                                 s.groups, s.bootstrap)
            if s.bootstrap_port is not None and s.listen is not None and s.dp_index == 0:
                self._bootstrap = BootstrapServer(s.bootstrap_host, s.bootstrap_port, s.bootstrap_engines())
                self._bootstrap.start()
            self._fleet = fleet_member(s, vllm_config, self._scheduler.has_pending_push_work)
        else:
            self._worker = WorkerSide(s)

    # -- scheduler side ----------------------------------------------------------------------------
    def _book(self) -> core.SchedulerBook:
        assert self._scheduler is not None, "a scheduler hook called on the worker's connector"
        return self._scheduler

    def on_new_request(self, request: Any) -> None:
        self._stop_short(request)
        self._book().on_new_request(request.request_id, request.kv_transfer_params, request.num_prompt_tokens)

    def _stop_short(self, request: Any) -> None:
        """A prefill request of a model with a recurrent state computes its prompt but the last token, once:
        the decode computes that token from the state (a state cannot be rewound to recompute it)."""
        params = request.kv_transfer_params
        if not (self._settings.produce and self._settings.groups.backoff and params
                and params.get("do_remote_decode") and not params.get("_kvpush_short")
                and request.num_prompt_tokens > 1 and request.prompt_token_ids is not None):
            return
        request.prompt_token_ids.pop()
        request._all_token_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvpush_short"] = True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        book = self._book()
        if book.transfer_id(request.request_id) is None and request.kv_transfer_params:
            self._stop_short(request)
            book.on_new_request(request.request_id, request.kv_transfer_params, request.num_prompt_tokens)
        return book.matched_tokens(request.request_id, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        self._book().after_alloc(request.request_id, self._settings.group_blocks(blocks.get_block_ids()),
                                 num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        groups = getattr(self._kv_cache_config, "transfer_group_ids", None)
        return tuple(groups) if groups is not None else super().get_loaded_kv_cache_group_ids(request)

    def build_connector_meta(self, scheduler_output: Any) -> KvpushMetadata:
        return KvpushMetadata(self._book().build_step(scheduled_requests(scheduler_output, self._settings.group_blocks),
                                                      scheduler_output.total_num_scheduled_tokens > 0))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvpushWorkerMeta):
            self._book().ids_in(meta.ids_in)
        self._book().connector_output(connector_output.finished_sending or (),
                                      connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus  # type: ignore[import-not-found, unused-ignore]

        ok = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        params = request.kv_transfer_params
        if ok and params and params.get("_kvpush_short"):
            # Its one token follows the prompt but its last token: the answer says so (its stop reason), and no
            # router may stream it as the answer's first (kvrouter's ``first_token.lead_of`` does not).
            request.stop_reason = SHORT_STOP_REASON
        return self._book().request_finished(request.request_id, ok)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager's ``request_finished``: every group's blocks are kept, or not, alike."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # -- worker side -------------------------------------------------------------------------------
    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker hook called on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        names = sorted(kv_caches, key=_layer_order(kv_caches))
        if self._settings.groups.plain:
            self._work().register(names, [kv_caches[name] for name in names])
            return
        slot_of, pages = _layer_slots(names, kv_caches)
        self._work().register(names, pages, slot_of)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvpushMetadata):
            self._work().begin_step(connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # pushes land by themselves; the request waits in WAITING_FOR_REMOTE_KVS

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._work().layer_saved(layer_name)

    def wait_for_save(self) -> None:
        self._work().end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._work().results()
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> KvpushWorkerMeta | None:
        ids_in = self._work().take_ids_in()
        return KvpushWorkerMeta(dict.fromkeys(ids_in, 1)) if ids_in else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._work().take_load_errors()
        # with several KV cache groups vLLM takes failed requests only (``failed_recving``), never block ids
        return errors if self._settings.groups.plain else set()

    def get_kv_connector_stats(self) -> KvpushStats | None:
        """This step's counters (since the last call) and gauges, for vLLM's metrics (worker side only)."""
        if self._worker is None or self._worker.engine is None:
            return None
        counters = self._worker.stats()
        data = {key: counters.get(f"{book}.{name}", 0) - self._reported.get(f"{book}.{name}", 0)
                for (book, name), key in _COUNTERS.items()}
        self._reported = counters
        data.update(self._worker.gauges())
        return KvpushStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvpushStats:
        return KvpushStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvpushPromMetrics:
        return KvpushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def stats(self) -> dict[str, int]:
        """This worker's counters: pushes pipelined or after the forward, blocks pushed, transfers
        landed/failed/released (prefill side); ids sent, landed, failed, aborted (decode side)."""
        return self._worker.stats() if self._worker is not None else {}

    def shutdown(self) -> None:
        if self._bootstrap is not None:
            self._bootstrap.close()
            self._bootstrap = None
        if self._fleet is not None:
            self._fleet.close()
            self._fleet = None
        if self._worker is not None:
            self._worker.close()
