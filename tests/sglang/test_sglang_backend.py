"""kvpush's SGLang backend between processes over SGLang's real disaggregation classes (``peer.py``): pages of an
MHA pool land where the decode asked, in chunks, with the aux row; an abort, a killed prefill, a prefill or a
decode that dies with its link closing before its control socket, and a peer without the token each end a room
promptly and leave nothing behind; ``KVPUSH_LOOP_YIELDS`` reaches kvpush's loop thread. About 60 s, most of it
importing SGLang.

The decodes' SGLang heartbeat is slowed to 10 minutes, so that what ends a room whose prefill died is kvpush."""


from __future__ import annotations

import os
import time
from typing import Any

import pytest

SUCCESS, FAILED = 4, 0  # SGLang's KVPoll
TOKEN = "sglang-test-secret"
# bootstrap: prefill A (shared), B (killed by a test), C (TP 2), D (exits links first in a test)
PORT_A, PORT_B, PORT_C, PORT_D = 18931, 18933, 18935, 18937
BOOT_A, BOOT_B, BOOT_C, BOOT_D = (f"127.0.0.1:{port}" for port in (PORT_A, PORT_B, PORT_C, PORT_D))
SLOW_HEARTBEAT = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "600"}
# the eight peers import SGLang inside the first test's timeout (pytest-timeout times fixtures too): up to
# ``Peer.wait_ready``'s 120 s each, side by side, and the test
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def peers(peer_factory: Any) -> dict[str, Any]:
    """Prefill A, B and D, prefill C's two TP ranks, a decode, a decode holding another token (its loop thread yields)
    and decode E (exits links first in a test), all started at once (their imports overlap)."""
    token = {"KVPUSH_AUTH_TOKEN": TOKEN}
    decode_env = {**token, **SLOW_HEARTBEAT}
    prefill_a, prefill_b, c0, c1, prefill_d, decode, stranger, decode_e = peer_factory([
        {"role": "prefill", "port": PORT_A, "env": token}, {"role": "prefill", "port": PORT_B, "env": token},
        {"role": "prefill", "port": PORT_C, "tp_rank": 0, "tp_size": 2, "env": token},
        {"role": "prefill", "port": PORT_C, "tp_rank": 1, "tp_size": 2, "env": token},
        {"role": "prefill", "port": PORT_D, "env": token},
        {"role": "decode", "port": PORT_A, "env": decode_env},
        {"role": "decode", "port": PORT_A,
         "env": {"KVPUSH_AUTH_TOKEN": "not-the-secret", "KVPUSH_LOOP_YIELDS": "1", **SLOW_HEARTBEAT}},
        {"role": "decode", "port": PORT_A, "env": decode_env}])
    return {"prefill_a": prefill_a, "prefill_b": prefill_b, "prefill_c": (c0, c1), "prefill_d": prefill_d,
            "decode": decode, "stranger": stranger, "decode_e": decode_e}


def _no_leak(*endpoints: Any) -> None:
    deadline = time.monotonic() + 15  # a watch of a peer ends at its next probe: up to 2 s and one probe's 1 s
    for peer in endpoints:
        stats = peer.ask("stats")
        while any(stats.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            stats = peer.ask("stats")
        assert not any(stats.values()), f"{peer.role} still holds {stats}"


def _fails_promptly(peer: Any, room: int) -> dict[str, Any]:
    """``room`` ends Failed on ``peer`` well before SGLang's bootstrap and waiting timeouts (300 s)."""
    waited = peer.ask("wait", room=room, timeout=30)
    assert waited["status"] == FAILED and waited["seconds"] < 10, waited
    return waited


def test_pages_and_aux_land_where_the_decode_asked(peers: dict[str, Any]) -> None:
    prefill, decode = peers["prefill_a"], peers["decode"]
    src, dst = [1, 2, 3, 4, 8, 30, 31], [5, 6, 7, 9, 10, 50, 2]
    assert decode.ask("receive", room=101, pages=dst, aux=3, bootstrap=BOOT_A)["status"] != FAILED
    prefill.ask("send", room=101, pages=src, aux=2, bootstrap=BOOT_A, chunks=3)
    assert prefill.ask("wait", room=101, timeout=20)["status"] == SUCCESS
    assert decode.ask("wait", room=101, timeout=20)["status"] == SUCCESS
    check = decode.ask("check", room=101, src_pages=src, src_tp_size=1)
    assert check == {"mismatched_buffers": 0, "aux_ok": True, "written_elsewhere": 0, "room_untouched": False}
    decode.ask("clear", room=101)
    prefill.ask("clear", room=101)
    _no_leak(prefill, decode)


def test_a_tp2_prefill_sends_each_rank_its_heads_into_a_tp1_decode(peers: dict[str, Any]) -> None:
    """Heterogeneous TP: the decode holds all 4 KV heads, each prefill rank 2 of them; SGLang's rank mapping
    sends the room to both ranks, and each pushes its heads' slabs into every token of the decode's pages."""
    ranks, decode = peers["prefill_c"], peers["decode"]
    src, dst = [3, 4, 5, 12], [20, 21, 22, 23]
    assert decode.ask("receive", room=105, pages=dst, aux=2, bootstrap=BOOT_C)["status"] != FAILED
    for rank in ranks:
        rank.ask("send", room=105, pages=src, aux=1, bootstrap=BOOT_C, chunks=2)
    assert decode.ask("wait", room=105, timeout=20)["status"] == SUCCESS
    for rank in ranks:
        assert rank.ask("wait", room=105, timeout=20)["status"] == SUCCESS
    check = decode.ask("check", room=105, src_pages=src, src_tp_size=2)
    assert check == {"mismatched_buffers": 0, "aux_ok": True, "written_elsewhere": 0, "room_untouched": False}
    decode.ask("clear", room=105)
    for rank in ranks:
        rank.ask("clear", room=105)
    _no_leak(decode, *ranks)


def test_abort_on_the_decode_fails_the_room_on_both_sides_and_frees_everything(peers: dict[str, Any]) -> None:
    prefill, decode = peers["prefill_a"], peers["decode"]
    assert decode.ask("receive", room=102, pages=[11, 12, 13], aux=4, bootstrap=BOOT_A)["status"] != FAILED
    assert decode.ask("abort", room=102)["status"] == FAILED
    assert decode.ask("released", room=102)["released"]  # the prefill acknowledged: nothing of it can land
    prefill.ask("send", room=102, pages=[20, 21, 22], aux=5, bootstrap=BOOT_A)
    _fails_promptly(prefill, 102)
    check = decode.ask("check", room=102, src_pages=[20, 21, 22], src_tp_size=1)
    assert check["room_untouched"] and not check["written_elsewhere"], check
    decode.ask("clear", room=102)
    prefill.ask("clear", room=102)
    _no_leak(prefill, decode)


def test_an_abort_between_two_chunks_stops_the_room_and_is_acknowledged_once_drained(peers: dict[str, Any]) -> None:
    prefill, decode = peers["prefill_a"], peers["decode"]
    src, dst = [40, 41, 42, 43], [44, 45, 46, 47]
    assert decode.ask("receive", room=106, pages=dst, aux=6, bootstrap=BOOT_A)["status"] != FAILED
    prefill.ask("send", room=106, pages=src, aux=6, bootstrap=BOOT_A, chunks=2, hold=1)  # the first half goes
    assert decode.ask("abort", room=106)["status"] == FAILED
    assert decode.ask("released", room=106)["released"]
    prefill.ask("send_rest", room=106)  # SGLang's scheduler sends the last chunk: it must not move
    _fails_promptly(prefill, 106)
    check = decode.ask("check", room=106, src_pages=src, src_tp_size=1)
    assert not check["written_elsewhere"] and not check["aux_ok"], check
    decode.ask("clear", room=106)
    prefill.ask("clear", room=106)
    _no_leak(prefill, decode)


def test_an_abort_on_the_prefill_before_its_first_chunk_ends_the_decodes_room_at_once(peers: dict[str, Any]) -> None:
    prefill, decode = peers["prefill_a"], peers["decode"]
    assert decode.ask("receive", room=107, pages=[60, 61], aux=1, bootstrap=BOOT_A)["status"] != FAILED
    prefill.ask("send", room=107, pages=[62, 63], aux=1, bootstrap=BOOT_A, chunks=1, hold=1)  # destination in, no chunk
    assert prefill.ask("abort", room=107)["status"] == FAILED
    assert "Abort" in _fails_promptly(decode, 107).get("reason", "")
    assert decode.ask("check", room=107, src_pages=[62, 63], src_tp_size=1)["room_untouched"]
    decode.ask("clear", room=107)
    prefill.ask("clear", room=107)
    _no_leak(prefill, decode)


def test_an_abort_on_the_prefill_between_two_chunks_ends_the_decodes_room_at_once(peers: dict[str, Any]) -> None:
    prefill, decode = peers["prefill_a"], peers["decode"]
    src, dst = [24, 25, 26, 27], [28, 29, 30, 31]
    assert decode.ask("receive", room=108, pages=dst, aux=7, bootstrap=BOOT_A)["status"] != FAILED
    prefill.ask("send", room=108, pages=src, aux=2, bootstrap=BOOT_A, chunks=2, hold=1, fill_aux=11)  # first half
    time.sleep(0.5)  # and lands: no push of the room is running when it is aborted
    prefill.ask("stall", seconds=0.5)  # kvpush's loop hears of the abort only after SGLang cleared the sender
    assert prefill.ask("abort", room=108)["status"] == FAILED
    prefill.ask("clear", room=108)  # as SGLang does at once: the decode must still hear of it
    _fails_promptly(decode, 108)
    check = decode.ask("check", room=108, src_pages=src, src_tp_size=1, fill_aux=11)
    assert not check["written_elsewhere"] and not check["aux_ok"], check
    decode.ask("clear", room=108)
    _no_leak(prefill, decode)


def test_an_abort_on_the_prefill_right_after_its_chunk_ends_the_decodes_room_at_once(peers: dict[str, Any]) -> None:
    """With kvpush's loop thread held up (a loaded host), the chunk's push is cancelled before it started (its
    body never runs): the room still ends on both sides, and its count of pushes in flight too."""
    prefill, decode = peers["prefill_a"], peers["decode"]
    for room in (111, 112, 113):
        assert decode.ask("receive", room=room, pages=[40, 41], aux=5, bootstrap=BOOT_A)["status"] != FAILED
        sent = prefill.ask("send", room=room, pages=[42, 43], aux=5, bootstrap=BOOT_A, abort=True, stall=0.3)
        assert sent["status"] == FAILED
        _fails_promptly(decode, room)
        decode.ask("clear", room=room)
        prefill.ask("clear", room=room)
        _no_leak(prefill, decode)


def test_an_abort_on_the_prefill_before_the_decodes_destination_came_ends_it_when_it_comes(
        peers: dict[str, Any]) -> None:
    prefill, decode = peers["prefill_a"], peers["decode"]
    prefill.ask("open", room=109, pages=[32, 33], aux=3, bootstrap=BOOT_A)
    assert prefill.ask("abort", room=109)["status"] == FAILED
    prefill.ask("clear", room=109)
    decode.ask("receive", room=109, pages=[34, 35], aux=3, bootstrap=BOOT_A)
    _fails_promptly(decode, 109)
    assert decode.ask("check", room=109, src_pages=[32, 33], src_tp_size=1)["room_untouched"]
    decode.ask("clear", room=109)
    _no_leak(prefill, decode)  # the late destination was not kept either


def test_an_abort_on_the_decode_before_the_prefills_request_came_ends_it_when_it_comes(peers: dict[str, Any]) -> None:
    """SGLang's prealloc queue: the decode aborts before it sent any pages; the prefill's request comes later
    and must not wait 300 s for a destination that will never come."""
    prefill, decode = peers["prefill_a"], peers["decode"]
    decode.ask("receive", room=110, pages=[36, 37], aux=4, bootstrap=BOOT_A, metadata=False)
    assert decode.ask("abort", room=110)["status"] == FAILED
    decode.ask("clear", room=110)
    time.sleep(0.5)  # the abort reaches the prefill first
    prefill.ask("open", room=110, pages=[38, 39], aux=4, bootstrap=BOOT_A)
    _fails_promptly(prefill, 110)
    prefill.ask("clear", room=110)
    _no_leak(prefill, decode)


def test_a_peer_without_the_token_is_refused(peers: dict[str, Any]) -> None:
    prefill, stranger = peers["prefill_a"], peers["stranger"]
    assert stranger.ask("receive", room=103, pages=[1, 2], aux=1, bootstrap=BOOT_A)["status"] != FAILED
    prefill.ask("send", room=103, pages=[3, 4], aux=1, bootstrap=BOOT_A)
    sent = prefill.ask("wait", room=103, timeout=20)
    received = stranger.ask("wait", room=103, timeout=20)
    assert sent["status"] == FAILED and received["status"] == FAILED, (sent, received)
    assert "LLM_LINK_FAILED" in received.get("reason", ""), received  # the decode's engine refused the link
    check = stranger.ask("check", room=103, src_pages=[3, 4], src_tp_size=1)
    assert check["room_untouched"] and not check["written_elsewhere"], check
    stranger.ask("clear", room=103)
    prefill.ask("clear", room=103)
    _no_leak(prefill, stranger)


def test_a_killed_prefill_fails_its_rooms_at_once_not_after_the_bootstrap_timeout(peers: dict[str, Any]) -> None:
    prefill, decode = peers["prefill_b"], peers["decode"]
    assert decode.ask("receive", room=104, pages=[40, 41], aux=6, bootstrap=BOOT_B)["status"] != FAILED
    assert prefill.ask("links") == {"links": 1}  # the prefill links to the decode on its registration
    prefill.kill()
    waited = decode.ask("wait", room=104, timeout=60)
    assert waited["status"] == FAILED and waited["seconds"] < 15, waited
    decode.ask("clear", room=104)
    _no_leak(decode)


def test_a_prefill_whose_link_closes_before_its_control_socket_strands_no_room(peers: dict[str, Any]) -> None:
    """A dying process closes its sockets one after another: right as its link closed, the prefill may still
    accept a connection. The decode asks again: a room that only the prefill's being gone can end (bootstrapped,
    no pages sent yet, as SGLang's prealloc queue holds it) fails promptly too, not after SGLang's timers."""
    prefill, decode = peers["prefill_d"], peers["decode"]
    # room 114 is granted: the link's closing fails it. Room 115 is the case: only the prefill's being gone ends it
    assert decode.ask("receive", room=114, pages=[44, 45], aux=5, bootstrap=BOOT_D)["status"] != FAILED
    assert decode.ask("receive", room=115, pages=[46, 47], aux=4, bootstrap=BOOT_D, metadata=False)["status"] != FAILED
    assert prefill.ask("links") == {"links": 1}  # the prefill links to the decode on its registration
    assert prefill.ask("exit_links_first", linger=1.5) == {"closed": 1}
    for room in (114, 115):
        waited = decode.ask("wait", room=room, timeout=60)
        assert waited["status"] == FAILED and waited["seconds"] < 15, (room, waited)
    assert prefill.process.wait(10) == 0
    for room in (114, 115):
        decode.ask("clear", room=room)
    _no_leak(decode)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_kvpush_loop_thread_yields_only_where_asked(peers: dict[str, Any]) -> None:
    assert peers["stranger"].ask("loop_policy") == {"policy": os.SCHED_BATCH}
    assert peers["decode"].ask("loop_policy") == {"policy": os.SCHED_OTHER}


def test_a_decode_whose_link_closes_before_its_control_socket_strands_no_room(peers: dict[str, Any]) -> None:
    """The same on the prefill: a room whose destination came from a decode that dies, and whose pages are not
    computed yet (no push that could fail), fails promptly."""
    prefill, decode = peers["prefill_a"], peers["decode_e"]
    assert decode.ask("receive", room=117, pages=[52, 53], aux=2, bootstrap=BOOT_A)["status"] != FAILED
    prefill.ask("open", room=117, pages=[54, 55], aux=2, bootstrap=BOOT_A)
    assert decode.ask("links")["links"] >= 1  # the destination reached the prefill, which linked to the decode
    assert decode.ask("exit_links_first", linger=1.5)["closed"] >= 1
    waited = prefill.ask("wait", room=117, timeout=60)
    assert waited["status"] == FAILED and waited["seconds"] < 15, waited
    assert decode.process.wait(10) == 0
    prefill.ask("clear", room=117)
    _no_leak(prefill)


def test_a_live_prefill_whose_link_dropped_keeps_the_room_waiting_on_it_and_serves_it(peers: dict[str, Any]) -> None:
    """The other side of asking again: a prefill whose link dropped but whose process lives is not declared gone
    however long the decode watches it, and once it links again (its push) the watch ends and the room lands."""
    prefill, decode = peers["prefill_a"], peers["decode"]
    src, dst = [3, 4], [60, 61]
    assert decode.ask("receive", room=118, pages=dst, aux=1, bootstrap=BOOT_A, metadata=False)["status"] != FAILED
    assert prefill.ask("links")["links"] >= 1  # it links to the decode on its registration (or linked before)
    prefill.ask("close_links")
    deadline = time.monotonic() + 10
    while decode.ask("stats")["watches"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode.ask("stats")["watches"] >= 1  # the link to prefill A closed with room 118 waiting on it
    time.sleep(1.5)  # asked again several times meanwhile: it accepts every time
    assert decode.ask("send_metadata", room=118)["status"] != FAILED
    prefill.ask("send", room=118, pages=src, aux=1, bootstrap=BOOT_A)
    assert prefill.ask("wait", room=118, timeout=20)["status"] == SUCCESS
    assert decode.ask("wait", room=118, timeout=20)["status"] == SUCCESS
    check = decode.ask("check", room=118, src_pages=src, src_tp_size=1)
    assert check["mismatched_buffers"] == 0 and check["aux_ok"], check
    # the room still waits in SGLang's books until it is cleared: only the new link ends the watch
    deadline = time.monotonic() + 10
    while decode.ask("stats")["watches"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode.ask("stats")["watches"] == 0
    decode.ask("clear", room=118)
    prefill.ask("clear", room=118)
    _no_leak(prefill, decode)  # the watches ended too
