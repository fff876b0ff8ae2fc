"""Per-link counters as plain data, logged link state changes, and the Prometheus export."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from kvtest import EngineFactory, cluster, link

from kvpush import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode

DESC = CacheDesc(2, (8, 1024), DataType.DT_UINT8)


async def test_link_counters_rtt_failures_and_state_logs(make_engine: EngineFactory,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    decode = await make_engine(2, listen=True, kvpush__transport="tcp", llm__EnableRemoteCacheAccessible="0",
                               kvpush__keepalive_interval_ms="50")
    prefill = await make_engine(1, kvpush__transport="tcp", kvpush__keepalive_interval_ms="50")
    decode.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 0))
    src = prefill.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
    await link(prefill, 2, decode.listen_address[1])
    with pytest.raises(LLMException) as caught:  # the decode side refuses remote access
        await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0], [1])
    assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    for _ in range(100):
        if prefill.link_stats()[2]["rtt_ms"] is not None:
            break
        await asyncio.sleep(0.02)
    stats = prefill.link_stats()[2]
    json.dumps(stats)  # plain data
    assert stats["transport"] == "tcp" and stats["state"] == "ready" and stats["rtt_ms"] > 0
    assert stats["write_requests"] == 1 and stats["bytes_pushed"] == 2 * 1024 and stats["bytes_out"] > 2048
    assert stats["failures"] == {"LLM_FEATURE_NOT_ENABLED": 1} and "remote cache access" in stats["last_error"]
    await prefill.unlink_clusters([cluster(2, decode.listen_address[1])])
    for _ in range(100):
        if not decode.links:
            break
        await asyncio.sleep(0.01)
    messages = [r.getMessage() for r in caplog.records]
    assert any("link to cluster 2 ready over tcp" in m for m in messages)
    assert any("link to cluster 2 closed: unlinked" in m for m in messages)
    assert any("link to cluster 1 closed: peer unlinked" in m for m in messages)


async def test_prometheus_export(make_engine: EngineFactory) -> None:
    prometheus_client = pytest.importorskip("prometheus_client", reason="the optional 'metrics' extra")
    from kvpush.metrics import export_prometheus

    decode = await make_engine(2, listen=True, kvpush__transport="tcp")
    prefill = await make_engine(1, kvpush__transport="tcp")
    decode.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 0))
    src = prefill.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
    await link(prefill, 2, decode.listen_address[1])
    await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [0, 1], [5, 6])
    registry = prometheus_client.CollectorRegistry()
    export_prometheus(prefill, registry)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'kvpush_link_write_requests_total{cluster="1",peer="2",transport="tcp"} 1.0' in text
    assert 'kvpush_link_bytes_pushed_total{cluster="1",peer="2",transport="tcp"} 4096.0' in text
    assert 'kvpush_links{cluster="1"} 1.0' in text
