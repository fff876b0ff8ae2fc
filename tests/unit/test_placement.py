"""Placement.DEVICE on a host without an accelerator runtime is host memory (issue 12): accepted
after checking it is mapped, writable memory of this process; unmapped memory is LLM_PARAM_INVALID,
never a crash."""

from __future__ import annotations

import logging
import mmap

import numpy as np
import pytest
from kvtest import EngineFactory

from kvpush import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement
from kvpush.memory import accelerator_runtime, mapped_writable

DESC = CacheDesc(2, (4, 16), DataType.DT_FLOAT16, Placement.DEVICE)


def test_mapped_writable_tells_mapped_from_unmapped_and_read_only() -> None:
    array = np.zeros(4096, np.uint8)
    assert mapped_writable(array.ctypes.data, array.nbytes)
    guard = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    base = np.frombuffer(guard, np.uint8).ctypes.data
    assert mapped_writable(base, 3 * mmap.PAGESIZE)
    assert not mapped_writable(0x10, 64)  # the zero page is never mapped
    read_only = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ)
    address = np.frombuffer(read_only, np.uint8).ctypes.data
    assert not mapped_writable(address, 16)


async def test_device_memory_on_a_cpu_host_registers_as_host_memory(make_engine: EngineFactory,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    assert accelerator_runtime() is None  # no CUDA / CANN runtime in the test process
    engine = await make_engine(1)
    tensors = [np.zeros((4, 16), np.float16) for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="kvpush.memory"):
        cache = engine.cache_manager.register_blocks_cache(DESC, [t.ctypes.data for t in tensors],
                                                           BlocksCacheKey(1, 0))
        engine.cache_manager.register_blocks_cache(DESC, [np.zeros((4, 16), np.float16) for _ in range(2)],
                                                   BlocksCacheKey(1, 1))
    assert cache.cache_desc.placement == Placement.DEVICE  # reported as the program gave it
    assert sum("placement DEVICE" in record.message for record in caplog.records) <= 1  # said once


@pytest.mark.parametrize("placement", [Placement.DEVICE, Placement.HOST])
async def test_unmapped_addresses_are_refused_clearly(make_engine: EngineFactory, placement: Placement) -> None:
    engine = await make_engine(1)
    desc = CacheDesc(1, (4, 16), DataType.DT_FLOAT16, placement)
    with pytest.raises(LLMException) as caught:
        engine.cache_manager.register_blocks_cache(desc, [0x1000], BlocksCacheKey(1, 0))
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "not mapped" in str(caught.value)
