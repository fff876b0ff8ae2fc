"""The vLLM-free core of kvpush's vLLM KV connector: what is sent, when, and what a request waits for.

How a request moves (decode first, prefill pushes layer by layer):

1. A proxy gives one request two sets of ``kv_transfer_params`` sharing a ``transfer_id``: the decode
   instance's (``do_remote_prefill``, the prefill's kvpush address) and the prefill instance's
   (``do_remote_decode``). Either may be scheduled first.
2. Decode scheduler: ``SchedulerBook.matched_tokens`` claims the prompt as loaded asynchronously;
   after vLLM allocated the blocks, ``after_alloc`` turns them into a ``RecvSpec`` for the worker.
3. Decode worker: ``ConsumerBook`` sends the destination block ids to the prefill worker as
   ``BlockIds`` messages and waits for a ``Done`` notification, which the prefill sends after every
   byte landed. Only then is the request reported finished (``take_finished``); a failure, timeout,
   lost link or a prefill's refusal reports its blocks as load errors instead.
4. Prefill worker: ``ProducerBook`` pushes, in every step that computes part of the prompt, the
   blocks that step touches, one layer at a time as ``save_kv_layer`` sees it (``SendStep``). Block
   ids that arrive after the forward pass started are served by a push after it; the prefill
   scheduler delays freeing the blocks (``request_finished`` returns True) until the worker reports
   the transfer settled (``take_finished_sending``).

Everything here is pure: the clock and every effect (pushes, messages) are injected, events come
in as method calls, and every wait has a deadline from ``ConnectorConfig``. The books are not
thread-safe; the adapter calls them from one thread. Message formats are versioned
(``PROTOCOL_VERSION``) and bounded (``MAX_MESSAGE_BYTES``; long block lists are split).
"""

from __future__ import annotations

import enum
import hashlib
import ipaddress
import logging
import struct
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpush import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_TRANSFER_ID_BYTES = 128
MAX_REASON_BYTES = 512
MAX_BLOCKS_PER_TRANSFER = 1 << 24
TOMBSTONES = 4096  # ended transfer ids remembered, so late messages get an answer

ROLES = ("kv_producer", "kv_consumer", "kv_both")


class MessageError(ValueError):
    """Bytes that are not a connector message of a version this side speaks."""


class ParamsError(ValueError):
    """``kv_transfer_params`` or ``kv_connector_extra_config`` that cannot be used; says which key."""


# -- messages --------------------------------------------------------------------------------------

class Kind(enum.IntEnum):
    BLOCK_IDS = 1  # decode -> prefill: where the request's blocks go
    ABORT = 2  # decode -> prefill: stop; answer with Done once no byte of the transfer can still land
    DONE = 3  # prefill -> decode (a notification): the transfer ended, with its outcome


class Outcome(enum.IntEnum):
    LANDED = 0  # every byte of every block is in the decode's memory
    FAILED = 1  # a push failed or the prefill request ended early; nothing more of it will land
    ABORTED = 2  # ended because the decode asked
    UNKNOWN = 3  # the prefill has no such transfer (never seen, expired, or ended before)
    MISMATCH = 4  # the two sides disagree (block size, prompt length, block count)


@dataclass(frozen=True)
class BlockIds:
    """One part of a decode's destination block list. ``blocks`` are ``dst[offset:offset+len]`` of a
    list of ``total`` ids; block ``i`` of that list receives the prefill's block ``first_block + i``
    (the decode already holds the first ``first_block`` blocks from its prefix cache)."""

    transfer_id: str
    block_size: int
    num_tokens: int
    first_block: int
    total: int
    offset: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Abort:
    transfer_id: str
    reason: str = ""


@dataclass(frozen=True)
class Done:
    transfer_id: str
    outcome: Outcome
    num_blocks: int = 0
    reason: str = ""


Message = BlockIds | Abort | Done

_HEAD = struct.Struct("<4sBB")  # magic, version, kind
_MAGIC = b"KVPC"
_IDS = struct.Struct("<IIIIII")  # block_size, num_tokens, first_block, total, offset, count
_DONE = struct.Struct("<BIH")  # outcome, num_blocks, reason length
_REASON = struct.Struct("<H")
_U32_MAX = 0xFFFFFFFF


def _text(value: str, limit: int) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) <= limit:
        return raw
    return raw[:limit].decode("utf-8", "ignore").encode("utf-8")  # never cut a character in half


def _tid_bytes(transfer_id: str) -> bytes:
    raw = transfer_id.encode("utf-8")
    if not raw or len(raw) > MAX_TRANSFER_ID_BYTES:
        raise MessageError(f"transfer id must be 1..{MAX_TRANSFER_ID_BYTES} bytes, got {len(raw)}")
    return bytes([len(raw)]) + raw


def encode(message: Message) -> bytes:
    """One message as bytes. A ``BlockIds`` must fit ``MAX_MESSAGE_BYTES`` (``block_id_messages``
    splits a long list)."""
    if isinstance(message, BlockIds):
        if any(b < 0 or b > _U32_MAX for b in message.blocks):
            raise MessageError("block ids must fit in 32 bits")
        body = _IDS.pack(message.block_size, message.num_tokens, message.first_block, message.total, message.offset,
                         len(message.blocks)) + struct.pack(f"<{len(message.blocks)}I", *message.blocks)
        kind = Kind.BLOCK_IDS
    elif isinstance(message, Abort):
        reason = _text(message.reason, MAX_REASON_BYTES)
        body, kind = _REASON.pack(len(reason)) + reason, Kind.ABORT
    elif isinstance(message, Done):
        reason = _text(message.reason, MAX_REASON_BYTES)
        body, kind = _DONE.pack(int(message.outcome), message.num_blocks, len(reason)) + reason, Kind.DONE
    else:
        raise TypeError(f"not a connector message: {type(message).__name__}")
    data = _HEAD.pack(_MAGIC, PROTOCOL_VERSION, kind) + _tid_bytes(message.transfer_id) + body
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{kind.name} message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes) -> Message:
    """Parse one message; raises MessageError for anything malformed, truncated, padded or of another
    protocol version (the message names what was wrong)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"a message is bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    if len(data) < _HEAD.size + 2:
        raise MessageError(f"message of {len(data)} bytes is too short")
    magic, version, kind_value = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise MessageError("not a kvpush connector message (bad magic)")
    if version != PROTOCOL_VERSION:
        raise MessageError(f"connector protocol version {version}; this side speaks {PROTOCOL_VERSION}")
    try:
        kind = Kind(kind_value)
    except ValueError:
        raise MessageError(f"unknown message kind {kind_value}") from None
    at = _HEAD.size
    tid_len = data[at]
    at += 1
    if tid_len == 0 or tid_len > MAX_TRANSFER_ID_BYTES or at + tid_len > len(data):
        raise MessageError(f"bad transfer id length {tid_len}")
    try:
        transfer_id = data[at:at + tid_len].decode("utf-8")
    except UnicodeDecodeError:
        raise MessageError("transfer id is not UTF-8") from None
    at += tid_len
    try:
        if kind == Kind.BLOCK_IDS:
            block_size, num_tokens, first_block, total, offset, count = _IDS.unpack_from(data, at)
            at += _IDS.size
            if at + 4 * count != len(data):
                raise MessageError(f"BLOCK_IDS says {count} ids, carries {(len(data) - at) / 4:g}")
            blocks = struct.unpack_from(f"<{count}I", data, at)
            if block_size == 0 or total > MAX_BLOCKS_PER_TRANSFER or offset + count > total:
                raise MessageError(f"BLOCK_IDS geometry out of range (block_size={block_size}, total={total}, "
                                   f"offset={offset}, count={count})")
            return BlockIds(transfer_id, block_size, num_tokens, first_block, total, offset, blocks)
        if kind == Kind.ABORT:
            (length,) = _REASON.unpack_from(data, at)
            at += _REASON.size
            if at + length != len(data) or length > MAX_REASON_BYTES:
                raise MessageError("ABORT reason length does not match the message")
            return Abort(transfer_id, data[at:].decode("utf-8", "replace"))
        outcome_value, num_blocks, length = _DONE.unpack_from(data, at)
        at += _DONE.size
        if at + length != len(data) or length > MAX_REASON_BYTES:
            raise MessageError("DONE reason length does not match the message")
        try:
            outcome = Outcome(outcome_value)
        except ValueError:
            raise MessageError(f"unknown outcome {outcome_value}") from None
        return Done(transfer_id, outcome, num_blocks, data[at:].decode("utf-8", "replace"))
    except struct.error as error:
        raise MessageError(f"{kind.name} message truncated: {error}") from None


def block_id_messages(transfer_id: str, block_size: int, num_tokens: int, first_block: int,
                      blocks: Sequence[int], limit: int = MAX_MESSAGE_BYTES) -> list[bytes]:
    """The destination block list as messages of at most ``limit`` bytes each, in order (one
    message up to ~16 000 blocks at 64 KiB). An empty list is one message with no ids."""
    if len(blocks) > MAX_BLOCKS_PER_TRANSFER:
        raise MessageError(f"{len(blocks)} blocks exceed {MAX_BLOCKS_PER_TRANSFER} per transfer")
    overhead = _HEAD.size + 1 + len(transfer_id.encode("utf-8")) + _IDS.size
    per_message = (limit - overhead) // 4
    if per_message < 1:
        raise MessageError(f"limit of {limit} bytes leaves no room for a block id")
    parts = []
    for offset in range(0, max(len(blocks), 1), per_message):
        chunk = tuple(int(b) for b in blocks[offset:offset + per_message])
        parts.append(encode(BlockIds(transfer_id, block_size, num_tokens, first_block, len(blocks), offset, chunk)))
    return parts


# -- configuration and addresses -------------------------------------------------------------------

@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, from ``kv_connector_extra_config`` (every key optional).

    ``host``/``port``: where this worker's kvpush engine listens (default: ``VLLM_HOST_IP`` or
    127.0.0.1, and ``listen_port(kv_port, role)``); ``cluster_id``: its kvpush cluster id (default:
    derived from host and port for a listener, random for a decode that only dials);
    ``transport``, ``auth_token``: kvpush's ``kvpush.transport`` / ``kvpush.auth_token``;
    ``engine_options``: more kvpush options, passed through. Deadlines: ``transfer_timeout_s``
    bounds a decode's wait from allocation to the last byte; ``ids_timeout_s`` how long a finished
    prefill request keeps its blocks for block ids that have not come; ``abort_grace_s`` how long a
    decode waits, after an abort or timeout, for the prefill to confirm nothing more will land;
    ``sync_kv_timeout_ms`` is kvpush's per-layer deadline; ``link_timeout_ms`` bounds linking.
    """

    host: str | None = None
    port: int | None = None
    cluster_id: int | None = None
    transport: str = "auto"
    auth_token: str | None = None
    transfer_timeout_s: float = 60.0
    ids_timeout_s: float = 30.0
    abort_grace_s: float = 5.0
    link_timeout_ms: int = 3000
    sync_kv_timeout_ms: int = 5000
    max_transfers: int = 4096
    engine_options: Mapping[str, str] = field(default_factory=dict)

    _FLOATS = ("transfer_timeout_s", "ids_timeout_s", "abort_grace_s")
    _INTS = ("port", "cluster_id", "link_timeout_ms", "sync_kv_timeout_ms", "max_transfers")
    _STRS = ("host", "transport", "auth_token")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Validate ``extra`` (unknown keys and wrong types raise ParamsError naming the key)."""
        values: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            if key in cls._FLOATS:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise ParamsError(f"kv_connector_extra_config[{key!r}] must be a positive number, got {value!r}")
                values[key] = float(value)
            elif key in cls._INTS:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ParamsError(f"kv_connector_extra_config[{key!r}] must be a non-negative int, got {value!r}")
                values[key] = value
            elif key in cls._STRS:
                if not isinstance(value, str):
                    raise ParamsError(f"kv_connector_extra_config[{key!r}] must be a string, got {value!r}")
                values[key] = value
            elif key == "engine_options":
                if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                             for k, v in value.items()):
                    raise ParamsError("kv_connector_extra_config['engine_options'] must map strings to strings")
                values[key] = dict(value)
            else:
                known = sorted(cls._FLOATS + cls._INTS + cls._STRS + ("engine_options",))
                raise ParamsError(f"kv_connector_extra_config has unknown key {key!r}; known: {', '.join(known)}")
        if "port" in values and not 0 < values["port"] < 65536:
            raise ParamsError(f"kv_connector_extra_config['port']={values['port']} is not a TCP port")
        return cls(**values)

    def engine_options_for(self, listen: tuple[str, int] | None) -> dict[str, str]:
        """kvpush ``LLMDataDist`` options for this worker's engine."""
        options = {"llm.SyncKvCacheWaitTime": str(self.sync_kv_timeout_ms), "kvpush.transport": self.transport}
        if listen is not None:
            host, port = listen
            options["llm.listenIpInfo"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self.auth_token:
            options["kvpush.auth_token"] = self.auth_token
        options.update(self.engine_options)
        return options


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
    listen; ``+ 2 * rank`` for the rank-th worker of an instance."""
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

    @classmethod
    def of(cls, host: str, port: int, cluster_id: int | None = None) -> PeerAddress:
        return cls(host, port, derive_cluster_id(host, port) if cluster_id is None else cluster_id)


# -- kv_transfer_params ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ConsumerParams:
    """A decode-side request: its KV comes from the prefill at ``remote``."""

    transfer_id: str
    remote: PeerAddress


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


def parse_params(params: Mapping[str, Any] | None,
                 default_remote: Callable[[], PeerAddress] | None = None) -> ConsumerParams | ProducerParams | None:
    """What a request's ``kv_transfer_params`` ask of this connector; None: nothing. Keys (NIXL's
    names where they exist): ``do_remote_prefill`` (decode side) with ``transfer_id`` and the prefill's
    ``remote_host``/``remote_port`` (default ``default_remote()``) and optional ``remote_cluster_id``;
    ``do_remote_decode`` (prefill side) with an optional ``transfer_id``. Raises ParamsError."""
    if not params:
        return None
    if not isinstance(params, Mapping):
        raise ParamsError(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
    if params.get("do_remote_prefill"):
        transfer_id = _transfer_id(params)
        if transfer_id is None:
            raise ParamsError("kv_transfer_params with do_remote_prefill need a 'transfer_id'")
        host, port, cluster_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_cluster_id")
        if host is None and port is None and default_remote is not None:
            remote = default_remote()
            host, port = remote.host, remote.port
            cluster_id = remote.cluster_id if cluster_id is None else cluster_id
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


# -- what the scheduler tells the workers each step ------------------------------------------------

@dataclass(frozen=True)
class RecvSpec:
    """Decode worker: receive ``transfer_id`` into ``blocks`` (the request's blocks from ``first_block``
    on, ``num_tokens`` prompt tokens in all). ``error``: the request cannot be received (report it
    failed at once, ``blocks`` as load errors)."""

    req_id: str
    transfer_id: str
    remote: PeerAddress
    first_block: int
    blocks: tuple[int, ...]
    num_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class SendStep:
    """Prefill worker: this step computes prompt tokens ``[computed_before, computed_after)`` of the
    request whose blocks are ``blocks`` (the whole list; new after a preemption: ``resumed``)."""

    req_id: str
    transfer_id: str
    blocks: tuple[int, ...]
    computed_before: int
    computed_after: int
    num_prompt_tokens: int
    resumed: bool = False


@dataclass(frozen=True)
class FinishedSend:
    """Prefill worker: the request finished (``ok``: normally, else aborted). ``delayed``: the
    scheduler kept its blocks, so the worker must report it in ``finished_sending``."""

    req_id: str
    transfer_id: str
    ok: bool
    delayed: bool


@dataclass
class StepMeta:
    """The connector metadata of one step (plain data: it may cross a process boundary)."""

    recv: list[RecvSpec] = field(default_factory=list)
    recv_aborted: list[str] = field(default_factory=list)
    send: list[SendStep] = field(default_factory=list)
    send_finished: list[FinishedSend] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.recv or self.recv_aborted or self.send or self.send_finished)


@dataclass(frozen=True)
class Scheduled:
    """One scheduled request of a step, as the adapter reads it from vLLM's SchedulerOutput:
    ``new_blocks`` are all its blocks for a new or ``resumed`` request, else the ones added this
    step (None: none); ``num_computed_tokens`` before this step."""

    req_id: str
    new_blocks: tuple[int, ...] | None
    resumed: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class _SchedRequest:
    req_id: str
    num_prompt_tokens: int
    consumer: ConsumerParams | None = None
    transfer_id: str = ""
    issued: bool = False  # consumer: a RecvSpec went to the worker
    blocks: list[int] = field(default_factory=list)  # producer
    handed: bool = False  # producer: a SendStep went to the worker


class SchedulerBook:
    """The scheduler side: which requests load or send, their block lists, and what to delay.

    ``produce``/``consume`` follow the instance's kv_role. ``local`` is this instance's own kvpush
    address (returned to the proxy by a prefill in ``request_finished``), ``default_remote`` the
    prefill a decode uses when the params name none.
    """

    def __init__(self, block_size: int, produce: bool, consume: bool, local: PeerAddress | None = None,
                 default_remote: Callable[[], PeerAddress] | None = None, name: str = "kvpush") -> None:
        if block_size < 1:
            raise ParamsError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.produce = produce
        self.consume = consume
        self.local = local
        self.default_remote = default_remote
        self.name = name
        self._requests: dict[str, _SchedRequest] = {}
        self._meta = StepMeta()
        self._pending_send: set[str] = set()  # producer requests whose blocks wait for finished_sending
        self._received: set[str] = set()  # consumer requests reported finished_recving

    # -- per request ---------------------------------------------------------------------------------
    def on_new_request(self, req_id: str, params: Mapping[str, Any] | None, num_prompt_tokens: int) -> None:
        """Note a request; one with unusable params is served locally (logged), never left waiting."""
        try:
            parsed = parse_params(params, self.default_remote)
        except ParamsError as error:
            log.warning("%s: request %s: %s; computing it locally", self.name, req_id, error)
            return
        if isinstance(parsed, ConsumerParams):
            if not self.consume:
                log.warning("%s: request %s asks to load remote KV but this instance is not a consumer", self.name,
                            req_id)
                return
            self._requests[req_id] = _SchedRequest(req_id, num_prompt_tokens, consumer=parsed,
                                                   transfer_id=parsed.transfer_id)
        elif isinstance(parsed, ProducerParams):
            if not self.produce:
                log.warning("%s: request %s asks to send its KV but this instance is not a producer", self.name,
                            req_id)
                return
            transfer_id = parsed.transfer_id or _local_transfer_id(self.name, req_id)
            self._requests[req_id] = _SchedRequest(req_id, num_prompt_tokens, transfer_id=transfer_id)

    def transfer_id(self, req_id: str) -> str | None:
        request = self._requests.get(req_id)
        return request.transfer_id if request is not None else None

    def matched_tokens(self, req_id: str, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens to load, asynchronously?) for vLLM's get_num_new_matched_tokens; side-effect free.
        A decode request claims every prompt token it does not hold, once."""
        request = self._requests.get(req_id)
        if request is None or request.consumer is None or request.issued:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks) with ``num_external_tokens`` to
        load: queue the decode worker's RecvSpec for the next step."""
        request = self._requests.get(req_id)
        if request is None or request.consumer is None or request.issued or num_external_tokens <= 0:
            return
        request.issued = True
        local_tokens = request.num_prompt_tokens - num_external_tokens
        first_block = local_tokens // self.block_size
        end_block = blocks_for(request.num_prompt_tokens, self.block_size)
        error = None
        if local_tokens < 0 or local_tokens % self.block_size:
            error = f"{local_tokens} locally computed tokens are not whole blocks of {self.block_size}"
            first_block = max(local_tokens, 0) // self.block_size
        elif len(block_ids) < end_block:
            error = f"{len(block_ids)} blocks allocated for {request.num_prompt_tokens} tokens"
        blocks = tuple(int(b) for b in block_ids[first_block:end_block])
        self._meta.recv.append(RecvSpec(req_id, request.transfer_id, request.consumer.remote, first_block, blocks,
                                        request.num_prompt_tokens, error))

    def build_step(self, scheduled: Iterable[Scheduled]) -> StepMeta:
        """This step's metadata: queued RecvSpecs and aborts, and a SendStep for every producer request
        computing prompt tokens in this step. Resets the queue."""
        meta = self._meta
        for item in scheduled:
            request = self._requests.get(item.req_id)
            if request is None or request.consumer is not None:
                continue
            if item.resumed or not request.handed:
                request.blocks = list(item.new_blocks or ())
            elif item.new_blocks:
                request.blocks.extend(item.new_blocks)
            before = item.num_computed_tokens
            if before >= request.num_prompt_tokens:
                continue  # decoding on the prefill instance: only prompt KV is sent
            after = min(before + item.num_scheduled_tokens, request.num_prompt_tokens)
            meta.send.append(SendStep(item.req_id, request.transfer_id, tuple(request.blocks), before, after,
                                      request.num_prompt_tokens, item.resumed and request.handed))
            request.handed = True
        self._meta = StepMeta()
        return meta

    def request_finished(self, req_id: str, ok: bool) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks?, kv_transfer_params for the output). A producer request the
        worker has seen keeps its blocks until the worker reports it settled; its params tell a
        proxy that sends the decode request afterwards where to get the KV."""
        request = self._requests.pop(req_id, None)
        if request is None:
            return False, None
        if request.consumer is not None:
            if request.issued and req_id not in self._received:
                self._meta.recv_aborted.append(req_id)  # vLLM keeps the blocks until finished_recving
            self._received.discard(req_id)
            return False, None
        delay = request.handed
        self._meta.send_finished.append(FinishedSend(req_id, request.transfer_id, ok, delay))
        if delay:
            self._pending_send.add(req_id)
        params = None
        if ok and self.local is not None:
            params = decode_request_params(request.transfer_id, self.local.host, self.local.port,
                                           self.local.cluster_id)
        return delay, params

    def connector_output(self, finished_sending: Iterable[str] = (), finished_recving: Iterable[str] = ()) -> None:
        self._pending_send.difference_update(finished_sending)
        for req_id in finished_recving:
            if req_id in self._requests:
                self._received.add(req_id)

    def has_pending_push_work(self) -> bool:
        return bool(self._pending_send)


def _local_transfer_id(name: str, req_id: str) -> str:
    candidate = f"{name}-{req_id}"
    if len(candidate.encode("utf-8")) <= MAX_TRANSFER_ID_BYTES:
        return candidate
    return f"{name[:32]}-{hashlib.blake2b(req_id.encode('utf-8'), digest_size=16).hexdigest()}"


# -- worker side: effects the books ask for --------------------------------------------------------

class ProducerEffects(Protocol):
    """What the prefill worker's book asks the engine to do. Results come back as calls on the book:
    ``on_push_done(push_id, error)`` for every started push, ``on_notified(transfer_id, error)`` for
    every ``notify``."""

    def start_push(self, push_id: int, peer: int, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   pipelined: bool) -> None:
        """Pipelined: a layer pusher whose layers come by ``push_layer`` and end with ``finish_push``;
        else push every layer now."""

    def push_layer(self, push_id: int, layer: int) -> None: ...

    def finish_push(self, push_id: int) -> None:
        """Every layer was pushed: wait for all of them, then report ``on_push_done``."""

    def cancel_push(self, push_id: int) -> None:
        """Stop the push; ``on_push_done`` follows once no byte of it can still land."""

    def notify(self, peer: int, data: bytes, transfer_id: str) -> None:
        """Send ``data`` on the peer's notification inbox, after every transfer that already ended."""

    def reply(self, peer: int, data: bytes) -> None:
        """Best-effort answer to the peer, on its notification inbox (about transfers this side does
        not have)."""


class ConsumerEffects(Protocol):
    """What the decode worker's book asks the engine to do; ``send_ids`` reports
    ``on_ids_sent(transfer_id, error, retryable, delivered_any)``."""

    def send_ids(self, remote: PeerAddress, frames: Sequence[bytes], transfer_id: str) -> None:
        """Link to ``remote`` if needed, then send ``frames`` in order, after anything sent before."""

    def send_abort(self, peer: int, data: bytes) -> None:
        """Best effort, ordered after earlier sends to that peer."""


Clock = Callable[[], float]


# -- prefill worker ---------------------------------------------------------------------------------

class ProducerState(enum.Enum):
    WAITING_IDS = "waiting for the decode's block ids"
    PUSHING = "pushing layers"
    DRAINING = "waiting for pushes to finish"
    NOTIFYING = "notifying the decode"
    RELEASABLE = "waiting for the request to finish"


@dataclass
class _Outgoing:
    transfer_id: str
    created: float
    req_id: str | None = None
    # from the decode
    peer: int | None = None
    first_block: int = 0
    dst_blocks: list[int] | None = None
    num_tokens: int = 0
    parts: list[int] = field(default_factory=list)
    parts_total: int = 0
    # from the prefill's scheduler
    blocks: list[int] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    computed_upto: int = 0
    step_after: int = 0
    pushed_upto: int = 0  # block index (in the prefill's list) below which every block was pushed
    finished: bool = False
    delayed: bool = False
    # progress
    pushes: set[int] = field(default_factory=set)
    failure: str | None = None
    outcome: Outcome = Outcome.LANDED
    notify_state: str = ""  # "", "sent", "done"
    ids_deadline: float | None = None


class ProducerBook:
    """The prefill worker's transfers, keyed by transfer id; see the module docstring.

    A transfer's blocks are released (its request reported in ``take_finished_sending``) only when
    the request finished in vLLM, no push of it is in flight and the decode was told the outcome (or
    cannot be). Block ids that never come are given up ``ids_timeout_s`` after the request finished;
    ids for a request not seen yet wait ``transfer_timeout_s``.
    """

    def __init__(self, block_size: int, num_layers: int, config: ConnectorConfig, clock: Clock,
                 effects: ProducerEffects) -> None:
        self.block_size = block_size
        self.num_layers = num_layers
        self.config = config
        self.clock = clock
        self.effects = effects
        self._transfers: dict[str, _Outgoing] = {}
        self._push_owner: dict[int, _Outgoing] = {}
        self._step: list[tuple[_Outgoing, int | None]] = []  # this step's transfers and their pipelined push
        self._step_layers: dict[int, set[int]] = {}
        self._next_push = 1
        self._finished_sending: set[str] = set()
        self._ended: OrderedDict[str, str] = OrderedDict()  # transfer id -> how it ended
        #: pushes_pipelined / pushes_after_forward / blocks_pushed / landed / failed / released
        self.stats: Counter[str] = Counter()

    # -- introspection -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._transfers)

    def state_of(self, transfer_id: str) -> ProducerState | None:
        t = self._transfers.get(transfer_id)
        if t is None:
            return None
        if t.pushes:
            return ProducerState.PUSHING if t.failure is None else ProducerState.DRAINING
        if t.notify_state == "sent":
            return ProducerState.NOTIFYING
        if t.failure is None and t.dst_blocks is None:
            return ProducerState.WAITING_IDS
        if t.failure is None and t.notify_state != "done":
            return ProducerState.PUSHING  # between the steps of a chunked prefill
        return ProducerState.RELEASABLE

    def ended(self, transfer_id: str) -> str | None:
        """How a released transfer ended ("landed" or the reason), while remembered."""
        return self._ended.get(transfer_id)

    # -- vLLM step hooks ---------------------------------------------------------------------------
    def begin_step(self, sends: Sequence[SendStep], finished: Sequence[FinishedSend] = ()) -> None:
        """Before the forward pass: start a pipelined push for every request whose decode blocks are
        known and whose blocks this step touches; then take note of finished requests."""
        for item in finished:
            self._finish(item)
        for send in sends:
            t = self._transfers.get(send.transfer_id)
            if t is None:
                t = self._transfers[send.transfer_id] = _Outgoing(send.transfer_id, self.clock())
                gone = self._ended.get(send.transfer_id)
                if gone is not None:  # its decode already gave up (and was answered): only keep the blocks
                    t.failure, t.outcome = f"ended before its request ran: {gone}", Outcome.UNKNOWN
                    t.notify_state = "done"
            if t.req_id is None:
                t.ids_deadline = None  # the request is here; its ids are awaited from when it finishes
            t.req_id = send.req_id
            t.blocks = list(send.blocks)
            if send.resumed:
                log.info("transfer %s: request %s was preempted; its blocks are pushed again", t.transfer_id,
                         send.req_id)
                t.pushed_upto = t.first_block
            if t.num_prompt_tokens is None:
                t.num_prompt_tokens = send.num_prompt_tokens
                self._check_tokens(t)
            t.computed_upto = send.computed_before
            t.step_after = send.computed_after
            push_id = None
            if t.failure is None and t.dst_blocks is not None:
                end = min(blocks_for(send.computed_after, self.block_size), self._end_block(t))
                push_id = self._start(t, t.pushed_upto, end, pipelined=True)
                t.pushed_upto = max(t.pushed_upto, self._end_block(t) if send.computed_after >= t.num_tokens
                                    else send.computed_after // self.block_size)
            self._step.append((t, push_id))

    def layer_saved(self, layer: int) -> None:
        """Layer ``layer``'s KV of this step is in memory: push it for every pipelined push."""
        for _, push_id in self._step:
            if push_id is not None and push_id in self._step_layers:
                self._step_layers[push_id].add(layer)
                self.effects.push_layer(push_id, layer)

    def end_step(self) -> None:
        """After the forward pass: every pipelined push gets its missing layers (a model whose layers
        did not all reach ``save_kv_layer``) and is finished; late block ids are served."""
        step, self._step = self._step, []
        for t, push_id in step:
            t.computed_upto = max(t.computed_upto, t.step_after)
            if push_id is not None and push_id in self._step_layers:
                for layer in range(self.num_layers):
                    if layer not in self._step_layers[push_id]:
                        self.effects.push_layer(push_id, layer)
                del self._step_layers[push_id]
                self.effects.finish_push(push_id)
        for t, _ in step:
            if t.transfer_id in self._transfers:
                self._settle(t)

    # -- engine events -----------------------------------------------------------------------------
    def on_message(self, peer: int, message: Message) -> None:
        if isinstance(message, BlockIds):
            self._on_ids(peer, message)
        elif isinstance(message, Abort):
            t = self._transfers.get(message.transfer_id)
            if t is None or t.peer not in (None, peer):
                log.debug("abort for transfer %s from cluster %d: nothing to abort", message.transfer_id, peer)
                if t is None:
                    self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.UNKNOWN, 0, "no such transfer")))
                return
            t.peer = peer
            self._fail(t, f"aborted by the decode ({message.reason or 'no reason given'})", Outcome.ABORTED)
        else:
            log.warning("prefill side got a %s message from cluster %d; ignored", type(message).__name__, peer)

    def on_push_done(self, push_id: int, error: str | None) -> None:
        t = self._push_owner.pop(push_id, None)
        if t is None:
            return
        t.pushes.discard(push_id)
        if error is not None:
            self._fail(t, f"push failed: {error}", Outcome.FAILED)
        else:
            self._settle(t)

    def on_notified(self, transfer_id: str, error: str | None) -> None:
        t = self._transfers.get(transfer_id)
        if t is None:
            return
        if error is not None:
            log.warning("transfer %s: could not tell the decode (cluster %s) the outcome: %s; it will time out",
                        transfer_id, t.peer, error)
        t.notify_state = "done"
        self._settle(t)

    def on_link_lost(self, peer: int, reason: str = "link closed") -> None:
        for t in [t for t in self._transfers.values() if t.peer == peer]:
            t.notify_state = t.notify_state or "done"  # nobody to tell
            self._fail(t, f"link to the decode (cluster {peer}) lost: {reason}", Outcome.FAILED)

    def poll(self) -> None:
        """Give up transfers whose request or block ids did not come in time."""
        now = self.clock()
        for t in [t for t in self._transfers.values() if t.ids_deadline is not None and now >= t.ids_deadline]:
            t.ids_deadline = None
            if t.failure is not None:
                continue
            if t.req_id is None:
                waited = self.config.transfer_timeout_s
                self._fail(t, f"its request did not reach this prefill within {waited:g} s", Outcome.UNKNOWN)
            elif t.dst_blocks is None:
                self._fail(t, f"no block ids from a decode within {self.config.ids_timeout_s:g} s", Outcome.FAILED)

    def take_finished_sending(self) -> set[str]:
        done, self._finished_sending = self._finished_sending, set()
        return done

    # -- internals ---------------------------------------------------------------------------------
    def _end_block(self, t: _Outgoing) -> int:
        """One past the last prefill block the decode wants."""
        return t.first_block + len(t.dst_blocks or ())

    def _start(self, t: _Outgoing, start: int, end: int, pipelined: bool) -> int | None:
        start = max(start, t.first_block)
        end = min(end, self._end_block(t), len(t.blocks))
        if start >= end or t.peer is None or t.dst_blocks is None:
            return None
        push_id = self._next_push
        self._next_push += 1
        src = t.blocks[start:end]
        dst = t.dst_blocks[start - t.first_block:end - t.first_block]
        t.pushes.add(push_id)
        self._push_owner[push_id] = t
        if pipelined:
            self._step_layers[push_id] = set()
        self.stats["pushes_pipelined" if pipelined else "pushes_after_forward"] += 1
        self.stats["blocks_pushed"] += len(src)
        self.effects.start_push(push_id, t.peer, src, dst, pipelined)
        return push_id

    def _finish(self, item: FinishedSend) -> None:
        t = self._transfers.get(item.transfer_id)
        if t is None:
            if item.delayed:  # never leak blocks, even for a request this book somehow lost
                self._finished_sending.add(item.req_id)
            return
        t.req_id = item.req_id
        t.finished = True
        t.delayed = item.delayed
        if not item.ok:
            self._fail(t, "the prefill request was aborted", Outcome.FAILED)
        elif not item.delayed:
            self._fail(t, "the prefill request ended before it was scheduled", Outcome.FAILED)
        elif t.dst_blocks is None and t.failure is None:
            t.ids_deadline = self.clock() + self.config.ids_timeout_s
        self._settle(t)

    def _on_ids(self, peer: int, message: BlockIds) -> None:
        t = self._transfers.get(message.transfer_id)
        if t is None:
            gone = self._ended.get(message.transfer_id)
            if gone is not None:
                self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.UNKNOWN, 0,
                                                     f"already ended: {gone}")))
                return
            if len(self._transfers) >= self.config.max_transfers:
                self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.FAILED, 0,
                                                     f"prefill tracks {len(self._transfers)} transfers already")))
                return
            t = self._transfers[message.transfer_id] = _Outgoing(message.transfer_id, self.clock())
            t.ids_deadline = t.created + self.config.transfer_timeout_s
        if t.peer is not None and t.peer != peer:
            self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.FAILED, 0,
                                                 f"transfer already belongs to cluster {t.peer}")))
            return
        t.peer = peer
        if t.failure is not None:
            self._settle(t)  # answers with the failure (once its pushes drained)
            return
        if t.dst_blocks is not None:
            self._fail(t, "block ids sent twice", Outcome.MISMATCH)
            return
        if message.block_size != self.block_size:
            self._fail(t, f"decode block size {message.block_size}, prefill {self.block_size}", Outcome.MISMATCH)
            return
        if message.offset != len(t.parts) or (t.parts and message.total != t.parts_total):
            self._fail(t, f"block id part at {message.offset} of {message.total} out of order", Outcome.MISMATCH)
            return
        t.parts.extend(message.blocks)
        t.parts_total = message.total
        if len(t.parts) < message.total:
            return
        if message.total != blocks_for(message.num_tokens, self.block_size) - message.first_block:
            self._fail(t, f"{message.total} blocks from block {message.first_block} do not cover "
                          f"{message.num_tokens} tokens", Outcome.MISMATCH)
            return
        t.dst_blocks, t.parts = t.parts, []
        t.first_block = message.first_block
        t.num_tokens = message.num_tokens
        t.pushed_upto = max(t.pushed_upto, t.first_block)
        if t.req_id is not None:
            t.ids_deadline = None
        if not self._check_tokens(t):
            return
        self._settle(t)

    def _check_tokens(self, t: _Outgoing) -> bool:
        if t.dst_blocks is not None and t.num_prompt_tokens is not None and t.num_tokens != t.num_prompt_tokens:
            self._fail(t, f"decode expects {t.num_tokens} prompt tokens, prefill has {t.num_prompt_tokens}",
                       Outcome.MISMATCH)
            return False
        return True

    def _fail(self, t: _Outgoing, reason: str, outcome: Outcome) -> None:
        if t.failure is None:
            t.failure, t.outcome = reason, outcome
            log.warning("transfer %s (request %s): %s", t.transfer_id, t.req_id, reason)
            for push_id in sorted(t.pushes):
                self.effects.cancel_push(push_id)
        self._settle(t)

    def _in_step(self, t: _Outgoing) -> bool:
        return any(item is t for item, _ in self._step)

    def _settle(self, t: _Outgoing) -> None:
        """Move ``t`` on as far as it can go now: catch-up pushes, the Done notification, release."""
        if t.pushes:
            return
        if t.failure is None:
            if t.dst_blocks is None:
                return
            if t.finished and t.computed_upto < t.num_tokens:
                self._fail(t, f"request finished with {t.computed_upto} of {t.num_tokens} prompt tokens computed",
                           Outcome.FAILED)
                return
            if not self._in_step(t):
                # Blocks every layer of which is in memory and that no later step writes: all of them
                # once the request finished, else the whole blocks below the computed tokens.
                limit = self._end_block(t) if t.finished else t.computed_upto // self.block_size
                if t.pushed_upto < limit:
                    start, t.pushed_upto = t.pushed_upto, limit
                    if self._start(t, start, limit, pipelined=False) is not None:
                        return
            if not t.finished or t.pushed_upto < self._end_block(t):
                return
        if t.peer is not None and not t.notify_state:
            t.notify_state = "sent"
            if t.failure is None:
                done = Done(t.transfer_id, Outcome.LANDED, len(t.dst_blocks or ()))
            else:
                done = Done(t.transfer_id, t.outcome, 0, t.failure)
            self.effects.notify(t.peer, encode(done), t.transfer_id)
            return
        if t.notify_state == "sent":
            return
        if t.req_id is not None and not t.finished:
            return  # the request still computes into (and owns) its blocks
        self._release(t)

    def _release(self, t: _Outgoing) -> None:
        del self._transfers[t.transfer_id]
        self.stats["released"] += 1
        self.stats["landed" if t.failure is None else "failed"] += 1
        if t.finished and t.delayed and t.req_id is not None:
            self._finished_sending.add(t.req_id)
        self._ended[t.transfer_id] = "landed" if t.failure is None else t.failure
        while len(self._ended) > TOMBSTONES:
            self._ended.popitem(last=False)
        log.debug("transfer %s (request %s) released: %s", t.transfer_id, t.req_id, self._ended[t.transfer_id])


# -- decode worker ----------------------------------------------------------------------------------

class ConsumerState(enum.Enum):
    SENDING_IDS = "sending block ids"
    WAITING_LANDED = "waiting for the landed notification"
    LANDED = "landed"
    FAILING = "failed; waiting for the prefill to confirm nothing more lands"
    FAILED = "failed"
    ABORTING = "aborted; waiting for the prefill to confirm nothing more lands"
    ABORTED = "aborted"


_REPORTABLE = (ConsumerState.LANDED, ConsumerState.FAILED, ConsumerState.ABORTED)


@dataclass(frozen=True)
class Received:
    """What the decode worker reports in one step: ``finished`` goes to vLLM's finished_recving (every
    ended transfer, failed ones included), ``failed`` to failed_recving, ``load_errors`` are the failed
    transfers' destination blocks (get_block_ids_with_load_errors)."""

    finished: set[str]
    failed: set[str]
    load_errors: set[int]
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 1.0


@dataclass
class _Incoming:
    spec: RecvSpec
    state: ConsumerState
    deadline: float
    grace_deadline: float = 0.0
    sending: bool = False  # a send_ids is in flight
    delivered: bool = False  # some of the ids may have reached the prefill
    retry_at: float | None = None
    backoff: float = _RETRY_FIRST_S
    reason: str = ""


class ConsumerBook:
    """The decode worker's transfers; see the module docstring.

    Every transfer ends reported exactly once by ``take_finished``: LANDED (the prefill's Done said
    every byte landed), FAILED (its blocks are load errors) or ABORTED (vLLM finished the request while
    it waited). A transfer whose ids may have reached the prefill is reported FAILED or ABORTED only
    once the prefill confirmed nothing more will land, the link to it is gone, or ``abort_grace_s``
    passed; every other wait ends at ``transfer_timeout_s``.
    """

    def __init__(self, block_size: int, config: ConnectorConfig, clock: Clock, effects: ConsumerEffects) -> None:
        self.block_size = block_size
        self.config = config
        self.clock = clock
        self.effects = effects
        self._transfers: dict[str, _Incoming] = {}
        self._by_req: dict[str, str] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()
        #: ids_sent / landed / failed / aborted
        self.stats: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._transfers)

    def state_of(self, transfer_id: str) -> ConsumerState | None:
        t = self._transfers.get(transfer_id)
        return t.state if t is not None else None

    def reason(self, transfer_id: str) -> str:
        t = self._transfers.get(transfer_id)
        return t.reason if t is not None else ""

    # -- vLLM step hooks ---------------------------------------------------------------------------
    def begin_step(self, recv: Sequence[RecvSpec], aborted: Sequence[str] = ()) -> None:
        now = self.clock()
        for spec in recv:
            if spec.transfer_id in self._transfers or spec.req_id in self._by_req:
                self._report_now(spec, "this transfer id is already being received")
                continue
            if spec.error is not None or len(self._transfers) >= self.config.max_transfers:
                reason = spec.error or f"{len(self._transfers)} transfers already in flight"
                self._report_now(spec, reason)
                continue
            t = _Incoming(spec, ConsumerState.SENDING_IDS, now + self.config.transfer_timeout_s)
            self._transfers[spec.transfer_id] = t
            self._by_req[spec.req_id] = spec.transfer_id
            self._send_ids(t)
        for req_id in aborted:
            transfer_id = self._by_req.get(req_id)
            waiting = self._transfers.get(transfer_id) if transfer_id is not None else None
            if waiting is not None:
                self._abort(waiting, now)

    def poll(self) -> None:
        """Deadlines and retries."""
        now = self.clock()
        for t in list(self._transfers.values()):
            if t.state in (ConsumerState.SENDING_IDS, ConsumerState.WAITING_LANDED):
                if now >= t.deadline:
                    self._give_up(t, f"not landed within {self.config.transfer_timeout_s:g} s", now)
                elif t.retry_at is not None and now >= t.retry_at and not t.sending:
                    t.retry_at = None
                    self._send_ids(t)
            elif t.state in (ConsumerState.FAILING, ConsumerState.ABORTING) and now >= t.grace_deadline:
                log.warning("transfer %s: no confirmation from the prefill within %g s; releasing its blocks anyway",
                            t.spec.transfer_id, self.config.abort_grace_s)
                self._end(t, ConsumerState.FAILED if t.state == ConsumerState.FAILING else ConsumerState.ABORTED)

    def take_finished(self) -> Received:
        """The requests to report this step (each exactly once), which of them failed, and their blocks."""
        received = Received(self._finished, self._failed, self._load_errors)
        self._finished, self._failed, self._load_errors = set(), set(), set()
        return received

    # -- engine events -----------------------------------------------------------------------------
    def on_ids_sent(self, transfer_id: str, error: str | None = None, retryable: bool = False,
                    delivered_any: bool = True) -> None:
        t = self._transfers.get(transfer_id)
        if t is None:
            return
        t.sending = False
        if error is None:
            t.delivered = True
            if t.state == ConsumerState.SENDING_IDS:
                t.state = ConsumerState.WAITING_LANDED
            return
        t.delivered = t.delivered or delivered_any
        now = self.clock()
        if t.state in (ConsumerState.ABORTING, ConsumerState.FAILING) and not t.delivered:
            # nothing reached the prefill, so nothing can land: no need to wait for its confirmation
            self._end(t, ConsumerState.ABORTED if t.state == ConsumerState.ABORTING else ConsumerState.FAILED)
        elif t.state != ConsumerState.SENDING_IDS:
            return
        elif retryable and not t.delivered and now + t.backoff < t.deadline:
            log.info("transfer %s: sending block ids failed (%s); again in %.2f s", transfer_id, error, t.backoff)
            t.retry_at = now + t.backoff
            t.backoff = min(t.backoff * 2, _RETRY_MAX_S)
        else:
            self._give_up(t, f"could not send block ids to {t.spec.remote.host}:{t.spec.remote.port}: {error}", now)

    def on_done(self, peer: int, message: Done) -> None:
        t = self._transfers.get(message.transfer_id)
        if t is None:
            log.debug("notification for transfer %s, which is not waiting here", message.transfer_id)
            return
        if peer != t.spec.remote.cluster_id:
            log.warning("transfer %s: notification from cluster %d, expected %d; ignored", message.transfer_id, peer,
                        t.spec.remote.cluster_id)
            return
        if t.state == ConsumerState.ABORTING:
            self._end(t, ConsumerState.ABORTED)
            return
        if t.state not in (ConsumerState.SENDING_IDS, ConsumerState.WAITING_LANDED, ConsumerState.FAILING):
            return
        if message.outcome == Outcome.LANDED and message.num_blocks == len(t.spec.blocks):
            self._end(t, ConsumerState.LANDED)  # even after our timeout: the bytes are there
            return
        if message.outcome == Outcome.LANDED:
            t.reason = f"prefill pushed {message.num_blocks} blocks, {len(t.spec.blocks)} expected"
        else:
            t.reason = t.reason or f"prefill reports {message.outcome.name}: {message.reason}"
        log.warning("transfer %s (request %s): %s", message.transfer_id, t.spec.req_id, t.reason)
        self._end(t, ConsumerState.FAILED)

    def on_message(self, peer: int, message: Message) -> None:
        if isinstance(message, Done):
            self.on_done(peer, message)
        else:
            log.warning("decode side got a %s message from cluster %d; ignored", type(message).__name__, peer)

    def on_link_lost(self, peer: int, reason: str = "link closed") -> None:
        for t in [t for t in self._transfers.values() if t.spec.remote.cluster_id == peer]:
            if t.state == ConsumerState.ABORTING:
                self._end(t, ConsumerState.ABORTED)
            elif t.state in (ConsumerState.WAITING_LANDED, ConsumerState.FAILING) or (
                    t.state == ConsumerState.SENDING_IDS and t.delivered):
                t.reason = t.reason or f"link to the prefill (cluster {peer}) lost: {reason}"
                log.warning("transfer %s (request %s): %s", t.spec.transfer_id, t.spec.req_id, t.reason)
                self._end(t, ConsumerState.FAILED)

    # -- internals ---------------------------------------------------------------------------------
    def _send_ids(self, t: _Incoming) -> None:
        spec = t.spec
        try:
            frames = block_id_messages(spec.transfer_id, self.block_size, spec.num_tokens, spec.first_block,
                                       spec.blocks)
        except MessageError as error:
            self._give_up(t, str(error), self.clock())
            return
        t.sending = True
        self.stats["ids_sent"] += 1
        self.effects.send_ids(spec.remote, frames, spec.transfer_id)

    def _give_up(self, t: _Incoming, reason: str, now: float) -> None:
        t.reason = t.reason or reason
        log.warning("transfer %s (request %s): %s", t.spec.transfer_id, t.spec.req_id, t.reason)
        if t.delivered or t.sending:
            t.state = ConsumerState.FAILING
            t.grace_deadline = now + self.config.abort_grace_s
            self.effects.send_abort(t.spec.remote.cluster_id, encode(Abort(t.spec.transfer_id, t.reason)))
        else:
            self._end(t, ConsumerState.FAILED)

    def _abort(self, t: _Incoming, now: float) -> None:
        if t.state in _REPORTABLE or t.state == ConsumerState.ABORTING:
            return
        if t.state == ConsumerState.FAILING:
            t.state = ConsumerState.ABORTING  # the abort already went out; vLLM no longer needs the blocks
            return
        t.reason = "request finished while waiting for its KV"
        if t.delivered or t.sending:
            t.state = ConsumerState.ABORTING
            t.grace_deadline = now + self.config.abort_grace_s
            self.effects.send_abort(t.spec.remote.cluster_id, encode(Abort(t.spec.transfer_id, t.reason)))
        else:
            self._end(t, ConsumerState.ABORTED)

    def _end(self, t: _Incoming, state: ConsumerState) -> None:
        t.state = state
        self.stats[state.name.lower()] += 1
        del self._transfers[t.spec.transfer_id]
        self._by_req.pop(t.spec.req_id, None)
        self._finished.add(t.spec.req_id)
        if state == ConsumerState.FAILED:
            self._failed.add(t.spec.req_id)
            self._load_errors.update(t.spec.blocks)
        log.debug("transfer %s (request %s): %s", t.spec.transfer_id, t.spec.req_id, state.value)

    def _report_now(self, spec: RecvSpec, reason: str) -> None:
        self.stats["failed"] += 1
        log.warning("request %s (transfer %s): %s", spec.req_id, spec.transfer_id, reason)
        self._finished.add(spec.req_id)
        self._failed.add(spec.req_id)
        self._load_errors.update(spec.blocks)
