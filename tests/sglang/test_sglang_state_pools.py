"""kvpush's SGLang backend moves a model's state pools with its KV, between processes over SGLang's real
disaggregation classes (``peer.py``, ``KVPUSH_TEST_STATE``): a sliding-window model's window sub-pool (SWA pages, a
TP 2 prefill into a TP 1 decode, each rank its heads) and a hybrid model's recurrent state (one Mamba slot per
side). SGLang 0.5.23's CPU build serves neither family (its Mamba kernels are CUDA or Triton only; gpt-oss, its SWA
hybrid, fails its first forward on the torch_native backend: docs/guides/models.md), so the real classes in two
processes are where these pools are tested. A pool kvpush does not move (a DSA indexer) refuses to start, named."""

from __future__ import annotations

from typing import Any

import pytest

SUCCESS, FAILED = 4, 0  # SGLang's KVPoll
PORT_SWA, PORT_MAMBA, PORT_DSA = 18961, 18963, 18965
BOOT_SWA, BOOT_MAMBA = f"127.0.0.1:{PORT_SWA}", f"127.0.0.1:{PORT_MAMBA}"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def peers(peer_factory: Any) -> dict[str, Any]:
    """An SWA prefill of two TP ranks and an SWA decode; a Mamba prefill and decode; all started at once."""
    swa, mamba = {"KVPUSH_TEST_STATE": "swa"}, {"KVPUSH_TEST_STATE": "mamba"}
    s0, s1, swa_decode, mamba_prefill, mamba_decode = peer_factory([
        {"role": "prefill", "port": PORT_SWA, "tp_rank": 0, "tp_size": 2, "env": swa},
        {"role": "prefill", "port": PORT_SWA, "tp_rank": 1, "tp_size": 2, "env": swa},
        {"role": "decode", "port": PORT_SWA, "env": swa},
        {"role": "prefill", "port": PORT_MAMBA, "env": mamba},
        {"role": "decode", "port": PORT_MAMBA, "env": mamba}])
    return {"swa_prefill": (s0, s1), "swa_decode": swa_decode, "mamba_prefill": mamba_prefill,
            "mamba_decode": mamba_decode}


def _landed(decode: Any, prefills: tuple[Any, ...], room: int, src: list[int], src_tp: int) -> None:
    assert decode.ask("wait", room=room, timeout=20)["status"] == SUCCESS
    for prefill in prefills:
        assert prefill.ask("wait", room=room, timeout=20)["status"] == SUCCESS
    check = decode.ask("check", room=room, src_pages=src, src_tp_size=src_tp)
    assert check == {"mismatched_buffers": 0, "aux_ok": True, "written_elsewhere": 0, "room_untouched": False}


def test_a_window_sub_pool_moves_its_pages_from_the_end_each_prefill_rank_its_heads(peers: dict[str, Any]) -> None:
    """The window's pages as each side names them (SGLang computes the page-aligned window on both), here the
    prefill's one page longer: paired from the end, the prefill's oldest page stays out."""
    ranks, decode = peers["swa_prefill"], peers["swa_decode"]
    src, dst = [3, 4, 5, 12], [20, 21, 22, 23]
    swa_src, swa_dst = [9, 2, 7], [14, 15]
    assert decode.ask("receive", room=301, pages=dst, aux=2, bootstrap=BOOT_SWA,
                      state=[swa_dst])["status"] != FAILED
    for rank in ranks:
        rank.ask("send", room=301, pages=src, aux=1, bootstrap=BOOT_SWA, chunks=2, state=[swa_src])
    _landed(decode, ranks, 301, src, 2)
    assert decode.ask("check_state", room=301, src=swa_src) == {"mismatched": 0, "written_elsewhere": 0}
    decode.ask("clear", room=301)
    for rank in ranks:
        rank.ask("clear", room=301)


def test_a_recurrent_state_moves_its_one_slot_after_the_last_chunk(peers: dict[str, Any]) -> None:
    prefill, decode = peers["mamba_prefill"], peers["mamba_decode"]
    src, dst = [1, 2, 3], [7, 8, 9]
    assert decode.ask("receive", room=302, pages=dst, aux=4, bootstrap=BOOT_MAMBA, state=[[6]])["status"] != FAILED
    prefill.ask("send", room=302, pages=src, aux=3, bootstrap=BOOT_MAMBA, chunks=3, state=[[2]])
    _landed(decode, (prefill,), 302, src, 1)
    assert decode.ask("check_state", room=302, src=[2]) == {"mismatched": 0, "written_elsewhere": 0}
    decode.ask("clear", room=302)
    prefill.ask("clear", room=302)


def test_a_state_only_one_side_names_fails_the_room_rather_than_leave_a_decode_without_it(
        peers: dict[str, Any]) -> None:
    prefill, decode = peers["mamba_prefill"], peers["mamba_decode"]
    assert decode.ask("receive", room=303, pages=[10], aux=5, bootstrap=BOOT_MAMBA, state=[[5]])["status"] != FAILED
    prefill.ask("send", room=303, pages=[11], aux=3, bootstrap=BOOT_MAMBA)  # no state named on the prefill
    waited = decode.ask("wait", room=303, timeout=20)
    assert waited["status"] == FAILED and "only the decode names indices" in waited.get("reason", ""), waited
    decode.ask("clear", room=303)
    prefill.ask("clear", room=303)


def test_a_state_pool_kvpush_does_not_move_is_refused_at_start_up_by_name(peer_factory: Any) -> None:
    with pytest.raises(AssertionError, match="DSA state pool"):
        peer_factory([{"role": "prefill", "port": PORT_DSA, "env": {"KVPUSH_TEST_STATE": "dsa"}}])
