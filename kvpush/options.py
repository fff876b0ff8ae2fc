"""``LLMConfig`` and the option dictionary it generates, parsed into ``EngineOptions``.

Pure: parsing never touches the network. Keys follow LLM-DataDist (``llm.*``, ``ge.*``); kvpush's
own live under ``kvpush.*``. A key that is neither is an error, never silently ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .status import param_invalid
from .types import check_int, check_ip

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "tcp", "ucx", "cma")
_TRANSPORT_ALIASES = {"shm": "cma", "same-host": "cma"}

# attribute name -> option key. Keys that mean nothing on a CPU host are accepted and logged.
_FIELDS: dict[str, str] = {
    "listen_ip_info": "llm.listenIpInfo",
    "sync_kv_timeout": "llm.SyncKvCacheWaitTime",
    "device_id": "ge.exec.deviceId",
    "enable_cache_manager": "llm.EnableCacheManager",
    "enable_remote_cache_accessible": "llm.EnableRemoteCacheAccessible",
    "enable_switch_role": "llm.EnableSwitchRole",
    "local_comm_res": "llm.LocalCommRes",
    "mem_pool_cfg": "llm.MemPoolConfig",
    "host_mem_pool_cfg": "llm.HostMemPoolConfig",
    "buf_pool_cfg": "llm.BufPoolCfg",
    "mem_utilization": "llm.MemUtilization",
    "link_total_time": "llm.LinkTotalTime",
    "link_retry_count": "llm.LinkRetryCount",
    "rdma_traffic_class": "llm.RdmaTrafficClass",
    "rdma_service_level": "llm.RdmaServiceLevel",
    "transport": "kvpush.transport",
    "auth_token": "kvpush.auth_token",
    "keepalive_interval_ms": "kvpush.keepalive_interval_ms",
    "keepalive_timeout_ms": "kvpush.keepalive_timeout_ms",
}
_HARDWARE_ONLY = {
    "llm.LocalCommRes",
    "llm.MemPoolConfig",
    "llm.HostMemPoolConfig",
    "llm.BufPoolCfg",
    "llm.MemUtilization",
    "llm.RdmaTrafficClass",
    "llm.RdmaServiceLevel",
    "llm.DeviceId",
    "ge.exec.deviceId",
    "llm.EnableCacheManager",
    "llm.EnableSwitchRole",
}
_ALIASES = {"llm.ListenIpInfo": "llm.listenIpInfo", "llm.DeviceId": "ge.exec.deviceId"}
KNOWN_KEYS = frozenset(_FIELDS.values()) | frozenset(_ALIASES)


class LLMConfig:
    """LLM-DataDist's configuration object: set attributes, then ``generate_options()``.

    Unknown attributes raise ``AttributeError`` (a typo must not be silently dropped).
    """

    __slots__ = (*_FIELDS, "ge_options")

    def __init__(self) -> None:
        for name in _FIELDS:
            object.__setattr__(self, name, None)
        self.ge_options: dict[str, str] = {}

    def generate_options(self) -> dict[str, str]:
        """The option dict for ``LLMDataDist.init``: every field set so far, as strings, with ``ge_options``."""
        options: dict[str, str] = {}
        for key, value in self.ge_options.items():
            options[str(key)] = str(value)
        for name, key in _FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool):
                options[key] = "1" if value else "0"
            elif isinstance(value, (list, tuple)) and name == "device_id":
                options[key] = ",".join(str(v) for v in value)
            else:
                options[key] = str(value)
        return options


def _parse_bool(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "on", "yes"):
        return True
    if lowered in ("0", "false", "off", "no"):
        return False
    raise param_invalid(f"option {key}={text!r} is not a boolean")


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


@dataclass
class EngineOptions:
    listen: tuple[str, int] | None = None
    sync_kv_timeout_ms: int = 1000
    transport: str = "auto"
    auth_token: str | None = None
    keepalive_interval_ms: int = 200
    keepalive_timeout_ms: int = 1000
    link_retry_count: int = 1
    enable_remote_cache_accessible: bool = True


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
            _parse_positive_int(raw_key, text)
            log.debug("option %s accepted; link time is bounded by link_clusters(timeout=...)", raw_key)
        elif key == "kvpush.transport":
            text = _TRANSPORT_ALIASES.get(text, text)
            if text not in TRANSPORTS:
                raise param_invalid(f"option {raw_key}={text!r} must be one of {', '.join(TRANSPORTS)}")
            parsed.transport = text
        elif key == "kvpush.auth_token":
            parsed.auth_token = text or None
        elif key == "kvpush.keepalive_interval_ms":
            parsed.keepalive_interval_ms = _parse_positive_int(raw_key, text)
        elif key == "kvpush.keepalive_timeout_ms":
            parsed.keepalive_timeout_ms = _parse_positive_int(raw_key, text)
        elif key in _HARDWARE_ONLY or key.startswith("ge."):
            log.debug("option %s=%r accepted; it has no effect on a CPU host", raw_key, text)
        else:
            raise param_invalid(f"unknown option key {raw_key!r}")
    if parsed.keepalive_timeout_ms <= parsed.keepalive_interval_ms:
        raise param_invalid("option kvpush.keepalive_timeout_ms must exceed kvpush.keepalive_interval_ms")
    return parsed
