"""Engine lifecycle, switch_role, listen, finalize with transfers in flight, copy_blocks, the kv_* forms, IPv6."""

from __future__ import annotations

import asyncio
import signal
import socket

import numpy as np
import pytest
from kvtest import EngineFactory, cluster, link
from peer import Peer

from kvpush import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

DESC = CacheDesc(4, (16, 256), DataType.DT_INT32)  # 1 KiB blocks


async def test_init_twice_is_a_no_op_and_async_with_finalizes() -> None:
    async with LLMDataDist(LLMRole.DECODER, 5, {"llm.listenIpInfo": "127.0.0.1:0"}) as engine:
        address = engine.listen_address
        assert address is not None and address[1] > 0
        await engine.init({"llm.listenIpInfo": "127.0.0.1:0"})
        assert engine.listen_address == address
    assert engine.listen_address is None
    await engine.finalize()  # idempotent
    with pytest.raises(LLMException) as caught:
        engine.cache_manager  # noqa: B018
    assert caught.value.status_code == LLMStatusCode.LLM_ENGINE_FINALIZED


async def test_unknown_option_key_at_init() -> None:
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as caught:
        await engine.init({"llm.SyncKvCacheWaitTim": "100"})
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "llm.SyncKvCacheWaitTim" in str(caught.value)


async def test_listen_on_a_busy_port_is_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        engine = LLMDataDist(LLMRole.DECODER, 1)
        with pytest.raises(LLMException) as caught:
            await engine.init({"llm.listenIpInfo": f"127.0.0.1:{busy.getsockname()[1]}"})
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


async def test_switch_role(make_engine: EngineFactory) -> None:
    first = await make_engine(1, listen=True, role=LLMRole.DECODER)
    second = await make_engine(2)
    await link(second, 1, first.listen_address[1])
    with pytest.raises(LLMException) as caught:
        await first.switch_role(LLMRole.PROMPT)
    assert caught.value.status_code == LLMStatusCode.LLM_EXIST_LINK
    await second.unlink_clusters([cluster(1, first.listen_address[1])])
    for _ in range(100):
        if not first.links:
            break
        await asyncio.sleep(0.01)
    await first.switch_role(LLMRole.PROMPT)  # no listen option: the listener stops
    assert first.role == LLMRole.PROMPT and first.listen_address is None
    await second.switch_role(LLMRole.DECODER, {"llm.listenIpInfo": "127.0.0.1:0"})
    assert second.listen_address is not None
    await link(first, 2, second.listen_address[1])  # now the other way round
    with pytest.raises(TypeError):
        await second.switch_role(2)  # type: ignore[arg-type]


async def test_listen_starts_and_moves_the_listener_and_leaves_links_alone(make_engine: EngineFactory) -> None:
    first = await make_engine(1)  # not listening
    with pytest.raises(RuntimeError):
        await LLMDataDist(LLMRole.PROMPT, 9).listen("127.0.0.1", 0)  # before init
    second = await make_engine(2, listen=True)
    await link(first, 2, second.listen_address[1])  # type: ignore[index]
    address = await first.listen("127.0.0.1", 0)  # with a link: switch_role would refuse
    assert address == first.listen_address and address[1] > 0 and 2 in first.links
    assert await first.listen("127.0.0.1", 0) == address  # already listening on that host: nothing changes
    assert await first.listen("127.0.0.1", address[1]) == address
    third = await make_engine(3)
    await link(third, 1, address[1])
    with socket.socket() as busy:  # a bind that fails leaves the listener as it was
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(LLMException, match=f"127.0.0.1:{busy.getsockname()[1]}") as caught:
            await first.listen("127.0.0.1", busy.getsockname()[1])
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert first.listen_address == address
    moved = await first.listen("127.0.0.1", _free_port())  # moves: the old port stops, the links stay
    assert moved != address and sorted(first.links) == [2, 3]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", address[1]), timeout=1).close()
    fourth = await make_engine(4)
    await link(fourth, 1, moved[1])
    assert sorted(first.links) == [2, 3, 4]
    cache = first.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
    second.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 0))
    await first.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, [0], [1])  # the first link still works
    for bad, error in ((("127.0.0.1", 70000), ValueError), ((None, 0), TypeError), (("127.0.0.1", "1"), TypeError)):
        with pytest.raises(error):
            await first.listen(*bad)  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_finalize_ends_in_flight_transfers(make_engine: EngineFactory) -> None:
    with Peer(2) as peer:
        peer.call("allocate", name="kv", num_tensors=4, shape=[16, 256], dtype=3, model_id=0)
        engine = await make_engine(1, llm__SyncKvCacheWaitTime="30000")
        cache = engine.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        await link(engine, 2, peer.port)
        peer.signal(signal.SIGSTOP)
        try:
            push = asyncio.create_task(engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, [0], [1]))
            pull = asyncio.create_task(engine.cache_manager.pull_blocks(BlocksCacheKey(2, 0), cache, [0], [1]))
            await asyncio.sleep(0.1)
            await engine.finalize()
            async with asyncio.timeout(5):
                results = await asyncio.gather(push, pull, return_exceptions=True)
        finally:
            peer.signal(signal.SIGCONT)
        assert all(isinstance(r, LLMException) for r in results), results
        assert cache.tensors == []  # memory kvpush allocated is released


async def test_copy_blocks(make_engine: EngineFactory) -> None:
    engine = await make_engine(1)
    cache = engine.cache_manager.allocate_blocks_cache(DESC)
    for index, tensor in enumerate(cache.tensors):
        tensor[:] = np.arange(16)[:, None] + 100 * index
    await engine.cache_manager.copy_blocks(cache, {0: [5, 6], 5: [7]})
    for index, tensor in enumerate(cache.tensors):
        rows = tensor[:, 0] - 100 * index
        assert rows.tolist() == [0, 1, 2, 3, 4, 0, 0, 5, 8, 9, 10, 11, 12, 13, 14, 15]  # 7 got the *old* 5
    with pytest.raises(LLMException) as caught:
        await engine.cache_manager.copy_blocks(cache, {0: [16]})
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as caught:
        await engine.cache_manager.copy_blocks(cache, {0: [3], 1: [3]})
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        await engine.cache_manager.copy_blocks(cache, [(0, 1)])  # type: ignore[arg-type]


async def test_kv_blocks_forms_move_single_tensors(make_engine: EngineFactory) -> None:
    decode = await make_engine(2, listen=True)
    prefill = await make_engine(1)
    dst = decode.cache_manager.allocate_blocks_cache(DESC)
    src = prefill.cache_manager.allocate_blocks_cache(DESC)
    for index, tensor in enumerate(src.tensors):
        tensor[:] = np.arange(16)[:, None] + 1000 * (index + 1)
    await link(prefill, 2, decode.listen_address[1])
    index = CacheKeyByIdAndIndex(2, dst.cache_id)
    for tensor in range(4):
        param = KvCacheExtParam((tensor, tensor), (tensor, tensor), 1)
        assert await prefill.cache_manager.push_kv_blocks(src, index, [5, 6, 7], [5, 6, 7], param) == 0
    for tensor in range(4):
        assert (dst.tensors[tensor][5:8, 0] == [1000 * (tensor + 1) + b for b in (5, 6, 7)]).all()
        assert not dst.tensors[tensor][:5].any() and not dst.tensors[tensor][8:].any()
    back = prefill.cache_manager.allocate_blocks_cache(DESC)
    status = await prefill.cache_manager.pull_kv_blocks(index, back, [5, 6, 7], [0, 1, 2],
                                                        KvCacheExtParam((1, 1), (0, 0), 2))
    assert status == LLMStatusCode.LLM_SUCCESS
    assert (back.tensors[0][0:3, 0] == [3005, 3006, 3007]).all()
    assert (back.tensors[1][0:3, 0] == [4005, 4006, 4007]).all()
    assert not back.tensors[2].any() and not back.tensors[3].any()


async def test_ipv6_loopback(make_engine: EngineFactory) -> None:
    if not socket.has_ipv6:
        pytest.skip("this host has no IPv6 stack")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("::1 is not configured on this host")
    decode = LLMDataDist(LLMRole.DECODER, 2)
    await decode.init({"llm.listenIpInfo": "[::1]:0"})
    try:
        prefill = await make_engine(1)
        dst = decode.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 0))
        src = prefill.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        src.tensors[0][:] = 7
        status, _ = await prefill.link_clusters([cluster(2, decode.listen_address[1], host="::1")])
        assert status == LLMStatusCode.LLM_SUCCESS
        await prefill.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [3], [9])
        assert (dst.tensors[0][9] == 7).all() and not dst.tensors[0][8].any()
    finally:
        await decode.finalize()
