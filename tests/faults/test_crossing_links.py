"""Links made from both ends at once (LLM-DataDist's transfer-backend samples do it): both calls
succeed, transfers work both ways while the links cross, no link reported usable is torn down, and
both sides' non-force unlinks succeed - every round, on every transport (SPEC 3)."""

from __future__ import annotations

import asyncio

import numpy as np
from kvtest import cluster, desc, fill, raw

from kvpush import BlocksCacheKey, LLMDataDist, LLMRole, LLMStatusCode

ROUNDS = 50


async def engine(cluster_id: int, transport: str) -> LLMDataDist:
    dd = LLMDataDist(LLMRole.MIX, cluster_id)
    await dd.init({"llm.listenIpInfo": "127.0.0.1:0", "kvpush.transport": transport})
    dd.cache_manager.allocate_blocks_cache(desc(8, 4), BlocksCacheKey(cluster_id, 0))
    return dd


def cache(dd: LLMDataDist):  # type: ignore[no-untyped-def]
    entry = dd.registry.get(1)
    assert entry is not None
    return entry.cache


async def test_both_ends_link_each_other_at_once_every_round(transport: str) -> None:
    for round_index in range(ROUNDS):
        left, right = await engine(1, transport), await engine(2, transport)
        try:
            a, b = cache(left), cache(right)
            fill(a, round_index)
            fill(b, round_index + 1000)
            assert left.listen_address is not None and right.listen_address is not None
            to_right, to_left = cluster(2, right.listen_address[1]), cluster(1, left.listen_address[1])
            results = await asyncio.gather(left.link_clusters([to_right], timeout=5000),
                                           right.link_clusters([to_left], timeout=5000))
            assert [codes for _, codes in results] == [[LLMStatusCode.LLM_SUCCESS]] * 2, (round_index, results)
            # pushes and pulls both ways at once, right after the crossing
            await asyncio.gather(
                left.cache_manager.push_blocks(BlocksCacheKey(2, 0), a, [0, 1], [4, 5]),
                right.cache_manager.push_blocks(BlocksCacheKey(1, 0), b, [2], [6]),
                left.cache_manager.pull_blocks(BlocksCacheKey(2, 0), a, [3], [7]),
                right.cache_manager.pull_blocks(BlocksCacheKey(1, 0), b, [0], [1]),
            )
            assert np.array_equal(raw(b)[:, [4, 5]], raw(a)[:, [0, 1]])
            assert np.array_equal(raw(a)[:, 6], raw(b)[:, 2])
            assert np.array_equal(raw(a)[:, 7], raw(b)[:, 3])
            assert np.array_equal(raw(b)[:, 1], raw(a)[:, 0])
            await asyncio.sleep(0)
            assert list(left.links) == [2] and list(right.links) == [1]  # nothing was torn down
            unlinked = await asyncio.gather(left.unlink_clusters([to_right], timeout=5000),
                                            right.unlink_clusters([to_left], timeout=5000))
            assert [status for status, _ in unlinked] == [LLMStatusCode.LLM_SUCCESS] * 2, (round_index, unlinked)
            assert left.links == {} and right.links == {}
        finally:
            await left.finalize()
            await right.finalize()


async def test_a_push_in_flight_survives_the_peer_linking_back(transport: str) -> None:
    left, right = await engine(1, transport), await engine(2, transport)
    try:
        a = cache(left)
        fill(a, 5)
        assert left.listen_address is not None and right.listen_address is not None
        status, _ = await left.link_clusters([cluster(2, right.listen_address[1])])
        assert status == LLMStatusCode.LLM_SUCCESS
        for _ in range(10):
            pushing = asyncio.create_task(left.cache_manager.push_blocks(BlocksCacheKey(2, 0), a, [0, 1, 2], [5, 6, 7]))
            status, codes = await right.link_clusters([cluster(1, left.listen_address[1])])
            assert codes == [LLMStatusCode.LLM_SUCCESS]  # linked by the peer: usable both ways
            await pushing
        assert np.array_equal(raw(cache(right))[:, [5, 6, 7]], raw(a)[:, [0, 1, 2]])
        unlinked = await asyncio.gather(left.unlink_clusters([cluster(2, right.listen_address[1])]),
                                        right.unlink_clusters([cluster(1, left.listen_address[1])]))
        assert [status for status, _ in unlinked] == [LLMStatusCode.LLM_SUCCESS] * 2
    finally:
        await left.finalize()
        await right.finalize()
