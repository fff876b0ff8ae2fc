"""A thousand link/unlink and register/unregister cycles leave file descriptors and memory flat."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest
from kvtest import EngineFactory, cluster

from kvpush import BlocksCacheKey, CacheDesc, DataType, LLMStatusCode

CYCLES = 1000


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_link_unlink_cycles(make_engine: EngineFactory, transport: str) -> None:
    decode = await make_engine(2, listen=True, kvpush__transport=transport)
    prefill = await make_engine(1, kvpush__transport=transport)
    decode.cache_manager.allocate_blocks_cache(CacheDesc(2, (8, 1024), DataType.DT_UINT8), BlocksCacheKey(2, 0))
    target = [cluster(2, decode.listen_address[1])]
    for _ in range(20):  # warm up allocators and caches before measuring
        assert (await prefill.link_clusters(target))[0] == LLMStatusCode.LLM_SUCCESS
        assert (await prefill.unlink_clusters(target))[0] == LLMStatusCode.LLM_SUCCESS
    gc.collect()
    fds, rss = open_fds(), rss_bytes()
    for cycle in range(CYCLES):
        force = cycle % 2 == 1  # both kinds of unlink
        assert (await prefill.link_clusters(target))[0] == LLMStatusCode.LLM_SUCCESS
        assert (await prefill.unlink_clusters(target, force=force))[0] == LLMStatusCode.LLM_SUCCESS
        for _ in range(2000):  # a force unlink is noticed by the peer when the socket closes
            if 1 not in decode.links:
                break
            await asyncio.sleep(0.001)
    gc.collect()
    await asyncio.sleep(0.2)
    assert open_fds() - fds <= 4, f"{open_fds() - fds} file descriptors more after {CYCLES} cycles"
    assert rss_bytes() - rss <= 32 << 20, f"RSS grew {(rss_bytes() - rss) >> 20} MiB after {CYCLES} cycles"
    assert decode.links == {} and prefill.links == {}


async def test_register_unregister_cycles(make_engine: EngineFactory) -> None:
    engine = await make_engine(1, listen=True)
    desc = CacheDesc(4, (16, 4096), DataType.DT_FLOAT16)  # 512 KiB per cache
    for _ in range(20):
        engine.cache_manager.deallocate_cache(engine.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0)))
    gc.collect()
    fds, rss = open_fds(), rss_bytes()
    for cycle in range(CYCLES):
        cache = engine.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        cache.tensors[0][0, 0] = cycle
        engine.cache_manager.deallocate_cache(cache)
        registered = engine.cache_manager.register_blocks_cache(desc, [bytearray(desc.size) for _ in range(4)])
        engine.cache_manager.unregister_cache(registered.cache_id)
    gc.collect()
    assert open_fds() - fds <= 2
    assert rss_bytes() - rss <= 32 << 20, f"RSS grew {(rss_bytes() - rss) >> 20} MiB after {CYCLES} cycles"
    assert len(engine.registry) == 0
