"""Cache keys between two engines over loopback: the keys of ``allocate_cache`` / ``register_cache`` reach
the peer in the cache table, ``pull_cache`` / ``pull_blocks`` address a slot by ``CacheKey``, a pull
releases a request key of allocated memory on its owner (once every tensor of the slot moved),
``remove_cache_key`` releases it there, and ``deallocate_cache`` waits for the last key."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import EngineFactory, link, wait_for

from kvpush import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
)

SLOTS = CacheDesc(4, (3, 256), DataType.DT_INT32)  # 2 layers x (K, V), 3 batch slots of 1 KiB
OWNER, PULLER = 2, 1


async def pair(make_engine: EngineFactory) -> tuple[LLMDataDist, LLMDataDist]:
    owner = await make_engine(OWNER, listen=True)
    puller = await make_engine(PULLER)
    await link(puller, OWNER, owner.listen_address[1])  # type: ignore[index]
    return owner, puller


def filled(cache: Cache) -> Cache:
    for index, tensor in enumerate(cache.tensors):
        tensor[:] = np.arange(tensor.size, dtype=np.int32).reshape(tensor.shape) + 1000 * (index + 1)
    return cache


async def refused(call: object, code: LLMStatusCode) -> str:
    with pytest.raises(LLMException) as caught:
        await call  # type: ignore[misc]
    assert caught.value.status_code == code, caught.value
    return str(caught.value)


async def test_a_pull_by_cache_key_reads_the_named_slot_and_releases_the_key(make_engine: EngineFactory) -> None:
    owner, puller = await pair(make_engine)
    # keys made after linking reach the peer too (its table, or one bounded refresh on a miss)
    slots = filled(owner.cache_manager.allocate_cache(SLOTS, [CacheKey(9, 10), CacheKey(9), CacheKey(9, 12)]))
    mine = puller.cache_manager.allocate_cache(SLOTS)
    await puller.cache_manager.pull_cache(CacheKey(OWNER, 12), mine, batch_index=0)  # names slot 2
    assert all(np.array_equal(mine.tensors[t][0], slots.tensors[t][2]) for t in range(4))
    assert not any(mine.tensors[t][1:].any() for t in range(4))
    owned = owner.registry.get(slots.cache_id)
    assert owned is not None
    # request 12 was consumed by the pull: here at once, on the owner when the release arrived
    assert "req_id=12" in await refused(puller.cache_manager.pull_cache(CacheKey(OWNER, 12), mine),
                                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    assert list(owned.keys) == [(0, 10, 0)]  # the refused pull refreshed the table: the owner had released it
    # by (cache id, slot) at a keyed slot, one layer at a time: the key goes with the last tensor
    await puller.cache_manager.pull_cache(CacheKeyByIdAndIndex(OWNER, slots.cache_id, 0), mine, 1,
                                          src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
    assert list(owned.keys) == [(0, 10, 0)]
    await puller.cache_manager.pull_cache(CacheKey(OWNER, 10), mine, 1, src_layer_range=range(1, 2),
                                          dst_layer_range=range(1, 2))
    await wait_for(lambda: not owned.keys)
    assert all(np.array_equal(mine.tensors[t][1], slots.tensors[t][0]) for t in range(4))
    # the placeholder's slot is still there by id, and its memory is whole
    await puller.cache_manager.pull_cache(CacheKeyByIdAndIndex(OWNER, slots.cache_id, 1), mine, 2)
    assert np.array_equal(mine.tensors[3][2], slots.tensors[3][1])


async def test_prefix_keys_and_keys_of_registered_memory_stay_until_removed(make_engine: EngineFactory) -> None:
    owner, puller = await pair(make_engine)
    memory = [np.full((3, 256), 7, np.int32) for _ in range(4)]
    registered = owner.cache_manager.register_cache(SLOTS, memory, [CacheKey(9, 20)])
    prefixed = owner.cache_manager.allocate_cache(SLOTS, [CacheKey(9, prefix_id=5)])
    mine = puller.cache_manager.allocate_blocks_cache(CacheDesc(4, (8, 128), DataType.DT_INT32))
    for _ in range(2):  # pulled twice: neither key is consumed
        await puller.cache_manager.pull_blocks(CacheKey(OWNER, 20), mine, [], [3, 4])
        await puller.cache_manager.pull_blocks(CacheKey(OWNER, prefix_id=5), mine, [], [0])
    assert (mine.tensors[0][3:5] == 7).all() and not mine.tensors[0][0].any()
    owner.cache_manager.remove_cache_key(CacheKey(OWNER, 20))
    owner.cache_manager.remove_cache_key(CacheKey(1, 20))  # names nothing any more: a no-op
    await wait_for(lambda: puller.links[OWNER].peer.by_key((0, 20, 0)) is None)  # the owner's next table says so
    await refused(puller.cache_manager.pull_blocks(CacheKey(OWNER, 20), mine, [], [3]),
                  LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    await puller.cache_manager.pull_blocks(CacheKeyByIdAndIndex(OWNER, registered.cache_id), mine, [], [6])
    assert (mine.tensors[2][6] == 7).all()  # the slot itself is still there by id
    entry = owner.registry.get(prefixed.cache_id)
    assert entry is not None and list(entry.keys) == [(1, 5, 0)]


async def test_deallocated_memory_stays_for_its_keys_then_goes(make_engine: EngineFactory) -> None:
    owner, puller = await pair(make_engine)
    slots = filled(owner.cache_manager.allocate_cache(SLOTS, [CacheKey(9, 30), CacheKey(9, 31)]))
    owner.cache_manager.deallocate_cache(slots)  # still named by two keys: kept for the peers
    await refused(owner.cache_manager.copy_blocks(slots, {0: [1]}), LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    with pytest.raises(LLMException) as caught:
        owner.cache_manager.deallocate_cache(slots)  # once only
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    mine = puller.cache_manager.allocate_cache(SLOTS)
    await puller.cache_manager.pull_cache(CacheKey(OWNER, 31), mine)
    assert np.array_equal(mine.tensors[2][0], slots.tensors[2][1])
    entry = owner.registry.get(slots.cache_id)
    assert entry is not None
    await wait_for(lambda: list(entry.keys) == [(0, 30, 0)])  # the pull released its key; one is left
    owner.cache_manager.remove_cache_key(CacheKey(OWNER, 30))  # the last key: the memory goes
    assert owner.registry.get(slots.cache_id) is None and slots.tensors == []
    await refused(puller.cache_manager.pull_cache(CacheKeyByIdAndIndex(OWNER, slots.cache_id), mine),
                  LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


async def test_cache_key_arguments_are_checked_in_order_and_nothing_moves(make_engine: EngineFactory) -> None:
    owner, puller = await pair(make_engine)
    slots = filled(owner.cache_manager.allocate_cache(SLOTS, [CacheKey(9, 40)]))
    owner.cache_manager.allocate_blocks_cache(CacheDesc(4, (8, 128), DataType.DT_INT32), BlocksCacheKey(9, 0))
    cm = puller.cache_manager
    mine = cm.allocate_blocks_cache(CacheDesc(4, (8, 128), DataType.DT_INT32))
    with pytest.raises(TypeError):
        await cm.pull_cache("key", cm.allocate_cache(SLOTS))  # type: ignore[arg-type]
    await refused(cm.pull_cache(CacheKey(OWNER), cm.allocate_cache(SLOTS)), LLMStatusCode.LLM_PARAM_INVALID)
    await refused(cm.pull_blocks(CacheKey(OWNER, 40), mine, [0], [1]), LLMStatusCode.LLM_PARAM_INVALID)
    await refused(cm.pull_blocks(CacheKey(5, 40), mine, [], [1]), LLMStatusCode.LLM_NOT_YET_LINK)
    assert "req_id=41" in await refused(cm.pull_blocks(CacheKey(OWNER, 41), mine, [], [1]),
                                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    assert "holds 1024 bytes (2 blocks)" in await refused(cm.pull_blocks(CacheKey(OWNER, 40), mine, [], [1, 2, 3]),
                                                          LLMStatusCode.LLM_PARAM_INVALID)
    assert "blocks cache" in await refused(cm.pull_blocks(CacheKeyByIdAndIndex(OWNER, slots.cache_id + 1), mine,
                                                          [], [1]), LLMStatusCode.LLM_PARAM_INVALID)
    assert not any(t.any() for t in mine.tensors)
    owned = owner.registry.get(slots.cache_id)
    assert owned is not None and list(owned.keys) == [(0, 40, 0)]  # refused pulls release nothing
    with pytest.raises(LLMException) as caught:  # a key already naming a slot here
        owner.cache_manager.allocate_cache(SLOTS, [CacheKey(9, 40)])
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        owner.cache_manager.remove_cache_key(BlocksCacheKey(9, 0))  # type: ignore[arg-type]


async def test_a_batch_dimension_other_than_0_is_refused_at_registration(make_engine: EngineFactory) -> None:
    engine = await make_engine(1)
    strided = CacheDesc(2, (4, 8), DataType.DT_INT32, batch_dim_index=1)
    for register in (lambda: engine.cache_manager.allocate_cache(strided),
                     lambda: engine.cache_manager.allocate_blocks_cache(strided),
                     lambda: engine.cache_manager.register_cache(strided, [np.zeros((4, 8), np.int32)] * 2)):
        with pytest.raises(LLMException, match="batch_dim_index=1") as caught:
            register()
        assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert len(engine.registry) == 0
