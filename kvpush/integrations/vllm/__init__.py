"""kvpush in vLLM: ``KvpushConnector``, the KV connector vLLM loads with

    KVTransferConfig(kv_connector="KvpushConnector", kv_connector_module_path="kvpush.integrations.vllm", ...)

- ``connector``: ``KvpushConnector`` (``KVConnectorBase_V1`` and ``SupportsHMA``), the thin layer over vLLM's hooks;
- ``core``: the connector's books, vLLM-free and pure (what is sent, when, what a request waits for);
- ``settings``: what it reads from vLLM's objects; ``worker``: a worker's state; ``bridge``: its kvpush engine on an
  event-loop thread of its own; ``fleet``: an instance's membership of an etcd fleet. vLLM-free.

The model families' layouts (``..families``), tensor parallelism (``..topology``) and the settings both engines take
(``..config``) are shared with SGLang's backend (``..sglang``). Importing this package imports no vLLM: the
connector's names load on first use.
"""

from __future__ import annotations

from typing import Any

_CONNECTOR_NAMES = ("KvpushConnector", "KvpushMetadata", "KvpushWorkerMeta", "KvpushStats", "KvpushPromMetrics",
                    "SHORT_STOP_REASON")


def __getattr__(name: str) -> Any:
    if name in _CONNECTOR_NAMES:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_CONNECTOR_NAMES)
