"""Every SPEC §6 check: the documented exception class and status code, and no byte moved.

Two engines in this process over loopback; after each rejected call the prefill link has issued no
request and the decode cache is unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from kvtest import EngineFactory, link

from kvpush import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
)

P = LLMStatusCode.LLM_PARAM_INVALID
DESC = CacheDesc(4, (8, 64), DataType.DT_FLOAT16)  # 4 tensors = 2 layers of K,V; 8 blocks of 128 bytes


@dataclass
class Pair:
    prefill: LLMDataDist
    decode: LLMDataDist
    src: Cache
    dst: Cache
    key: BlocksCacheKey

    def dst_bytes(self) -> bytes:
        return b"".join(t.tobytes() for t in self.dst.tensors)

    def sent(self) -> int:
        counters = self.prefill.links[2].counters
        return counters["write_requests"] + counters["read_requests"]


@pytest.fixture
async def pair(make_engine: EngineFactory) -> AsyncIterator[Pair]:
    decode = await make_engine(2, listen=True)
    prefill = await make_engine(1)
    dst = decode.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 0))
    src = prefill.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
    for tensor in src.tensors:
        tensor[:] = 1
    await link(prefill, 2, decode.listen_address[1])
    yield Pair(prefill, decode, src, dst, BlocksCacheKey(2, 0))


async def expect_refused(pair: Pair, error: type[BaseException], code: LLMStatusCode | None, **kwargs: Any) -> str:
    args: dict[str, Any] = {"dst_cache_key": pair.key, "src_cache": pair.src, "src_blocks": [0, 1],
                            "dst_blocks": [2, 3]}
    args.update(kwargs)
    before, sent = pair.dst_bytes(), pair.sent()
    with pytest.raises(error) as caught:
        await pair.prefill.cache_manager.push_blocks(**args)
    if code is not None:
        assert isinstance(caught.value, LLMException) and caught.value.status_code == code, caught.value
    assert pair.sent() == sent, "a request was sent for a refused call"
    assert pair.dst_bytes() == before, "destination memory changed for a refused call"
    return str(caught.value)


async def test_valid_call_moves_bytes(pair: Pair) -> None:
    await pair.prefill.cache_manager.push_blocks(pair.key, pair.src, [0, 1], [2, 3])
    assert pair.sent() == 1  # its two small layers go as one request (kvpush.layer_merge_bytes)
    assert (pair.dst.tensors[0][[2, 3]] == 1).all() and (pair.dst.tensors[0][[0, 1, 4]] == 0).all()


@pytest.mark.parametrize("kwargs", [
    {"dst_cache_key": (2, 0)},
    {"src_cache": "cache"},
    {"src_blocks": "01"},
    {"dst_blocks": [2, "3"]},
    {"dst_blocks": [2.0, 3.0]},
    {"src_blocks": [0, True]},
    {"src_layer_range": [0, 1]},
    {"dst_layer_range": (0, 1)},
    {"tensor_num_per_layer": "2"},
])
async def test_wrong_types_raise_type_error(pair: Pair, kwargs: dict[str, Any]) -> None:
    await expect_refused(pair, TypeError, None, **kwargs)


@pytest.mark.parametrize("kwargs", [
    {"src_blocks": [0, -1]},
    {"dst_blocks": [2, 1 << 64]},
    {"dst_blocks": [-1, 2**63]},
    {"src_layer_range": range(-1, 1)},
])
async def test_out_of_type_range_raises_value_error(pair: Pair, kwargs: dict[str, Any]) -> None:
    await expect_refused(pair, ValueError, None, **kwargs)


async def test_source_must_be_a_blocks_cache(pair: Pair) -> None:
    contiguous = pair.prefill.cache_manager.allocate_cache(DESC)
    assert "not a blocks cache" in await expect_refused(pair, LLMException, P, src_cache=contiguous)


async def test_dst_blocks_empty(pair: Pair) -> None:
    assert "empty" in await expect_refused(pair, LLMException, P, src_blocks=[], dst_blocks=[])


async def test_block_list_lengths_differ(pair: Pair) -> None:
    await expect_refused(pair, LLMException, P, src_blocks=[0, 1, 2], dst_blocks=[2, 3])


@pytest.mark.parametrize("n", [0, 5])
async def test_tensor_num_per_layer_out_of_range(pair: Pair, n: int) -> None:
    assert "tensor_num_per_layer" in await expect_refused(pair, LLMException, P, tensor_num_per_layer=n)


async def test_tensor_num_per_layer_must_divide_with_a_range(pair: Pair) -> None:
    await expect_refused(pair, LLMException, P, tensor_num_per_layer=3, src_layer_range=range(0, 1),
                         dst_layer_range=range(0, 1))


@pytest.mark.parametrize("kwargs", [
    {"src_layer_range": range(0, 2, 2), "dst_layer_range": range(0, 2, 2)},   # step != 1
    {"src_layer_range": range(1, 1), "dst_layer_range": range(1, 1)},         # empty
    {"src_layer_range": range(0, 3), "dst_layer_range": range(0, 3)},         # past the local layers
    {"src_layer_range": range(0, 2), "dst_layer_range": range(0, 1)},         # unequal lengths
    {"src_layer_range": range(0, 1), "dst_layer_range": range(2, 3)},         # past the remote layers
])
async def test_bad_layer_ranges(pair: Pair, kwargs: dict[str, Any]) -> None:
    await expect_refused(pair, LLMException, P, **kwargs)


async def test_no_link(pair: Pair) -> None:
    await expect_refused(pair, LLMException, LLMStatusCode.LLM_NOT_YET_LINK, dst_cache_key=BlocksCacheKey(77, 0))


async def test_local_cache_released(pair: Pair) -> None:
    other = pair.prefill.cache_manager.allocate_blocks_cache(DESC)
    pair.prefill.cache_manager.deallocate_cache(other)
    await expect_refused(pair, LLMException, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, src_cache=other)


async def test_remote_cache_missing(pair: Pair) -> None:
    message = await expect_refused(pair, LLMException, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                                   dst_cache_key=BlocksCacheKey(2, 9))
    assert "model_id=9" in message


async def test_src_block_past_the_end(pair: Pair) -> None:
    message = await expect_refused(pair, LLMException, P, src_blocks=[0, 8])
    assert "src_blocks[1]=8" in message and "8 blocks" in message


async def test_dst_block_past_the_end(pair: Pair) -> None:
    message = await expect_refused(pair, LLMException, P, dst_blocks=[2, 512])
    assert "dst_blocks[1]=512 is out of range: remote cache has 8 blocks" in message


async def test_block_size_mismatch(pair: Pair) -> None:
    pair.decode.cache_manager.allocate_blocks_cache(CacheDesc(4, (8, 32), DataType.DT_FLOAT16), BlocksCacheKey(2, 1))
    message = await expect_refused(pair, LLMException, P, dst_cache_key=BlocksCacheKey(2, 1))
    assert "block size" in message


async def test_dtype_mismatch(pair: Pair) -> None:
    pair.decode.cache_manager.allocate_blocks_cache(CacheDesc(4, (8, 32), DataType.DT_INT32), BlocksCacheKey(2, 1))
    message = await expect_refused(pair, LLMException, P, dst_cache_key=BlocksCacheKey(2, 1))
    assert "dtype" in message


async def test_duplicate_destination_blocks(pair: Pair) -> None:
    assert "repeats block 3" in await expect_refused(pair, LLMException, P, src_blocks=[0, 1], dst_blocks=[3, 3])


async def test_checks_run_in_spec_order(pair: Pair) -> None:
    # empty destination list beats a bad N, which beats a missing link
    message = await expect_refused(pair, LLMException, P, dst_blocks=[], src_blocks=[], tensor_num_per_layer=0,
                                   dst_cache_key=BlocksCacheKey(77, 0))
    assert "empty" in message
    await expect_refused(pair, LLMException, P, tensor_num_per_layer=0, dst_cache_key=BlocksCacheKey(77, 0))
    # a bad N beats a bad layer range
    assert "tensor_num_per_layer" in await expect_refused(pair, LLMException, P, tensor_num_per_layer=0,
                                                          src_layer_range=range(0, 2, 2))
    # a missing link beats an out-of-range block
    await expect_refused(pair, LLMException, LLMStatusCode.LLM_NOT_YET_LINK, dst_blocks=[2, 999],
                         dst_cache_key=BlocksCacheKey(77, 0))


async def test_pull_checks_are_mirrored(pair: Pair) -> None:
    cm = pair.prefill.cache_manager
    with pytest.raises(LLMException) as caught:
        await cm.pull_blocks(pair.key, pair.src, [0, 9], [1, 2])  # src (remote) block 9 past the end
    assert caught.value.status_code == P and "remote cache has 8 blocks" in str(caught.value)
    with pytest.raises(LLMException) as caught:
        await cm.pull_blocks(pair.key, pair.src, [0, 1], [1, 1])
    assert caught.value.status_code == P
    with pytest.raises(TypeError):
        await cm.pull_blocks(pair.key, "cache", [0], [1])  # type: ignore[arg-type]
    assert pair.sent() == 0


async def test_push_kv_blocks_returns_codes(pair: Pair) -> None:
    cm = pair.prefill.cache_manager
    index = CacheKeyByIdAndIndex(2, pair.dst.cache_id)
    assert await cm.push_kv_blocks(pair.src, index, [0], [1]) == LLMStatusCode.LLM_SUCCESS
    assert await cm.push_kv_blocks(pair.src, CacheKeyByIdAndIndex(2, pair.dst.cache_id, 1), [0], [1]) == P
    assert await cm.push_kv_blocks(pair.src, index, [], []) == P
    assert await cm.push_kv_blocks(pair.src, index, [0], [1], KvCacheExtParam((1, 0), (1, 0), 2)) == P
    assert await cm.push_kv_blocks(pair.src, index, [0], [1], KvCacheExtParam((0, 1), (0, 0), 2)) == P
    assert await cm.push_kv_blocks(pair.src, index, [0], [1], KvCacheExtParam((0, 2), (0, 2), 2)) == P
    assert await cm.push_kv_blocks(pair.src, CacheKeyByIdAndIndex(5, 1), [0], [1]) == LLMStatusCode.LLM_NOT_YET_LINK
    assert await cm.push_kv_blocks(pair.src, CacheKeyByIdAndIndex(2, 999), [0], [1]) == \
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert await cm.push_kv_blocks(pair.src, index, [0], ["x"]) == P
    assert pair.sent() == 1  # only the first call moved bytes (2 small layers: one request)


async def test_push_cache_checks(pair: Pair) -> None:
    cm = pair.prefill.cache_manager
    local = cm.allocate_cache(DESC)
    remote = pair.decode.cache_manager.allocate_cache(DESC)
    key = CacheKeyByIdAndIndex(2, remote.cache_id, 0)
    with pytest.raises(LLMException) as caught:
        await cm.push_cache(CacheKeyByIdAndIndex(2, remote.cache_id, 8), local)
    assert caught.value.status_code == P
    with pytest.raises(LLMException) as caught:
        await cm.push_cache(key, local, size=129)
    assert caught.value.status_code == P
    with pytest.raises(LLMException) as caught:
        await cm.push_cache(key, local, src_batch_index=8)
    assert caught.value.status_code == P
    with pytest.raises(TypeError):
        await cm.push_cache(pair.key, local)  # type: ignore[arg-type]
    assert pair.sent() == 0


async def test_registration_checks(pair: Pair) -> None:
    cm = pair.prefill.cache_manager
    desc = CacheDesc(2, (4, 8), DataType.DT_FLOAT)
    good = [np.zeros((4, 8), np.float32) for _ in range(2)]
    with pytest.raises(LLMException) as caught:
        cm.register_blocks_cache(desc, good[:1])  # wrong count
    assert caught.value.status_code == P
    with pytest.raises(LLMException) as caught:
        cm.register_blocks_cache(desc, [good[0], np.zeros((4, 8), np.float16)])  # dtype
    assert caught.value.status_code == P
    with pytest.raises(LLMException) as caught:
        cm.register_blocks_cache(desc, [good[0], np.zeros((4, 9), np.float32)])  # size
    assert caught.value.status_code == P
    with pytest.raises(LLMException) as caught:
        cm.register_blocks_cache(desc, [good[0], np.zeros((8, 8), np.float32)[::2]])  # not contiguous
    assert caught.value.status_code == P
    with pytest.raises(LLMException) as caught:
        cm.register_blocks_cache(desc, [good[0], 0])  # zero address
    assert caught.value.status_code == P
    with pytest.raises(ValueError):
        cm.register_blocks_cache(desc, [good[0], -5])
    with pytest.raises(TypeError):
        cm.register_blocks_cache(desc, [good[0], "addr"])
    with pytest.raises(TypeError):
        cm.register_blocks_cache("desc", good)  # type: ignore[arg-type]
    cache = cm.register_blocks_cache(desc, good, BlocksCacheKey(1, 5))
    with pytest.raises(LLMException) as caught:
        cm.register_blocks_cache(desc, [np.zeros((4, 8), np.float32) for _ in range(2)], BlocksCacheKey(1, 5))
    assert caught.value.status_code == P  # model_id taken
    with pytest.raises(LLMException) as caught:
        cm.register_blocks_cache(desc, [good[0].__array_interface__["data"][0] + 16, np.zeros((4, 8), np.float32)])
    assert caught.value.status_code == P  # overlaps a registered tensor
    cm.unregister_cache(cache.cache_id)
    with pytest.raises(LLMException) as caught:
        cm.unregister_cache(cache.cache_id)
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    readonly = np.zeros((4, 8), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(LLMException):
        cm.register_blocks_cache(desc, [readonly, np.zeros((4, 8), np.float32)])


async def test_a_registered_cache_keeps_its_geometry_whatever_happens_to_the_descriptor(
        make_engine: EngineFactory) -> None:
    """The bounds checks read the geometry the cache was registered with: growing the caller's
    descriptor afterwards (or trying to grow the cache's own) can never let a push address blocks
    past the memory that was registered (it would write past the end of the mapping)."""
    engine = await make_engine(1)
    desc = CacheDesc(4, [8, 64], DataType.DT_FLOAT16)
    cache = engine.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    desc.update_dim(0, 1 << 20)  # the caller's object describes the next cache now
    assert cache.cache_desc.shape == (8, 64) and desc.shape == (1 << 20, 64)
    with pytest.raises(ValueError, match="registered cache cannot change"):
        cache.cache_desc.update_dim(0, 1 << 20)
    with pytest.raises(AttributeError, match="registered cache cannot change"):
        cache.cache_desc.shape = (1 << 20, 64)  # type: ignore[misc]
    grown = cache.cache_desc.__copy__()  # a copy describes another cache and may change
    grown.update_dim(0, 16)
    assert grown.shape == (16, 64) and cache.cache_desc.shape == (8, 64) and grown != cache.cache_desc


async def test_a_grown_descriptor_does_not_widen_a_registered_cache_on_either_side(pair: Pair) -> None:
    DESC.update_dim(0, 4096)  # the module's descriptor both caches were registered from
    try:
        message = await expect_refused(pair, LLMException, P, src_blocks=[0, 1], dst_blocks=[2, 4000])
        assert "remote cache has 8 blocks" in message
        await expect_refused(pair, LLMException, P, src_blocks=[0, 4000], dst_blocks=[2, 3])
    finally:
        DESC.update_dim(0, 8)
