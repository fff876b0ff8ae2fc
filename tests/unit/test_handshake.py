"""kvpush.handshake without sockets: two Handshake objects wired to each other through queues."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvpush.handshake import Handshake, HandshakeResult, Identity
from kvpush.protocol import HEADER_SIZE, Kind, ProtocolError, decode_header, decode_json, encode_json
from kvpush.status import LLMException, LLMStatusCode


def pair(dialer_id: Identity, acceptor_id: Identity, *, dialer_offers: dict[str, Any] | None = None,
         acceptor_offers: dict[str, Any] | None = None) -> tuple[Handshake, Handshake, list[Kind]]:
    """A dialer and an acceptor whose sends are delivered to each other (frames recorded in order)."""
    seen: list[Kind] = []
    ends: dict[str, Handshake] = {}

    def sender(to: str) -> Any:
        def send(frame: bytes) -> None:
            header = decode_header(frame[:HEADER_SIZE])
            seen.append(header.kind)
            ends[to].deliver(header.kind, decode_json(header.kind, frame[HEADER_SIZE:]))
        return send

    ends["dialer"] = Handshake(dialer_id, sender("acceptor"), lambda: dialer_offers or {}, dialer=True)
    ends["acceptor"] = Handshake(acceptor_id, sender("dialer"), lambda: acceptor_offers or {}, dialer=False)
    return ends["dialer"], ends["acceptor"], seen


async def run(dialer: Handshake, acceptor: Handshake,
              expect: int | None = None) -> tuple[HandshakeResult | BaseException, HandshakeResult | BaseException]:
    """Both sides; when one fails, the other sees its stream close (as a link closing would do)."""
    async def side(run: Any, other: Handshake) -> Any:
        try:
            return await run
        except LLMException:
            other.stream_closed("the other side closed the connection")
            raise

    results = await asyncio.wait_for(asyncio.gather(side(dialer.dial(expect), acceptor),
                                                    side(acceptor.accept(), dialer), return_exceptions=True), 5)
    return results[0], results[1]


async def test_without_tokens_both_sides_learn_each_other_and_the_offers() -> None:
    dialer, acceptor, seen = pair(Identity(1, 1, "aa", None), Identity(2, 2, "bb", None),
                                  dialer_offers={"x": {"d": 1}}, acceptor_offers={"x": {"a": 2}})
    left, right = await run(dialer, acceptor, expect=2)
    assert isinstance(left, HandshakeResult) and isinstance(right, HandshakeResult)
    assert (left.peer_cluster_id, left.peer_role, left.peer_instance, left.peer_offers) == (2, 2, "bb", {"x": {"a": 2}})
    assert (right.peer_cluster_id, right.peer_role, right.peer_instance, right.peer_offers) == (1, 1, "aa",
                                                                                              {"x": {"d": 1}})
    assert seen == [Kind.HELLO, Kind.HELLO, Kind.AUTH, Kind.READY]


async def test_the_same_token_authenticates_and_the_token_never_crosses_the_wire() -> None:
    frames: list[bytes] = []
    dialer, acceptor, _ = pair(Identity(1, 1, "aa", "s3cret"), Identity(2, 2, "bb", "s3cret"))
    for end in (dialer, acceptor):
        original = end._send  # noqa: SLF001 - the test records what each end sends

        def recording(frame: bytes, original: Any = original) -> None:
            frames.append(frame)
            original(frame)
        end._send = recording  # noqa: SLF001
    left, right = await run(dialer, acceptor)
    assert isinstance(left, HandshakeResult) and isinstance(right, HandshakeResult)
    assert not any(b"s3cret" in frame for frame in frames)


@pytest.mark.parametrize("tokens", [("a", "b"), ("a", None), (None, "b")])
async def test_a_wrong_or_missing_token_fails_the_link_on_both_sides(tokens: tuple[str | None, str | None]) -> None:
    dialer, acceptor, _ = pair(Identity(1, 1, "aa", tokens[0]), Identity(2, 2, "bb", tokens[1]))
    left, right = await run(dialer, acceptor)
    for result in (left, right):
        assert isinstance(result, LLMException) and result.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert "auth" in str(left) or "refused" in str(left)


async def test_a_peer_with_the_wrong_cluster_id_is_refused_by_the_dialer() -> None:
    dialer, acceptor, _ = pair(Identity(1, 1, "aa", None), Identity(3, 2, "bb", None))
    left, _ = await run(dialer, acceptor, expect=2)
    assert isinstance(left, LLMException) and "not 2" in str(left)


async def test_a_peer_with_this_engines_own_cluster_id_is_refused() -> None:
    dialer, acceptor, _ = pair(Identity(1, 1, "aa", None), Identity(1, 2, "bb", None))
    left, right = await run(dialer, acceptor)
    assert isinstance(right, LLMException) and "own cluster id" in str(right)
    assert isinstance(left, LLMException)


async def test_a_protocol_version_mismatch_is_named() -> None:
    acceptor = Handshake(Identity(2, 2, "bb", None), lambda frame: None, dict, dialer=False)
    hello = {"version": 99, "cluster_id": 1, "role": 1, "instance": "aa", "nonce": "00" * 32, "auth": False}
    acceptor.deliver(Kind.HELLO, hello)
    with pytest.raises(LLMException, match="protocol 99"):
        await acceptor.accept()


async def test_malformed_hello_and_bad_nonce_are_link_failures() -> None:
    for body in ({"version": 1}, {"version": 1, "cluster_id": 1, "nonce": "00"}):
        acceptor = Handshake(Identity(2, 2, "bb", None), lambda frame: None, dict, dialer=False)
        acceptor.deliver(Kind.HELLO, body)
        with pytest.raises(LLMException) as caught:
            await acceptor.accept()
        assert caught.value.status_code == LLMStatusCode.LLM_LINK_FAILED


def test_frames_out_of_turn_are_protocol_errors() -> None:
    dialer = Handshake(Identity(1, 1, "aa", None), lambda frame: None, dict, dialer=True)
    with pytest.raises(ProtocolError):
        dialer.deliver(Kind.TABLE, {})
    with pytest.raises(ProtocolError, match="before authentication"):
        dialer.deliver(Kind.READY, {})  # the dialer has not sent AUTH yet
    acceptor = Handshake(Identity(2, 2, "bb", None), lambda frame: None, dict, dialer=False)
    with pytest.raises(ProtocolError, match="before authentication"):
        acceptor.deliver(Kind.READY, {})  # an acceptor never receives READY


async def test_a_closed_stream_ends_a_waiting_step_with_the_reason() -> None:
    acceptor = Handshake(Identity(2, 2, "bb", None), lambda frame: None, dict, dialer=False)
    acceptor.stream_closed("peer vanished")
    with pytest.raises(LLMException, match="peer vanished"):
        await acceptor.accept()


async def test_offers_are_made_only_after_authentication() -> None:
    made: list[str] = []
    dialer = Handshake(Identity(1, 1, "aa", "t"), lambda frame: None, lambda: made.append("d") or {}, dialer=True)
    dialing = asyncio.ensure_future(dialer.dial())
    await asyncio.sleep(0)
    assert made == []  # HELLO went out without offers
    dialer.deliver(Kind.HELLO, {"version": 1, "cluster_id": 2, "nonce": "11" * 32, "auth": True, "proof": "bad"})
    with pytest.raises(LLMException, match="proof is wrong"):
        await dialing
    assert made == []  # a peer that failed to prove the token learns nothing
    assert encode_json(Kind.PING, 0, {})  # the codec is the one the link uses
