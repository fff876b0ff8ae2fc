"""kvpush/memory.py: what registration accepts (numpy, DLPack, buffer protocol, int addresses), and the
registry's cache keys (the slots they name, their checks, their release by pulls and by their owner)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from kvtest import EngineFactory

from kvpush import BlocksCacheKey, Cache, CacheDesc, CacheKey, DataType, LLMException, LLMStatusCode
from kvpush.memory import CacheRegistry, allocate_regions, region_of

DESC = CacheDesc(2, (4, 16), DataType.DT_FLOAT16)


class DLPackTensor:
    """What a CPU torch tensor offers: __dlpack__ and __dlpack_device__."""

    def __init__(self, array: np.ndarray[Any, Any], device: tuple[int, int] = (1, 0)) -> None:
        self.array, self.device = array, device

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


class TorchLikeBF16:
    """A bfloat16 tensor numpy cannot import through DLPack: kvpush uses its own accessors."""

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("bfloat16 is not supported by numpy")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return int(self.array.__array_interface__["data"][0])

    def numel(self) -> int:
        return int(self.array.size)

    def element_size(self) -> int:
        return 2


async def test_accepts_numpy_dlpack_buffer_and_int(make_engine: EngineFactory) -> None:
    engine = await make_engine(1)
    cm = engine.cache_manager
    arrays = [np.full((4, 16), i, np.float16) for i in range(8)]
    from_numpy = cm.register_blocks_cache(DESC, arrays[0:2], BlocksCacheKey(1, 0))
    from_dlpack = cm.register_blocks_cache(DESC, [DLPackTensor(arrays[2]), DLPackTensor(arrays[3])])
    raw = [bytearray(DESC.size), bytearray(DESC.size)]
    from_buffer = cm.register_blocks_cache(DESC, raw)
    from_int = cm.register_blocks_cache(DESC, [int(a.__array_interface__["data"][0]) for a in arrays[4:6]])
    for cache, expect in ((from_numpy, 0), (from_dlpack, 2), (from_int, 4)):
        assert cache.is_blocks_cache and (cache.tensors[0] == expect).all()
        assert cache.tensors[0].shape == (4, 16) and cache.tensors[0].dtype == np.float16
    from_buffer.tensors[1][:] = 3
    assert raw[1] == np.full((4, 16), 3, np.float16).tobytes()
    assert [c.cache_id for c in (from_numpy, from_dlpack, from_buffer, from_int)] == [1, 2, 3, 4]


async def test_bf16_tensor_without_numpy_support(make_engine: EngineFactory) -> None:
    engine = await make_engine(1)
    desc = CacheDesc(1, (4, 16), DataType.DT_BF16)
    backing = np.zeros((4, 16), np.uint16)
    cache = engine.cache_manager.register_blocks_cache(desc, [TorchLikeBF16(backing)])
    cache.tensors[0][1] = 7
    assert (backing[1] == 7).all()


async def test_device_memory_is_refused(make_engine: EngineFactory) -> None:
    engine = await make_engine(1)
    device_tensor = DLPackTensor(np.zeros((4, 16), np.float16), device=(2, 0))
    with pytest.raises(LLMException) as caught:
        engine.cache_manager.register_blocks_cache(DESC, [device_tensor, device_tensor])
    assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


async def test_allocate_is_page_aligned_and_zeroed(make_engine: EngineFactory) -> None:
    engine = await make_engine(1)
    cache = engine.cache_manager.allocate_blocks_cache(CacheDesc(3, (5, 100), DataType.DT_INT32))
    assert all(addr % 4096 == 0 for addr in cache.tensor_addrs)
    assert all((t == 0).all() and t.shape == (5, 100) and t.dtype == np.int32 for t in cache.tensors)
    cache.tensors[2][4] = 9
    assert ctypes.c_int32.from_address(cache.tensor_addrs[2] + 4 * 400).value == 9
    engine.cache_manager.deallocate_cache(cache)
    assert cache.tensors == []


async def test_calls_before_init_raise_runtime_error() -> None:
    from kvpush import LLMDataDist, LLMRole

    engine = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(RuntimeError):
        engine.cache_manager  # noqa: B018
    with pytest.raises(RuntimeError):
        await engine.link_clusters([])
    with pytest.raises(TypeError):
        LLMDataDist("prompt", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, 1 << 64)


async def test_views_outlive_deallocate_and_finalize(make_engine: EngineFactory) -> None:
    engine = await make_engine(1)
    cache = engine.cache_manager.allocate_blocks_cache(CacheDesc(2, (8, 1024), DataType.DT_UINT8))
    kept = cache.tensors[1]
    kept[:] = 5
    engine.cache_manager.deallocate_cache(cache)
    assert (kept == 5).all()  # still mapped: freed only when the last view goes
    other = engine.cache_manager.allocate_blocks_cache(CacheDesc(1, (8, 1024), DataType.DT_UINT8)).tensors[0]
    await engine.finalize()
    other[:] = 3
    assert (other == 3).all() and (kept == 5).all()


# -- cache keys in the registry (no engine) ----------------------------------------------------------
SLOTS = CacheDesc(2, (4, 16), DataType.DT_UINT8)  # 2 tensors of 4 batch slots x 16 bytes


def _allocated(registry: CacheRegistry, keys: list[CacheKey], desc: CacheDesc = SLOTS) -> Cache:
    mapping, regions = allocate_regions(desc)
    return registry.add(desc, regions, False, None, mapping, cache_keys=keys)


def test_cache_keys_name_batch_slots_and_reach_the_table() -> None:
    registry = CacheRegistry()
    cache = _allocated(registry, [CacheKey(1, 10), CacheKey(1), CacheKey(1, prefix_id=5)])  # slot 1: a placeholder
    entry = registry.get(cache.cache_id)
    assert entry is not None and entry.keys == {(0, 10, 0): 0, (1, 5, 0): 2}
    assert registry.slot_of((0, 10, 0)) == (entry, 0) and registry.slot_of((1, 10, 0)) is None
    (row,) = registry.table()
    assert row["keys"] == [[0, 10, 0, 0, 1], [1, 5, 0, 2, 0]]  # a prefix key is not released by a pull
    assert "keys" not in CacheRegistry().table() and registry.version == 1


@pytest.mark.parametrize("keys, words", [
    ([CacheKey(1, i) for i in range(5)], "5 cache keys for 4 batch slots"),
    ([CacheKey(1, 3), CacheKey(2, 3)], r"repeats cache_keys\[0\]"),  # the cluster id does not tell them apart
    ([CacheKey(1, 3, 0, 4)], "exactly one of req_id and prefix_id"),
    ([CacheKey(1, 10)], "already names a slot of cache 1"),
])
def test_cache_keys_are_checked_before_anything_is_kept(keys: list[CacheKey], words: str) -> None:
    registry = CacheRegistry()
    _allocated(registry, [CacheKey(1, 10)])
    with pytest.raises(LLMException, match=words) as caught:
        _allocated(registry, keys)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert len(registry) == 1 and registry.version == 1
    mapping, regions = allocate_regions(SLOTS)
    with pytest.raises(LLMException, match="BlocksCacheKey"):
        registry.add(SLOTS, regions, True, None, mapping, cache_keys=[CacheKey(1, 11)])
    with pytest.raises(TypeError):
        _allocated(registry, ["key"])  # type: ignore[list-item]


def test_a_request_key_of_allocated_memory_goes_once_every_tensor_of_its_slot_was_pulled() -> None:
    registry = CacheRegistry()
    cache = _allocated(registry, [CacheKey(1, 10), CacheKey(1, 11)])
    assert not registry.note_pulled((0, 10, 0), cache.cache_id, 1, 0, 2)  # not the slot it names: left alone
    assert not registry.note_pulled((0, 10, 0), cache.cache_id + 1, 0, 0, 2)
    assert not registry.note_pulled((0, 10, 0), cache.cache_id, 0, 0, 1)  # one layer of two
    assert registry.slot_of((0, 10, 0)) is not None
    assert registry.note_pulled((0, 10, 0), cache.cache_id, 0, 1, 1)  # the other one: the key goes
    assert registry.slot_of((0, 10, 0)) is None and registry.get(cache.cache_id) is not None
    assert not registry.note_pulled((0, 10, 0), cache.cache_id, 0, 0, 2)  # already gone


def test_keys_of_caller_owned_memory_and_prefix_keys_stay_until_removed() -> None:
    registry = CacheRegistry()
    memory = [np.zeros(64, np.uint8) for _ in range(2)]
    registered = registry.add(SLOTS, [region_of(m, f"addrs[{i}]", SLOTS) for i, m in enumerate(memory)], False,
                              None, cache_keys=[CacheKey(1, 10)])
    allocated = _allocated(registry, [CacheKey(1, prefix_id=3)])
    assert not registry.note_pulled((0, 10, 0), registered.cache_id, 0, 0, 2)
    assert not registry.note_pulled((1, 3, 0), allocated.cache_id, 0, 0, 2)
    assert registry.remove_key((0, 10, 0)) and registry.remove_key((1, 3, 0))
    assert not registry.remove_key((1, 3, 0))  # names nothing any more: a no-op
    assert registry.version == 4 and "keys" not in registry.table()[0]


def test_deallocating_keyed_memory_waits_for_its_last_key() -> None:
    registry = CacheRegistry()
    cache = _allocated(registry, [CacheKey(1, 10), CacheKey(1, 11)])
    entry = registry.get(cache.cache_id)
    assert entry is not None
    version = registry.version
    assert not registry.deallocate(cache.cache_id)  # kept for its keys: peers still see it, nothing changed
    assert entry.deallocated and not entry.removed and registry.version == version
    assert not registry.deallocate(cache.cache_id)  # once only
    assert registry.remove_key((0, 10, 0)) and registry.get(cache.cache_id) is entry
    assert registry.note_pulled((0, 11, 0), cache.cache_id, 1, 0, 2)  # the last key: the cache goes
    assert registry.get(cache.cache_id) is None and entry.removed and cache.tensors == []
    plain = _allocated(registry, [])
    assert registry.deallocate(plain.cache_id) and registry.get(plain.cache_id) is None
    keyed = _allocated(registry, [CacheKey(1, 12)])
    assert registry.remove(keyed.cache_id) is not None and registry.slot_of((0, 12, 0)) is None  # keys go with it
    assert _allocated(registry, [CacheKey(1, 12)]).cache_id == keyed.cache_id + 1  # the name is free again
