"""Sans-I/O wire format: frame headers, message kinds and their metadata codecs.

Every message is one frame::

    header  24 bytes  <H B B I Q Q : magic, kind, flags, meta_len, request_id, payload_len
    meta    meta_len bytes (JSON for control messages, a packed struct for transfers)
    payload payload_len bytes (block bytes of a WRITE or READ_DATA; empty otherwise)

A transfer request (WRITE / READ, or WRITE_INTENT / READ_INTENT for one-sided transports, which the
receiver answers with a GRANT before the sender copies; LANDED follows the copy) names the peer's
cache by id, the first tensor and the number
of tensors of one layer, and the merged runs ``(offset, length)`` within each tensor, so its size
grows with runs, never with tensors x blocks. The payload is tensor-major: every run of the first
tensor, then every run of the next.

Nothing here touches a socket: the functions build and check bytes, and raise ``ProtocolError``
for anything a well-behaved peer never sends. A ``ProtocolError`` closes the link that produced it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from .layout import RUN_DTYPE, IoVec, Runs, unpack_wire_runs

PROTOCOL_VERSION = 1
MAGIC = 0x4B50  # "KP"
HEADER = struct.Struct("<HBBIQQ")
HEADER_SIZE = HEADER.size
TRANSFER_META = struct.Struct("<QIIIi")
_TRANSFER_HEAD = struct.Struct("<HBBIQQ" + "QIIIi")  # HEADER then TRANSFER_META, packed in one call
STATUS_META = struct.Struct("<I")
_STATUS_FRAME = struct.Struct("<HBBIQQ" + "I")  # HEADER then STATUS_META: an answer without a message, in one call

MAX_JSON_META = 1 << 20
MAX_RUNS = 1 << 20
MAX_TRANSFER_META = TRANSFER_META.size + MAX_RUNS * 16
MAX_OFFER_ENTRIES = 1 << 20  # a READ_OFFER's source entries (tensors x runs); more go as ordinary writes
MAX_READ_OFFER_META = MAX_TRANSFER_META + MAX_OFFER_ENTRIES * 16
MAX_STATUS_META = STATUS_META.size + 4096
MESSAGE_META = struct.Struct("<B")  # the channel: 0 message, 1 notification
MAX_MESSAGE_DATA = 64 << 10
MAX_MESSAGE_META = MESSAGE_META.size + MAX_MESSAGE_DATA


class ProtocolError(Exception):
    """The peer sent something no conforming peer sends; the link must be closed."""


class Kind(IntEnum):
    HELLO = 1
    AUTH = 2
    READY = 3
    TABLE = 4
    TABLE_REQUEST = 5
    PING = 6
    PONG = 7
    WRITE = 8
    DONE = 9
    READ = 10
    READ_DATA = 11
    BYE = 12
    # one-sided (same-host) transfers: ask, get a grant, copy, tell
    WRITE_INTENT = 13
    READ_INTENT = 14
    GRANT = 15
    LANDED = 16
    # standing same-host write grants ("leases") for one cache: request, grant, refuse, revoke, revoked
    LEASE = 17
    # a leased write already copied: what landed where, so the receiver validates and counts it
    WRITE_NOTICE = 18
    # a small message or a transfer's completion notification to the peer (SPEC 10), and its answer
    MESSAGE = 19
    MESSAGE_ACK = 20
    # the sender pulled a batch slot that a cache key of the receiver names (the receiver may drop the key)
    RELEASE_KEY = 21
    # same host: a write whose bytes the receiver copies itself, out of the sender's memory (the sender goes
    # on computing); answered with DONE once they are in the receiver's memory
    READ_OFFER = 22


JSON_KINDS = frozenset({Kind.HELLO, Kind.AUTH, Kind.READY, Kind.TABLE, Kind.TABLE_REQUEST,
                        Kind.PING, Kind.PONG, Kind.BYE, Kind.LEASE, Kind.RELEASE_KEY})
PAYLOAD_KINDS = frozenset({Kind.WRITE, Kind.READ_DATA})
TRANSFER_KINDS = frozenset({Kind.WRITE, Kind.READ, Kind.WRITE_INTENT, Kind.READ_INTENT, Kind.WRITE_NOTICE})


@dataclass(slots=True)  # not frozen: made on every transfer, and a frozen __init__ sets each field slowly
class FrameHeader:
    kind: Kind
    flags: int
    meta_len: int
    request_id: int
    payload_len: int


def encode_header(kind: Kind, request_id: int, meta_len: int, payload_len: int, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, int(kind), flags, meta_len, request_id, payload_len)


def _meta_limit(kind: Kind) -> int:
    if kind in JSON_KINDS:
        return MAX_JSON_META
    if kind == Kind.MESSAGE:
        return MAX_MESSAGE_META
    if kind in TRANSFER_KINDS:
        return MAX_TRANSFER_META
    if kind == Kind.READ_OFFER:
        return MAX_READ_OFFER_META
    return MAX_STATUS_META


# kind byte -> (kind, the most meta it may carry, whether it may carry a payload): one lookup per frame
_KINDS = {int(kind): (kind, _meta_limit(kind), kind in PAYLOAD_KINDS) for kind in Kind}


def decode_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and bound-check a header. Raises ProtocolError for anything malformed."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"header is {len(data)} bytes, expected {HEADER_SIZE}")
    magic, kind_value, flags, meta_len, request_id, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:04x}")
    known = _KINDS.get(kind_value)
    if known is None:
        raise ProtocolError(f"unknown frame kind {kind_value}")
    kind, limit, carries_payload = known
    if meta_len > limit:
        raise ProtocolError(f"{kind.name} meta of {meta_len} bytes exceeds {limit}")
    if payload_len and not carries_payload:
        raise ProtocolError(f"{kind.name} frame carries a payload of {payload_len} bytes")
    return FrameHeader(kind, flags, meta_len, request_id, payload_len)


# -- control messages (JSON) -------------------------------------------------------------------

def encode_json(kind: Kind, request_id: int, body: dict[str, Any]) -> bytes:
    meta = json.dumps(body, separators=(",", ":")).encode()
    return encode_header(kind, request_id, len(meta), 0) + meta


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"non-finite number {name} in JSON meta")


def decode_json(kind: Kind, meta: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        body = json.loads(bytes(meta), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ProtocolError(f"{kind.name} meta is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind.name} meta is not a JSON object")
    return body


# -- transfers ---------------------------------------------------------------------------------

class TransferMeta:
    """What a WRITE or READ addresses in the receiver's registry: ``num_tensors`` tensors from
    ``first_tensor`` of cache ``cache_id``, the same ``runs`` (``layout.Runs`` of (offset, length)) in each."""

    __slots__ = ("cache_id", "first_tensor", "num_tensors", "runs", "budget_ms")

    def __init__(self, cache_id: int, first_tensor: int, num_tensors: int, runs: Runs, budget_ms: int = 0) -> None:
        self.cache_id = cache_id
        self.first_tensor = first_tensor
        self.num_tensors = num_tensors
        self.runs = runs
        self.budget_ms = budget_ms

    @property
    def offsets(self) -> np.ndarray[Any, Any]:
        return self.runs.column(0)

    @property
    def lengths(self) -> np.ndarray[Any, Any]:
        return self.runs.length

    @property
    def payload_len(self) -> int:
        return self.num_tensors * self.runs.bytes_per_tensor


def encode_transfer(kind: Kind, request_id: int, cache_id: int, first_tensor: int,  # noqa: PLR0913
                    num_tensors: int, runs_wire: bytes, payload_len: int, budget_ms: int = 0) -> bytes:
    """Header + meta of a transfer frame (a WRITE's payload follows), one parameter per field."""
    n_runs = len(runs_wire) >> 4
    return _TRANSFER_HEAD.pack(MAGIC, kind, 0, TRANSFER_META.size + len(runs_wire), request_id, payload_len, cache_id,
                               first_tensor, num_tensors, n_runs, budget_ms) + runs_wire


_KIND_WRITE = Kind.WRITE  # (bound once: an enum class's attribute is looked up anew on each use)


def decode_transfer(header: FrameHeader, meta: bytes | bytearray | memoryview) -> TransferMeta:
    if len(meta) < TRANSFER_META.size:
        raise ProtocolError(f"{header.kind.name} meta of {len(meta)} bytes is truncated")
    cache_id, first_tensor, num_tensors, n_runs, budget_ms = TRANSFER_META.unpack_from(meta)
    if len(meta) != TRANSFER_META.size + 16 * n_runs:
        raise ProtocolError(f"{header.kind.name} meta length {len(meta)} does not match {n_runs} runs")
    if n_runs == 0 or num_tensors == 0:
        raise ProtocolError(f"{header.kind.name} addresses no bytes")
    runs = unpack_wire_runs(meta, TRANSFER_META.size, n_runs)
    expected = num_tensors * runs.bytes_per_tensor
    if header.kind is _KIND_WRITE and expected != header.payload_len:
        raise ProtocolError(f"WRITE payload_len {header.payload_len} != runs total {expected}")
    return TransferMeta(cache_id, first_tensor, num_tensors, runs, budget_ms)


#: READ_OFFER flag: more offers follow soon (the next layers of a layer-pipelined request), so the receiver may
#: hold this one's DONE and send it with a later one (``read_offers.ReadOffers.send_held``): the sender's event loop
#: then wakes once per layer, not twice.
OFFER_MORE = 0x01
# the offer ends with a ``GATE``: its bytes may be copied once the sender's word at that address holds the
# token (``kvpush.marks``); the token's complement withdraws the offer
OFFER_GATED = 0x02
GATE = struct.Struct("<QQ")  # (the mark's address in the sender's memory, the token)
_OFFER_FLAGS_AT = 3  # the flags byte of a frame header (``HEADER``: magic, kind, flags, ...)


def encode_read_offer(request_id: int, cache_id: int, first_tensor: int, num_tensors: int,  # noqa: PLR0913
                      runs_wire: bytes, budget_ms: int, source: bytes, more: bool = False,
                      gate: tuple[int, int] | None = None) -> bytes:
    """A READ_OFFER: a transfer's meta (where the bytes go in the receiver's cache, as for a WRITE) followed
    by ``source``, the packed ``(address, length)`` entries in the sender's memory to read them from, one
    per destination entry (tensor-major, like the destination's). ``more``: the ``OFFER_MORE`` flag;
    ``gate``: ``(address, token)`` of the sender's mark (``OFFER_GATED``)."""
    tail = b"" if gate is None else GATE.pack(*gate)
    flags = (OFFER_MORE if more else 0) | (0 if gate is None else OFFER_GATED)
    return _TRANSFER_HEAD.pack(MAGIC, Kind.READ_OFFER, flags,
                               TRANSFER_META.size + len(runs_wire) + len(source) + len(tail), request_id, 0, cache_id,
                               first_tensor, num_tensors, len(runs_wire) >> 4, budget_ms) + runs_wire + source + tail


def offer_flags(frame: bytes, more: bool) -> bytes:
    """An encoded READ_OFFER with its ``OFFER_MORE`` flag set or cleared (the rest unchanged)."""
    flags = frame[_OFFER_FLAGS_AT] & ~OFFER_MORE | (OFFER_MORE if more else 0)
    return frame[:_OFFER_FLAGS_AT] + bytes((flags,)) + frame[_OFFER_FLAGS_AT + 1:]


def decode_read_offer(header: FrameHeader, meta: bytes | bytearray | memoryview
                      ) -> tuple[TransferMeta, IoVec, tuple[int, int] | None]:
    """A READ_OFFER's transfer, its source vector and its gate (``OFFER_GATED``, else None); ``ProtocolError``
    unless the source has one entry per destination entry, each as long as the run it fills."""
    if len(meta) < TRANSFER_META.size:
        raise ProtocolError(f"READ_OFFER meta of {len(meta)} bytes is truncated")
    _, _, num_tensors, n_runs, _ = TRANSFER_META.unpack_from(meta)
    runs_end = TRANSFER_META.size + 16 * n_runs
    entries = num_tensors * n_runs
    gated = bool(header.flags & OFFER_GATED)
    if len(meta) != runs_end + 16 * entries + (GATE.size if gated else 0):
        raise ProtocolError(f"READ_OFFER meta length {len(meta)} does not match {n_runs} runs x {num_tensors} tensors")
    transfer = decode_transfer(header, memoryview(meta)[:runs_end])
    source = np.frombuffer(meta, RUN_DTYPE, count=2 * entries, offset=runs_end).reshape(-1, 2)
    if not np.array_equal(source[:, 1].reshape(num_tensors, n_runs), np.broadcast_to(
            transfer.lengths.astype(RUN_DTYPE, copy=False), (num_tensors, n_runs))):
        raise ProtocolError("READ_OFFER source entries do not match the runs they fill")
    gate: tuple[int, int] | None = GATE.unpack_from(meta, runs_end + 16 * entries) if gated else None
    return transfer, IoVec.of_array(source.astype(np.uint64)), gate


def encode_status(kind: Kind, request_id: int, status: int, message: str = "", payload_len: int = 0) -> bytes:
    """DONE (reply to WRITE), READ_DATA (reply to READ; payload follows when status is 0), GRANT
    (reply to an intent) or LANDED (the one-sided copy finished, status 0, or was abandoned)."""
    if not message:  # the common answer, in one call
        return _STATUS_FRAME.pack(MAGIC, kind, 0, STATUS_META.size, request_id, payload_len, status & 0xFFFFFFFF)
    text = message.encode()[:4096]
    meta = STATUS_META.pack(status & 0xFFFFFFFF) + text
    return encode_header(kind, request_id, len(meta), payload_len) + meta


def decode_status(header: FrameHeader, meta: bytes | bytearray | memoryview) -> tuple[int, str]:
    if len(meta) < STATUS_META.size:
        raise ProtocolError(f"{header.kind.name} meta of {len(meta)} bytes is truncated")
    (status,) = STATUS_META.unpack_from(meta)
    if len(meta) == STATUS_META.size:  # the common answer: no message
        return status, ""
    return status, bytes(meta[STATUS_META.size:]).decode(errors="replace")


def encode_message(request_id: int, channel: int, data: bytes) -> bytes:
    """A MESSAGE frame: the channel byte, then the data (at most ``MAX_MESSAGE_DATA`` bytes)."""
    meta = MESSAGE_META.pack(channel) + data
    return encode_header(Kind.MESSAGE, request_id, len(meta), 0) + meta


def decode_message(meta: bytes | bytearray | memoryview) -> tuple[int, bytes]:
    if len(meta) < MESSAGE_META.size:
        raise ProtocolError("MESSAGE meta is truncated")
    (channel,) = MESSAGE_META.unpack_from(meta)
    if channel not in (0, 1):
        raise ProtocolError(f"MESSAGE on unknown channel {channel}")
    return channel, bytes(meta[MESSAGE_META.size:])


# -- cache keys ----------------------------------------------------------------------------------
# A TABLE entry of a contiguous cache may list the cache keys naming its batch slots: "keys": [[kind, id,
# model_id, slot, released_on_pull], ...] (kind 0: id is a request id, 1: a prefix id). A peer that lists
# keys understands RELEASE_KEY, and a peer sends RELEASE_KEY only for keys it read in such a table, so an
# engine that predates cache keys never receives one (same protocol version).

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class KeyRelease:
    """RELEASE_KEY: the sender pulled tensors ``[first_tensor, first_tensor + num_tensors)`` of batch
    slot ``slot`` of the receiver's cache ``cache_id``, the slot cache key ``name`` (kind, id, model id)
    names. Sent after the pull's last byte arrived; never answered."""

    name: tuple[int, int, int]
    cache_id: int
    slot: int
    first_tensor: int
    num_tensors: int


def encode_release_key(release: KeyRelease) -> bytes:
    return encode_json(Kind.RELEASE_KEY, 0, {"key": list(release.name), "cache": release.cache_id,
                                             "slot": release.slot,
                                             "tensors": [release.first_tensor, release.num_tensors]})


def decode_release_key(body: dict[str, Any]) -> KeyRelease:
    """A RELEASE_KEY body, checked for shape and ranges (the receiver checks it against its registry)."""
    key, cache_id, slot, tensors = body.get("key"), body.get("cache"), body.get("slot"), body.get("tensors")

    def ints(value: object, count: int) -> bool:
        return isinstance(value, list) and len(value) == count and all(type(v) is int for v in value)

    if not (ints(key, 3) and ints(tensors, 2) and type(cache_id) is int and type(slot) is int):
        raise ProtocolError(f"malformed RELEASE_KEY {body!r}")
    assert isinstance(key, list) and isinstance(tensors, list) and isinstance(cache_id, int) and isinstance(slot, int)
    kind, key_id, model_id = key
    first, count = tensors
    if (kind not in (0, 1) or not 0 <= key_id < _U64 or not 0 <= model_id <= _U64 or not 0 < cache_id < (1 << 63)
            or not 0 <= slot < (1 << 48) or not 0 <= first < (1 << 31) or not 0 < count <= (1 << 31)):
        raise ProtocolError(f"RELEASE_KEY out of range: {body!r}")
    return KeyRelease((kind, key_id, model_id), cache_id, slot, first, count)
