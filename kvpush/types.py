"""Public value types: enums, cache descriptors, cache keys, cluster info, KvCacheExtParam.

Everything here is plain data with argument checks; nothing does I/O. Checks follow the SPEC's
error classes: a wrong Python type raises ``TypeError``, an integer outside its type's range
raises ``ValueError``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

U64_MAX = (1 << 64) - 1


class LLMRole(IntEnum):
    """A label for an engine; it never restricts who may push or pull."""

    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(IntEnum):
    HOST = 0
    DEVICE = 1


class DataType(IntEnum):
    """LLM-DataDist's data types (same numbers)."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        """Bytes per element (BF16: 2)."""
        return _ITEMSIZE[self]

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The numpy dtype used for views of this type (BF16 is viewed as uint16)."""
        return np.dtype(_NUMPY_NAME[self])


_NUMPY_NAME: dict[DataType, str] = {
    DataType.DT_FLOAT: "float32",
    DataType.DT_FLOAT16: "float16",
    DataType.DT_INT8: "int8",
    DataType.DT_INT32: "int32",
    DataType.DT_UINT8: "uint8",
    DataType.DT_INT16: "int16",
    DataType.DT_UINT16: "uint16",
    DataType.DT_UINT32: "uint32",
    DataType.DT_INT64: "int64",
    DataType.DT_UINT64: "uint64",
    DataType.DT_DOUBLE: "float64",
    DataType.DT_BOOL: "bool",
    DataType.DT_BF16: "uint16",
}
_ITEMSIZE: dict[DataType, int] = {dt: np.dtype(name).itemsize for dt, name in _NUMPY_NAME.items()}


def check_int(name: str, value: object, lo: int = 0, hi: int = U64_MAX) -> int:
    """``value`` as an int in [lo, hi]: TypeError for a non-int (bool included), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    number = int(value)
    if not lo <= number <= hi:
        raise ValueError(f"{name}={number} is out of range [{lo}, {hi}]")
    return number


class CacheDesc:
    """``num_tensors`` tensors of one ``shape`` and ``data_type``; ``shape[0]`` is the block (or
    batch) dimension. ``size`` is the bytes of one tensor, ``block_bytes`` the bytes of one block."""

    def __init__(
        self,
        num_tensors: int,
        shape: Sequence[int],
        data_type: DataType,
        placement: Placement = Placement.HOST,
    ) -> None:
        self.num_tensors = check_int("num_tensors", num_tensors, 0, 1 << 31)
        if not isinstance(shape, (list, tuple)):
            raise TypeError(f"shape must be a list or tuple of int, got {type(shape).__name__}")
        self.shape = tuple(check_int(f"shape[{i}]", dim, 0, 1 << 48) for i, dim in enumerate(shape))
        if not isinstance(data_type, DataType):
            if isinstance(data_type, int) and not isinstance(data_type, bool):
                data_type = DataType(data_type)
            else:
                raise TypeError(f"data_type must be a DataType, got {type(data_type).__name__}")
        self.data_type = data_type
        if not isinstance(placement, Placement):
            if isinstance(placement, int) and not isinstance(placement, bool):
                placement = Placement(placement)
            else:
                raise TypeError(f"placement must be a Placement, got {type(placement).__name__}")
        self.placement = placement

    @property
    def size(self) -> int:
        """Bytes of one tensor."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.data_type.itemsize

    @property
    def num_blocks(self) -> int:
        """``shape[0]``: blocks (or batch slots) per tensor."""
        return self.shape[0] if self.shape else 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one tensor (``size // shape[0]``)."""
        return self.size // self.shape[0] if self.shape and self.shape[0] else 0

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self.num_tensors}, shape={list(self.shape)}, "
            f"data_type={self.data_type.name}, placement={self.placement.name})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheDesc) and (
            self.num_tensors,
            self.shape,
            self.data_type,
            self.placement,
        ) == (other.num_tensors, other.shape, other.data_type, other.placement)

    def __hash__(self) -> int:
        return hash((self.num_tensors, self.shape, self.data_type, self.placement))


@dataclass(eq=False)
class Cache:
    """A registered cache. ``tensors`` are numpy views of the registered memory, one per tensor."""

    cache_id: int
    cache_desc: CacheDesc
    tensor_addrs: list[int]
    is_blocks_cache: bool
    tensors: list[np.ndarray[Any, Any]] = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        kind = "blocks" if self.is_blocks_cache else "contiguous"
        return f"Cache(cache_id={self.cache_id}, {kind}, {self.cache_desc!r})"


class BlocksCacheKey:
    """Names a blocks cache: at registration ``model_id`` names it (``cluster_id`` is ignored);
    at transfer time ``cluster_id`` picks the linked peer and ``model_id`` that peer's cache."""

    def __init__(
        self,
        cluster_id: int | None = None,
        model_id: int = 0,
        *,
        prompt_cluster_id: int | None = None,
    ) -> None:
        if cluster_id is not None and prompt_cluster_id is not None:
            raise TypeError("give cluster_id or prompt_cluster_id, not both")
        chosen = prompt_cluster_id if cluster_id is None else cluster_id
        self.cluster_id = check_int("cluster_id", 0 if chosen is None else chosen)
        self.model_id = check_int("model_id", model_id)

    @property
    def prompt_cluster_id(self) -> int:
        """LLM-DataDist's name for ``cluster_id``."""
        return self.cluster_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey(cluster_id={self.cluster_id}, model_id={self.model_id})"


class CacheKeyByIdAndIndex:
    """Addresses a peer's cache by its cache id (the C++ ``CacheIndex``)."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self.cluster_id = check_int("cluster_id", cluster_id)
        self.cache_id = check_int("cache_id", cache_id, 0, (1 << 63) - 1)
        self.batch_index = check_int("batch_index", batch_index)

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self.cluster_id}, cache_id={self.cache_id}, "
            f"batch_index={self.batch_index})"
        )


def check_ip(name: str, ip: object) -> str:
    """A literal IPv4/IPv6 address (or an IPv4 as int, as LLM-DataDist accepts) or a host name."""
    if isinstance(ip, bool):
        raise TypeError(f"{name} must be a str or int, got bool")
    if isinstance(ip, int):
        return str(ipaddress.IPv4Address(check_int(name, ip, 0, (1 << 32) - 1)))
    if not isinstance(ip, str):
        raise TypeError(f"{name} must be a str or int, got {type(ip).__name__}")
    text = ip.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text:
        raise ValueError(f"{name} is empty")
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        if all(part.isalnum() or part == "-" for part in text.replace(".", " ").split()):
            return text  # a host name such as "localhost"
        raise ValueError(f"{name}={ip!r} is not an IP address or host name") from None


class LLMClusterInfo:
    """A peer to link to: its cluster id and the addresses it listens on."""

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self.local_ip_info: list[tuple[str, int]] = []
        self.remote_ip_info: list[tuple[str, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """The peer's cluster id (required before linking)."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = check_int("remote_cluster_id", value)

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Accepted for LLM-DataDist compatibility: kvpush picks the local address per connection."""
        self.local_ip_info.append((check_ip("ip", ip), check_int("port", port, 0, 65535)))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """An address the peer listens on (IPv4, IPv6 or host name); tried in order when linking."""
        self.remote_ip_info.append((check_ip("ip", ip), check_int("port", port, 1, 65535)))

    def __repr__(self) -> str:
        return f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, remote={self.remote_ip_info})"


class KvCacheExtParam:
    """Layer selection for the status-returning forms: inclusive ``(first, second)`` pairs,
    ``(-1, -1)`` meaning all layers."""

    def __init__(
        self,
        src_layer_range: tuple[int, int] = (-1, -1),
        dst_layer_range: tuple[int, int] = (-1, -1),
        tensor_num_per_layer: int = 2,
    ) -> None:
        self.src_layer_range = _pair("src_layer_range", src_layer_range)
        self.dst_layer_range = _pair("dst_layer_range", dst_layer_range)
        self.tensor_num_per_layer = check_int("tensor_num_per_layer", tensor_num_per_layer, 0, 1 << 31)

    def __repr__(self) -> str:
        return (
            f"KvCacheExtParam(src_layer_range={self.src_layer_range}, "
            f"dst_layer_range={self.dst_layer_range}, tensor_num_per_layer={self.tensor_num_per_layer})"
        )


def _pair(name: str, value: object) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a (first, second) pair of int")
    return (check_int(f"{name}[0]", value[0], -1), check_int(f"{name}[1]", value[1], -1))
