"""kvpush.integrations.topology: head sharding as vLLM does it, and legs that cover every head of every block of every
decode rank exactly once, for any valid (KV heads, prefill TP, decode TP)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpush.integrations.topology import Leg, Sharding, TopologyError, plan_legs, senders, targets

SIZES = st.sampled_from([1, 2, 3, 4, 6, 8, 16])


def _valid(heads: int, tp: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


@settings(max_examples=400, deadline=None)
@given(heads=SIZES, p_tp=SIZES, d_tp=SIZES, data=st.data())
def test_every_head_of_every_block_of_every_decode_rank_is_pushed_exactly_once(
        heads: int, p_tp: int, d_tp: int, data: st.DataObject) -> None:
    assume(_valid(heads, p_tp) and _valid(heads, d_tp))
    prefill, decode = Sharding(heads, p_tp), Sharding(heads, d_tp)
    blocks = data.draw(st.integers(1, 5))
    src_blocks = np.array(data.draw(st.permutations(range(8)))[:blocks])  # the prefill's vLLM block ids
    dst_blocks = np.array(data.draw(st.permutations(range(10)))[:blocks])  # the decode's
    # each prefill rank's memory, in kvpush blocks (vLLM block * local + local head): the global head id it holds
    # and the vLLM block it belongs to, encoded as block * 1000 + head
    p_mem = [np.array([(b // prefill.local) * 1000 + prefill.first_head(r) + b % prefill.local
                       for b in range(8 * prefill.local)]) for r in range(p_tp)]
    d_mem = [np.full(10 * decode.local, -1) for _ in range(d_tp)]
    writes = [np.zeros(10 * decode.local, int) for _ in range(d_tp)]
    legs = plan_legs(prefill, decode)
    for leg in legs:
        src, dst = leg.block_ids(src_blocks, dst_blocks, prefill.local, decode.local)
        d_mem[leg.decode_rank][dst] = p_mem[leg.prefill_rank][src]
        np.add.at(writes[leg.decode_rank], dst, 1)
    for d in range(d_tp):
        for i, (src_block, dst_block) in enumerate(zip(src_blocks, dst_blocks)):
            for local, head in enumerate(decode.heads(d)):
                slot = dst_block * decode.local + local
                assert writes[d][slot] == 1, (d, i, head)
                assert d_mem[d][slot] == src_block * 1000 + head, (d, i, head)
        untouched = np.ones(10 * decode.local, bool)
        for dst_block in dst_blocks:
            untouched[dst_block * decode.local:(dst_block + 1) * decode.local] = False
        assert not writes[d][untouched].any()
    # a leg moves consecutive heads between one pair of ranks; each prefill head it reads is one that rank holds
    for leg in legs:
        assert 0 <= leg.src_head and leg.src_head + leg.heads <= prefill.local
        assert 0 <= leg.dst_head and leg.dst_head + leg.heads <= decode.local
    assert sum(leg.heads for leg in legs) == d_tp * decode.local  # exactly once, across all decode ranks
    # every prefill rank hears of every transfer, from exactly as many decode ranks as they all announce
    told: dict[int, list[int]] = {p: [] for p in range(p_tp)}
    for d in range(d_tp):
        for target in targets(prefill, decode, d):
            told[target.prefill_rank].append(target.info.legs)
            assert target.info.dst_local == decode.local
    assert all(announced and set(announced) == {len(announced)} for announced in told.values()), told


def test_vllm_sharding_with_and_without_replicas() -> None:
    two_on_four = Sharding(2, 4)  # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; 2, 3 head 1
    assert (two_on_four.local, two_on_four.replicas) == (1, 2)
    assert [list(two_on_four.heads(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert list(two_on_four.holders(1)) == [2, 3]
    eight_on_two = Sharding(8, 2)
    assert [list(eight_on_two.heads(r)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(TopologyError, match="one must divide"):
        Sharding(6, 4)
    with pytest.raises(TopologyError, match="KV heads: prefill 2, decode 4"):
        plan_legs(Sharding(2, 1), Sharding(4, 1))


def test_the_shapes_the_issue_names() -> None:
    # 2 -> 1: the decode's one rank gets head 0 from prefill rank 0 and head 1 from rank 1
    assert plan_legs(Sharding(2, 2), Sharding(2, 1)) == [Leg(0, 0, 0, 0, 1), Leg(1, 0, 0, 1, 1)]
    # 1 -> 2: each decode rank gets its head from the prefill's one rank
    assert plan_legs(Sharding(2, 1), Sharding(2, 2)) == [Leg(0, 0, 0, 0, 1), Leg(0, 1, 1, 0, 1)]
    # 2 -> 2: rank to rank
    assert plan_legs(Sharding(2, 2), Sharding(2, 2)) == [Leg(0, 0, 0, 0, 1), Leg(1, 1, 0, 0, 1)]
    # replicated on the prefill (2 heads, 4 ranks) -> 1: one replica of each head pushes, two push nothing
    legs = plan_legs(Sharding(2, 4), Sharding(2, 1))
    assert legs == [Leg(0, 0, 0, 0, 1), Leg(2, 0, 0, 1, 1)]
    assert [senders(legs, p) for p in range(4)] == [1, 0, 1, 0]
    # 8 heads, TP 1 -> 2: consecutive heads go as one leg
    assert plan_legs(Sharding(8, 1), Sharding(8, 2)) == [Leg(0, 0, 0, 0, 4), Leg(0, 1, 4, 0, 4)]
