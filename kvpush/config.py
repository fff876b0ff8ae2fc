"""``LLMConfig``: LLM-DataDist's configuration object, with its fields, checks and generated option keys.

Pure. Every field is checked on assignment as LLM-DataDist checks it (``TypeError`` for a wrong type,
``ValueError`` outside an integer type's range, ``LLMException(LLM_PARAM_INVALID)`` for a value the field
does not allow); ``generate_options()`` emits LLM-DataDist's keys and value formats (``llm.*``, ``ge.*``)
plus kvpush's own (``kvpush.*``), which ``kvpush.options.parse_options`` reads.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .status import param_invalid
from .types import check_int

INT32 = (-(1 << 31), (1 << 31) - 1)
UINT32_MAX = (1 << 32) - 1
# ``kvpush.layer_merge_bytes``: consecutive layers of one transfer travel as one request of up to this
# many bytes (a layer this big or bigger goes alone; 0: one request per layer). A request costs each side
# a fixed amount of Python whatever its size, which a short prompt's small layers would not amortize.
LAYER_MERGE_BYTES = 2 << 20
MAX_MERGE_BYTES = 1 << 40


def _check_type(name: str, value: object, types: tuple[type, ...]) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise TypeError(f"{name} only support {[t.__name__ for t in types]}, but got {type(value)}.")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise param_invalid(message)


def _str(name: str, value: object) -> str:
    _check_type(name, value, (str,))
    return str(value)


def _flag(name: str, value: object) -> bool:
    _check_type(name, value, (bool,))
    return bool(value)


def _uint32(name: str, value: object) -> int:
    _check_type(name, value, (int,))
    return check_int(name, value, 0, UINT32_MAX)


def _device_id(name: str, value: object) -> int | list[int] | tuple[int, ...]:
    _check_type(name, value, (int, list, tuple))
    assert isinstance(value, (int, list, tuple))
    for device in value if isinstance(value, (list, tuple)) else [value]:
        _check_type(name, device, (int,))
        _require(device >= 0, "device_id should be greater than or equal to zero.")
        check_int(name, device, *INT32)
    return value


def _sync_kv_timeout(name: str, value: object) -> int | str:
    _check_type(name, value, (int, str))
    assert isinstance(value, (int, str))
    if isinstance(value, str):
        _require(value.isdigit(), "sync_kv_timeout must be digit.")
    _require(int(value) > 0, "sync_kv_timeout should be greater than zero.")
    check_int(name, int(value), *INT32)
    return value


def _int_in(name: str, value: object, lo: int, hi: int, message: str) -> int:
    _check_type(name, value, (int,))
    assert isinstance(value, int)
    _require(lo <= value <= hi, message.format(value=value))
    return value


def _link_total_time(name: str, value: object) -> int:
    return _int_in(name, value, 0, UINT32_MAX,
                   "link_total_time should be an integer between [0, 2^32-1], given value is {value}")


def _link_retry_count(name: str, value: object) -> int:
    return _int_in(name, value, 1, 100,
                   "link_retry_count should be an integer between [1, 100], given value is {value}")


def _mem_utilization(name: str, value: object) -> float:
    _check_type(name, value, (float,))
    assert isinstance(value, float)
    _require(0.0 <= value <= 1.0, f"mem_utilization must be in range [0,1], current:{value}")
    return value


def _ipv4_as_int(ip: object) -> object:
    """LLM-DataDist's form of an IPv4 address in ``cluster_info``: its 4 bytes read little-endian."""
    if not isinstance(ip, str):
        return ip
    try:
        return int.from_bytes(socket.inet_aton(ip), byteorder="little")
    except OSError:
        raise RuntimeError(f"Can not parse ip str:{ip}") from None


def _cluster_info(name: str, value: object) -> str:
    text = _str(name, value)
    info = json.loads(text)
    for ip_info in info.get("listen_ip_info", []) if isinstance(info, dict) else []:
        ip_info["ip"] = _ipv4_as_int(ip_info["ip"])
    return json.dumps(info)


def _ge_options(name: str, value: object) -> dict[str, str]:
    _check_type(name, value, (dict,))
    assert isinstance(value, dict)
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} dict key only support {str}, but got {type(key)}.")
        if not isinstance(item, str):
            raise TypeError(f"{name} dict value only support {str}, but got {type(item)}.")
    return value


def _token(name: str, value: object) -> str | None:
    return None if value is None else _str(name, value)


def _positive_ms(name: str, value: object) -> int:
    return _int_in(name, value, 1, INT32[1], f"{name} must be > 0 ms, got {{value}}")


def _merge_bytes(name: str, value: object) -> int:
    return _int_in(name, value, 0, MAX_MERGE_BYTES, f"{name} must be in [0, 2^40] bytes, got {{value}}")


def _any_int(name: str, value: object) -> int:
    return _int_in(name, value, -(1 << 63), (1 << 63) - 1, "{value}")




def _when_set(value: Any) -> str | None:
    return None if value is None else str(value)


def _when_given(value: Any) -> str | None:
    return str(value) if value else None


def _as_01(value: Any) -> str | None:
    return None if value is None else "1" if value else "0"


def _only_on(value: Any) -> str | None:
    return "1" if value else None


@dataclass(frozen=True)
class _Field:
    """One ``LLMConfig`` attribute: ``check`` runs on assignment as LLM-DataDist's does; ``initial`` is its
    value before any assignment and ``unset`` what it reads as while that value is None (LLM-DataDist's
    getters: ``link_retry_count`` reads 1, ``local_comm_res`` "", ...). ``key``: the option it becomes in
    ``generate_options`` (as ``emit`` renders it; None: not emitted)."""

    check: Callable[[str, Any], Any]
    initial: Any = None
    unset: Any = None
    key: str | None = None
    emit: Callable[[Any], str | None] = _when_set


# In LLM-DataDist's order; ``ge_options`` and ``device_id`` are emitted by ``generate_options`` itself.
_FIELDS: dict[str, _Field] = {
    "ge_options": _Field(_ge_options),
    "device_id": _Field(_device_id),
    "sync_kv_timeout": _Field(_sync_kv_timeout, key="llm.SyncKvCacheWaitTime"),
    "deploy_res_path": _Field(_str, "", "", "llm.deployResPath", _when_given),
    "buf_pool_cfg": _Field(_str, "", "", "llm.BufPoolCfg", _when_given),
    "mem_pool_cfg": _Field(_str, "", "", "llm.MemPoolConfig", _when_given),
    "host_mem_pool_cfg": _Field(_str, "", "", "llm.HostMemPoolConfig", _when_given),
    "enable_cache_manager": _Field(_flag, None, False, "llm.EnableCacheManager", _as_01),
    "enable_remote_cache_accessible": _Field(_flag, None, False, "llm.EnableRemoteCacheAccessible", _as_01),
    "listen_ip_info": _Field(_str, "", "", "llm.listenIpInfo", _when_given),
    "link_total_time": _Field(_link_total_time, None, 0, "llm.LinkTotalTime"),
    "link_retry_count": _Field(_link_retry_count, None, 1, "llm.LinkRetryCount"),
    "rdma_traffic_class": _Field(_uint32, key="llm.RdmaTrafficClass"),
    "rdma_service_level": _Field(_uint32, key="llm.RdmaServiceLevel"),
    "local_comm_res": _Field(_str, None, "", "llm.LocalCommRes"),
    "transfer_backend": _Field(_str, None, "", "llm.TransferBackend"),
    "global_resource_config": _Field(_str, None, "", "llm.GlobalResourceConfig"),
    "cluster_info": _Field(_cluster_info, "", "", "llm.ClusterInfo", _when_given),
    "output_max_size": _Field(_any_int, key="llm.OutputMaxSize"),
    "enable_switch_role": _Field(_flag, False, False, "llm.EnableSwitchRole", _only_on),
    "mem_utilization": _Field(_mem_utilization, 0.95, 0.95, "llm.MemoryUtilization"),
    # kvpush's own
    "transport": _Field(_str, key="kvpush.transport"),
    "auth_token": _Field(_token, key="kvpush.auth_token"),
    "keepalive_interval_ms": _Field(_positive_ms, key="kvpush.keepalive_interval_ms"),
    "keepalive_timeout_ms": _Field(_positive_ms, key="kvpush.keepalive_timeout_ms"),
    "layer_merge_bytes": _Field(_merge_bytes, key="kvpush.layer_merge_bytes"),
}
KVPUSH_KEYS = tuple(field.key for field in _FIELDS.values() if field.key and field.key.startswith("kvpush."))


class LLMConfig:
    """LLM-DataDist's configuration object (``LlmConfig``): set attributes, then ``generate_options()``.

    Every field of LLM-DataDist's ``LlmConfig`` with its checks (``TypeError`` for a wrong type,
    ``ValueError`` outside an integer type's range, ``LLMException(LLM_PARAM_INVALID)`` for a value the
    field does not allow), plus kvpush's ``transport``, ``auth_token``, ``keepalive_interval_ms``,
    ``keepalive_timeout_ms`` and ``layer_merge_bytes``. Unknown attributes raise ``AttributeError`` (a
    typo must not be silently dropped; differs: LLM-DataDist accepts any attribute and ignores it).
    """

    __slots__ = ("_values",)

    def __init__(self) -> None:
        values: dict[str, Any] = {name: field.initial for name, field in _FIELDS.items()}
        values["ge_options"] = {}  # a fresh dict per instance
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        field = _FIELDS.get(name)
        if field is None:
            raise AttributeError(f"'LLMConfig' object has no attribute {name!r}")
        value = self._values[name]
        return field.unset if value is None else value

    def __setattr__(self, name: str, value: Any) -> None:
        field = _FIELDS.get(name)
        if field is None:
            raise AttributeError(f"'LLMConfig' object has no attribute {name!r}")
        self._values[name] = field.check(name, value)

    def generate_options(self) -> dict[str, str]:
        """The option dict for ``LLMDataDist.init``: the same keys and value formats as LLM-DataDist's
        (``ge_options`` first; device ids joined with ";"; ``llm.MemoryUtilization`` always present)."""
        values = self._values
        options: dict[str, str] = dict(values["ge_options"])
        device_id = values["device_id"]
        if isinstance(device_id, int):
            options["ge.exec.deviceId"] = options["ge.session_device_id"] = str(device_id)
        elif device_id is not None:
            options["ge.session_device_id"] = str(device_id[0])
            options["ge.exec.deviceId"] = ";".join(str(device) for device in device_id)
        for name, field in _FIELDS.items():
            text = None if field.key is None else field.emit(values[name])
            if text is not None:
                options[field.key] = text  # type: ignore[index]  # (key is set when text is)
        return options

    def gen_options(self) -> dict[str, str]:
        """LLM-DataDist's other name for ``generate_options``."""
        return self.generate_options()

    @property
    def options(self) -> dict[str, str]:
        """The options as ``generate_options()`` makes them now."""
        return self.generate_options()
