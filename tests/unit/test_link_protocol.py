"""kvpush.link_protocol without sockets: the link's states, the Kind -> handler table, the answers it
sends, the requests it completes, and the unlink agreement (BYE, crossing unlinks), driven with frames
built by kvpush.protocol and a driver that records what the core asks of it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvpush.link_protocol import LinkProtocol, LinkState
from kvpush.peer import PeerTable
from kvpush.protocol import (
    HEADER_SIZE,
    Kind,
    ProtocolError,
    decode_header,
    decode_json,
    decode_status,
    encode_json,
    encode_message,
    encode_read_offer,
    encode_status,
    encode_transfer,
)
from kvpush.requests import RequestTable
from kvpush.status import LLMException, LLMStatusCode


class Driver:
    """A LinkDriver that records every frame and every call."""

    def __init__(self) -> None:
        self.sent: list[tuple[Kind, Any]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.accepts_messages = True

    def send(self, head: bytes, payload: Any = None) -> Any:
        header = decode_header(head[:HEADER_SIZE])
        meta = head[HEADER_SIZE:]
        body = decode_json(header.kind, meta) if header.kind in (Kind.PONG, Kind.BYE) else decode_status(header, meta)
        self.sent.append((header.kind, body))
        return None

    def became_ready(self) -> None:
        self.calls.append(("ready",))

    def table_arrived(self) -> None:
        self.calls.append(("table",))

    def send_table(self, request_id: int) -> None:
        self.calls.append(("send_table", request_id))

    def deliver(self, channel: int, data: bytes) -> bool:
        self.calls.append(("deliver", channel, data))
        return self.accepts_messages

    def bye_answered(self) -> None:
        self.calls.append(("bye_answered",))

    def ack_bye(self, leases_done: bool = True) -> None:
        self.calls.append(("ack_bye", leases_done))

    def ack_bye_when_idle(self) -> None:
        self.calls.append(("ack_bye_when_idle",))

    def close(self, reason: str, abort: bool = False) -> None:
        self.calls.append(("close", reason))

    def stream_closed(self, reason: str) -> None:
        self.calls.append(("stream_closed", reason))


class Handshake:
    def __init__(self) -> None:
        self.delivered: list[Kind] = []
        self.done_after = 2
        self.closed: list[str] = []

    def deliver(self, kind: Kind, body: dict[str, Any]) -> bool:
        self.delivered.append(kind)
        return len(self.delivered) >= self.done_after

    def stream_closed(self, reason: str) -> None:
        self.closed.append(reason)


class Offers:
    """The read offers served here, as the core reads them before each frame (``ReadOffers``)."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls
        self.holding = False
        self.gated_offers: dict[int, Any] = {}

    def before_frame(self) -> None:
        if self.holding:
            self.calls.append(("send_held",))
            self.holding = False
        if self.gated_offers:
            self.calls.append(("poll_gates",))


class Inbound:
    """The serving side, as the core routes frames to it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.reads = Offers(self.calls)

    def serve_write(self, header: Any, meta: bytes, in_hand: bool = False) -> None:
        self.calls.append(("write", header.request_id, in_hand))

    def serve_read(self, header: Any, meta: bytes) -> None:
        self.calls.append(("read", header.request_id))

    def on_read_offer(self, header: Any, meta: bytes) -> None:
        self.calls.append(("read_offer", header.request_id))

    def on_intent(self, header: Any, meta: bytes) -> None:
        self.calls.append(("intent", header.kind))

    def on_landed(self, header: Any, meta: bytes) -> None:
        self.calls.append(("landed", header.request_id))

    def on_notice(self, header: Any, meta: bytes) -> None:
        self.calls.append(("notice", header.request_id))

    def on_release_key(self, header: Any, meta: bytes) -> None:
        self.calls.append(("release_key",))

    def on_lease(self, body: dict[str, Any]) -> None:
        self.calls.append(("lease", body["op"]))

    def end_leases(self) -> None:
        self.calls.append(("end_leases",))


class OneSided:
    def __init__(self, idle: bool) -> None:
        self.idle = idle
        self.calls: list[str] = []

    def close_leases(self) -> None:
        self.calls.append("close_leases")

    def leases_idle(self) -> bool:
        return self.idle


def core(ready: bool = True) -> tuple[LinkProtocol, Driver, Inbound, RequestTable]:
    driver, inbound = Driver(), Inbound()
    requests = RequestTable(asyncio.get_running_loop(), lambda error: None)
    protocol = LinkProtocol(driver, Handshake(), requests, PeerTable(), inbound)  # type: ignore[arg-type]
    if ready:
        protocol.become_ready()
    return protocol, driver, inbound, requests


def frame(head: bytes) -> tuple[Any, bytes]:
    return decode_header(head[:HEADER_SIZE]), head[HEADER_SIZE:]


async def test_frames_go_to_the_handshake_until_it_ends_then_through_the_table() -> None:
    protocol, driver, inbound, _ = core(ready=False)
    handshake = protocol.handshake
    assert protocol.state is LinkState.HANDSHAKE and not protocol.ready
    protocol.on_frame(*frame(encode_json(Kind.HELLO, 0, {})))
    assert protocol.state is LinkState.HANDSHAKE and driver.calls == []
    protocol.on_frame(*frame(encode_json(Kind.READY, 0, {})))  # the handshake says it is over
    assert protocol.ready and driver.calls == [("ready",)]
    assert handshake.delivered == [Kind.HELLO, Kind.READY]  # type: ignore[attr-defined]
    protocol.on_frame(*frame(encode_transfer(Kind.READ, 7, 1, 0, 1, b"\0" * 16, 0)))
    assert inbound.calls == [("read", 7)]
    with pytest.raises(ProtocolError, match="unexpected HELLO"):
        protocol.on_frame(*frame(encode_json(Kind.HELLO, 0, {})))


async def test_serving_frames_are_routed_to_the_inbound_side_a_small_write_in_hand() -> None:
    protocol, _, inbound, _ = core()
    runs = b"\0" * 8 + (64).to_bytes(8, "little")
    protocol.on_frame(*frame(encode_transfer(Kind.WRITE, 1, 1, 0, 1, runs, 64)))
    protocol.on_frame(*frame(encode_transfer(Kind.WRITE, 2, 1, 0, 1, runs, 64)), True)
    protocol.on_frame(*frame(encode_transfer(Kind.WRITE_INTENT, 3, 1, 0, 1, runs, 0)))
    protocol.on_frame(*frame(encode_status(Kind.LANDED, 3, 0)))
    protocol.on_frame(*frame(encode_json(Kind.LEASE, 0, {"op": "request", "cache": 1})))
    assert inbound.calls == [("write", 1, False), ("write", 2, True), ("intent", Kind.WRITE_INTENT), ("landed", 3),
                             ("lease", "request")]
    with pytest.raises(ProtocolError, match="GRANT on a link that sent no one-sided request"):
        protocol.on_frame(*frame(encode_status(Kind.GRANT, 4, 0)))


async def test_answers_the_inbound_side_holds_go_back_before_any_frame_but_a_read_offer_is_handled() -> None:
    protocol, _, inbound, _ = core()
    runs = b"\0" * 8 + (64).to_bytes(8, "little")
    protocol.on_frame(*frame(encode_transfer(Kind.WRITE, 1, 1, 0, 1, runs, 64)))
    inbound.reads.holding = True  # a layer's DONE waits: the next layer's offer does not send it
    protocol.on_frame(*frame(encode_read_offer(4, 1, 0, 1, runs, 100, (0x7000).to_bytes(8, "little") + runs[8:],
                                               more=True)))
    protocol.on_frame(*frame(encode_transfer(Kind.WRITE, 2, 1, 0, 1, runs, 64)))  # any other frame does, first
    protocol.on_frame(*frame(encode_transfer(Kind.WRITE, 3, 1, 0, 1, runs, 64)))
    assert inbound.calls == [("write", 1, False), ("read_offer", 4), ("send_held",), ("write", 2, False),
                             ("write", 3, False)]


async def test_offers_waiting_for_their_marks_are_read_again_on_any_frame_but_a_read_offer() -> None:
    """A layer pusher whose caller is done sends a frame: a layer may just have been marked ready."""
    protocol, _, inbound, _ = core()
    runs = b"\0" * 8 + (64).to_bytes(8, "little")
    inbound.reads.gated_offers[4] = object()
    protocol.on_frame(*frame(encode_read_offer(4, 1, 0, 1, runs, 100, (0x7000).to_bytes(8, "little") + runs[8:],
                                               more=True, gate=(0x9000, 77))))
    protocol.on_frame(*frame(encode_json(Kind.PING, 0, {"t": 1.0})))
    assert inbound.calls == [("read_offer", 4), ("poll_gates",)]


async def test_a_ping_is_answered_and_a_pong_measured() -> None:
    protocol, driver, _, _ = core()
    protocol.on_frame(*frame(encode_json(Kind.PING, 0, {"t": 12.5})))
    assert driver.sent == [(Kind.PONG, {"t": 12.5})]
    protocol.on_frame(*frame(encode_json(Kind.PONG, 0, {"t": time.monotonic()})))
    assert protocol.rtt_ms is not None and 0 <= protocol.rtt_ms < 1000


async def test_done_completes_its_write_a_refusal_fails_it_and_an_unknown_one_is_ignored() -> None:
    protocol, _, _, requests = core()
    ok, refused = requests.new(Kind.WRITE), requests.new(Kind.WRITE)
    protocol.on_frame(*frame(encode_status(Kind.DONE, ok.request_id, 0)))
    protocol.on_frame(*frame(encode_status(Kind.DONE, refused.request_id,
                                           int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST), "no such cache")))
    protocol.on_frame(*frame(encode_status(Kind.DONE, 99, 0)))  # abandoned or never asked: ignored
    assert ok.ended and ok.error is None
    assert isinstance(refused.error, LLMException) and refused.error.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert len(requests) == 0


async def test_messages_are_delivered_and_acknowledged_or_refused_when_the_inbox_is_full() -> None:
    protocol, driver, _, requests = core()
    protocol.on_frame(*frame(encode_message(5, 1, b"landed")))
    driver.accepts_messages = False
    protocol.on_frame(*frame(encode_message(6, 0, b"hello")))
    delivered = [call for call in driver.calls if call[0] == "deliver"]
    assert delivered == [("deliver", 1, b"landed"), ("deliver", 0, b"hello")]
    assert driver.sent == [(Kind.MESSAGE_ACK, (0, "")),
                           (Kind.MESSAGE_ACK, (int(LLMStatusCode.LLM_LINK_BUSY), "the receiver's inbox is full"))]
    mine = requests.new(Kind.MESSAGE)
    protocol.on_frame(*frame(encode_status(Kind.MESSAGE_ACK, mine.request_id, int(LLMStatusCode.LLM_LINK_BUSY))))
    assert mine.error is not None and mine.error.status_code == LLMStatusCode.LLM_LINK_BUSY


async def test_a_table_is_applied_and_completes_the_request_that_asked_for_it() -> None:
    protocol, driver, _, requests = core()
    asked = requests.new(Kind.TABLE_REQUEST)
    table = {"version": 1, "caches": [{"id": 3, "model": 0, "blocks": True, "n": 2, "shape": [4, 8], "dtype": 1}]}
    protocol.on_frame(*frame(encode_json(Kind.TABLE, asked.request_id, table)))
    assert asked.ended and asked.error is None and driver.calls[-1] == ("table",)
    cache = protocol.peer.by_model(0)
    assert cache is not None and cache.cache_id == 3
    protocol.on_frame(*frame(encode_json(Kind.TABLE_REQUEST, 8, {})))
    assert driver.calls[-1] == ("send_table", 8)


async def test_a_closed_link_ignores_frames_and_a_lost_stream_is_reported_once() -> None:
    protocol, driver, inbound, _ = core(ready=False)
    protocol.on_close("reset by peer")  # during the handshake: the handshake hears of it too
    assert protocol.handshake.closed == ["reset by peer"]  # type: ignore[attr-defined]
    assert driver.calls == [("stream_closed", "reset by peer")]
    assert protocol.close() is False  # it was never ready
    protocol.on_frame(*frame(encode_json(Kind.PING, 0, {})))
    protocol.on_close("again")
    assert driver.sent == [] and driver.calls == [("stream_closed", "reset by peer")] and inbound.calls == []
    ready, _, _, _ = core()
    assert ready.close() is True and ready.state is LinkState.CLOSED


async def test_the_peers_unlink_is_answered_at_once_or_once_its_copies_into_us_are_drained() -> None:
    protocol, driver, inbound, _ = core()
    protocol.on_frame(*frame(encode_json(Kind.BYE, 0, {"leases_done": True})))
    assert protocol.agreed and inbound.calls == [("end_leases",)] and driver.calls[-1] == ("ack_bye", True)
    busy, busy_driver, _, _ = core()
    onesided = OneSided(idle=False)
    busy.onesided = onesided  # type: ignore[assignment]
    busy.on_frame(*frame(encode_json(Kind.BYE, 0, {})))
    assert onesided.calls == ["close_leases"] and busy_driver.calls[-1] == ("ack_bye_when_idle",)


async def test_an_unlink_is_answered_by_the_peers_ack_or_by_its_own_crossing_bye() -> None:
    protocol, driver, _, _ = core()
    assert protocol.begin_unlink() and protocol.unlinking
    protocol.on_frame(*frame(encode_json(Kind.BYE, 0, {"ack": True, "leases_done": True})))
    assert protocol.agreed and driver.calls[-2:] == [("bye_answered",), ("close", "unlinked")]
    crossing, crossing_driver, _, _ = core()
    onesided = OneSided(idle=True)
    crossing.onesided = onesided  # type: ignore[assignment]
    assert crossing.begin_unlink() and onesided.calls == ["close_leases"]
    crossing.on_frame(*frame(encode_json(Kind.BYE, 0, {"leases_done": True})))  # the peer unlinks too
    assert crossing.agreed and crossing_driver.calls[-1] == ("bye_answered",)
    assert crossing_driver.sent == [(Kind.BYE, {"ack": True, "leases_done": True})]  # its BYE answered, not acked
    not_ready, _, _, _ = core(ready=False)
    assert not not_ready.begin_unlink() and not not_ready.unlinking
