"""The option dictionary (``LLMConfig.generate_options()``'s, or the caller's) parsed into ``EngineOptions``.

Pure: parsing never touches the network. Keys are LLM-DataDist's (``llm.*``, ``ge.*``) and kvpush's own
(``kvpush.*``). ``parse_options`` accepts every key LLM-DataDist defines: those that mean something on a
host without an accelerator take effect, the others are accepted (their value checked) and noted in the
debug log. A key that is neither is an error, never silently ignored.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transports.registry import canonical_transport, transport_names

from .config import INT32, KVPUSH_KEYS, LAYER_MERGE_BYTES, MAX_MERGE_BYTES, UINT32_MAX, LLMConfig
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
    "llm.RdmaTrafficClass": lambda key, text: _parse_int(key, text, 0, UINT32_MAX),
    "llm.RdmaServiceLevel": lambda key, text: _parse_int(key, text, 0, UINT32_MAX),
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
    "llm.RefInputSeqLenDimIndex": lambda key, text: _parse_int(key, text, *INT32),
    "llm.kvTensorFormat": _any_text,
}
_ALIASES = {
    "llm.ListenIpInfo": "llm.listenIpInfo",
    "llm.DeviceId": "ge.exec.deviceId",
    "llm.MemUtilization": "llm.MemoryUtilization",  # kvpush's earlier spelling
}

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


def _parse_transport(key: str, text: str) -> str:
    name = canonical_transport(text)
    if name is None:
        raise param_invalid(f"option {key}={text!r} must be one of {', '.join(transport_names())}")
    return name


# the keys that take effect: key -> (the EngineOptions field it sets, its parser)
_EFFECTIVE_KEYS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "llm.listenIpInfo": ("listen", parse_host_port),
    "llm.SyncKvCacheWaitTime": ("sync_kv_timeout_ms", _parse_positive_int),
    "llm.EnableRemoteCacheAccessible": ("enable_remote_cache_accessible", _parse_bool),
    "llm.LinkRetryCount": ("link_retry_count", _parse_positive_int),
    "llm.LinkTotalTime": ("link_total_time_ms", lambda key, text: _parse_int(key, text, 0, UINT32_MAX)),
    "kvpush.transport": ("transport", _parse_transport),
    "kvpush.auth_token": ("auth_token", lambda key, text: text or None),
    "kvpush.keepalive_interval_ms": ("keepalive_interval_ms", _parse_positive_int),
    "kvpush.keepalive_timeout_ms": ("keepalive_timeout_ms", _parse_positive_int),
    "kvpush.layer_merge_bytes": ("layer_merge_bytes", lambda key, text: _parse_int(key, text, 0, MAX_MERGE_BYTES)),
}


assert set(KVPUSH_KEYS) <= set(_EFFECTIVE_KEYS)  # every key LLMConfig emits takes effect
KNOWN_KEYS = frozenset(_EFFECTIVE_KEYS) | frozenset(_HARDWARE_ONLY) | frozenset(_ALIASES)


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
        effective = _EFFECTIVE_KEYS.get(key)
        if effective is not None:
            setattr(parsed, effective[0], effective[1](raw_key, text))
            continue
        if key in _HARDWARE_ONLY:
            _HARDWARE_ONLY[key](raw_key, text)
        elif not key.startswith("ge."):
            raise param_invalid(f"unknown option key {raw_key!r}")
        log.debug("option %s=%r accepted; it has no effect on a host without an accelerator", raw_key, text)
    if parsed.keepalive_timeout_ms <= parsed.keepalive_interval_ms:
        raise param_invalid("option kvpush.keepalive_timeout_ms must exceed kvpush.keepalive_interval_ms")
    return parsed
