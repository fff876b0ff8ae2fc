"""What KvpushConnector reads from vLLM's objects: the settings both sides derive from the vLLM config
(``ConnectorSettings``: role, addresses, cluster id, TP place, fingerprints), the one blocks cache of a
worker's KV tensors (``cache_desc``) and a scheduler output's requests (``scheduled_requests``). Works
without vLLM or torch (any objects with the attributes vLLM's would have).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvpush import (
    AUTH_TOKEN_ENV,
    CacheDesc,
    DataType,
    LLMRole,
    is_loopback,
)

from ..families import PLAIN, Group, Groups
from . import core

_DTYPES = {"float32": DataType.DT_FLOAT, "float16": DataType.DT_FLOAT16, "bfloat16": DataType.DT_BF16,
           "int8": DataType.DT_INT8}

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

    def __init__(self, vllm_config: Any, tp_rank: int = 0, kv_cache_config: Any = None) -> None:
        transfer = vllm_config.kv_transfer_config
        self.role: str = transfer.kv_role
        if self.role not in core.ROLES:
            raise core.ParamsError(f"kv_role {self.role!r} is not one of {', '.join(core.ROLES)}")
        self.config = core.ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        self.block_size: int = int(vllm_config.cache_config.block_size)
        #: the model's KV cache groups (``families.Groups``) and which of vLLM's groups they are
        self.groups, self.group_ids, self.block_size = kv_groups(kv_cache_config, self.block_size)
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
        #: MLA: one latent per token that every rank holds whole (``core.Geometry.mla``)
        self.mla = bool(getattr(getattr(vllm_config, "model_config", None), "use_mla", False))
        self.kv_heads: int | None = 1 if self.mla else _total_kv_heads(vllm_config)
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
        self.engine_id = str(transfer.engine_id)
        self.name = f"kvpush-{self.engine_id[:8]}"
        self.dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
        self.dp_index = int(getattr(parallel, "data_parallel_index", 0) or 0)
        #: where a prefill serves the Mooncake bootstrap contract (GET /query; None: not served), and what its
        #: requests' answers name (``core.Bootstrap``)
        self.bootstrap_port: int | None = None
        self.bootstrap_host = self.listen[0] if self.listen is not None else "127.0.0.1"
        if self.produce and self.config.bootstrap_server_address is not None:
            given = core.Bootstrap(core.bootstrap_url(self.config.bootstrap_server_address))
            self.bootstrap_host, self.bootstrap_port = given.host, given.port
        elif self.produce:
            self.bootstrap_port = _bootstrap_port(self.config.bootstrap_port)
        self.bootstrap: core.Bootstrap | None = None
        if self.bootstrap_port is not None and self.listen is not None:
            self.bootstrap = core.Bootstrap.at(self.bootstrap_host, self.bootstrap_port, self.engine_id)
        self._first_port = (self.config.port if self.config.port else core.listen_port(transfer.kv_port, self.role)
                            ) if self.listen is not None else None

    def bootstrap_engines(self) -> dict[int, tuple[str, list[core.PeerAddress]]]:
        """What this instance's ``/query`` lists: every data-parallel rank's engine id (vLLM's: ``<id>_dp<r>``
        with more than one) and every tensor-parallel rank's kvpush address, by ``listen_port``'s rule."""
        assert self.listen is not None and self._first_port is not None
        first = core.PeerAddress.of(self.listen[0], self._first_port, self.config.cluster_id)
        base = self.engine_id.removesuffix(f"_dp{self.dp_index}") if self.dp_size > 1 else self.engine_id
        return {dp: (f"{base}_dp{dp}" if self.dp_size > 1 else base,
                     [first.of_rank(dp * self.tp_size + tp) for tp in range(self.tp_size)])
                for dp in range(self.dp_size)}

    def geometry(self, layers: int, local_heads: int, head_size: int, dtype: str, page: int = 0) -> core.Geometry:
        """This worker's geometry, once its KV tensors are known."""
        kv_heads = self.kv_heads or local_heads * self.tp_size
        return core.Geometry(self.model, dtype, self.block_size, head_size, layers, kv_heads, self.tp_size,
                             self.tp_rank, self.mla, self.groups, page)

    def group_blocks(self, block_ids: Any) -> tuple[tuple[int, ...], ...]:
        """vLLM's block ids of a request (one list per KV cache group) reduced to the groups that move."""
        lists = core.per_group(block_ids)
        if len(lists) == 1 or self.group_ids is None:
            return lists
        return tuple(lists[i] for i in self.group_ids)


def _bootstrap_port(configured: int | None) -> int | None:
    """The bootstrap port: the config's, else ``VLLM_MOONCAKE_BOOTSTRAP_PORT``'s (vLLM's variable), else None."""
    if configured:
        return configured
    value = os.environ.get(core.BOOTSTRAP_PORT_ENV)
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise core.ParamsError(f"{core.BOOTSTRAP_PORT_ENV}={value!r} is not a TCP port")
    return port


def kv_groups(kv_cache_config: Any, block_size: int) -> tuple[Groups, tuple[int, ...] | None, int]:
    """(the KV cache groups that move, their indices among vLLM's groups, the block size) of ``kv_cache_config``
    (vLLM's ``KVCacheConfig``; None: one full-attention group). A group kvpush cannot move is refused, named."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return PLAIN, None, block_size
    ids = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(groups))))
    found: list[Group] = []
    sizes = set()
    for index in ids:
        spec = groups[index].kv_cache_spec
        kind = type(spec).__name__
        if kind in ("FullAttentionSpec", "MLAAttentionSpec"):
            found.append(Group("full"))
            sizes.add(int(spec.block_size))
        elif kind in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
            found.append(Group.window(int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0)),
                                      int(spec.block_size)))
            sizes.add(int(spec.block_size))
        elif kind == "MambaSpec":
            found.append(Group("state", spare_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0)))
        else:
            raise NotImplementedError(f"KvpushConnector: KV cache group {index} ({kind}, layers "
                                      f"{', '.join(groups[index].layer_names[:3])}...) is not supported; full "
                                      f"attention, MLA, sliding windows and Mamba/linear-attention state are")
    if len(sizes) > 1:
        raise NotImplementedError(f"KvpushConnector: KV cache groups with block sizes {sorted(sizes)}; one block "
                                  f"size for every attention group is supported")
    return Groups(tuple(found)), ids, sizes.pop() if sizes else block_size


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


def scheduled_requests(scheduler_output: Any,
                       select: Callable[[Any], tuple[tuple[int, ...], ...]]) -> Iterable[core.Scheduled]:
    """vLLM's scheduled requests of a step; ``select`` reduces a request's block ids (one list per KV cache
    group) to the groups that move (``ConnectorSettings.group_blocks``)."""
    counts = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        yield core.Scheduled(new.req_id, select(new.block_ids), False, new.num_computed_tokens, counts[new.req_id])
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        groups = cached.new_block_ids[i]
        blocks = select(groups) if groups is not None else None
        yield core.Scheduled(req_id, blocks, req_id in cached.resumed_req_ids, cached.num_computed_tokens[i],
                             counts.get(req_id, 0))
