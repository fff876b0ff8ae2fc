"""kvpush.plan and kvpush.validate: SPEC-order checks and the one-pass plan, without a link."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush import validate as v
from kvpush.memory import CacheRegistry, allocate_regions
from kvpush.peer import RemoteCache
from kvpush.plan import check_block_args, check_cache_args, plan_blocks, plan_cache
from kvpush.protocol import Kind
from kvpush.status import LLMException, LLMStatusCode
from kvpush.types import BlocksCacheKey, Cache, CacheDesc, CacheKeyByIdAndIndex, DataType

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
    plan = plan_blocks(args, entry, remote())  # type: ignore[arg-type]
    assert plan.length.tolist() == [192, 64]  # blocks 0-2 -> 4-6 merged; 7 -> 1 alone
    assert plan.local_offset.tolist() == [0, 7 * 64] and plan.remote_offset.tolist() == [4 * 64, 64]
    assert [(s.dst_layer, s.src_first, s.count) for s in plan.steps] == [(0, 0, 2), (1, 2, 2)]


def test_layer_ranges_map_source_to_destination_layers() -> None:
    cache, entry = local_cache()
    args = check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2, 0), cache, [0], [0], range(1, 2),
                            range(0, 1), 2)
    plan = plan_blocks(args, entry, remote(tensors=2))  # type: ignore[arg-type]
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
        plan_blocks(args, entry, peer)  # type: ignore[arg-type]
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_destination_block_twice_is_refused_after_the_bounds() -> None:
    cache, entry = local_cache()
    args = check_block_args("push_blocks", Kind.WRITE, BlocksCacheKey(2, 0), cache, [0, 1], [3, 3], None, None, 2)
    with pytest.raises(LLMException, match="repeats block 3"):
        plan_blocks(args, entry, remote())  # type: ignore[arg-type]


def test_a_pull_plan_reads_remote_runs_into_local_blocks() -> None:
    cache, entry = local_cache()
    args = check_block_args("pull_blocks", Kind.READ, BlocksCacheKey(2, 0), cache, [8, 9], [0, 1], None, None, 2)
    plan = plan_blocks(args, entry, remote())  # type: ignore[arg-type]
    assert plan.kind == Kind.READ and plan.remote_offset.tolist() == [8 * 64] and plan.local_offset.tolist() == [0]


def test_a_cache_plan_moves_one_slot_per_tensor() -> None:
    cache, entry = local_cache()
    args = check_cache_args("push_cache", Kind.WRITE, CacheKeyByIdAndIndex(2, 9, 3), cache, 1, None, None, -1, 2)
    plan = plan_cache(args, entry, remote())  # type: ignore[arg-type]
    assert plan.local_offset.tolist() == [64] and plan.remote_offset.tolist() == [3 * 64] and len(plan.steps) == 2
    too_big = check_cache_args("push_cache", Kind.WRITE, CacheKeyByIdAndIndex(2, 9, 0), cache, 0, None, None, 65, 2)
    with pytest.raises(LLMException, match="exceeds a slot"):
        plan_cache(too_big, entry, remote())  # type: ignore[arg-type]


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
