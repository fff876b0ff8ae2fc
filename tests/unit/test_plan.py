"""kvpush.plan and kvpush.validate: SPEC-order checks and the one-pass plan, without a link."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvpush import validate as v
from kvpush.memory import CacheRegistry, allocate_regions
from kvpush.peer import RemoteCache
from kvpush.plan import check_block_args, check_cache_args, group_steps
from kvpush.plan import plan as plan_of
from kvpush.protocol import Kind
from kvpush.status import LLMException, LLMStatusCode
from kvpush.types import BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType

DESC = CacheDesc(4, (16, 32), DataType.DT_FLOAT16)  # 2 layers x (K, V), 16 blocks of 64 bytes


def local_cache() -> tuple[Cache, object]:
    registry = CacheRegistry()
    mapping, regions = allocate_regions(DESC)
    cache = registry.add(DESC, regions, True, 0, mapping)
    entry = registry.get(cache.cache_id)
    return cache, entry


def remote(num_blocks: int = 16, tensors: int = 4, dtype: DataType = DataType.DT_FLOAT16,
           row: int = 32, blocks: bool = True) -> RemoteCache:
    return RemoteCache(9, 0, blocks, tensors, (num_blocks, row), dtype)


def test_a_push_plan_merges_runs_and_has_one_step_per_layer() -> None:
    cache, entry = local_cache()
    args = check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2, 0), cache, [0, 1, 2, 7], [4, 5, 6, 1],
                            None, None, 2)
    assert (args.cluster_id, args.model_id) == (2, 0)
    plan = plan_of(args, entry, remote())  # type: ignore[arg-type]
    assert plan.length.tolist() == [192, 64]  # blocks 0-2 -> 4-6 merged; 7 -> 1 alone
    assert plan.local_offset.tolist() == [0, 7 * 64] and plan.remote_offset.tolist() == [4 * 64, 64]
    assert [(s.dst_layer, s.src_first, s.count) for s in plan.steps] == [(0, 0, 2), (1, 2, 2)]


def test_layer_ranges_map_source_to_destination_layers() -> None:
    cache, entry = local_cache()
    args = check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2, 0), cache, [0], [0], range(1, 2),
                            range(0, 1), 2)
    plan = plan_of(args, entry, remote(tensors=2))  # type: ignore[arg-type]
    assert [(s.dst_layer, s.src_first, s.dst_first) for s in plan.steps] == [(0, 2, 0)]


@pytest.mark.parametrize("call,error", [
    (lambda c: check_block_args("push_blocks", Kind.WRITE, "nope", c, [0], [0], None, None, 2), TypeError),
    (lambda c: check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2), c, [0], [-1], None, None, 2),
     ValueError),
    (lambda c: check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2), c, [0], [], None, None, 2),
     LLMStatusCode.LLM_PARAM_INVALID),
    (lambda c: check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2), c, [0], [0], None, None, 0),
     LLMStatusCode.LLM_PARAM_INVALID),
    (lambda c: check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2), c, [0], [0], range(0, 3),
                                range(0, 3), 2), LLMStatusCode.LLM_PARAM_INVALID),
])
def test_local_checks_raise_the_documented_class(call: object, error: object) -> None:
    cache, _ = local_cache()
    if isinstance(error, type):
        with pytest.raises(error):
            call(cache)  # type: ignore[operator]
    else:
        with pytest.raises(LLMException) as caught:
            call(cache)  # type: ignore[operator]
        assert caught.value.status_code == error


@pytest.mark.parametrize("peer,words", [
    (remote(num_blocks=4), "out of range"),
    (remote(dtype=DataType.DT_BF16), "dtype"),
    (remote(row=64), "block size"),
    (remote(blocks=False), "not a blocks cache"),
])
def test_checks_against_the_peers_cache(peer: RemoteCache, words: str) -> None:
    cache, entry = local_cache()
    args = check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2, 0), cache, [0, 1], [3, 5], None, None, 2)
    with pytest.raises(LLMException, match=words) as caught:
        plan_of(args, entry, peer)  # type: ignore[arg-type]
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_destination_block_twice_is_refused_after_the_bounds() -> None:
    cache, entry = local_cache()
    args = check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2, 0), cache, [0, 1], [3, 3], None, None, 2)
    with pytest.raises(LLMException, match="repeats block 3"):
        plan_of(args, entry, remote())  # type: ignore[arg-type]


def test_a_pull_plan_reads_remote_runs_into_local_blocks() -> None:
    cache, entry = local_cache()
    args = check_block_args("pull_blocks", Kind.READ, BlocksCacheKey(2, 0), cache, [8, 9], [0, 1], None, None, 2)
    plan = plan_of(args, entry, remote())  # type: ignore[arg-type]
    assert not plan.push and plan.remote_offset.tolist() == [8 * 64] and plan.local_offset.tolist() == [0]


def test_a_cache_plan_moves_one_slot_per_tensor() -> None:
    cache, entry = local_cache()
    args = check_cache_args("push_cache", Kind.WRITE, CacheKeyByIdAndIndex(2, 9, 3), cache, 1, None, None, -1, 2)
    plan = plan_of(args, entry, remote())  # type: ignore[arg-type]
    assert plan.local_offset.tolist() == [64] and plan.remote_offset.tolist() == [3 * 64] and len(plan.steps) == 2
    too_big = check_cache_args("push_cache", Kind.WRITE, CacheKeyByIdAndIndex(2, 9, 0), cache, 0, None, None, 65, 2)
    with pytest.raises(LLMException, match="exceeds a slot"):
        plan_of(too_big, entry, remote())  # type: ignore[arg-type]


def test_validate_layer_steps_and_ext_param_ranges() -> None:
    assert [s.count for s in v.layer_steps("x", 5, 5, 2, None, None)] == [2, 2, 1]
    with pytest.raises(LLMException):
        v.layer_steps("x", 4, 6, 2, None, None)  # different tensor counts need ranges
    assert v.ext_param_range("x", "r", (-1, -1), 4, 2) is None
    assert v.ext_param_range("x", "r", (0, 1), 4, 2) == range(0, 2)
    with pytest.raises(LLMException):
        v.ext_param_range("x", "r", (1, 0), 4, 2)
    assert v.check_blocks("x", "b", np.array([1, 2], np.int64)).tolist() == [1, 2]
    with pytest.raises(TypeError):
        v.check_blocks("x", "b", [True])


# -- a batch slot into blocks -------------------------------------------------------------------------
SLOTS = CacheDesc(4, (3, 200), DataType.DT_FLOAT16)  # 3 slots of 400 bytes per tensor


def contiguous_cache(desc: CacheDesc = SLOTS) -> tuple[Cache, object]:
    registry = CacheRegistry()
    mapping, regions = allocate_regions(desc)
    cache = registry.add(desc, regions, False, None, mapping)
    return cache, registry.get(cache.cache_id)


def test_a_peer_slot_is_pulled_into_blocks_of_the_local_block_size() -> None:
    cache, entry = local_cache()  # 64-byte blocks
    args = check_block_args("pull_blocks", Kind.READ, CacheKeyByIdAndIndex(2, 9, 2), cache, [], [5, 6, 1, 9], None,
                            None, 2)
    assert args.from_slot and (args.cache_id, args.remote_slot, args.slot_key) == (9, 2, None)
    plan = plan_of(args, entry, remote(num_blocks=3, row=100, blocks=False))  # type: ignore[arg-type]
    # slot 2 starts at 2 * 200 bytes; its blocks 0, 1 -> 5, 6 (merged), 2 -> 1, 3 -> 9 (8 of 64 bytes)
    assert plan.remote_offset.tolist() == [400, 528, 592] and plan.local_offset.tolist() == [320, 64, 576]
    assert plan.length.tolist() == [128, 64, 8] and plan.bytes_per_tensor == 200
    assert [(s.src_first, s.dst_first, s.count) for s in plan.steps] == [(0, 0, 2), (2, 2, 2)]


def test_a_slot_named_by_a_cache_key_is_planned_at_the_slot_the_table_gives() -> None:
    cache, entry = local_cache()
    args = check_block_args("pull_blocks", Kind.READ, CacheKey(2, 70), cache, [], [3], None, None, 2)
    assert args.slot_key == (0, 70, 0) and args.cache_id is None and args.remote_slot is None
    plan = plan_of(args, entry, remote(num_blocks=3, row=32, blocks=False), remote_slot=1)  # type: ignore[arg-type]
    assert plan.remote_offset.tolist() == [64] and plan.local_offset.tolist() == [192]


def test_a_local_slot_is_pushed_into_blocks_of_the_peer_block_size() -> None:
    cache, entry = contiguous_cache()
    args = check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2, 0), cache, [], [7, 8, 2, 3, 4, 5, 6], None,
                            None, 2, local_slot=1)
    plan = plan_of(args, entry, remote())  # type: ignore[arg-type]  # 64-byte blocks
    assert plan.local_offset.tolist() == [400, 528] and plan.remote_offset.tolist() == [448, 128]
    assert plan.length.tolist() == [128, 272]  # 7 blocks: the last holds 400 - 6 * 64 = 16 bytes


@pytest.mark.parametrize("make, words", [
    (lambda c, b: check_block_args("pull_blocks", Kind.READ, CacheKeyByIdAndIndex(2, 9), b, [0], [1], None, None,
                                   2), "src_blocks must be empty"),
    (lambda c, b: check_block_args("pull_blocks", Kind.READ, CacheKeyByIdAndIndex(2, 9), b, [], [], None, None, 2),
     "dst_blocks is empty"),
    (lambda c, b: check_block_args("pull_blocks", Kind.READ, CacheKey(2), b, [], [1], None, None, 2),
     "exactly one of req_id and prefix_id"),
    (lambda c, b: check_block_args("pull_blocks", Kind.READ, CacheKeyByIdAndIndex(2, 9), c, [], [1], None, None, 2),
     "not a blocks cache"),
    (lambda c, b: check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2), b, [], [1], None, None, 2,
                                   local_slot=0), "is a blocks cache"),
    (lambda c, b: check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2), c, [], [1], None, None, 0,
                                   local_slot=0), "tensor_num_per_layer=0"),
])
def test_slot_arguments_are_refused_in_spec_order(make: Any, words: str) -> None:
    contiguous, _ = contiguous_cache()
    blocks, _ = local_cache()
    with pytest.raises(LLMException, match=words) as caught:
        make(contiguous, blocks)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        check_block_args("push_blocks", Kind.WRITE, CacheKey(2, 1), contiguous, [], [1], None, None, 2, local_slot=0)
    with pytest.raises(ValueError):
        check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2), contiguous, [], [1], None, None, 2,
                         local_slot=-1)


@pytest.mark.parametrize("peer, dst, slot, words", [
    (remote(num_blocks=3, row=100, blocks=True), [0], 0, "is a blocks cache"),
    (remote(num_blocks=3, row=100, blocks=False), [0], 3, "batch index 3 is out of range"),
    (remote(num_blocks=3, row=100, blocks=False), [16], 0, "out of range: local cache has 16 blocks"),
    (remote(num_blocks=3, row=100, blocks=False, dtype=DataType.DT_BF16), [0], 0, "dtype"),
    (remote(num_blocks=3, row=100, blocks=False), [0, 1, 2, 3, 4], 0, "holds 200 bytes \\(4 blocks\\)"),
    (remote(num_blocks=3, row=100, blocks=False, tensors=2), [0], 0, "local cache has 2 tensors, remote 4"),
    (remote(num_blocks=3, row=100, blocks=False), [2, 2], 0, "repeats block 2"),
])
def test_a_slot_pull_is_checked_against_the_peers_cache(peer: RemoteCache, dst: list[int], slot: int,
                                                       words: str) -> None:
    cache, entry = local_cache()
    args = check_block_args("pull_blocks", Kind.READ, CacheKeyByIdAndIndex(2, 9, slot), cache, [], dst, None, None,
                            2)
    with pytest.raises(LLMException, match=words) as caught:
        plan_of(args, entry, peer)  # type: ignore[arg-type]
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_pull_cache_by_key_and_the_batch_dimension_check() -> None:
    cache, entry = contiguous_cache()
    args = check_cache_args("pull_cache", Kind.READ, CacheKey(2, prefix_id=4, model_id=1), cache, 0, None, None, -1,
                            2)
    assert args.key == (1, 4, 1) and args.cache_id is None
    plan = plan_of(args, entry, remote(num_blocks=3, row=200, blocks=False), remote_slot=2)  # type: ignore[arg-type]
    assert plan.remote_offset.tolist() == [800] and plan.local_offset.tolist() == [0]
    with pytest.raises(LLMException, match="exactly one"):
        check_cache_args("pull_cache", Kind.READ, CacheKey(2), cache, 0, None, None, -1, 2)
    with pytest.raises(TypeError):
        check_cache_args("push_cache", Kind.WRITE, CacheKey(2, 1), cache, 0, None, None, -1, 2)
    with pytest.raises(LLMException) as caught:
        v.check_batch_dim("register_cache", CacheDesc(1, (4, 8), DataType.DT_INT8, batch_dim_index=1))
    assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    v.check_batch_dim("register_cache", CacheDesc(1, (4, 8), DataType.DT_INT8))


def test_group_steps_merges_layers_that_follow_one_another_up_to_the_limit() -> None:
    LayerStep, layer_steps = v.LayerStep, v.layer_steps
    steps = layer_steps("t", 8, 8, 2, None, None)  # 4 layers of 2 tensors
    assert group_steps(steps, 100, 400) == [(LayerStep(0, 0, 0, 4), (0, 1)), (LayerStep(2, 4, 4, 4), (2, 3))]
    assert group_steps(steps, 100, 800) == [(LayerStep(0, 0, 0, 8), (0, 1, 2, 3))]
    assert group_steps(steps, 100, 199) == [(step, (step.dst_layer,)) for step in steps]  # a layer alone is over
    # layer ranges that skip or reorder tensors on either side: nothing merges across the gap
    ranged = layer_steps("t", 8, 8, 2, range(0, 2), range(2, 4)) + layer_steps("t", 8, 8, 2, range(3, 4), range(0, 1))
    assert group_steps(ranged, 100, 10_000) == [(LayerStep(2, 0, 4, 4), (2, 3)), (LayerStep(0, 6, 0, 2), (0,))]
