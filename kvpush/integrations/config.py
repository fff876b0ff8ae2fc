"""What an engine's kvpush side is told - vLLM's connector's and SGLang's backend's alike: its settings
(``ConnectorConfig``, from ``kv_connector_extra_config``), where engines listen (``listen_port``, ``PeerAddress``,
``derive_cluster_id``), what a request's ``kv_transfer_params`` ask (``parse_params``) and the params a proxy
sends (``prefill_request_params``, ``decode_request_params``). Pure; anything unusable raises ``ParamsError``
naming the key.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("kv_producer", "kv_consumer", "kv_both")
MAX_TRANSFER_ID_BYTES = 128  # a transfer id on the wire (UTF-8)
# a prefill's hold for its decode's block ids before its forward: none, since ids that come during the forward join
# it from the next layer on (issue 42: the hold was 4-8 ms of every P/D request's time to first token)
IDS_WAIT_MS = 0
IDLE_WAIT_MS = 20  # how long an empty engine step waits for a transfer's news before vLLM takes the next one


class ParamsError(ValueError):
    """``kv_transfer_params`` or ``kv_connector_extra_config`` that cannot be used; says which key."""


# -- configuration and addresses -------------------------------------------------------------------

@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, from ``kv_connector_extra_config`` (every key optional).

    ``host``/``port``: where this worker's kvpush engine listens (default: ``VLLM_HOST_IP`` or
    127.0.0.1, and ``listen_port(kv_port, role)``); ``cluster_id``: its kvpush cluster id (default:
    derived from host and port for a listener, random for a decode that only dials);
    ``transport``, ``auth_token``: kvpush's ``kvpush.transport`` / ``kvpush.auth_token``;
    ``engine_options``: more kvpush options, passed through; ``insecure``: let a listener off loopback
    run without a token (see ``ConnectorSettings``); ``discovery`` (``etcd://HOST:PORT[,...]``) and
    ``advertise_url`` (this instance's OpenAI server, which the connector cannot see): register the
    instance in that etcd for ``kvpush proxy --discovery`` (``kvpush.fleet``). Deadlines:
    ``transfer_timeout_s`` bounds a decode's wait from allocation to the last byte; ``ids_timeout_s``
    how long a finished prefill request keeps its blocks for block ids that have not come;
    ``ids_wait_ms`` how long a prefill holds a request whose decode sends block ids before its forward,
    waiting for them (0, the default: never held; ids that come during the forward join it: the layers
    computed so far go at once, the others as they are computed); ``idle_wait_ms`` how long
    an engine step that computes nothing waits for a transfer's news before vLLM takes the next one (0: not
    at all; vLLM's worker then spins between such steps); ``own_sched_group`` (true): a worker bound to some of
    the cores takes a session, so a scheduling group, of its own (``kvpush.integrations.sched_group``);
    ``loop_yields`` (false): the worker's kvpush loop thread runs under ``SCHED_BATCH``, so its wakeups (a push's
    last layers, its notices) do not preempt the engine's own thread on a shared core (``kvpush.portal``);
    ``abort_grace_s`` how long a decode waits, after an abort or timeout, for the prefill to confirm
    nothing more will land; ``sync_kv_timeout_ms`` is kvpush's per-layer deadline; ``link_timeout_ms``
    bounds linking. ``bootstrap_port``: a prefill serves vLLM's Mooncake bootstrap contract (``GET /query``)
    there, on its kvpush host, so routers that speak it (vllm-router and llm-d's sidecar with
    ``--kv-connector mooncake``, Dynamo) drive it unchanged (default: ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` if set,
    else none is served); ``bootstrap_server_address`` (``HOST:PORT``, the key vLLM's MooncakeConnector reads, which
    Dynamo's Mooncake protocol hands decodes): serve it there instead.
    """

    host: str | None = None
    port: int | None = None
    cluster_id: int | None = None
    transport: str = "auto"
    auth_token: str | None = None
    transfer_timeout_s: float = 60.0
    ids_timeout_s: float = 30.0
    ids_wait_ms: int = IDS_WAIT_MS
    idle_wait_ms: int = IDLE_WAIT_MS
    own_sched_group: bool = True
    loop_yields: bool = False
    abort_grace_s: float = 5.0
    link_timeout_ms: int = 3000
    sync_kv_timeout_ms: int = 5000
    max_transfers: int = 4096
    insecure: bool = False
    discovery: str | None = None
    advertise_url: str | None = None
    bootstrap_port: int | None = None
    bootstrap_server_address: str | None = None
    engine_options: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Validate ``extra`` (unknown keys and wrong types raise ParamsError naming the key)."""
        values: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            check = _CHECKS.get(key)
            if check is None:
                raise ParamsError(f"kv_connector_extra_config has unknown key {key!r}; "
                                  f"known: {', '.join(sorted(_CHECKS))}")
            values[key] = check(key, value)
        for key in ("port", "bootstrap_port"):
            if key in values and not 0 < values[key] < 65536:
                raise ParamsError(f"kv_connector_extra_config[{key!r}]={values[key]} is not a TCP port")
        if ("discovery" in values) != ("advertise_url" in values):
            raise ParamsError("kv_connector_extra_config: 'discovery' and 'advertise_url' go together (the URL a "
                              "proxy reaches this instance's OpenAI server at, e.g. http://10.0.0.5:8100)")
        address = values.get("bootstrap_server_address")
        if address is not None:
            port = Bootstrap(bootstrap_url(address, "kv_connector_extra_config['bootstrap_server_address']")).port
            if values.get("bootstrap_port", port) != port:
                raise ParamsError(f"kv_connector_extra_config: bootstrap_port {values['bootstrap_port']} and "
                                  f"bootstrap_server_address {address!r} disagree")
        url = values.get("advertise_url")
        if url is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
            raise ParamsError(f"kv_connector_extra_config['advertise_url']={url!r} is not an http(s) URL")
        return cls(**values)

    def engine_options_for(self, listen: tuple[str, int] | None, auth_token: str | None = None) -> dict[str, str]:
        """kvpush ``LLMDataDist`` options for this worker's engine; ``auth_token``: the one in force (the
        config's, or the environment's)."""
        # A serving process's event-loop thread can be starved for a second on a busy host (a 1 s keepalive
        # dropped links during the vLLM benchmark on 2 shared cores); a peer that dies is still noticed at
        # once by its socket closing. engine_options may set other values.
        options = {"llm.SyncKvCacheWaitTime": str(self.sync_kv_timeout_ms), "kvpush.transport": self.transport,
                   "kvpush.keepalive_interval_ms": "500", "kvpush.keepalive_timeout_ms": "5000"}
        if listen is not None:
            host, port = listen
            options["llm.listenIpInfo"] = _host_port(host, port)
        if auth_token or self.auth_token:
            options["kvpush.auth_token"] = auth_token or self.auth_token or ""
        options.update(self.engine_options)
        return options


def _positive(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ParamsError(f"kv_connector_extra_config[{key!r}] must be a positive number, got {value!r}")
    return float(value)


def _count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParamsError(f"kv_connector_extra_config[{key!r}] must be a non-negative int, got {value!r}")
    return value


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ParamsError(f"kv_connector_extra_config[{key!r}] must be a string, got {value!r}")
    return value


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ParamsError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")
    return value


def _string_map(key: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ParamsError(f"kv_connector_extra_config[{key!r}] must map strings to strings")
    return dict(value)


# each key of kv_connector_extra_config -> its check (which returns the value to keep)
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    **dict.fromkeys(("transfer_timeout_s", "ids_timeout_s", "abort_grace_s"), _positive),
    **dict.fromkeys(("port", "cluster_id", "link_timeout_ms", "sync_kv_timeout_ms", "max_transfers", "ids_wait_ms",
                     "idle_wait_ms", "bootstrap_port"),
                    _count),
    **dict.fromkeys(("host", "transport", "auth_token", "discovery", "advertise_url", "bootstrap_server_address"),
                    _text),
    "insecure": _flag,
    "own_sched_group": _flag,
    "loop_yields": _flag,
    "engine_options": _string_map,
}


def derive_cluster_id(host: str, port: int) -> int:
    """The kvpush cluster id of the engine listening at ``host:port``, computable by anyone who knows
    the address: an IPv4 address and port packed into 48 bits; an IPv6 address or a host name hashed
    into 63 bits with the top bit set (never equal to an IPv4 one). ``localhost`` counts as 127.0.0.1;
    other names must be spelt the same on both sides (an IP address is safest)."""
    if not 0 < port < 65536:
        raise ParamsError(f"port {port} is not a TCP port")
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        name = "127.0.0.1"
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        address = None
    if isinstance(address, ipaddress.IPv4Address):
        return (int(address) << 16) | port
    key = (address.packed if address is not None else name.encode("utf-8")) + port.to_bytes(2, "big")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") | (1 << 63)


def listen_port(kv_port: int, role: str, rank: int = 0) -> int:
    """Default listen port of a worker: ``kv_port`` for a prefill (``kv_producer``, ``kv_both``), so a
    decode on the same host reaches it with vLLM's defaults; ``+ 1`` for a decode that is asked to
    listen; ``+ 2 * rank`` for the rank-th worker of an instance (its tensor-parallel rank, counted on
    across data-parallel replicas), so a prefill's and a decode's ranks on one host never collide."""
    if role not in ROLES:
        raise ParamsError(f"kv_role {role!r} is not one of {', '.join(ROLES)}")
    port = kv_port + (1 if role == "kv_consumer" else 0) + 2 * rank
    if not 0 < port < 65536:
        raise ParamsError(f"kv_port {kv_port} with rank {rank} gives no valid port")
    return port


@dataclass(frozen=True)
class PeerAddress:
    """Where a prefill worker's engine listens, and its cluster id."""

    host: str
    port: int
    cluster_id: int
    #: every rank's cluster id, when the instance said so (its bootstrap server's answer); else the rule below
    rank_ids: tuple[int, ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, host: str, port: int, cluster_id: int | None = None) -> PeerAddress:
        return cls(host, port, derive_cluster_id(host, port) if cluster_id is None else cluster_id)

    def of_rank(self, rank: int) -> PeerAddress:
        """Where rank ``rank`` of the instance whose rank 0 is here listens: ``port + 2 * rank`` (see
        ``listen_port``), its cluster id from ``rank_ids``, else derived from that address, or this one's
        ``+ rank`` when this one was set explicitly (``cluster_id`` in the instance's config)."""
        if rank == 0:
            return self
        port = self.port + 2 * rank
        if not 0 < port < 65536:
            raise ParamsError(f"rank {rank} of the instance at {self.host}:{self.port} has no valid port")
        if self.rank_ids:
            if rank >= len(self.rank_ids):
                raise ParamsError(f"the instance at {self.host}:{self.port} has {len(self.rank_ids)} ranks, "
                                  f"not {rank + 1}")
            return PeerAddress(self.host, port, self.rank_ids[rank])
        derived = self.cluster_id == derive_cluster_id(self.host, self.port)
        return PeerAddress(self.host, port, derive_cluster_id(self.host, port) if derived else self.cluster_id + rank)


# -- kv_transfer_params ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Bootstrap:
    """A prefill named the Mooncake way: the URL of its bootstrap server (``GET {url}/query``) and the
    engine id of the data-parallel rank the request went to (None: the server's only engine)."""

    url: str
    engine_id: str | None = None

    @classmethod
    def at(cls, host: str, port: int, engine_id: str | None = None) -> Bootstrap:
        return cls(f"http://{_host_port(host, port)}", engine_id)

    @property
    def host(self) -> str:
        return self.url.removeprefix("http://").rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.url.rpartition(":")[2])


@dataclass(frozen=True)
class ConsumerParams:
    """A decode-side request: its KV comes from the prefill at ``remote``, or from the one ``bootstrap``
    names (its address is looked up first: ``bootstrap_address``)."""

    transfer_id: str
    remote: PeerAddress | None
    bootstrap: Bootstrap | None = None


@dataclass(frozen=True)
class ProducerParams:
    """A prefill-side request whose KV goes to a decode; ``transfer_id`` None: this side names it."""

    transfer_id: str | None


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def _transfer_id(params: Mapping[str, Any]) -> str | None:
    value = params.get("transfer_id")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value.encode("utf-8")) <= MAX_TRANSFER_ID_BYTES:
        raise ParamsError(f"kv_transfer_params['transfer_id'] must be a string of 1..{MAX_TRANSFER_ID_BYTES} "
                          f"bytes, got {value!r}")
    return value


def parse_params(params: Mapping[str, Any] | None) -> ConsumerParams | ProducerParams | None:
    """What a request's ``kv_transfer_params`` ask of this connector; None: nothing. Keys (NIXL's and
    Mooncake's names): ``do_remote_prefill`` (decode side) with ``transfer_id`` and either the prefill's
    ``remote_host``/``remote_port`` (and optional ``remote_cluster_id``) or its ``remote_bootstrap_addr``
    (``http://HOST:PORT``; optional ``remote_engine_id``); ``do_remote_decode`` (prefill side) with an
    optional ``transfer_id``. A decode request that names no prefill is refused: the connector never
    guesses one. Raises ParamsError."""
    if not params:
        return None
    if not isinstance(params, Mapping):
        raise ParamsError(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
    if params.get("do_remote_prefill"):
        transfer_id = _transfer_id(params)
        if transfer_id is None:
            raise ParamsError("kv_transfer_params with do_remote_prefill need a 'transfer_id'")
        host, port, cluster_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_cluster_id")
        if host is None and port is None:
            bootstrap = params.get("remote_bootstrap_addr")
            if bootstrap is None:
                raise ParamsError("kv_transfer_params with do_remote_prefill name no prefill: give 'remote_host' and "
                                  "'remote_port' (kvpush proxy, vllm-router's prefill-first mode) or "
                                  "'remote_bootstrap_addr' (the Mooncake contract)")
            return ConsumerParams(transfer_id, None, Bootstrap(bootstrap_url(bootstrap),
                                                               _engine_id(params.get("remote_engine_id"))))
        if not isinstance(host, str) or not host:
            raise ParamsError(f"kv_transfer_params['remote_host'] must be a host, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ParamsError(f"kv_transfer_params['remote_port'] must be a TCP port, got {port!r}")
        if cluster_id is not None and (isinstance(cluster_id, bool) or not isinstance(cluster_id, int)
                                       or not 0 <= cluster_id < 1 << 64):
            raise ParamsError(f"kv_transfer_params['remote_cluster_id'] must be a uint64, got {cluster_id!r}")
        return ConsumerParams(transfer_id, PeerAddress.of(host, port, cluster_id))
    if params.get("do_remote_decode"):
        return ProducerParams(_transfer_id(params))
    return None


_BOOTSTRAP_URL = re.compile(r"(?:http://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})/?")


def bootstrap_url(value: object, key: str = "kv_transfer_params['remote_bootstrap_addr']") -> str:
    """A bootstrap server's address as ``http://HOST:PORT`` (vLLM's form; a bare ``HOST:PORT`` is taken too)."""
    match = _BOOTSTRAP_URL.fullmatch(value) if isinstance(value, str) else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ParamsError(f"{key} must be http://HOST:PORT, got {value!r}")
    return f"http://{match.group(1)}:{int(match.group(2))}"


def _engine_id(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise ParamsError(f"kv_transfer_params['remote_engine_id'] must be a string, got {value!r}")
    return value


# -- the Mooncake bootstrap contract ---------------------------------------------------------------

BOOTSTRAP_PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
_WILDCARDS = ("0.0.0.0", "::", "")


def bootstrap_answer(engines: Mapping[int, tuple[str, Sequence[PeerAddress]]]) -> dict[str, Any]:
    """The body of a prefill's ``GET /query``, in vLLM's MooncakeConnector shape: per data-parallel rank its
    engine id and every tensor-parallel rank's kvpush address (``{"<tp>": {"0": "tcp://HOST:PORT"}}``; one
    pipeline stage), and under ``kvpush`` what a kvpush decode needs beyond it (each rank's cluster id)."""
    answer: dict[str, Any] = {}
    for dp_rank, (engine_id, ranks) in sorted(engines.items()):
        answer[str(dp_rank)] = {
            "engine_id": engine_id,
            "worker_addr": {str(tp): {"0": f"tcp://{_host_port(a.host, a.port)}"} for tp, a in enumerate(ranks)},
            "kvpush": {"version": 1, "cluster_ids": {str(tp): a.cluster_id for tp, a in enumerate(ranks)}},
        }
    return answer


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bootstrap_address(answer: object, bootstrap: Bootstrap) -> PeerAddress:
    """Tensor-parallel rank 0's kvpush address of the engine ``bootstrap`` names, from its server's ``/query``
    answer (``bootstrap_answer``). A wildcard listen host is reached at the bootstrap URL's host. Raises
    ParamsError naming what is wrong: no such engine, a prefill that runs another connector (no ``kvpush``
    entry), ranks that do not follow kvpush's ports (``PeerAddress.of_rank``)."""
    where = f"the bootstrap server at {bootstrap.url}"
    if not isinstance(answer, Mapping) or not answer:
        raise ParamsError(f"{where} answered /query with no engine")
    entries = [entry for entry in answer.values() if isinstance(entry, Mapping)]
    if bootstrap.engine_id is None:
        if len(entries) != 1:
            raise ParamsError(f"{where} serves {len(entries)} engines: the request must name one "
                              f"('remote_engine_id')")
        entry = entries[0]
    else:
        found = [entry for entry in entries if entry.get("engine_id") == bootstrap.engine_id]
        if not found:
            known = ", ".join(sorted(str(entry.get("engine_id")) for entry in entries))
            raise ParamsError(f"{where} serves no engine {bootstrap.engine_id!r} (it serves: {known}); the prefill "
                              f"may have restarted")
        entry = found[0]
    kvpush, workers = entry.get("kvpush"), entry.get("worker_addr")
    if not isinstance(kvpush, Mapping) or not isinstance(workers, Mapping):
        raise ParamsError(f"{where} is not a KvpushConnector prefill's (its answer has no 'kvpush' entry): a "
                          f"KvpushConnector decode loads KV from KvpushConnector prefills only")
    try:
        cluster_ids = {int(tp): int(cid) for tp, cid in kvpush["cluster_ids"].items()}
        addresses = {int(tp): _parse_worker(stages["0"]) for tp, stages in workers.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ParamsError(f"{where} answered /query with a malformed kvpush entry: {error!r}") from None
    if not addresses or sorted(addresses) != list(range(len(addresses))) or sorted(cluster_ids) != sorted(addresses):
        raise ParamsError(f"{where}: tensor-parallel ranks {sorted(addresses)} are not 0..n-1 with a cluster id each")
    host, port = addresses[0]
    for rank, (other_host, other_port) in addresses.items():
        if (other_host, other_port) != (host, port + 2 * rank):
            raise ParamsError(f"{where}: rank {rank} listens at {_host_port(other_host, other_port)}, not where "
                              f"kvpush's rank rule puts it ({_host_port(host, port + 2 * rank)})")
    if host in _WILDCARDS:  # listening everywhere: reached where its bootstrap server was
        host = bootstrap.host
    return PeerAddress(host, port, cluster_ids[0], tuple(cluster_ids[rank] for rank in range(len(cluster_ids))))


def _parse_worker(value: object) -> tuple[str, int]:
    if not isinstance(value, str):
        raise ValueError(f"worker address {value!r}")
    host, _, port = value.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def prefill_request_params(transfer_id: str) -> dict[str, Any]:
    """``kv_transfer_params`` a proxy gives the prefill instance's copy of a request."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def decode_request_params(transfer_id: str, prefill_host: str, prefill_port: int,
                          prefill_cluster_id: int | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` a proxy gives the decode instance's copy of a request."""
    params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
                              "remote_host": prefill_host, "remote_port": prefill_port}
    if prefill_cluster_id is not None:
        params["remote_cluster_id"] = prefill_cluster_id
    return params
