"""kvpush.integrations.sglang.core: SGLang's pool as kvpush blocks, heads between TP sizes, the backend's
messages and settings. Pure: no SGLang."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvpush import MAX_MESSAGE_BYTES
from kvpush.integrations.config import ParamsError
from kvpush.integrations.sglang import core

HEAD_DIM, ITEM = 8, 2  # bf16


def kv_args(pages: int = 10, page_size: int = 4, local: int = 2, total: int = 4, layers: int = 3) -> SimpleNamespace:
    page_bytes = page_size * local * HEAD_DIM * ITEM
    return SimpleNamespace(kv_data_lens=[pages * page_bytes] * 2 * layers, kv_item_lens=[page_bytes] * 2 * layers,
                           page_size=page_size, kv_head_num=local, total_kv_head_num=total)


def layout(tp_size: int, tp_rank: int, total: int = 4, **kwargs: int) -> core.PoolLayout:
    local = max(1, total // tp_size)
    return core.PoolLayout.of(kv_args(local=local, total=total, **kwargs), tp_size, tp_rank, False)


def test_a_pool_is_one_block_per_head_of_every_token() -> None:
    pool = layout(2, 1)
    assert (pool.buffers, pool.pages, pool.page_size, pool.local_heads, pool.slab_bytes) == (6, 10, 4, 2, 16)
    assert pool.blocks == 10 * 4 * 2
    assert core.PoolLayout.from_wire(pool.to_wire()) == pool


def test_pools_kvpush_cannot_register_are_refused_naming_the_values() -> None:
    args = kv_args()
    args.kv_data_lens = [*args.kv_data_lens[:-1], 1]
    with pytest.raises(core.LayoutError, match="different sizes"):
        core.PoolLayout.of(args, 1, 0, False)
    with pytest.raises(core.LayoutError, match="heads"):
        core.PoolLayout.of(kv_args(local=3, total=4), 2, 0, False)  # 4 heads over 2 ranks are 2 each
    with pytest.raises(core.LayoutError, match="bad pool layout"):
        core.PoolLayout.from_wire({**layout(1, 0).to_wire(), "tp_rank": 3})


def test_equal_tp_moves_whole_pages_as_one_run() -> None:
    prefill, decode = layout(1, 0), layout(1, 0)
    leg = core.overlap(prefill, decode)
    assert leg is not None and leg.heads == 4
    src, dst = core.slab_ids(leg, [2, 3], [7, 8], prefill, decode)
    per_page = 4 * 4  # tokens x heads
    assert np.array_equal(src, np.arange(2 * per_page, 4 * per_page))
    assert np.array_equal(dst, np.arange(7 * per_page, 9 * per_page))


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4)])
def test_between_tp_sizes_every_decode_head_comes_from_exactly_one_prefill_rank(prefill_tp: int,
                                                                                decode_tp: int) -> None:
    """Simulate the bytes: each rank's pool as [token, local head] cells holding (token, global head)."""
    page_size, pages = 4, 6
    src_pages, dst_pages = np.array([1, 4]), np.array([5, 0])
    for d in range(decode_tp):
        decode = layout(decode_tp, d)
        received = np.full((pages * page_size * decode.local_heads, 2), -1)
        for p in range(prefill_tp):
            prefill = layout(prefill_tp, p)
            leg = core.overlap(prefill, decode)
            if leg is None:
                continue
            cells = np.array([(t, prefill.sharding().heads(p)[h]) for t in range(pages * page_size)
                              for h in range(prefill.local_heads)])
            src, dst = core.slab_ids(leg, src_pages, dst_pages, prefill, decode)
            received[dst] = cells[src]
        tokens = lambda ps: (ps[:, None] * page_size + np.arange(page_size)).ravel()  # noqa: E731
        for local, head in enumerate(decode.sharding().heads(d)):
            got = received[tokens(dst_pages) * decode.local_heads + local]
            assert np.array_equal(got[:, 0], tokens(src_pages)) and (got[:, 1] == head).all()
        assert (received[:, 0] == -1).sum() == received.shape[0] - len(src_pages) * page_size * decode.local_heads


def test_mla_pools_move_whole_pages_whatever_the_tp_sizes() -> None:
    prefill = core.PoolLayout.of(kv_args(local=1, total=1), 2, 1, True)
    decode = core.PoolLayout.of(kv_args(local=1, total=1), 4, 3, True)
    leg = core.overlap(prefill, decode)
    assert leg is not None and (leg.src_head, leg.dst_head, leg.heads) == (0, 0, 1)


def test_incompatible_pools_are_named_on_both_sides() -> None:
    problem = core.incompatibility(layout(1, 0), layout(1, 0, page_size=8))
    assert problem == "page size: prefill 4, decode 8"
    assert core.incompatibility(layout(1, 0), layout(2, 1)) is None


def test_registration_and_done_round_trip_and_refuse_garbage() -> None:
    registration = core.Registration("127.0.0.1", 4242, 77, layout(2, 0), (64, 32))
    assert core.Registration.decode(registration.encode()) == registration
    with pytest.raises(core.LayoutError):
        core.Registration.decode(b'{"v": 2}')
    done = core.Done(2**63 + 5, 3, (b"abc", b"", bytes(100)))
    assert core.decode_done(core.encode_done(done)) == done
    for garbage in (b"", b"XXXX" + bytes(16), core.encode_done(done)[:-1]):
        with pytest.raises(core.LayoutError):
            core.decode_done(garbage)
    with pytest.raises(core.LayoutError, match="notification carries"):
        core.encode_done(core.Done(1, 0, (bytes(MAX_MESSAGE_BYTES),)))


def test_cluster_ids_come_from_the_control_address_both_sides_know() -> None:
    assert core.cluster_id_of("127.0.0.1", 5000) == core.cluster_id_of("localhost", 5000)
    assert core.cluster_id_of("127.0.0.1", 5000) != core.cluster_id_of("127.0.0.1", 5001)


def test_prefill_ranks_carry_the_rank_numbers_their_abort_acknowledgements_carry() -> None:
    """SGLang's prefill acknowledges an abort as rank ``attn_tp_rank * pp * cp + pp_rank * cp + cp_rank``."""
    places = [(0, 0, 0), (1, 1, 2), (2, 0, 1)]  # (tp, pp, cp) ranks
    infos = [{"rank_ip": "10.0.0.1", "rank_port": 7000 + i, "attn_tp_rank": tp, "pp_size": 2, "pp_rank": pp,
              "attn_cp_size": 3, "attn_cp_rank": cp} for i, (tp, pp, cp) in enumerate(places)]
    ranks = core.prefill_ranks("10.0.0.1:8998", infos)
    assert [rank.rank for rank in ranks.values()] == [0, 1 * 6 + 1 * 3 + 2, 2 * 6 + 0 + 1]
    assert list(ranks) == [core.cluster_id_of("10.0.0.1", 7000 + i) for i in range(3)]
    plain = core.prefill_ranks("h:1", [{"rank_ip": "h", "rank_port": 9, "is_dummy": True}])  # TP 1, no CP or PP
    assert list(plain.values()) == [core.PrefillRank("h:1", "h", 9, 0)]


def test_settings_come_from_the_environment_and_keep_the_listener_rule() -> None:
    settings = core.BackendSettings.from_env({"KVPUSH_TRANSPORT": "tcp", "KVPUSH_AUTH_TOKEN": "s3cret"})
    options = settings.engine_options(("10.0.0.5", 0))
    assert options["kvpush.transport"] == "tcp" and options["kvpush.auth_token"] == "s3cret"
    assert options["llm.listenIpInfo"] == "10.0.0.5:0"
    settings.check_listener("10.0.0.5")  # a token: fine
    with pytest.raises(ParamsError, match="KVPUSH_AUTH_TOKEN"):
        core.BackendSettings.from_env({}).check_listener("10.0.0.5")
    core.BackendSettings.from_env({}).check_listener("127.0.0.1")
    core.BackendSettings.from_env({"KVPUSH_INSECURE": "1"}).check_listener("10.0.0.5")
    with pytest.raises(ParamsError):
        core.BackendSettings.from_env({"KVPUSH_SYNC_KV_TIMEOUT_MS": "soon"})


def test_the_loop_thread_yields_only_when_asked_and_a_bad_value_is_named() -> None:
    assert not core.BackendSettings.from_env({}).loop_yields
    assert core.BackendSettings.from_env({"KVPUSH_LOOP_YIELDS": "1"}).loop_yields
    assert not core.BackendSettings.from_env({"KVPUSH_LOOP_YIELDS": "0"}).loop_yields
    with pytest.raises(ParamsError, match="KVPUSH_LOOP_YIELDS"):
        core.BackendSettings.from_env({"KVPUSH_LOOP_YIELDS": "sometimes"})


def test_aborted_rooms_remember_why_and_forget_the_oldest_past_their_bound() -> None:
    rooms = core.AbortedRooms(limit=3)
    for room in range(5):
        rooms.add(room, f"aborted {room}")
    assert len(rooms) == 3
    assert rooms.reason(0) is None and rooms.reason(1) is None  # the oldest went first
    assert rooms.reason(4) == "aborted 4"
    rooms.add(2, "again")  # re-added: now the newest
    rooms.add(5, "aborted 5")
    assert rooms.reason(2) == "again" and rooms.reason(3) is None and len(rooms) == 3


# -- state pools beside the KV (KVArgs.state_*) ------------------------------------------------------------

def with_states(args: SimpleNamespace, *components: tuple[str, list[int], list[int]]) -> SimpleNamespace:
    """``components``: (SGLang's StateType name, each entry's buffer bytes, each entry's item bytes)."""
    args.state_types = [SimpleNamespace(name=kind) for kind, _, _ in components]
    args.state_data_lens = [lens for _, lens, _ in components]
    args.state_item_lens = [items for _, _, items in components]
    return args


def test_a_window_sub_pool_is_a_pool_of_its_own_and_a_state_a_cache_per_slot_size() -> None:
    page = 4 * 2 * HEAD_DIM * ITEM
    args = with_states(kv_args(total=2), ("SWA", [6 * page] * 4, [page] * 4),
                       ("MAMBA", [9 * 288, 9 * 1024, 9 * 288, 9 * 1024], [288, 1024, 288, 1024]))
    swa, mamba = core.state_pools(args, 1, 0)
    assert swa.window is not None and (swa.window.buffers, swa.window.pages, swa.window.local_heads) == (4, 6, 2)
    assert mamba.groups == (core.SlotGroup((0, 2), 9, 288), core.SlotGroup((1, 3), 9, 1024))
    assert core.state_model_ids((swa, mamba)) == [[1], [2, 3]]  # after the KV pool's (core.MODEL_ID 0)
    assert tuple(core.StatePool.from_wire(p.to_wire()) for p in (swa, mamba)) == (swa, mamba)
    registration = core.Registration("127.0.0.1", 1, 2, layout(1, 0, total=2), (64,), (swa, mamba))
    assert core.Registration.decode(registration.encode()) == registration


def test_a_state_pool_kvpush_does_not_move_is_refused_by_name() -> None:
    with pytest.raises(core.LayoutError, match="DSA state pool"):
        core.state_pools(with_states(kv_args(total=2), ("DSA", [640], [64])), 1, 0)
    with pytest.raises(core.LayoutError, match="do not cut into slots"):
        core.state_pools(with_states(kv_args(total=2), ("MAMBA", [1000], [288])), 1, 0)


def test_the_two_sides_state_pools_must_agree_and_a_state_moves_between_equal_tp_sizes_only() -> None:
    page = 4 * 2 * HEAD_DIM * ITEM
    args = with_states(kv_args(total=2), ("MAMBA", [9 * 288], [288]))
    (mamba,) = core.state_pools(args, 1, 0)
    one = layout(1, 0, total=2)
    assert core.incompatibility(one, one, (mamba,), ()) == "state pools: prefill ['MAMBA'], decode []"
    other = core.StatePool("MAMBA", None, (core.SlotGroup((0,), 9, 512),))
    assert "MAMBA state pool 0: prefill MAMBA (1 x 9 slots of 288 bytes)" in (
        core.incompatibility(layout(1, 0, total=2), layout(1, 0, total=2), (mamba,), (other,)) or "")
    assert "equal TP sizes only" in (core.incompatibility(layout(2, 0, total=2), one, (mamba,), (mamba,)) or "")
    (swa,) = core.state_pools(with_states(kv_args(total=2), ("SWA", [6 * page] * 4, [page] * 4)), 1, 0)
    (wide,) = core.state_pools(with_states(kv_args(total=2), ("SWA", [6 * page] * 6, [page] * 6)), 1, 0)
    assert core.incompatibility(layout(1, 0, total=2), layout(1, 0, total=2), (swa,), (wide,)) == (
        "SWA state pool 0: buffers (layers x K/V): prefill 4, decode 6")


def test_a_window_s_pages_pair_from_the_end_and_a_state_moves_its_slot_in_every_slot_size() -> None:
    page = 4 * 2 * HEAD_DIM * ITEM
    (swa,) = core.state_pools(with_states(kv_args(total=2), ("SWA", [6 * page] * 2, [page] * 2)), 1, 0)
    assert swa.window is not None
    leg = core.overlap(swa.window, swa.window)
    ((cache, src, dst),) = core.state_pushes(swa, swa, [9, 2, 5], [4, 1], leg)
    assert cache == 0 and src[:8].tolist() == list(range(2 * 4 * 2, 3 * 4 * 2))  # page 2's tokens, both heads
    assert dst[:8].tolist() == list(range(4 * 4 * 2, 5 * 4 * 2))  # into page 4
    (mamba,) = core.state_pools(with_states(kv_args(total=2), ("MAMBA", [9 * 288, 9 * 1024], [288, 1024])), 1, 0)
    pushes = core.state_pushes(mamba, mamba, [3], [7], None)
    assert [(c, s.tolist(), d.tolist()) for c, s, d in pushes] == [(0, [3], [7]), (1, [3], [7])]
    with pytest.raises(core.LayoutError, match="one slot per side"):
        core.state_pushes(mamba, mamba, [3, 4], [7], None)
    with pytest.raises(core.LayoutError, match="decode's MAMBA slot 9"):
        core.state_pushes(mamba, mamba, [3], [9], None)
    indices = [np.asarray([3, 4]), None]
    decoded = core.decode_state_indices(core.encode_state_indices(indices))
    assert decoded[0] is not None and decoded[0].tolist() == [3, 4] and decoded[1] is None
