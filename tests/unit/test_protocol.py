"""kvpush/protocol.py: frame encoding and the checks on what a peer sends."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.layout import pack_runs
from kvpush.protocol import (
    HEADER_SIZE,
    OFFER_GATED,
    OFFER_MORE,
    KeyRelease,
    Kind,
    ProtocolError,
    decode_header,
    decode_json,
    decode_read_offer,
    decode_release_key,
    decode_status,
    decode_transfer,
    encode_header,
    encode_json,
    encode_read_offer,
    encode_release_key,
    encode_status,
    encode_transfer,
    offer_flags,
)


def test_header_round_trip() -> None:
    header = decode_header(encode_header(Kind.WRITE, 77, 40, 1 << 33))
    assert (header.kind, header.request_id, header.meta_len, header.payload_len) == (Kind.WRITE, 77, 40, 1 << 33)


def test_json_round_trip() -> None:
    frame = encode_json(Kind.HELLO, 0, {"cluster_id": 5})
    header = decode_header(frame[:HEADER_SIZE])
    assert decode_json(header.kind, frame[HEADER_SIZE:]) == {"cluster_id": 5}


def test_transfer_round_trip() -> None:
    runs = pack_runs(np.array([0, 8192], np.uint64), np.array([4096, 4096], np.uint64))
    frame = encode_transfer(Kind.WRITE, 3, 9, 4, 2, runs, 2 * 8192, budget_ms=1000)
    header = decode_header(frame[:HEADER_SIZE])
    meta = decode_transfer(header, frame[HEADER_SIZE:])
    assert (meta.cache_id, meta.first_tensor, meta.num_tensors, meta.budget_ms) == (9, 4, 2, 1000)
    assert meta.offsets.tolist() == [0, 8192] and meta.lengths.tolist() == [4096, 4096]
    assert meta.payload_len == header.payload_len


def read_offer(source: list[list[int]], lengths: tuple[int, ...] = (4096, 100), tensors: int = 2) -> bytes:
    runs = pack_runs(np.array([0, 8192][:len(lengths)], np.uint64), np.array(lengths, np.uint64))
    return encode_read_offer(5, 9, 4, tensors, runs, 300, np.array(source, np.uint64).tobytes())


def test_a_read_offer_round_trips_with_one_source_entry_per_destination_entry() -> None:
    source = [[0x1000, 4096], [0x9000, 100], [0x20000, 4096], [0x30000, 100]]  # tensor-major, like the runs
    frame = read_offer(source)
    header = decode_header(frame[:HEADER_SIZE])
    assert header.kind == Kind.READ_OFFER and header.payload_len == 0
    meta, vector, gate = decode_read_offer(header, frame[HEADER_SIZE:])
    assert (meta.cache_id, meta.first_tensor, meta.num_tensors, meta.budget_ms) == (9, 4, 2, 300)
    assert meta.offsets.tolist() == [0, 8192] and meta.lengths.tolist() == [4096, 100]
    assert vector.tolist() == source and vector.nbytes == 2 * 4196 and gate is None


def test_a_gated_read_offer_carries_its_mark_after_the_source() -> None:
    source = [[0x1000, 4096], [0x9000, 100], [0x20000, 4096], [0x30000, 100]]
    runs = pack_runs(np.array([0, 8192], np.uint64), np.array([4096, 100], np.uint64))
    gated = encode_read_offer(5, 9, 4, 2, runs, 300, np.array(source, np.uint64).tobytes(), more=True,
                              gate=(0x7F00_0000_1000, (1 << 64) - 5))
    header = decode_header(gated[:HEADER_SIZE])
    assert header.flags == OFFER_MORE | OFFER_GATED
    meta, vector, gate = decode_read_offer(header, gated[HEADER_SIZE:])
    assert vector.tolist() == source and gate == (0x7F00_0000_1000, (1 << 64) - 5) and meta.budget_ms == 300
    assert offer_flags(gated, more=False)[HEADER_SIZE:] == gated[HEADER_SIZE:]  # the gate stays
    with pytest.raises(ProtocolError):  # the flag without the gate
        decode_read_offer(header, read_offer(source)[HEADER_SIZE:])


def test_a_read_offer_says_whether_more_follow_and_only_that_flag_changes() -> None:
    source = [[0x1000, 4096], [0x9000, 100], [0x20000, 4096], [0x30000, 100]]
    runs = pack_runs(np.array([0, 8192], np.uint64), np.array([4096, 100], np.uint64))
    more = encode_read_offer(5, 9, 4, 2, runs, 300, np.array(source, np.uint64).tobytes(), more=True)
    assert decode_header(more[:HEADER_SIZE]).flags == OFFER_MORE
    assert not decode_header(read_offer(source)[:HEADER_SIZE]).flags
    last = offer_flags(more, more=False)
    assert last == read_offer(source) and offer_flags(last, more=True) == more
    header = decode_header(more[:HEADER_SIZE])
    assert decode_read_offer(header, more[HEADER_SIZE:])[1].tolist() == source


@pytest.mark.parametrize("source,cut", [
    ([[0x1000, 4096], [0x9000, 100], [0x20000, 4096], [0x30000, 99]], 0),   # a source shorter than its run
    ([[0x1000, 4096], [0x9000, 100], [0x20000, 4096]], 0),                  # an entry missing
    ([[0x1000, 4096], [0x9000, 100], [0x20000, 4096], [0x30000, 100]], 1),  # truncated
])
def test_a_read_offer_whose_source_does_not_match_its_runs_is_a_protocol_error(source: list[list[int]],
                                                                               cut: int) -> None:
    frame = read_offer(source)
    header = decode_header(frame[:HEADER_SIZE])
    with pytest.raises(ProtocolError):
        decode_read_offer(header, frame[HEADER_SIZE:len(frame) - cut])


def test_status_round_trip() -> None:
    frame = encode_status(Kind.DONE, 8, 0x5010B002, "no such cache")
    header = decode_header(frame[:HEADER_SIZE])
    assert decode_status(header, frame[HEADER_SIZE:]) == (0x5010B002, "no such cache")


@pytest.mark.parametrize("data", [
    b"\x00" * HEADER_SIZE,                                    # bad magic
    encode_header(Kind.WRITE, 1, 0, 0)[:-1],                  # truncated
    bytes([0x50, 0x4B, 99]) + b"\x00" * (HEADER_SIZE - 3),   # unknown kind
    encode_header(Kind.HELLO, 0, 1 << 30, 0),                 # oversized meta
    encode_header(Kind.PING, 0, 2, 100),                      # payload on a control frame
])
def test_malformed_headers_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_header(data)


def test_transfer_meta_inconsistencies_are_protocol_errors() -> None:
    runs = pack_runs(np.array([0], np.uint64), np.array([4096], np.uint64))
    frame = encode_transfer(Kind.WRITE, 1, 1, 0, 2, runs, 999)  # payload_len does not match the runs
    header = decode_header(frame[:HEADER_SIZE])
    with pytest.raises(ProtocolError):
        decode_transfer(header, frame[HEADER_SIZE:])
    frame = encode_transfer(Kind.READ, 1, 1, 0, 2, runs, 0)
    header = decode_header(frame[:HEADER_SIZE])
    with pytest.raises(ProtocolError):
        decode_transfer(header, frame[HEADER_SIZE:-1])  # truncated runs
    with pytest.raises(ProtocolError):
        decode_json(Kind.HELLO, b"[1, 2]")
    with pytest.raises(ProtocolError):
        decode_json(Kind.HELLO, b"\xff\xfe")


def test_a_key_release_round_trips() -> None:
    release = KeyRelease((0, 7, 1), 3, 2, 4, 2)
    frame = encode_release_key(release)
    header = decode_header(frame[:HEADER_SIZE])
    assert header.kind == Kind.RELEASE_KEY and header.payload_len == 0
    assert decode_release_key(decode_json(header.kind, frame[HEADER_SIZE:])) == release


@pytest.mark.parametrize("body", [
    {},
    {"key": [0, 7], "cache": 3, "slot": 0, "tensors": [0, 2]},           # a key of two fields
    {"key": [0, 7, 1], "cache": "3", "slot": 0, "tensors": [0, 2]},      # a cache id that is not an int
    {"key": [0, 7, 1], "cache": 3, "slot": True, "tensors": [0, 2]},     # bool is not an int here
    {"key": [2, 7, 1], "cache": 3, "slot": 0, "tensors": [0, 2]},        # neither a request nor a prefix
    {"key": [0, (1 << 64) - 1, 1], "cache": 3, "slot": 0, "tensors": [0, 2]},  # "no id" names nothing
    {"key": [0, 7, 1], "cache": 0, "slot": 0, "tensors": [0, 2]},        # cache ids start at 1
    {"key": [0, 7, 1], "cache": 3, "slot": -1, "tensors": [0, 2]},
    {"key": [0, 7, 1], "cache": 3, "slot": 0, "tensors": [0, 0]},        # no tensor
    {"key": [0, 7, 1], "cache": 3, "slot": 0, "tensors": [-1, 2]},
    {"key": [0, 7, 1.0], "cache": 3, "slot": 0, "tensors": [0, 2]},
])
def test_a_malformed_key_release_is_a_protocol_error(body: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        decode_release_key(body)
