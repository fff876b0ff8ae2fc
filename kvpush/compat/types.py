"""LLM-DataDist's value types where they differ from kvpush's, and the ones kvpush's core has no use for.

``CacheDesc``, ``BlocksCacheKey`` and ``CacheKey`` are kvpush's own (so the engine takes them as they
are) with LLM-DataDist's constructors: ``CacheDesc``'s placement defaults to DEVICE, ``BlocksCacheKey()``
without a cluster id is an error, ``CacheKey`` needs a cluster id and a req_id. The rest (``KvCache``,
``RegisterMemStatus``, ``Memtype``, ``MemInfo``, ``Status``) follow LLM-DataDist's definitions (package
``llm_datadist``, ``v2/llm_types.py`` and ``status.py``): same names, arguments, defaults, checks and
error classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

import kvpush
from kvpush import DataType, LLMException, LLMStatusCode, Placement

U64_MAX = (1 << 64) - 1
INVALID_ID = U64_MAX  # LLM-DataDist's "no id" (req_id / prefix_id)


def check_uint(name: str, value: object, bits: int) -> int:
    """LLM-DataDist's check_uint32/64: TypeError for a non-int, ValueError outside the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} only support ['int'], but got {type(value)}.")
    if not 0 <= value < (1 << bits):
        raise ValueError(f"{name}'s value is out of range,{value} is not a uint{bits} value.")
    return value


def require(condition: bool, message: str, code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID) -> None:
    """LLM-DataDist's raise_if_false: LLMException(message, status_code=LLM_PARAM_INVALID)."""
    if not condition:
        raise LLMException(message, status_code=code)


class CacheDesc(kvpush.CacheDesc):
    """LLM-DataDist's ``CacheDesc``: ``placement`` defaults to ``Placement.DEVICE``. On a host without an
    accelerator DEVICE memory is host memory: the placement is passed to the engine as given."""

    def __init__(self, num_tensors: int, shape: Sequence[int], data_type: DataType,
                 placement: Placement = Placement.DEVICE, batch_dim_index: int = 0, seq_len_dim_index: int = -1,
                 kv_tensor_format: str | None = None) -> None:
        check_uint("num_tensors", num_tensors, 32)
        if not isinstance(shape, (list, tuple)) or any(isinstance(d, bool) or not isinstance(d, int) for d in shape):
            raise TypeError(f"shape only support ['tuple', 'list'] of int, but got {shape!r}.")
        if not isinstance(data_type, DataType):
            raise TypeError(f"data_type only support ['DataType'], but got {type(data_type)}.")
        if not isinstance(placement, Placement):
            raise TypeError(f"placement only support ['Placement'], but got {type(placement)}.")
        if isinstance(batch_dim_index, bool) or not isinstance(batch_dim_index, int):
            raise TypeError(f"batch_dim_index only support ['int'], but got {type(batch_dim_index)}.")
        require(0 <= batch_dim_index < len(shape), f"batch_dim_index {batch_dim_index} out of range, [0, {len(shape)})")
        require(seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
                f"seq_len_dim_index {seq_len_dim_index} is invalid, should be -1 or in range [0, {len(shape)})")
        super().__init__(num_tensors, shape, data_type, placement, batch_dim_index, seq_len_dim_index,
                         kv_tensor_format)


class BlocksCacheKey(kvpush.BlocksCacheKey):
    """LLM-DataDist's ``BlocksCacheKey(cluster_id, model_id=0)`` (also ``prompt_cluster_id=``): the cluster id
    is required (``BlocksCacheKey()`` raises LLMException(LLM_PARAM_INVALID)), at most two arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require(len(args) + len(kwargs) <= 2, "Param num is over limit")
        if len(args) > 0:
            kwargs["cluster_id"] = args[0]
        if len(args) > 1:
            kwargs["model_id"] = args[1]
        require("prompt_cluster_id" in kwargs or "cluster_id" in kwargs,
                "Param prompt_cluster_id or cluster_id is required")
        for key in kwargs:
            require(key in ("prompt_cluster_id", "cluster_id", "model_id"), f"Unsupported param:{key}")
        cluster_id = kwargs["cluster_id"] if "cluster_id" in kwargs else kwargs["prompt_cluster_id"]
        model_id = kwargs.get("model_id", 0)
        for name, value, which in (("cluster_id", cluster_id, "first"), ("model_id", model_id, "second")):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"The {which} param {name} only support ['int'], but got {type(value)}.")
        super().__init__(cluster_id, model_id)


class CacheKey(kvpush.CacheKey):
    """LLM-DataDist's ``CacheKey(cluster_id, req_id, model_id=0, prefix_id=2**64-1)`` (also
    ``prompt_cluster_id=``): ``cluster_id`` and ``req_id`` are required, at most four arguments, each a
    uint64. It is kvpush's own ``CacheKey`` (the engine takes it as it is): given to ``allocate_cache`` /
    ``register_cache`` it names the caller's batch slots, given to ``pull_cache`` / ``pull_blocks`` the
    peer's slot."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require(len(args) + len(kwargs) <= 4, "Param num is over limit")
        for index, name in enumerate(("cluster_id", "req_id", "model_id", "prefix_id")[:len(args)]):
            kwargs[name] = args[index]
        require("prompt_cluster_id" in kwargs or "cluster_id" in kwargs,
                "Param prompt_cluster_id or cluster_id is required")
        require("req_id" in kwargs, "Param req_id is required")
        for key in kwargs:
            require(key in ("prompt_cluster_id", "cluster_id", "req_id", "model_id", "prefix_id"),
                    f"Unsupported param:{key}")
        cluster_id = check_uint("cluster_id", kwargs.get("cluster_id", kwargs.get("prompt_cluster_id")), 64)
        super().__init__(cluster_id, check_uint("req_id", kwargs["req_id"], 64),
                         check_uint("model_id", kwargs.get("model_id", 0), 64),
                         check_uint("prefix_id", kwargs.get("prefix_id", INVALID_ID), 64))

    def check_one_id(self) -> None:
        """Exactly one of req_id and prefix_id is a valid id (LLM-DataDist's rule for addressing a slot)."""
        check_one_id(self)


def check_one_id(key: kvpush.CacheKey) -> None:
    """LLM-DataDist's ``check_cache_key``: LLMException(LLM_PARAM_INVALID) unless exactly one of the key's
    req_id and prefix_id is a valid id."""
    valid = [value != INVALID_ID for value in (key.req_id, key.prefix_id)]
    require(any(valid), f"one of req id and prefix id should contain valid value:[0, 2**64-1), "
                        f"req id:{key.req_id},prefix id:{key.prefix_id}.")
    require(not all(valid), f"only one of req id and prefix id should contain valid value:[0, 2**64-1), "
                            f"req id:{key.req_id}, prefix id:{key.prefix_id}.")


class KvCache:
    """LLM-DataDist's v1 ``KvCache`` (per-device tensor addresses). kvpush runs in CacheManager mode only,
    so no kvpush call takes one; it is here so programs that import or build it keep working."""

    def __init__(self, cache_id: int, cache_desc: kvpush.CacheDesc, per_device_tensor_addrs: list[list[int]],
                 kv_cache_manager: object = None) -> None:
        if isinstance(cache_id, bool) or not isinstance(cache_id, int):
            raise TypeError(f"cache_id only support ['int'], but got {type(cache_id)}.")
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._per_device_tensor_addrs = per_device_tensor_addrs
        self._kv_cache_manager = kv_cache_manager

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> kvpush.CacheDesc:
        return self._cache_desc

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        return self._per_device_tensor_addrs

    def __repr__(self) -> str:
        return f"KvCache(cache_id = {self._cache_id}, num_devices = {len(self._per_device_tensor_addrs)})"

    @classmethod
    def create_cpu_cache(cls, cache_desc: kvpush.CacheDesc, addrs: list[int] | list[list[int]]) -> KvCache:
        if not isinstance(cache_desc, kvpush.CacheDesc):
            raise TypeError(f"cache_desc only support ['CacheDesc'], but got {type(cache_desc)}.")
        require(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        if not isinstance(addrs, list):
            raise TypeError(f"addrs only support ['list'], but got {type(addrs)}.")
        require(len(addrs) > 0, "addrs length should be bigger than zero.")
        nested = isinstance(addrs[0], list)
        for addr in addrs:
            if isinstance(addr, bool) or not isinstance(addr, (list, int)):
                raise TypeError(f"the internal element of addrs only support ['list', 'int'], but got {type(addr)}.")
            require(isinstance(addr, list) == nested, "the type of the internal element of addrs should be consistent.")
            if isinstance(addr, list):
                require(cache_desc.num_tensors == len(addr), f"cache_desc num_tensors:{cache_desc.num_tensors} "
                                                             f"should be equal to size of the internal element of "
                                                             f"addrs:{len(addr)}")
        if not nested:
            require(cache_desc.num_tensors == len(addrs),
                    f"cache_desc num_tensors:{cache_desc.num_tensors} should be equal to size of addrs:{len(addrs)}")
        per_device: list[list[int]] = addrs if nested else [addrs]  # type: ignore[assignment, list-item]
        return cls(-1, cache_desc, per_device, None)


class RegisterMemStatus(Enum):
    """What ``LLMDataDist.query_register_mem_status(comm_id)`` reports about a rank-table link."""

    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(Enum):
    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class MemInfo:
    """A memory range for ``CacheManager.remap_registered_memory``."""

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        if not isinstance(mem_type, Memtype):
            raise TypeError(f"mem_type only support ['Memtype'], but got {type(mem_type)}.")
        for name, value in (("addr", addr), ("size", size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} only support ['int'], but got {type(value)}.")
        self._mem_type, self._addr, self._size = mem_type, addr, size

    @property
    def mem_type(self) -> Memtype:
        return self._mem_type

    @property
    def addr(self) -> int:
        return self._addr

    @property
    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self.mem_type}, addr={self.addr}, size={self.size})"


class Status:
    """LLM-DataDist's ``Status``: a status code with ``is_ok()``."""

    def __init__(self, status: LLMStatusCode) -> None:
        self._status_code = status

    def is_ok(self) -> bool:
        return bool(self._status_code == LLMStatusCode.LLM_SUCCESS)

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code
