"""kvpush.serving without sockets: resolve() and its refusals, and the inbound side of one link
(stream writes, one-sided grants, standing grants, cache key releases) driven with frames built by
kvpush.protocol."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
from collections import Counter
from typing import Any

import numpy as np
import pytest

from kvpush.admission import Refusal, resolve
from kvpush.layout import pack_runs
from kvpush.memory import CacheEntry, CacheRegistry, allocate_regions
from kvpush.options import EngineOptions
from kvpush.protocol import (
    HEADER_SIZE,
    KeyRelease,
    Kind,
    ProtocolError,
    decode_header,
    decode_json,
    decode_status,
    decode_transfer,
    encode_json,
    encode_read_offer,
    encode_release_key,
    encode_status,
    encode_transfer,
)
from kvpush.read_offers import LinkPorts
from kvpush.serving import Inbound
from kvpush.status import LLMStatusCode
from kvpush.types import CacheDesc, CacheKey, DataType, RemoteAccess
from transports.base import TransportError

DESC = CacheDesc(4, (8, 64), DataType.DT_UINT8)  # 4 tensors of 8 blocks x 64 bytes
LOOP = asyncio.new_event_loop()  # never run: the inbound side's deadline timers are only scheduled on it


def teardown_module() -> None:
    LOOP.close()


def registry_with_cache(access: RemoteAccess = RemoteAccess.OPEN) -> tuple[CacheRegistry, int]:
    registry = CacheRegistry()
    mapping, regions = allocate_regions(DESC)
    cache = registry.add(DESC, regions, True, 0, mapping, access=access)
    return registry, cache.cache_id


def transfer_frame(kind: Kind, cache_id: int, first: int, count: int, offsets: list[int], lengths: list[int],
                   request_id: int = 7) -> tuple[Any, bytes]:
    wire = pack_runs(np.array(offsets, np.uint64), np.array(lengths, np.uint64))
    payload = count * sum(lengths) if kind == Kind.WRITE else 0
    frame = encode_transfer(kind, request_id, cache_id, first, count, wire, payload)
    return decode_header(frame[:HEADER_SIZE]), frame[HEADER_SIZE:]


class Sent:
    """Records what the inbound side sends (a stand-in for the frame stream's send)."""

    class Frame:
        def __init__(self) -> None:
            self.sent: concurrent.futures.Future[None] = concurrent.futures.Future()

    def __init__(self) -> None:
        self.frames: list[tuple[Kind, Any]] = []
        self.writes: list[list[int]] = []  # per send call: the request ids of the frames it carried

    def __call__(self, head: bytes, payload: Any = None) -> Any:
        ids = []
        while head:  # one call may carry several frames, back to back
            header = decode_header(head[:HEADER_SIZE])
            meta, head = head[HEADER_SIZE:HEADER_SIZE + header.meta_len], head[HEADER_SIZE + header.meta_len:]
            body = decode_json(header.kind, meta) if header.kind == Kind.LEASE else decode_status(header, meta)
            self.frames.append((header.kind, body))
            ids.append(header.request_id)
        self.writes.append(ids)
        return Sent.Frame()


def test_resolve_gives_the_iovec_of_the_addressed_runs() -> None:
    registry, cache_id = registry_with_cache()
    header, meta = transfer_frame(Kind.WRITE, cache_id, 2, 2, [64, 320], [128, 64])
    entry, iov = resolve(registry, True, decode_transfer(header, meta))
    base = entry.addrs
    assert iov.tolist() == [[base[2] + 64, 128], [base[2] + 320, 64], [base[3] + 64, 128], [base[3] + 320, 64]]
    assert entry.pins == 0  # pure: nothing pinned


@pytest.mark.parametrize("change,status,words", [
    ({"access": False}, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "disabled"),
    ({"cache": 99}, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "not registered"),
    ({"first": 3}, LLMStatusCode.LLM_PARAM_INVALID, "exceed"),
    ({"offset": 8 * 64 - 32}, LLMStatusCode.LLM_PARAM_INVALID, "outside"),
])
def test_resolve_refuses_what_lies_outside_the_registry(change: dict[str, Any], status: LLMStatusCode,
                                                        words: str) -> None:
    registry, cache_id = registry_with_cache()
    header, meta = transfer_frame(Kind.WRITE, change.get("cache", cache_id), change.get("first", 0), 2,
                                  [change.get("offset", 0)], [64])
    with pytest.raises(Refusal) as caught:
        resolve(registry, change.get("access", True), decode_transfer(header, meta))
    assert caught.value.status == status and words in caught.value.reason


class Engine:
    """What the inbound side reads of its engine: the registry, the options (remote access allowed, the
    engine's own limit) and where a registry change is told."""

    def __init__(self, registry: CacheRegistry, limit_ms: int = 1000, changed: list[bool] | None = None) -> None:
        self.registry = registry
        self.options = EngineOptions(sync_kv_timeout_ms=limit_ms)
        self.changed = changed if changed is not None else []

    def registry_changed(self) -> None:
        self.changed.append(True)


def inbound(registry: CacheRegistry, proves: bool = True) -> tuple[Inbound, Sent, Counter[str]]:
    sent, counters = Sent(), Counter[str]()
    closed: list[str] = []
    side = Inbound(Engine(registry), LinkPorts(sent, counters, LOOP, closed.append,
                                               lambda proof: proves and proof == "ok"), "9")
    return side, sent, counters


def test_a_stream_write_is_pinned_until_it_landed_then_answered_done() -> None:
    registry, cache_id = registry_with_cache()
    side, sent, counters = inbound(registry)
    header, meta = transfer_frame(Kind.WRITE, cache_id, 0, 2, [0], [64])
    sink = side.serve_write(header, meta)
    entry = registry.get(cache_id)
    assert sink is not None and entry is not None and entry.pins == 1 and sent.frames == []
    sink.on_done()
    assert entry.pins == 0 and counters["bytes_received"] == 128
    assert sent.frames == [(Kind.DONE, (0, ""))]


def test_a_write_whose_done_cannot_be_sent_is_unpinned_once() -> None:
    """DONE goes out before the bookkeeping; if sending it fails and closes the link (which unpins
    the writes in flight), the write is not unpinned a second time under another holder."""
    registry, cache_id = registry_with_cache()
    sent, closed = Sent(), []
    side: Inbound

    def send_then_fail(head: bytes, payload: Any = None) -> Any:
        frame = sent(head, payload)
        side.close(lambda: None)  # what a stream whose send failed does: the link closes
        closed.append(True)
        return frame

    side = Inbound(Engine(registry), LinkPorts(send_then_fail, Counter(), LOOP, lambda _: None, lambda proof: False),
                   "9")
    entry = registry.get(cache_id)
    assert entry is not None
    entry.pin()  # another holder (a lease, a held grant, another link's write)
    header, meta = transfer_frame(Kind.WRITE, cache_id, 0, 1, [0], [64])
    sink = side.serve_write(header, meta)
    assert sink is not None and entry.pins == 2
    sink.on_done()
    assert closed and entry.pins == 1


def test_a_refused_write_is_answered_with_its_status_and_nothing_is_pinned() -> None:
    registry, cache_id = registry_with_cache()
    side, sent, _ = inbound(registry)
    header, meta = transfer_frame(Kind.WRITE, cache_id + 1, 0, 1, [0], [64])
    assert side.serve_write(header, meta) is None
    assert sent.frames[0][0] == Kind.DONE and sent.frames[0][1][0] == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_a_grant_holds_its_pin_until_landed_and_a_closed_link_hands_the_pins_back() -> None:
    registry, cache_id = registry_with_cache()
    side, sent, counters = inbound(registry)
    entry = registry.get(cache_id)
    assert entry is not None
    for request_id in (1, 2):
        header, meta = transfer_frame(Kind.WRITE_INTENT, cache_id, 0, 1, [0], [64], request_id)
        side.on_intent(header, meta)
    assert [kind for kind, _ in sent.frames] == [Kind.GRANT, Kind.GRANT] and entry.pins == 2
    landed = encode_status(Kind.LANDED, 1, 0)
    side.on_landed(decode_header(landed[:HEADER_SIZE]), landed[HEADER_SIZE:])
    assert entry.pins == 1 and counters["bytes_received"] == 64
    held = side.close(lambda: None)
    assert held is not None and held.entries == [entry] and entry.pins == 1  # request 2 may still be copying
    held.release()
    assert entry.pins == 0


def test_standing_grants_need_proof_of_reach_and_are_revoked_on_release() -> None:
    registry, cache_id = registry_with_cache()
    side, sent, _ = inbound(registry)
    side.on_lease({"op": "request", "cache": cache_id, "proof": "wrong"})
    assert sent.frames[-1] == (Kind.LEASE, {"op": "refuse", "cache": cache_id, "reads": False, "gates": False})
    side.on_lease({"op": "request", "cache": cache_id, "proof": "ok"})
    entry = registry.get(cache_id)
    assert entry is not None
    assert sent.frames[-1] == (Kind.LEASE, {"op": "grant", "cache": cache_id, "reads": False, "gates": False})
    assert entry.pins == 1
    header, meta = transfer_frame(Kind.WRITE_NOTICE, cache_id, 0, 1, [0], [64])
    side.on_notice(header, meta)  # a leased write inside the cache is counted
    outside, outside_meta = transfer_frame(Kind.WRITE_NOTICE, cache_id, 3, 2, [0], [64])
    with pytest.raises(ProtocolError):
        side.on_notice(outside, outside_meta)
    registry.remove(cache_id)
    side.revoke_released()
    assert sent.frames[-1] == (Kind.LEASE, {"op": "revoke", "cache": cache_id}) and entry.pins == 1
    side.on_lease({"op": "revoked", "cache": cache_id})
    assert entry.pins == 0 and not entry.regions  # released once the writer confirmed
    with pytest.raises(ProtocolError):
        side.on_lease({"op": "revoked", "cache": cache_id})  # not being revoked any more


def test_a_graceful_unlink_ends_leases_and_late_frames_for_them_are_tolerated() -> None:
    registry, cache_id = registry_with_cache()
    side, _, _ = inbound(registry)
    side.on_lease({"op": "request", "cache": cache_id, "proof": "ok"})
    side.end_leases()
    entry = registry.get(cache_id)
    assert entry is not None and entry.pins == 0
    side.on_lease({"op": "revoked", "cache": cache_id})  # crossed the unlink: fine
    header, meta = transfer_frame(Kind.WRITE_NOTICE, cache_id, 0, 1, [0], [64])
    with pytest.raises(ProtocolError, match="after the writer ended"):
        side.on_notice(header, meta)


async def test_an_incoming_write_that_never_finishes_closes_the_link_and_unpins() -> None:
    registry, cache_id = registry_with_cache()
    sent, closed = Sent(), []
    side = Inbound(Engine(registry, limit_ms=100),  # own limit 100 ms -> deadline 2 * 0.1 + 1 s
                   LinkPorts(sent, Counter(), asyncio.get_running_loop(), closed.append, lambda proof: False), "9")
    header, meta = transfer_frame(Kind.WRITE, cache_id, 0, 1, [0], [64])
    assert side.serve_write(header, meta) is not None
    entry = registry.get(cache_id)
    assert entry is not None and entry.pins == 1
    await asyncio.sleep(1.4)
    assert len(closed) == 1 and "did not complete within 1.2 s" in closed[0]
    side.close(lambda: None)  # what the link does when it closes
    assert entry.pins == 0


def test_too_many_requests_in_flight_are_refused_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpush.serving as serving
    monkeypatch.setattr(serving, "MAX_INCOMING_IN_FLIGHT", 2)
    registry, cache_id = registry_with_cache()
    side, sent, _ = inbound(registry)
    for request_id in (1, 2, 3):
        header, meta = transfer_frame(Kind.WRITE_INTENT, cache_id, 0, 1, [0], [64], request_id)
        side.on_intent(header, meta)
    statuses = [body[0] for kind, body in sent.frames if kind == Kind.GRANT]
    assert statuses == [0, 0, LLMStatusCode.LLM_LINK_BUSY]
    side.close(lambda: None)


def release_frame(name: tuple[int, int, int], cache_id: int, slot: int, first: int, count: int) -> tuple[Any, bytes]:
    frame = encode_release_key(KeyRelease(name, cache_id, slot, first, count))
    return decode_header(frame[:HEADER_SIZE]), frame[HEADER_SIZE:]


def test_a_key_release_is_checked_against_the_registry_and_tells_every_peer_when_the_key_goes() -> None:
    registry = CacheRegistry()
    desc = CacheDesc(4, (2, 64), DataType.DT_UINT8)
    mapping, regions = allocate_regions(desc)
    cache = registry.add(desc, regions, False, None, mapping, cache_keys=[CacheKey(1, 10), CacheKey(1, 11)])
    changed: list[bool] = []
    engine = Engine(registry, changed=changed)
    side = Inbound(engine, LinkPorts(Sent(), Counter(), LOOP, lambda _: None, lambda proof: False), "9")
    side.on_release_key(*release_frame((0, 10, 0), cache.cache_id, 1, 0, 4))  # slot 1 is not key 10's: ignored
    side.on_release_key(*release_frame((0, 10, 0), cache.cache_id + 5, 0, 0, 4))  # no such cache: ignored
    side.on_release_key(*release_frame((0, 10, 0), cache.cache_id, 0, 0, 2))  # half of the slot's tensors
    assert changed == [] and registry.slot_of((0, 10, 0)) is not None
    side.on_release_key(*release_frame((0, 10, 0), cache.cache_id, 0, 2, 2))
    assert changed == [True] and registry.slot_of((0, 10, 0)) is None
    with pytest.raises(ProtocolError, match="which has 4"):
        side.on_release_key(*release_frame((0, 11, 0), cache.cache_id, 1, 2, 3))  # outside the cache
    engine.options.enable_remote_cache_accessible = False  # a peer could not have pulled: nothing is released
    side.on_release_key(*release_frame((0, 11, 0), cache.cache_id, 1, 0, 4))
    assert registry.slot_of((0, 11, 0)) is not None and changed == [True]
    malformed = encode_json(Kind.RELEASE_KEY, 0, {"key": [0, 11]})
    with pytest.raises(ProtocolError):
        side.on_release_key(decode_header(malformed[:HEADER_SIZE]), malformed[HEADER_SIZE:])


class Reader:
    """A same-host mover stand-in: records the copies it is asked for, each a future the test completes."""

    def __init__(self) -> None:
        self.copies: list[tuple[bool, list[list[int]], list[list[int]], asyncio.Future[Any]]] = []

    def start(self, is_read: bool, local: Any, remote: Any, *args: Any) -> asyncio.Future[Any]:
        copy: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.copies.append((is_read, local.tolist(), remote.tolist(), copy))
        return copy


def offer_frame(cache_id: int, first: int, source: list[list[int]], lengths: list[int],  # noqa: PLR0913
                request_id: int, more: bool = False, budget_ms: int = 1000,
                gate: tuple[int, int] | None = None) -> tuple[Any, bytes]:
    wire = pack_runs(np.array([64 * i for i in range(len(lengths))], np.uint64), np.array(lengths, np.uint64))
    count = len(source) // len(lengths)
    frame = encode_read_offer(request_id, cache_id, first, count, wire, budget_ms,
                              np.array(source, np.uint64).tobytes(), more, gate)
    return decode_header(frame[:HEADER_SIZE]), frame[HEADER_SIZE:]


def reading_side(registry: CacheRegistry, reader: Reader | None) -> tuple[Inbound, Sent, Counter[str], list[str]]:
    sent, counters, closed = Sent(), Counter[str](), list[str]()
    side = Inbound(Engine(registry), LinkPorts(sent, counters, asyncio.get_running_loop(), closed.append,
                                               lambda proof: proof == "ok", lambda: reader), "9")  # type: ignore
    return side, sent, counters, closed


def granted_reading_side() -> tuple[CacheRegistry, CacheEntry, Reader, Inbound, Sent, Counter[str]]:
    """A cache opened per request (``GRANTED``, as vLLM's decode registers its KV) and the inbound side of a
    link to cluster 9, which reads the peer; no block granted yet."""
    registry, cache_id = registry_with_cache(RemoteAccess.GRANTED)
    entry = registry.get(cache_id)
    assert entry is not None and entry.grants is not None
    reader = Reader()
    side, sent, counters, _ = reading_side(registry, reader)
    side.rename(9)
    return registry, entry, reader, side, sent, counters


async def test_a_read_offer_is_copied_by_this_side_into_the_checked_runs_and_answered_done() -> None:
    registry, cache_id = registry_with_cache()
    reader = Reader()
    side, sent, counters, _ = reading_side(registry, reader)
    entry = registry.get(cache_id)
    assert entry is not None
    side.on_lease({"op": "request", "cache": cache_id, "proof": "ok"})
    # it says it reads, gated offers too
    assert sent.frames[-1] == (Kind.LEASE, {"op": "grant", "cache": cache_id, "reads": True, "gates": True})
    header, meta = offer_frame(cache_id, 2, [[0x7000, 64], [0x8000, 64]], [64], 4)
    side.on_read_offer(header, meta)
    (is_read, local, remote, copy), = reader.copies
    base = entry.addrs
    assert is_read and local == [[base[2], 64], [base[3], 64]] and remote == [[0x7000, 64], [0x8000, 64]]
    assert entry.pins == 2 and sent.frames[-1][0] == Kind.LEASE  # pinned while it copies; nothing answered yet
    copy.set_result(128)
    await asyncio.sleep(0)
    assert sent.frames[-1][0] == Kind.DONE and sent.frames[-1][1] == (0, "")
    assert entry.pins == 1 and counters["bytes_received"] == 128


async def test_a_cache_open_per_request_is_never_leased_yet_read_into_within_its_grants() -> None:
    """vLLM's decode registers its KV ``GRANTED``: the lease is refused, but the refusal says this side reads,
    and every offer is checked against the blocks granted to the peer before a byte is copied."""
    registry, entry, reader, side, sent, _ = granted_reading_side()
    cache_id = entry.cache.cache_id
    side.on_lease({"op": "request", "cache": cache_id, "proof": "ok"})
    assert sent.frames[-1] == (Kind.LEASE, {"op": "refuse", "cache": cache_id, "reads": True, "gates": True})
    entry.grants.add(9, np.array([0]), write=True)
    side.on_read_offer(*offer_frame(cache_id, 0, [[0x7000, 64], [0x8000, 64], [0x9000, 64], [0xA000, 64]], [64], 4))
    assert len(reader.copies) == 1 and entry.pins == 1  # block 0 of each tensor: granted, being copied
    side.on_read_offer(*offer_frame(cache_id, 0, [[0x7000, 64]] * 8, [64, 64], 5))  # blocks 0 and 1
    assert len(reader.copies) == 1  # block 1 is not granted: refused, nothing copied
    assert sent.frames[-1][0] == Kind.DONE and sent.frames[-1][1][0] == int(LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
    reader.copies[0][3].set_result(256)
    await asyncio.sleep(0)
    assert sent.frames[-1][0] == Kind.DONE and sent.frames[-1][1] == (0, "") and entry.pins == 0


async def test_the_done_of_an_offer_marked_more_waits_for_the_senders_next_frame_or_its_hold() -> None:
    """A layer-pipelined request's offers say more follow: their DONEs are held and leave together, with the
    sender's next frame (``send_held``, which the link calls), with the DONE of an offer not marked so, or once
    the hold (at most a quarter of the offer's budget) ran out; a closed link answers nothing."""
    registry, cache_id = registry_with_cache()
    reader = Reader()
    side, sent, counters, _ = reading_side(registry, reader)
    entry = registry.get(cache_id)
    assert entry is not None

    def offer(request_id: int, more: bool, budget_ms: int = 1000) -> None:
        side.on_read_offer(*offer_frame(cache_id, 0, [[0x7000, 64]], [64], request_id, more, budget_ms))
        reader.copies[-1][3].set_result(64)

    offer(1, True)
    offer(2, True)
    await asyncio.sleep(0)
    assert sent.writes == [] and side.reads.holding and entry.pins == 0  # copied, unpinned, answer held
    side.reads.send_held()
    assert sent.writes == [[1, 2]] and not side.reads.holding
    assert [body for _, body in sent.frames] == [(0, ""), (0, "")]
    offer(3, True)
    offer(4, False)  # the request's last layer: answered at once, with what was held
    await asyncio.sleep(0)
    assert sent.writes[-1] == [3, 4] and not side.reads.holding
    offer(5, True, budget_ms=40)  # held at most 10 ms
    await asyncio.sleep(0)
    assert sent.writes[-1] == [3, 4] and side.reads.holding
    for _ in range(100):  # bounded: the hold ends within 10 ms
        if not side.reads.holding:
            break
        await asyncio.sleep(0.01)
    assert sent.writes[-1] == [5] and counters["bytes_received"] == 5 * 64
    offer(6, True)
    await asyncio.sleep(0)
    assert side.close(lambda: None) is None and not side.reads.holding
    await asyncio.sleep(0.15)  # past any hold: nothing is sent on a closed link
    assert sent.writes[-1] == [5]


async def test_a_read_offer_is_refused_outside_the_registry_or_without_a_reader() -> None:
    registry, cache_id = registry_with_cache()
    reader = Reader()
    side, sent, _, _ = reading_side(registry, reader)
    header, meta = offer_frame(cache_id, 3, [[0x7000, 64], [0x8000, 64]], [64], 4)  # tensors 3..4 of 4
    side.on_read_offer(header, meta)
    assert sent.frames[-1][0] == Kind.DONE and sent.frames[-1][1][0] == LLMStatusCode.LLM_PARAM_INVALID
    blind, blind_sent, _, _ = reading_side(registry, None)
    header, meta = offer_frame(cache_id, 0, [[0x7000, 64]], [64], 5)
    blind.on_read_offer(header, meta)
    assert blind_sent.frames[-1][1][0] == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    entry = registry.get(cache_id)
    assert entry is not None and entry.pins == 0 and reader.copies == []


async def test_a_failed_copy_is_answered_with_its_error_and_a_gone_sender_closes_the_link() -> None:
    registry, cache_id = registry_with_cache()
    reader = Reader()
    side, sent, _, closed = reading_side(registry, reader)
    for request_id in (1, 2):
        header, meta = offer_frame(cache_id, 0, [[0x7000, 64]], [64], request_id)
        side.on_read_offer(header, meta)

    class Gone(TransportError):
        @property
        def peer_gone(self) -> bool:
            return True

    reader.copies[0][3].set_exception(TransportError(14, "bad address"))
    reader.copies[1][3].set_exception(Gone(3, "no such process"))
    await asyncio.sleep(0)
    assert sent.frames[-1][0] == Kind.DONE and sent.frames[-1][1][0] == LLMStatusCode.LLM_FAILED
    assert len(closed) == 1 and "exited" in closed[0]
    entry = registry.get(cache_id)
    assert entry is not None and entry.pins == 0


async def test_a_copy_running_when_the_link_closes_unpins_when_it_ends_and_answers_nothing() -> None:
    registry, cache_id = registry_with_cache()
    reader = Reader()
    side, sent, _, _ = reading_side(registry, reader)
    header, meta = offer_frame(cache_id, 0, [[0x7000, 64]], [64], 1)
    side.on_read_offer(header, meta)
    entry = registry.get(cache_id)
    assert entry is not None and entry.pins == 1
    assert side.close(lambda: None) is None  # nothing the peer holds: this side's own copy
    assert entry.pins == 1  # the copy still writes into the cache
    reader.copies[0][3].set_result(64)
    await asyncio.sleep(0)
    assert entry.pins == 0 and sent.frames == []


async def marks_read(reader: Reader, words: list[int]) -> None:
    """The next read of the gated offers' marks: each waiting offer's word, as the sender's memory holds it."""
    for _ in range(100):
        await asyncio.sleep(0.002)
        if reader.copies and reader.copies[-1][3].done() is False and len(reader.copies[-1][1]) == len(words):
            break
    is_read, local, _, read = reader.copies.pop()
    assert is_read and [length for _, length in local] == [8] * len(words)
    for (address, _), word in zip(local, words, strict=True):
        ctypes.c_uint64.from_address(address).value = word
    read.set_result(8 * len(words))
    await asyncio.sleep(0)


async def test_a_gated_offer_is_pinned_at_once_and_copied_once_its_mark_reads_open() -> None:
    """Gated offers (``OFFER_GATED``): checked and pinned on arrival, their marks read from the sender (one
    read for all of them), copied once a mark holds the token; answers are held while another of the
    sender's offers is still open here, then all go in one write; a withdrawn mark is answered without a
    copy; a closing link lets go of what still waits."""
    registry, cache_id = registry_with_cache()
    reader = Reader()
    side, sent, counters, _ = reading_side(registry, reader)
    entry = registry.get(cache_id)
    assert entry is not None
    token = 0x1234_5678_9ABC_DEF0
    for request_id, mark in ((4, 0xA000), (5, 0xA008), (6, 0xA010)):
        side.on_read_offer(*offer_frame(cache_id, 0, [[0x7000 + 64 * request_id, 64]] * 4, [64], request_id, True,
                                        gate=(mark, token)))
    assert entry.pins == 3 and side.reads.gated and not reader.copies  # nothing copied before a mark says so

    await marks_read(reader, [token, 0, token ^ ((1 << 64) - 1)])  # 4 open, 5 not yet, 6 withdrawn
    assert sent.frames[-1] == (Kind.DONE, (int(LLMStatusCode.LLM_FAILED), "withdrawn by the sender"))
    (is_read, _, remote, copy), = reader.copies  # request 4's bytes
    assert is_read and remote == [[0x7000 + 256, 64]] * 4 and entry.pins == 2
    copy.set_result(256)
    await asyncio.sleep(0)
    assert side.reads.holding and counters["read_offer_answers_held"] == 1  # 5 is still open: 4's answer waits
    reader.copies.clear()
    side.reads.poll()  # a frame from the sender: read the marks now
    await marks_read(reader, [token])
    (_, _, _, copy), = reader.copies
    copy.set_result(256)
    await asyncio.sleep(0)
    assert sent.writes[-1] == [4, 5] and not side.reads.holding and entry.pins == 0  # the last one out sends both
    assert counters["read_offers_copied"] == 2 and counters["read_offers_withdrawn"] == 1
    side.on_read_offer(*offer_frame(cache_id, 0, [[0x7000, 64]] * 4, [64], 7, True, gate=(0xA000, token)))
    assert entry.pins == 1
    side.close(lambda: None)
    assert entry.pins == 0 and not side.reads.gated  # never copied: let go with the link


async def test_a_gated_offer_is_checked_again_when_marked_and_refused_when_its_cache_goes() -> None:
    """A gated offer waits for its mark; meanwhile the decode may end the grant of its blocks (the request was
    aborted, the blocks given to another) or unregister the cache. Marked after its grant ended, it is refused,
    nothing copied; its cache unregistered, it is refused at once. Either way its pin goes."""
    registry, entry, reader, side, sent, counters = granted_reading_side()
    cache_id = entry.cache.cache_id
    entry.grants.add(9, np.array([0]), write=True)
    token = 0x0F0F_1234_5678_9ABC
    for request_id, mark in ((4, 0xA000), (5, 0xA008)):
        side.on_read_offer(*offer_frame(cache_id, 0, [[0x7000, 64]] * 4, [64], request_id, True, gate=(mark, token)))
    assert entry.pins == 2 and side.reads.gated
    entry.grants.remove(9, np.array([0]), write=True)  # the decode revoked the blocks' grant
    await marks_read(reader, [token, 0])  # 4 marked now, 5 not yet
    assert reader.copies == [] and counters["read_offers_copied"] == 0  # nothing copied into the blocks
    assert sent.frames[-1][0] == Kind.DONE and sent.frames[-1][1][0] == int(LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
    assert entry.pins == 1 and counters["read_offers_refused_late"] == 1
    registry.remove(cache_id)
    side.revoke_released()  # the registry changed: what waits for the gone cache is answered now
    assert sent.frames[-1][0] == Kind.DONE and sent.frames[-1][1][0] == int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    assert entry.pins == 0 and not side.reads.gated and counters["read_offers_refused_late"] == 2
