"""A vLLM instance's place in the fleet: with ``discovery`` in ``kv_connector_extra_config``, the
scheduler side of KvpushConnector (one per instance) registers the instance in etcd while its engine is
up (``kvpush.fleet``): its role, ``advertise_url``, every rank's kvpush address, model,
KV-geometry fingerprint, state and load (read from its own ``/metrics`` every second). At shutdown it
leaves gracefully: ``draining``, its pending sends given a few seconds, then the lease revoked. etcd being
away never stops the instance: the registration is retried in the background and logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

from ...fleet import Instance, Load, parse_discovery, parse_load
from ...portal import Portal
from .settings import ConnectorSettings

log = logging.getLogger(__name__)

RETIRE_S = 10.0  # at shutdown, how long pending sends may hold the instance in ``draining``


def _role(kv_role: str) -> str:
    return {"kv_producer": "prefill", "kv_consumer": "decode"}.get(kv_role, "both")


class FleetMember:
    """Registers this instance for as long as it lives (``close`` leaves)."""

    def __init__(self, settings: ConnectorSettings, served_model: str, pending: Callable[[], bool],
                 events_config: Any = None) -> None:
        discovery, url = settings.config.discovery, settings.config.advertise_url
        assert discovery is not None and url is not None
        endpoints = parse_discovery(discovery)
        from ...fleet.etcd import Registrar  # the fleet extra: a clear ImportError without it

        kv, clusters = [], []
        if settings.produce and settings.local is not None:
            for rank in range(settings.tp_size):
                address = settings.local.of_rank(rank)
                host = f"[{address.host}]" if ":" in address.host else address.host
                kv.append(f"{host}:{address.port}")
                clusters.append(address.cluster_id)
        events, replay = events_endpoints(events_config, settings.listen[0] if settings.listen else None)
        self.instance = Instance(uuid.uuid4().hex[:12], _role(settings.role), url.rstrip("/"), served_model,
                                 settings.compat, tuple(kv), tuple(clusters), settings.tp_size, events=events,
                                 events_replay=replay, block_size=settings.block_size)
        self._pending = pending
        self._thread = Portal("kvpush-fleet")
        self._registrar = Registrar(endpoints, self.instance, load=self._load)
        self._run = self._thread.submit(self._registrar.run())
        log.info("KvpushConnector: registering this instance (%s, %s) in %s", self.instance.role, self.instance.url,
                 discovery)

    async def _load(self) -> Load:
        def read() -> str:
            with urllib.request.urlopen(f"{self.instance.url}/metrics", timeout=1) as answer:
                text: str = answer.read().decode("utf-8", "replace")
                return text
        return parse_load(await asyncio.to_thread(read))

    def close(self) -> None:
        """Leave: stop refreshing, mark draining, give pending sends ``RETIRE_S``, revoke the lease."""
        self._run.cancel()

        async def retire() -> None:
            async def drained() -> None:
                while self._pending():
                    await asyncio.sleep(0.1)
            await self._registrar.retire(drained, RETIRE_S)
        try:
            self._thread.run(retire(), timeout=RETIRE_S + 10)
        except Exception as error:  # noqa: BLE001 - shutting down: log, never raise into vLLM's shutdown
            log.warning("KvpushConnector: leaving the fleet: %s", error)
        self._thread.close()


def fleet_member(settings: ConnectorSettings, vllm_config: Any, pending: Callable[[], bool]) -> FleetMember | None:
    """The instance's registration when its config asks for one, else None."""
    if settings.config.discovery is None:
        return None
    model = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None) or "model"
    return FleetMember(settings, model[0] if isinstance(model, list) else str(model), pending,
                       getattr(vllm_config, "kv_events_config", None))


def events_endpoints(config: Any, host: str | None) -> tuple[str, str]:
    """Where a vLLM ``KVEventsConfig`` publishes (its endpoint and replay endpoint, ``tcp://*:PORT`` read as
    ``host``), as others reach it; ("", "") when it publishes none over TCP."""
    if config is None or not getattr(config, "enable_kv_cache_events", False) or getattr(config, "publisher",
                                                                                          "") != "zmq":
        return "", ""
    name = host or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
    name = f"[{name}]" if ":" in name else name

    def reachable(endpoint: Any) -> str:
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            return ""
        bound, _, port = endpoint[len("tcp://"):].rpartition(":")
        return f"tcp://{name if bound in ('*', '0.0.0.0', '::', '[::]', '') else bound}:{port}"

    endpoint = reachable(getattr(config, "endpoint", None))
    return endpoint, reachable(getattr(config, "replay_endpoint", None)) if endpoint else ""
