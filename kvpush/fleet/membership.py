"""A P/D fleet's membership, without I/O: what an instance registers (``Instance``), where the registry
is (``parse_discovery``), and what a reader makes of it (``Membership``: a snapshot, then watch events).
The store is etcd (``kvpush.fleet.etcd``): an instance's key lives under a lease it keeps alive, so a killed
instance leaves the registry within the lease's TTL.

Keys: ``/kvpush/instances/<role>/<id>`` (``id`` is new for every start of an instance, so two instances
never share a key and a restarted one is a new member); the value is the ``Instance`` as JSON. Nothing
secret is registered (no token: the links' ``KVPUSH_AUTH_TOKEN`` never goes into etcd).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

PREFIX = "/kvpush/instances/"
ROLES = ("prefill", "decode", "both")
STATES = ("ready", "draining")
TTL_S = 6  # a killed instance leaves the registry within this (etcd re-arms leases on its own restart)
REFRESH_S = 1.0  # how often an instance refreshes its lease and its load
DEFAULT_ETCD_PORT = 2379


class FleetError(ValueError):
    """A discovery address or a registry entry that cannot be used; says why."""


def parse_discovery(text: str) -> list[tuple[str, int]]:
    """``etcd://HOST[:PORT][,HOST[:PORT]...]`` -> endpoints; raises FleetError naming what is wrong."""
    if not isinstance(text, str) or not text.startswith("etcd://"):
        raise FleetError(f"discovery {text!r} is not etcd://HOST:PORT[,HOST:PORT...]")
    endpoints = []
    for part in text[len("etcd://"):].rstrip("/").split(","):
        match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?|([^:\[\]/]+)(?::(\d+))?", part.strip())
        if match is None:
            raise FleetError(f"discovery {text!r}: {part!r} is not HOST[:PORT]")
        host = match.group(1) or match.group(3)
        port = int(match.group(2) or match.group(4) or DEFAULT_ETCD_PORT)
        if not 0 < port < 65536:
            raise FleetError(f"discovery {text!r}: port {port} is not a TCP port")
        endpoints.append((host, port))
    return endpoints


@dataclass(frozen=True)
class Load:
    """An instance's load as it last reported it (None: it could not read it)."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # share of its KV blocks in use

    @property
    def requests(self) -> int:
        return (self.running or 0) + (self.waiting or 0)


@dataclass(frozen=True)
class Instance:
    """One registered vLLM instance. ``kv``: every rank's kvpush address ``HOST:PORT`` (a prefill's; a
    decode that only dials has none); ``compat``: a fingerprint of the KV geometry (model architecture,
    KV dtype, block size): only instances with the same one are paired. ``events``/``events_replay``: where
    it publishes its KV cache events (``tcp://HOST:PORT``; empty: it publishes none); ``block_size``: its
    prefix cache's block size (0: not said)."""

    id: str
    role: str
    url: str
    model: str
    compat: str
    kv: tuple[str, ...] = ()
    cluster_ids: tuple[int, ...] = ()
    tp: int = 1
    state: str = "ready"
    load: Load = field(default_factory=Load)
    started: float = field(default_factory=time.time)
    events: str = ""
    events_replay: str = ""
    block_size: int = 0

    @property
    def key(self) -> str:
        return f"{PREFIX}{self.role}/{self.id}"

    def to_json(self) -> bytes:
        body = asdict(self)
        body["kv"], body["cluster_ids"] = list(self.kv), list(self.cluster_ids)
        return json.dumps(body, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, key: str, value: bytes) -> Instance:
        """Raises FleetError for anything that is not a complete, consistent entry."""
        try:
            body = json.loads(value)
            load = Load(**body.get("load") or {})
            instance = cls(str(body["id"]), str(body["role"]), str(body["url"]), str(body["model"]),
                           str(body["compat"]), tuple(str(k) for k in body.get("kv", ())),
                           tuple(int(c) for c in body.get("cluster_ids", ())), int(body.get("tp", 1)),
                           str(body.get("state", "ready")), load, float(body.get("started", 0.0)),
                           str(body.get("events", "")), str(body.get("events_replay", "")),
                           int(body.get("block_size", 0)))
        except (ValueError, KeyError, TypeError) as error:
            raise FleetError(f"registry entry {key}: {error}") from None
        if instance.role not in ROLES or instance.state not in STATES or instance.key != key:
            raise FleetError(f"registry entry {key}: role {instance.role!r}, state {instance.state!r}")
        if instance.role != "decode" and not instance.kv:
            raise FleetError(f"registry entry {key}: a {instance.role} without a kvpush address")
        return instance

    def with_state(self, state: str, load: Load | None = None) -> Instance:
        return replace(self, state=state, load=self.load if load is None else load)

    def events_source(self) -> tuple[str, str | None] | None:
        """(endpoint, replay endpoint or None) where it publishes its KV events, or None."""
        return (self.events, self.events_replay or None) if self.events else None

    def kv_address(self) -> tuple[str, int]:
        """Rank 0's kvpush address (host, port)."""
        host, _, port = self.kv[0].rpartition(":")
        return host.strip("[]"), int(port)

    def row(self, now: float | None = None) -> dict[str, Any]:
        """What ``kvpush fleet`` shows of it."""
        age = (time.time() if now is None else now) - self.started
        return {"id": self.id, "role": self.role, "url": self.url, "kv": ",".join(self.kv) or "-",
                "model": self.model, "state": self.state, "tp": self.tp, "running": self.load.running,
                "waiting": self.load.waiting, "kv_usage": self.load.kv_usage, "age_s": round(age, 1),
                "compat": self.compat}


class Membership:
    """What a reader knows of the registry: the instances by key, from ``reset`` (a snapshot) and then
    ``apply`` (watch events). Entries that cannot be read are skipped and remembered in ``refused``."""

    def __init__(self) -> None:
        self.instances: dict[str, Instance] = {}
        self.refused: dict[str, str] = {}
        self.revision = 0

    def reset(self, entries: Iterable[tuple[str, bytes]], revision: int) -> None:
        self.instances, self.refused = {}, {}
        for key, value in entries:
            self._put(key, value)
        self.revision = revision

    def apply(self, kind: str, key: str, value: bytes, revision: int) -> None:
        """A watch event: ``kind`` PUT or DELETE."""
        if kind == "DELETE":
            self.instances.pop(key, None)
            self.refused.pop(key, None)
        else:
            self._put(key, value)
        self.revision = max(self.revision, revision)

    def _put(self, key: str, value: bytes) -> None:
        try:
            self.instances[key] = Instance.from_json(key, value)
            self.refused.pop(key, None)
        except FleetError as error:
            self.instances.pop(key, None)
            self.refused[key] = str(error)

    def ready(self, *roles: str) -> list[Instance]:
        """Instances in one of ``roles`` (a ``both`` counts as either) that take new requests."""
        return sorted((i for i in self.instances.values() if i.state == "ready"
                       and (i.role in roles or i.role == "both")), key=lambda i: i.key)


def parse_load(metrics: str) -> Load:
    """An instance's load from vLLM's Prometheus text (``/metrics``): requests running and waiting, and the
    share of its KV cache in use (summed over its engines)."""
    values: dict[str, float] = {}
    for line in metrics.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0]
        if metric in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            try:
                values[metric] = values.get(metric, 0.0) + float(value)
            except ValueError:
                continue
    running, waiting = values.get("vllm:num_requests_running"), values.get("vllm:num_requests_waiting")
    return Load(None if running is None else int(running), None if waiting is None else int(waiting),
                values.get("vllm:kv_cache_usage_perc"))


def load_of(instances: Mapping[str, Instance]) -> dict[str, int]:
    """Registered requests (running + waiting) per instance URL."""
    return {i.url: i.load.requests for i in instances.values()}
