"""The connector's wire messages and their codec: ``BlockIds`` (decode -> prefill: where the blocks go, and
which heads of them, ``LegInfo``), ``Abort`` (decode -> prefill: stop), ``Done`` (prefill -> decode, a
notification: how the transfer ended), and once per link ``Hello`` (decode -> prefill: its ``Geometry``)
and ``Welcome`` (prefill -> decode: its own, and a refusal if the two cannot exchange KV). Each is
versioned (``PROTOCOL_VERSION``) and bounded (``MAX_MESSAGE_BYTES``; ``block_id_messages`` splits a long
block list). Pure: bytes in, messages out; anything malformed raises ``MessageError``.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpush import MAX_MESSAGE_BYTES

from ...config import MAX_TRANSFER_ID_BYTES
from ...topology import Geometry, LegInfo

PROTOCOL_VERSION = 2  # 2: block ids carry their leg (tensor parallelism); Hello / Welcome
MAX_REASON_BYTES = 512
MAX_BLOCKS_PER_TRANSFER = 1 << 24


class MessageError(ValueError):
    """Bytes that are not a connector message of a version this side speaks."""


class Kind(enum.IntEnum):
    BLOCK_IDS = 1  # decode -> prefill: where the request's blocks go
    ABORT = 2  # decode -> prefill: stop; answer with Done once no byte of the transfer can still land
    DONE = 3  # prefill -> decode (a notification): the transfer ended, with its outcome
    HELLO = 4  # decode -> prefill, once per link: the decode worker's geometry
    WELCOME = 5  # prefill -> decode (a notification), the answer: the prefill worker's geometry, or a refusal


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
    (the decode already holds the first ``first_block`` blocks from its prefix cache). ``leg``: which
    heads (None: all of them, both sides holding the same heads)."""

    transfer_id: str
    block_size: int
    num_tokens: int
    first_block: int
    total: int
    offset: int
    blocks: tuple[int, ...]
    leg: LegInfo | None = None


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


@dataclass(frozen=True)
class Hello:
    """Decode -> prefill, when a decode worker links to a prefill worker: what its KV looks like."""

    geometry: Geometry
    transfer_id: str = "hello"


@dataclass(frozen=True)
class Welcome:
    """Prefill -> decode, the answer to ``Hello``: the prefill worker's geometry; ``refusal`` names each
    value that cannot be bridged ("" accepts)."""

    geometry: Geometry
    refusal: str = ""
    transfer_id: str = "welcome"


Message = BlockIds | Abort | Done | Hello | Welcome

_HEAD = struct.Struct("<4sBB")  # magic, version, kind
_MAGIC = b"KVPC"
_IDS = struct.Struct("<IIIIII")  # block_size, num_tokens, first_block, total, offset, count
_LEG = struct.Struct("<HHHHH")  # src_head, dst_head, heads, dst_local (0: no leg, all heads), legs
_JSON = struct.Struct("<H")  # a Hello's / Welcome's JSON length
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
        leg = message.leg
        try:
            leg_bytes = _LEG.pack(0, 0, 0, 0, 1) if leg is None else _LEG.pack(
                leg.src_head, leg.dst_head, leg.heads, leg.dst_local, leg.legs)
        except struct.error as error:
            raise MessageError(f"leg out of range: {leg}") from error
        if leg is not None and (leg.dst_local < 1 or leg.dst_head + leg.heads > leg.dst_local or leg.legs < 1):
            raise MessageError(f"leg out of range: {leg}")
        body = (_IDS.pack(message.block_size, message.num_tokens, message.first_block, message.total, message.offset,
                          len(message.blocks)) + leg_bytes + struct.pack(f"<{len(message.blocks)}I", *message.blocks))
        kind = Kind.BLOCK_IDS
    elif isinstance(message, Abort):
        reason = _text(message.reason, MAX_REASON_BYTES)
        body, kind = _REASON.pack(len(reason)) + reason, Kind.ABORT
    elif isinstance(message, Done):
        reason = _text(message.reason, MAX_REASON_BYTES)
        body, kind = _DONE.pack(int(message.outcome), message.num_blocks, len(reason)) + reason, Kind.DONE
    elif isinstance(message, (Hello, Welcome)):
        fields: dict[str, Any] = {"geometry": message.geometry.to_wire()}
        if isinstance(message, Welcome):
            fields["refusal"] = message.refusal[:MAX_REASON_BYTES]
        text = json.dumps(fields).encode("utf-8")
        body, kind = _JSON.pack(len(text)) + text, Kind.HELLO if isinstance(message, Hello) else Kind.WELCOME
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
    kind, transfer_id, at = _head(data)
    try:
        return _DECODERS[kind](data, at, transfer_id)
    except struct.error as error:
        raise MessageError(f"{kind.name} message truncated: {error}") from None


def _head(data: bytes) -> tuple[Kind, str, int]:
    """A message's kind, transfer id and where its body starts."""
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
    return kind, transfer_id, at + tid_len


def _block_ids(data: bytes, at: int, transfer_id: str) -> BlockIds:
    block_size, num_tokens, first_block, total, offset, count = _IDS.unpack_from(data, at)
    at += _IDS.size
    src_head, dst_head, heads, dst_local, legs = _LEG.unpack_from(data, at)
    at += _LEG.size
    leg = None if dst_local == 0 else LegInfo(src_head, dst_head, heads, dst_local, legs)
    if leg is not None and (dst_head + heads > dst_local or legs < 1):
        raise MessageError(f"BLOCK_IDS leg out of range: {leg}")
    if at + 4 * count != len(data):
        raise MessageError(f"BLOCK_IDS says {count} ids, carries {(len(data) - at) / 4:g}")
    blocks = struct.unpack_from(f"<{count}I", data, at)
    if block_size == 0 or total > MAX_BLOCKS_PER_TRANSFER or offset + count > total:
        raise MessageError(f"BLOCK_IDS geometry out of range (block_size={block_size}, total={total}, "
                           f"offset={offset}, count={count})")
    return BlockIds(transfer_id, block_size, num_tokens, first_block, total, offset, blocks, leg)


def _abort(data: bytes, at: int, transfer_id: str) -> Abort:
    (length,) = _REASON.unpack_from(data, at)
    at += _REASON.size
    if at + length != len(data) or length > MAX_REASON_BYTES:
        raise MessageError("ABORT reason length does not match the message")
    return Abort(transfer_id, data[at:].decode("utf-8", "replace"))


def _greeting(kind: Kind, data: bytes, at: int) -> tuple[Geometry, dict[str, Any]]:
    """A Hello's or Welcome's geometry and JSON fields."""
    (length,) = _JSON.unpack_from(data, at)
    at += _JSON.size
    if at + length != len(data):
        raise MessageError(f"{kind.name} length does not match the message")
    try:
        fields = json.loads(data[at:].decode("utf-8"))
        geometry = Geometry.from_wire(fields.get("geometry") if isinstance(fields, dict) else None)
    except (ValueError, UnicodeDecodeError) as error:
        raise MessageError(f"{kind.name}: {error}") from None
    return geometry, fields


def _hello(data: bytes, at: int, transfer_id: str) -> Hello:
    geometry, _ = _greeting(Kind.HELLO, data, at)
    return Hello(geometry, transfer_id)


def _welcome(data: bytes, at: int, transfer_id: str) -> Welcome:
    geometry, fields = _greeting(Kind.WELCOME, data, at)
    return Welcome(geometry, str(fields.get("refusal", "")), transfer_id)


def _done(data: bytes, at: int, transfer_id: str) -> Done:
    outcome_value, num_blocks, length = _DONE.unpack_from(data, at)
    at += _DONE.size
    if at + length != len(data) or length > MAX_REASON_BYTES:
        raise MessageError("DONE reason length does not match the message")
    try:
        outcome = Outcome(outcome_value)
    except ValueError:
        raise MessageError(f"unknown outcome {outcome_value}") from None
    return Done(transfer_id, outcome, num_blocks, data[at:].decode("utf-8", "replace"))


_DECODERS: dict[Kind, Callable[[bytes, int, str], Message]] = {
    Kind.BLOCK_IDS: _block_ids, Kind.ABORT: _abort, Kind.HELLO: _hello, Kind.WELCOME: _welcome,
    Kind.DONE: _done}


def block_id_messages(transfer_id: str, block_size: int, num_tokens: int, first_block: int,
                      blocks: Sequence[int], limit: int = MAX_MESSAGE_BYTES, leg: LegInfo | None = None) -> list[bytes]:
    """The destination block list as messages of at most ``limit`` bytes each, in order (one
    message up to ~16 000 blocks at 64 KiB), each carrying ``leg``. An empty list is one message with no
    ids."""
    if len(blocks) > MAX_BLOCKS_PER_TRANSFER:
        raise MessageError(f"{len(blocks)} blocks exceed {MAX_BLOCKS_PER_TRANSFER} per transfer")
    overhead = _HEAD.size + 1 + len(transfer_id.encode("utf-8")) + _IDS.size + _LEG.size
    per_message = (limit - overhead) // 4
    if per_message < 1:
        raise MessageError(f"limit of {limit} bytes leaves no room for a block id")
    parts = []
    for offset in range(0, max(len(blocks), 1), per_message):
        chunk = tuple(int(b) for b in blocks[offset:offset + per_message])
        parts.append(encode(BlockIds(transfer_id, block_size, num_tokens, first_block, len(blocks), offset, chunk,
                                     leg)))
    return parts
