"""``LLMConfig`` and the option dictionary it generates, parsed into ``EngineOptions``.

Pure: parsing never touches the network. ``LLMConfig`` has LLM-DataDist's fields, checks and
``generate_options()`` keys and value formats (``llm.*``, ``ge.*``); kvpush's own options live under
``kvpush.*``. ``parse_options`` accepts every key LLM-DataDist defines: those that mean something on
a host without an accelerator take effect, the others are accepted (their value checked) and noted
in the debug log. A key that is neither is an error, never silently ignored.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transports.registry import canonical_transport, transport_names

from .status import param_invalid
from .types import check_int, check_ip

log = logging.getLogger(__name__)

TRANSPORTS = transport_names()  # every name kvpush.transport accepts, "auto" first
AUTH_TOKEN_ENV = "KVPUSH_AUTH_TOKEN"  # where kvpush's own programs (CLI, vLLM connector) read a shared token


def is_loopback(host: str) -> bool:
    """True for an address only this host reaches (127.0.0.0/8, ::1, ``localhost``); False for anything
    else, wildcard addresses (0.0.0.0, ::) and other names included."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.split("%")[0]).is_loopback
    except ValueError:
        return False

_INT32 = (-(1 << 31), (1 << 31) - 1)
_UINT32_MAX = (1 << 32) - 1


# -- LLMConfig ---------------------------------------------------------------------------------------
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
    return check_int(name, value, 0, _UINT32_MAX)


def _device_id(name: str, value: object) -> int | list[int] | tuple[int, ...]:
    _check_type(name, value, (int, list, tuple))
    assert isinstance(value, (int, list, tuple))
    for device in value if isinstance(value, (list, tuple)) else [value]:
        _check_type(name, device, (int,))
        _require(device >= 0, "device_id should be greater than or equal to zero.")
        check_int(name, device, *_INT32)
    return value


def _sync_kv_timeout(name: str, value: object) -> int | str:
    _check_type(name, value, (int, str))
    assert isinstance(value, (int, str))
    if isinstance(value, str):
        _require(value.isdigit(), "sync_kv_timeout must be digit.")
    _require(int(value) > 0, "sync_kv_timeout should be greater than zero.")
    check_int(name, int(value), *_INT32)
    return value


def _int_in(name: str, value: object, lo: int, hi: int, message: str) -> int:
    _check_type(name, value, (int,))
    assert isinstance(value, int)
    _require(lo <= value <= hi, message.format(value=value))
    return value


def _link_total_time(name: str, value: object) -> int:
    return _int_in(name, value, 0, _UINT32_MAX,
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
    return _int_in(name, value, 1, _INT32[1], f"{name} must be > 0 ms, got {{value}}")


def _merge_bytes(name: str, value: object) -> int:
    return _int_in(name, value, 0, _MAX_MERGE_BYTES, f"{name} must be in [0, 2^40] bytes, got {{value}}")


def _any_int(name: str, value: object) -> int:
    return _int_in(name, value, -(1 << 63), (1 << 63) - 1, "{value}")


_KVPUSH_KEYS = {"transport": "kvpush.transport", "auth_token": "kvpush.auth_token",
                "keepalive_interval_ms": "kvpush.keepalive_interval_ms",
                "keepalive_timeout_ms": "kvpush.keepalive_timeout_ms",
                "layer_merge_bytes": "kvpush.layer_merge_bytes"}
# The consecutive layers of one transfer are packed into requests of at most this many bytes
# (``kvpush.layer_merge_bytes``; a layer this big or bigger goes alone): a request costs each side
# ~100-200 us of Python on a small host whatever its size, which a 256 KiB layer (a short prompt's)
# does not amortize.
LAYER_MERGE_BYTES = 2 << 20
_MAX_MERGE_BYTES = 1 << 40


class _Field:
    """One ``LLMConfig`` attribute: checked on assignment as LLM-DataDist checks it; ``initial`` is its value
    before any assignment and ``unset`` what it reads as while that value is None (LLM-DataDist's getters:
    ``link_retry_count`` reads 1, ``local_comm_res`` "", ...)."""

    def __init__(self, check: Callable[[str, Any], Any], initial: Any = None, unset: Any = None) -> None:
        self.check, self.initial, self.unset = check, initial, unset

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, config: LLMConfig | None, owner: type[LLMConfig]) -> Any:
        if config is None:
            return self
        value = config._values[self.name]
        return self.unset if value is None else value

    def __set__(self, config: LLMConfig, value: Any) -> None:
        config._values[self.name] = self.check(self.name, value)


class LLMConfig:
    """LLM-DataDist's configuration object (``LlmConfig``): set attributes, then ``generate_options()``.

    Every field of LLM-DataDist's ``LlmConfig`` with its checks (``TypeError`` for a wrong type,
    ``ValueError`` outside an integer type's range, ``LLMException(LLM_PARAM_INVALID)`` for a value the
    field does not allow), plus kvpush's ``transport``, ``auth_token``, ``keepalive_interval_ms``,
    ``keepalive_timeout_ms`` and ``layer_merge_bytes``. Unknown attributes raise ``AttributeError`` (a
    typo must not be silently dropped; differs: LLM-DataDist accepts any attribute and ignores it).
    """

    __slots__ = ("_values",)

    listen_ip_info = _Field(_str, "", "")
    device_id = _Field(_device_id)
    sync_kv_timeout = _Field(_sync_kv_timeout)
    deploy_res_path = _Field(_str, "", "")
    ge_options = _Field(_ge_options)  # a fresh dict per instance
    enable_switch_role = _Field(_flag, False, False)
    link_total_time = _Field(_link_total_time, None, 0)
    link_retry_count = _Field(_link_retry_count, None, 1)
    cluster_info = _Field(_cluster_info, "", "")
    output_max_size = _Field(_any_int)
    mem_utilization = _Field(_mem_utilization, 0.95, 0.95)
    buf_pool_cfg = _Field(_str, "", "")
    mem_pool_cfg = _Field(_str, "", "")
    host_mem_pool_cfg = _Field(_str, "", "")
    enable_cache_manager = _Field(_flag, None, False)
    enable_remote_cache_accessible = _Field(_flag, None, False)
    rdma_traffic_class = _Field(_uint32)
    rdma_service_level = _Field(_uint32)
    local_comm_res = _Field(_str, None, "")
    transfer_backend = _Field(_str, None, "")
    global_resource_config = _Field(_str, None, "")
    transport = _Field(_str)  # kvpush.transport
    auth_token = _Field(_token)  # kvpush.auth_token
    keepalive_interval_ms = _Field(_positive_ms)
    keepalive_timeout_ms = _Field(_positive_ms)
    layer_merge_bytes = _Field(_merge_bytes)

    def __init__(self) -> None:
        fields = {name: item for name, item in vars(LLMConfig).items() if isinstance(item, _Field)}
        self._values: dict[str, Any] = {name: item.initial for name, item in fields.items()}
        self._values["ge_options"] = {}

    def generate_options(self) -> dict[str, str]:
        """The option dict for ``LLMDataDist.init``: the same keys and value formats as LLM-DataDist's
        (``ge_options`` first; device ids joined with ";"; ``llm.MemoryUtilization`` always present)."""
        values = self._values
        options: dict[str, str] = dict(values["ge_options"])
        device_id = values["device_id"]
        if device_id is not None:
            if isinstance(device_id, int):
                options["ge.exec.deviceId"] = str(device_id)
                options["ge.session_device_id"] = str(device_id)
            else:
                options["ge.session_device_id"] = str(device_id[0])
                options["ge.exec.deviceId"] = ";".join(str(device) for device in device_id)
        if values["sync_kv_timeout"] is not None:
            options["llm.SyncKvCacheWaitTime"] = str(values["sync_kv_timeout"])
        if values["deploy_res_path"]:
            options["llm.deployResPath"] = str(values["deploy_res_path"])
        for name, key in (("buf_pool_cfg", "llm.BufPoolCfg"), ("mem_pool_cfg", "llm.MemPoolConfig"),
                          ("host_mem_pool_cfg", "llm.HostMemPoolConfig")):
            if values[name]:
                options[key] = str(values[name])
        for name, key in (("enable_cache_manager", "llm.EnableCacheManager"),
                          ("enable_remote_cache_accessible", "llm.EnableRemoteCacheAccessible")):
            if values[name] is not None:
                options[key] = "1" if values[name] else "0"
        if values["listen_ip_info"]:
            options["llm.listenIpInfo"] = str(values["listen_ip_info"])
        for name, key in (("link_total_time", "llm.LinkTotalTime"), ("link_retry_count", "llm.LinkRetryCount"),
                          ("rdma_traffic_class", "llm.RdmaTrafficClass"),
                          ("rdma_service_level", "llm.RdmaServiceLevel"), ("local_comm_res", "llm.LocalCommRes"),
                          ("transfer_backend", "llm.TransferBackend"),
                          ("global_resource_config", "llm.GlobalResourceConfig")):
            if values[name] is not None:
                options[key] = str(values[name])
        if values["cluster_info"]:
            options["llm.ClusterInfo"] = str(values["cluster_info"])
        if values["output_max_size"] is not None:
            options["llm.OutputMaxSize"] = str(values["output_max_size"])
        if values["enable_switch_role"]:
            options["llm.EnableSwitchRole"] = "1"
        if values["mem_utilization"] is not None:
            options["llm.MemoryUtilization"] = str(values["mem_utilization"])
        for name, key in _KVPUSH_KEYS.items():
            if values[name] is not None:
                options[key] = str(values[name])
        return options

    def gen_options(self) -> dict[str, str]:
        """LLM-DataDist's other name for ``generate_options``."""
        return self.generate_options()

    @property
    def options(self) -> dict[str, str]:
        """The options as ``generate_options()`` makes them now."""
        return self.generate_options()



# -- parsing -----------------------------------------------------------------------------------------
def _parse_bool(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "on", "yes"):
        return True
    if lowered in ("0", "false", "off", "no"):
        return False
    raise param_invalid(f"option {key}={text!r} is not a boolean")


def _parse_int(key: str, text: str, lo: int, hi: int) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise param_invalid(f"option {key}={text!r} is not an integer") from None
    if not lo <= value <= hi:
        raise param_invalid(f"option {key}={value} must be in [{lo}, {hi}]")
    return value


def _parse_positive_int(key: str, text: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise param_invalid(f"option {key}={text!r} is not an integer") from None
    if value <= 0:
        raise param_invalid(f"option {key}={value} must be > 0")
    return value


def parse_host_port(key: str, text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port)."""
    raw = str(text).strip()
    if raw.startswith("["):
        host, sep, port_text = raw[1:].partition("]:")
    else:
        host, sep, port_text = raw.rpartition(":")
    if not sep or not host:
        raise param_invalid(f"option {key}={text!r} must look like 'host:port' or '[v6]:port'")
    try:
        return check_ip(key, host), check_int(key, int(port_text), 0, 65535)
    except (TypeError, ValueError) as error:
        raise param_invalid(f"option {key}={text!r}: {error}") from None


def _parse_float_01(key: str, text: str) -> None:
    try:
        value = float(text)
    except ValueError:
        raise param_invalid(f"option {key}={text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise param_invalid(f"option {key}={value} must be in [0, 1]")


def _parse_json(key: str, text: str) -> None:
    try:
        json.loads(text)
    except ValueError as error:
        raise param_invalid(f"option {key} is not JSON: {error}") from None


def _any_text(key: str, text: str) -> None:
    return None


# LLM-DataDist's keys that mean nothing on a host without an accelerator: value check, then a debug note
_HARDWARE_ONLY: dict[str, Callable[[str, str], object]] = {
    "llm.LocalCommRes": _any_text,
    "llm.MemPoolConfig": _any_text,
    "llm.HostMemPoolConfig": _any_text,
    "llm.BufPoolCfg": _any_text,
    "llm.MemoryUtilization": _parse_float_01,
    "llm.RdmaTrafficClass": lambda key, text: _parse_int(key, text, 0, _UINT32_MAX),
    "llm.RdmaServiceLevel": lambda key, text: _parse_int(key, text, 0, _UINT32_MAX),
    "llm.EnableCacheManager": _parse_bool,  # kvpush always runs in CacheManager mode
    "llm.EnableSwitchRole": _parse_bool,  # switch_role always works
    "llm.TransferBackend": _any_text,  # kvpush picks its data path with kvpush.transport
    "llm.GlobalResourceConfig": _any_text,
    "llm.deployResPath": _any_text,
    "llm.ClusterInfo": _parse_json,
    "llm.OutputMaxSize": lambda key, text: _parse_int(key, text, 0, (1 << 63) - 1),
    # LLM-DataDist's v1 (KvCacheManager) mode describes its caches in options
    "llm.RefInputShapes": _any_text,
    "llm.RefInputDtypes": _any_text,
    "llm.RefInputSeqLenDimIndex": lambda key, text: _parse_int(key, text, *_INT32),
    "llm.kvTensorFormat": _any_text,
}
_ALIASES = {
    "llm.ListenIpInfo": "llm.listenIpInfo",
    "llm.DeviceId": "ge.exec.deviceId",
    "llm.MemUtilization": "llm.MemoryUtilization",  # kvpush's earlier spelling
}
_EFFECTIVE = ("llm.listenIpInfo", "llm.SyncKvCacheWaitTime", "llm.EnableRemoteCacheAccessible",
              "llm.LinkRetryCount", "llm.LinkTotalTime", *(_KVPUSH_KEYS.values()))
KNOWN_KEYS = frozenset(_EFFECTIVE) | frozenset(_HARDWARE_ONLY) | frozenset(_ALIASES)


@dataclass
class EngineOptions:
    listen: tuple[str, int] | None = None
    sync_kv_timeout_ms: int = 1000
    transport: str = "auto"
    auth_token: str | None = None
    keepalive_interval_ms: int = 200
    keepalive_timeout_ms: int = 1000
    link_retry_count: int = 1
    link_total_time_ms: int = 0  # llm.LinkTotalTime; 0: not set (links are bounded by their timeout argument)
    enable_remote_cache_accessible: bool = True
    layer_merge_bytes: int = LAYER_MERGE_BYTES  # 0: one request per layer (finest completed_layers)


def parse_options(options: Any) -> EngineOptions:
    """Validate an option dict (all values str, as LLM-DataDist passes them)."""
    if options is None:
        return EngineOptions()
    if isinstance(options, LLMConfig):
        options = options.generate_options()
    if not isinstance(options, dict):
        raise TypeError(f"options must be a dict of str, got {type(options).__name__}")
    parsed = EngineOptions()
    for raw_key, value in options.items():
        if not isinstance(raw_key, str):
            raise TypeError(f"option keys must be str, got {type(raw_key).__name__}")
        key = _ALIASES.get(raw_key, raw_key)
        text = str(value)
        if key == "llm.listenIpInfo":
            parsed.listen = parse_host_port(raw_key, text)
        elif key == "llm.SyncKvCacheWaitTime":
            parsed.sync_kv_timeout_ms = _parse_positive_int(raw_key, text)
        elif key == "llm.EnableRemoteCacheAccessible":
            parsed.enable_remote_cache_accessible = _parse_bool(raw_key, text)
        elif key == "llm.LinkRetryCount":
            parsed.link_retry_count = _parse_positive_int(raw_key, text)
        elif key == "llm.LinkTotalTime":
            parsed.link_total_time_ms = _parse_int(raw_key, text, 0, _UINT32_MAX)
        elif key == "kvpush.transport":
            name = canonical_transport(text)
            if name is None:
                raise param_invalid(f"option {raw_key}={text!r} must be one of {', '.join(transport_names())}")
            parsed.transport = name
        elif key == "kvpush.auth_token":
            parsed.auth_token = text or None
        elif key == "kvpush.keepalive_interval_ms":
            parsed.keepalive_interval_ms = _parse_positive_int(raw_key, text)
        elif key == "kvpush.keepalive_timeout_ms":
            parsed.keepalive_timeout_ms = _parse_positive_int(raw_key, text)
        elif key == "kvpush.layer_merge_bytes":
            parsed.layer_merge_bytes = _parse_int(raw_key, text, 0, _MAX_MERGE_BYTES)
        elif key in _HARDWARE_ONLY:
            _HARDWARE_ONLY[key](raw_key, text)
            log.debug("option %s=%r accepted; it has no effect on a host without an accelerator", raw_key, text)
        elif key.startswith("ge."):
            log.debug("option %s=%r accepted; it has no effect on a host without an accelerator", raw_key, text)
        else:
            raise param_invalid(f"unknown option key {raw_key!r}")
    if parsed.keepalive_timeout_ms <= parsed.keepalive_interval_ms:
        raise param_invalid("option kvpush.keepalive_timeout_ms must exceed kvpush.keepalive_interval_ms")
    return parsed
