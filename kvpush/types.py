"""Public value types: enums, cache descriptors, cache keys, cluster info, KvCacheExtParam.

Everything here is plain data with argument checks; nothing does I/O. Checks follow the SPEC's
error classes: a wrong Python type raises ``TypeError``, an integer outside its type's range
raises ``ValueError``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

U64_MAX = (1 << 64) - 1


class _NamedIntEnum(IntEnum):
    """``str()`` is ``"ClassName.MEMBER"``, as LLM-DataDist's enums print; ``int()`` gives the number."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class RemoteAccess(Enum):
    """What linked peers may do with a registered cache (kvpush's own; LLM-DataDist's model is ``OPEN``).

    ``OPEN``: any linked peer may read and write it (unless ``llm.EnableRemoteCacheAccessible`` is 0).
    ``GRANTED``: a peer may write (or read) only the blocks this side granted to it with
    ``CacheManager.allow``, while the grant lasts; one-sided transports whose remote keys open a whole
    registration (UCX) are not given any for it, so its bytes go in the link's stream, checked on arrival.
    ``PRIVATE``: peers neither see it in the cache table nor reach it."""

    OPEN = "open"
    GRANTED = "granted"
    PRIVATE = "private"


class LLMRole(_NamedIntEnum):
    """A label for an engine; it never restricts who may push or pull."""

    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(_NamedIntEnum):
    """Where a cache's memory lives. kvpush moves host memory; see ``CacheDesc``."""

    HOST = 0
    DEVICE = 1


class DataType(_NamedIntEnum):
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
    batch) dimension. ``size`` is the bytes of one tensor, ``block_bytes`` the bytes of one block.

    LLM-DataDist's descriptor fields are kept: ``batch_dim_index`` (which dimension indexes blocks or
    batch slots, ``batch_dim``; its length is ``batch_size``), ``seq_len_dim_index`` (-1: none) and
    ``kv_tensor_format`` (a label, e.g. ``"BSH"``), and ``update_dim(i, n)`` changes one dimension.
    kvpush's transfers address blocks and batch slots along dimension 0, so a cache whose
    ``batch_dim_index`` is not 0 can be described but is refused (LLM_FEATURE_NOT_ENABLED) when it is
    registered or allocated: its slots would be strided, not contiguous runs of bytes.
    """

    def __init__(
        self,
        num_tensors: int,
        shape: Sequence[int],
        data_type: DataType,
        placement: Placement = Placement.HOST,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
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
        batch_dim_index = check_int("batch_dim_index", batch_dim_index, -(1 << 31), (1 << 31) - 1)
        seq_len_dim_index = check_int("seq_len_dim_index", seq_len_dim_index, -(1 << 31), (1 << 31) - 1)
        # (types.py sits below status.py: a value outside what the descriptor allows is a ValueError here;
        # kvpush.compat.llm_datadist.CacheDesc raises LLM-DataDist's LLMException(LLM_PARAM_INVALID) first.)
        if kv_tensor_format is not None and not isinstance(kv_tensor_format, str):
            raise TypeError(f"kv_tensor_format must be a str or None, got {type(kv_tensor_format).__name__}")
        if not 0 <= batch_dim_index < max(len(self.shape), 1):
            raise ValueError(f"batch_dim_index {batch_dim_index} out of range, [0, {len(self.shape)})")
        if seq_len_dim_index != -1 and not 0 <= seq_len_dim_index < len(self.shape):
            raise ValueError(f"seq_len_dim_index {seq_len_dim_index} is invalid, should be -1 or in range "
                             f"[0, {len(self.shape)})")
        self.batch_dim_index = batch_dim_index
        self.seq_len_dim_index = seq_len_dim_index
        self.kv_tensor_format = kv_tensor_format

    @property
    def batch_dim(self) -> int:
        """LLM-DataDist's name for ``batch_dim_index``."""
        return self.batch_dim_index

    @property
    def batch_size(self) -> int:
        """Length of the batch (block) dimension: blocks or batch slots per tensor."""
        return self.shape[self.batch_dim_index] if self.shape else 0

    def __setattr__(self, name: str, value: object) -> None:
        if self.__dict__.get("_sealed"):
            raise AttributeError(f"CacheDesc.{name}: the descriptor of a registered cache cannot change")
        object.__setattr__(self, name, value)

    def seal(self) -> None:
        """From now on this descriptor cannot change (registration seals its own copy)."""
        object.__setattr__(self, "_sealed", True)

    def sealed_copy(self) -> CacheDesc:
        """A copy that can no longer change: a registered cache's own, which its bounds checks read
        (the caller's descriptor stays the caller's to change and describe the next cache with)."""
        twin = self.__copy__()
        twin.seal()
        return twin

    def __copy__(self) -> CacheDesc:
        """Copies (of a sealed descriptor too) can change: they describe another cache."""
        return type(self)(self.num_tensors, self.shape, self.data_type, self.placement, self.batch_dim_index,
                          self.seq_len_dim_index, self.kv_tensor_format)

    def __deepcopy__(self, memo: dict[int, object]) -> CacheDesc:
        return self.__copy__()  # every field is immutable

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set dimension ``dim_index`` to ``dim_value`` (before the descriptor is registered or allocated:
        a registered cache keeps the size it was registered with; its ``cache_desc`` refuses the change
        with ValueError)."""
        if self.__dict__.get("_sealed"):
            raise ValueError("update_dim: the descriptor of a registered cache cannot change; "
                             "describe the new shape with a new CacheDesc")
        index = check_int("dim_index", dim_index, -len(self.shape), len(self.shape) - 1) if self.shape else None
        if index is None:
            raise IndexError("update_dim: the shape has no dimensions")
        value = check_int("dim_value", dim_value, 0, 1 << 48)
        dims = list(self.shape)
        dims[index] = value
        self.shape = tuple(dims)

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

    def as_tuple(self) -> tuple[object, ...]:
        """Every field, in order: descriptors are equal (and hash alike) when these are."""
        return (self.num_tensors, self.shape, self.data_type, self.placement, self.batch_dim_index,
                self.seq_len_dim_index, self.kv_tensor_format)

    def __repr__(self) -> str:
        extra = ""
        if self.batch_dim_index != 0:
            extra += f", batch_dim_index={self.batch_dim_index}"
        if self.seq_len_dim_index != -1:
            extra += f", seq_len_dim_index={self.seq_len_dim_index}"
        if self.kv_tensor_format is not None:
            extra += f", kv_tensor_format={self.kv_tensor_format!r}"
        return (
            f"CacheDesc(num_tensors={self.num_tensors}, shape={list(self.shape)}, "
            f"data_type={self.data_type.name}, placement={self.placement.name}{extra})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheDesc) and self.as_tuple() == other.as_tuple()

    def __hash__(self) -> int:
        return hash(self.as_tuple())


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

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """LLM-DataDist's description of host memory the caller owns, not registered with any engine
        (``cache_id`` -1, a blocks cache): the host side of ``swap_blocks``. ``cache_desc.placement``
        must be HOST and ``addrs`` one int address per tensor (ValueError otherwise)."""
        if not isinstance(cache_desc, CacheDesc):
            raise TypeError(f"cache_desc must be a CacheDesc, got {type(cache_desc).__name__}")
        if not isinstance(addrs, list) or any(isinstance(a, bool) or not isinstance(a, int) for a in addrs):
            raise TypeError("addrs must be a list of int")
        if cache_desc.placement != Placement.HOST:
            raise ValueError("cache_desc placement must be HOST")
        if cache_desc.num_tensors != len(addrs):
            raise ValueError(f"cache_desc num_tensors:{cache_desc.num_tensors} not equal addrs num:{len(addrs)}")
        return cls(-1, cache_desc, [check_int(f"addrs[{i}]", a) for i, a in enumerate(addrs)], True)


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


INVALID_ID = U64_MAX  # LLM-DataDist's "no id" for a CacheKey's req_id / prefix_id

# What names a slot on its owner: (kind, id, model_id), kind REQUEST_KEY (id is the req_id) or PREFIX_KEY (id is
# the prefix_id). The two kinds are separate name spaces, as in LLM-DataDist; the cluster id only picks the owner.
KeyName = tuple[int, int, int]
REQUEST_KEY = 0
PREFIX_KEY = 1


class CacheKey:
    """Names one batch slot of a contiguous cache by request (LLM-DataDist's ``CacheKey``).

    Given to ``register_cache`` / ``allocate_cache``, ``cache_keys[i]`` names batch slot ``i`` of the new
    cache (the cluster id is ignored there); at transfer time ``cluster_id`` picks the linked peer and
    ``req_id`` (or ``prefix_id``) with ``model_id`` picks that peer's slot. A key names a request when
    ``prefix_id`` is ``INVALID_ID`` (the default), else a prefix; a key with neither id (both
    ``INVALID_ID``) is a placeholder that names nothing, for a batch slot in use by no request.
    Equal keys (same cluster, ids and model) compare and hash equal.
    """

    def __init__(self, cluster_id: int | None = None, req_id: int = INVALID_ID, model_id: int = 0,
                 prefix_id: int = INVALID_ID, *, prompt_cluster_id: int | None = None) -> None:
        if cluster_id is not None and prompt_cluster_id is not None:
            raise TypeError("give cluster_id or prompt_cluster_id, not both")
        chosen = prompt_cluster_id if cluster_id is None else cluster_id
        self._cluster = check_int("cluster_id", 0 if chosen is None else chosen)
        self._req = check_int("req_id", req_id)
        self._model = check_int("model_id", model_id)
        self._prefix = check_int("prefix_id", prefix_id)

    @property
    def cluster_id(self) -> int:
        return self._cluster

    @property
    def prompt_cluster_id(self) -> int:
        """LLM-DataDist's name for ``cluster_id``."""
        return self._cluster

    @property
    def req_id(self) -> int:
        return self._req

    @property
    def model_id(self) -> int:
        return self._model

    @property
    def prefix_id(self) -> int:
        return self._prefix

    @property
    def is_placeholder(self) -> bool:
        """Neither a request nor a prefix: names no slot (holds a batch index at registration)."""
        return self._req == INVALID_ID and self._prefix == INVALID_ID

    @property
    def has_one_id(self) -> bool:
        """Exactly one of ``req_id`` and ``prefix_id`` is an id: the key can address a slot."""
        return (self._req != INVALID_ID) != (self._prefix != INVALID_ID)

    def name(self) -> KeyName:
        """What names the slot on its owner: a prefix key by its prefix id, else by its request id."""
        if self._prefix != INVALID_ID:
            return (PREFIX_KEY, self._prefix, self._model)
        return (REQUEST_KEY, self._req, self._model)

    def _identity(self) -> tuple[int, int, int, int]:
        return (self._cluster, self._req, self._prefix, self._model)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        return (f"CacheKey(cluster_id={self._cluster}, req_id={self._req}, prefix_id={self._prefix}, "
                f"model_id={self._model})")


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
    """A peer to link to: its cluster id and the addresses it listens on.

    ``local_ip_info_list`` / ``remote_ip_info_list`` are LLM-DataDist's names for ``local_ip_info`` /
    ``remote_ip_info`` (the same lists of ``(ip, port)``; kvpush keeps the ip as text, so IPv6 fits).
    ``remote_role_type`` (an ``LLMRole`` or int) is recorded as LLM-DataDist does; roles never restrict
    who may push or pull.
    """

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self.local_ip_info: list[tuple[str, int]] = []
        self.remote_ip_info: list[tuple[str, int]] = []

    @property
    def local_ip_info_list(self) -> list[tuple[str, int]]:
        return self.local_ip_info

    @property
    def remote_ip_info_list(self) -> list[tuple[str, int]]:
        return self.remote_ip_info

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        """The peer's role as the caller describes it (None until set)."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"remote_role_type must be an LLMRole or int, got {type(value).__name__}")
        self._remote_role_type = value

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
