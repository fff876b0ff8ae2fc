"""kvpush.integrations.families: which blocks of a sliding-window or hybrid (recurrent-state) model move, and the
vLLM connector's books over such a layout (one block list per KV cache group), without vLLM."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_vllm_core import DECODE_CLUSTER, Clock, ProducerFx, run_step

from kvpush.integrations.families import PLAIN, Group, Groups, LayoutError, window_start
from kvpush.integrations.vllm import core
from kvpush.integrations.vllm.core import (
    ConnectorConfig,
    Done,
    FinishedSend,
    Geometry,
    Outcome,
    ProducerBook,
    SchedulerBook,
    SendStep,
)

# a Gemma-3-like model: a windowed group (window of 64 tokens over blocks of 32: 3 blocks) and a full one
WINDOWED = Groups((Group.window(64, 32), Group("full")))
# a Granite-4-like model: a Mamba state group beside a full-attention one
HYBRID = Groups((Group("state"), Group("full")))


def test_entries_go_by_position_then_group_and_only_the_window_and_the_state_move() -> None:
    groups, positions = WINDOWED.entries(6)
    assert list(zip(groups.tolist(), positions.tolist())) == [
        (1, 0), (1, 1), (1, 2), (0, 3), (1, 3), (0, 4), (1, 4), (0, 5), (1, 5)]
    groups, positions = HYBRID.entries(4, first_block=1)  # the decode holds block 0
    assert list(zip(groups.tolist(), positions.tolist())) == [(1, 1), (1, 2), (0, 3), (1, 3)]
    assert PLAIN.count(5, 2) == 3 and WINDOWED.count(2) == 4 and HYBRID.count(3, 3) == 0
    with pytest.raises(LayoutError):
        WINDOWED.entries(3, first_block=4)


def test_select_takes_each_groups_block_by_position_and_the_state_from_its_end() -> None:
    lists = ([0, 0, 0, 31, 41, 51], [10, 11, 12, 13, 14, 15])  # the window's group: null blocks before it
    assert WINDOWED.select(lists, *WINDOWED.entries(6)).tolist() == [10, 11, 12, 31, 13, 41, 14, 51, 15]
    spare = Groups((Group("state", spare_blocks=1), Group("full")))
    assert spare.select(([7, 99], [1, 2]), *spare.entries(2)).tolist() == [1, 7, 2]  # not the scratch block
    with pytest.raises(LayoutError, match="2 blocks allocated; block 2 is wanted"):
        WINDOWED.select(([5, 6], [1, 2]), *WINDOWED.entries(3))
    with pytest.raises(LayoutError, match="no state"):
        HYBRID.select(([], [1]), *HYBRID.entries(1))
    with pytest.raises(LayoutError, match="1 block lists for 2"):
        HYBRID.select(([1],), *HYBRID.entries(1))
    assert WINDOWED.held(np.array([0, 3])).tolist() == [False, True]
    assert PLAIN.held(np.array([0, 3])).tolist() == [True, True]  # in the plain layout 0 is a block like any


def test_groups_travel_and_a_peer_that_names_none_is_plain() -> None:
    for groups in (PLAIN, WINDOWED, HYBRID, Groups((Group("state", spare_blocks=2),))):
        assert Groups.from_wire(groups.to_wire()) == groups
    assert HYBRID.backoff == 1 and WINDOWED.backoff == 0 and PLAIN.plain and not WINDOWED.plain
    for bad in ([], "full", ["cross"], ["window"], ["window:x"], [3]):
        with pytest.raises(LayoutError):
            Groups.from_wire(bad)
    body = Geometry("m", "DT_INT8", 32, 1, 1, 2, 1, 0, groups=HYBRID, page=65536).to_wire()
    assert Geometry.from_wire(body).groups == HYBRID
    old = {key: value for key, value in body.items() if key not in ("groups", "page")}
    assert Geometry.from_wire({**old, "head_size": 32}).groups == PLAIN
    with pytest.raises(ValueError, match="bad geometry"):
        Geometry.from_wire({**body, "page": 0})  # a paged geometry names its page


def test_a_model_of_another_family_or_tp_size_is_refused_by_name() -> None:
    hybrid = Geometry("m", "DT_INT8", 32, 1, 1, 2, 1, 0, groups=HYBRID, page=65536)
    plain = Geometry("m", "DT_INT8", 32, 1, 1, 2, 1, 0)
    assert "KV cache groups: prefill [state, full], decode [full]" in (core.incompatibility(hybrid, plain) or "")
    wide = Geometry("m", "DT_INT8", 32, 1, 1, 2, 2, 1, groups=HYBRID, page=65536)
    assert "equal TP sizes only" in (core.incompatibility(wide, hybrid) or "")
    assert core.incompatibility(hybrid, hybrid) is None
    assert core.targets(wide.sharding(), wide.sharding(), 1)[0].prefill_rank == 1  # rank to rank


def test_window_start_is_page_aligned_and_never_before_what_the_decode_holds() -> None:
    assert window_start(1000, 128, 16) == 864 and window_start(100, 128, 16) == 0
    assert window_start(1000, 128, 16, held_tokens=900) == 896


# -- the scheduler and the prefill worker over a grouped layout ----------------------------------------

def test_a_decode_of_a_state_model_loads_the_prompt_but_its_last_token_into_every_groups_blocks() -> None:
    book = SchedulerBook(32, produce=False, consume=True, groups=HYBRID)
    book.on_new_request("r1", core.decode_request_params("tid", "127.0.0.1", 14579), num_prompt_tokens=65)
    assert book.matched_tokens("r1", 0) == (64, True)  # the 65th the decode computes from the state
    book.after_alloc("r1", ([9], [3, 4, 5]), num_external_tokens=64)
    (spec,) = book.build_step([]).recv
    assert (spec.first_block, spec.blocks, spec.num_tokens, spec.error) == (0, (3, 9, 4), 64, None)


def test_a_decode_of_a_windowed_model_sends_a_null_where_it_dropped_the_window_s_front() -> None:
    book = SchedulerBook(32, produce=False, consume=True, groups=WINDOWED)
    book.on_new_request("r1", core.decode_request_params("tid", "127.0.0.1", 14579), num_prompt_tokens=160)
    book.after_alloc("r1", ([0, 0, 0, 21, 22], [1, 2, 3, 4, 5]), num_external_tokens=160)
    (spec,) = book.build_step([]).recv
    assert spec.blocks == (1, 2, 0, 3, 21, 4, 22, 5) and spec.error is None


def grouped_producer(groups: Groups) -> tuple[ProducerBook, ProducerFx]:
    fx = ProducerFx()
    return ProducerBook(32, 2, ConnectorConfig(), Clock(), fx, groups=groups), fx


def give(book: ProducerBook, blocks: tuple[int, ...], num_tokens: int, first: int = 0) -> None:
    for frame in core.block_id_messages("tid", 32, num_tokens, first, blocks):
        book.on_message(DECODE_CLUSTER, core.decode(frame))  # type: ignore[arg-type]


def test_a_windowed_prefill_pushes_each_chunk_s_window_entries_and_skips_what_the_decode_dropped() -> None:
    book, fx = grouped_producer(WINDOWED)
    give(book, (1, 2, 0, 3, 21, 4, 22, 5), 160)  # the decode dropped the window's first block
    lists: Any = ([40, 41, 42], [60, 61, 62])
    run_step(book, [SendStep("p1", "tid", lists, 0, 96, 160)])
    lists = ([40, 41, 42, 43, 44], [60, 61, 62, 63, 64])
    run_step(book, [SendStep("p1", "tid", lists, 96, 160, 160)])
    assert [(p.src, p.dst) for p in fx.pushes.values()] == [([60, 61, 62], [1, 2, 3]), ([43, 63, 44, 64],
                                                                                         [21, 4, 22, 5])]
    for push_id in list(fx.pushes):
        book.on_push_done(push_id, None)
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert fx.notified == [(DECODE_CLUSTER, Done("tid", Outcome.LANDED, 8), "tid")]


def test_the_state_moves_with_the_last_chunk_and_a_prefill_missing_a_block_the_decode_holds_fails() -> None:
    book, fx = grouped_producer(HYBRID)
    give(book, (3, 9, 4), 64)  # by position, then group: the state sits at the last position
    run_step(book, [SendStep("p1", "tid", ([70], [50]), 0, 32, 64)])
    run_step(book, [SendStep("p1", "tid", ([70], [50, 51]), 32, 64, 64)])
    assert [(p.src, p.dst) for p in fx.pushes.values()] == [([50], [3]), ([70, 51], [9, 4])]

    book, fx = grouped_producer(WINDOWED)
    give(book, (1, 2, 20, 3, 21, 4, 22, 5), 160)
    run_step(book, [SendStep("p1", "tid", ([0, 0, 0, 43, 44], [60, 61, 62, 63, 64]), 0, 160, 160)])
    assert not fx.pushes and book.state_of("tid") is not None
    assert "the prefill holds no block at position(s) [2]" in fx.notified[0][1].reason
