"""The parts of LLM-DataDist's API the sample flows do not reach, on two blocking facades in this process
(each with its own engine and loop thread) linked over loopback: rank-table links and their failures,
transfer_cache_async's layer synchronisation, LLM-DataDist's layer defaults, local copies."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpush.compat.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

PROMPT, DECODER = 1, 2
BLOCKS, ROW = 6, 64  # float32 rows: 256-byte blocks


def desc(num_tensors: int, placement: Placement = Placement.HOST, blocks: int = BLOCKS) -> CacheDesc:
    return CacheDesc(num_tensors, [blocks, ROW], DataType.DT_FLOAT, placement)


def arrays(num_tensors: int, fill: float | None = None, blocks: int = BLOCKS) -> list[np.ndarray[Any, Any]]:
    if fill is not None:
        return [np.full((blocks, ROW), fill, np.float32) for _ in range(num_tensors)]
    return [(np.arange(blocks * ROW, dtype=np.float32).reshape(blocks, ROW) + 1000 * t) for t in range(num_tensors)]


def ptrs(tensors: list[np.ndarray[Any, Any]]) -> list[int]:
    return [int(t.ctypes.data) for t in tensors]


def cluster(cluster_id: int, port: int | None = None) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    if port is not None:
        info.append_remote_ip_info("127.0.0.1", port)
    return info


@pytest.fixture
def engines() -> Iterator[tuple[LLMDataDist, LLMDataDist]]:
    """A listening prompt (cluster 1) and a decoder (cluster 2), not linked yet."""
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, PROMPT), LLMDataDist(LLMRole.DECODER, DECODER)
    prompt.init({"llm.listenIpInfo": "127.0.0.1:0", "llm.SyncKvCacheWaitTime": "3000"})
    decoder.init({"llm.SyncKvCacheWaitTime": "3000"})
    yield prompt, decoder
    decoder.finalize()
    prompt.finalize()


@pytest.fixture
def linked(engines: tuple[LLMDataDist, LLMDataDist]) -> tuple[LLMDataDist, LLMDataDist]:
    prompt, decoder = engines
    assert prompt.listen_address is not None
    assert decoder.link_clusters([cluster(PROMPT, prompt.listen_address[1])], 5000)[0] == LLMStatusCode.LLM_SUCCESS
    return prompt, decoder


# -- rank-table links -----------------------------------------------------------------------------
def rank_table(port: int) -> str:
    return json.dumps({"server_count": "1", "status": "completed", "version": "1.2", "server_list": [{
        "device": [{"device_id": "0", "device_ip": "127.0.0.1", "device_port": str(port), "rank_id": "0"},
                   {"device_id": "1", "device_ip": "127.0.0.1", "rank_id": "1"}],
        "host_ip": "127.0.0.1", "server_id": "1"}]})


def wait_status(engine: LLMDataDist, comm_id: int, seconds: float = 10) -> RegisterMemStatus:
    deadline = time.monotonic() + seconds
    while (status := engine.query_register_mem_status(comm_id)) == RegisterMemStatus.PREPARING:
        assert time.monotonic() < deadline, "still PREPARING"
        time.sleep(0.02)
    return status


def test_rank_table_link_both_ends_then_unlink() -> None:
    lower, higher = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    lower.init({})
    higher.init({})
    try:
        port = _free_port()
        table = rank_table(port)
        dialer_comm = higher.link("link", {1: 0, 2: 1}, table)  # before the peer listens: it retries
        assert higher.query_register_mem_status(dialer_comm) == RegisterMemStatus.PREPARING
        time.sleep(0.3)
        listener_comm = lower.link("link", {1: 0, 2: 1}, table)
        assert (dialer_comm, listener_comm) == (1, 1)
        assert wait_status(higher, dialer_comm) == RegisterMemStatus.OK
        assert wait_status(lower, listener_comm) == RegisterMemStatus.OK
        assert lower.listen_address == ("127.0.0.1", port)  # rank 0 listens where the table says
        higher.check_link_status(1)
        lower.check_link_status(2)
        second = higher.link("link2", {1: 0, 2: 1}, table)  # a second comm over the same pair
        assert second == 2 and wait_status(higher, second) == RegisterMemStatus.OK
        higher.unlink(dialer_comm)
        higher.check_link_status(1)  # comm 2 still links them
        higher.unlink(second)
        with pytest.raises(LLMException) as caught:
            higher.check_link_status(1)
        assert caught.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        deadline = time.monotonic() + 5
        while True:  # the peer's end goes too
            try:
                lower.check_link_status(2)
            except LLMException as error:
                assert error.status_code == LLMStatusCode.LLM_NOT_YET_LINK
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        lower.unlink(listener_comm)
        for call in (lambda: higher.unlink(dialer_comm), lambda: higher.query_register_mem_status(99)):
            with pytest.raises(LLMException) as caught:
                call()
            assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    finally:
        higher.finalize()
        lower.finalize()


def test_a_rank_table_peer_that_never_comes_is_failed_after_link_total_time() -> None:
    engine = LLMDataDist(LLMRole.DECODER, 2)
    engine.init({"llm.LinkTotalTime": "400"})
    try:
        started = time.monotonic()
        comm = engine.link("lonely", {1: 0, 2: 1}, rank_table(_free_port()))
        assert wait_status(engine, comm) == RegisterMemStatus.FAILED
        assert 0.35 < time.monotonic() - started < 3
    finally:
        engine.finalize()


@pytest.mark.parametrize("args, error", [
    (("", {1: 0, 2: 1}), LLMException),
    (("x" * 128, {1: 0, 2: 1}), LLMException),
    ((3, {1: 0, 2: 1}), TypeError),
    (("c", [(1, 0), (2, 1)]), TypeError),
    (("c", {1: "0", 2: 1}), TypeError),
    (("c", {1: 0}), LLMException),
    (("c", {1: 1, 2: 0}), LLMException),
    (("c", {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}), LLMException),
    (("c", {1: 0, 2: -1}), ValueError),
    (("c", {7: 0, 8: 1}), LLMException),  # this engine (cluster 2) is not in the comm
    (("c", {1: 0, 2: 5}), LLMException),  # rank 5 is not in the rank table
])
def test_rank_table_link_checks_its_arguments(args: tuple[Any, Any], error: type[Exception]) -> None:
    engine = LLMDataDist(LLMRole.DECODER, 2)
    engine.init({})
    try:
        with pytest.raises(error) as caught:
            engine.link(args[0], args[1], rank_table(_free_port()))
        if error is LLMException:
            assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # type: ignore[attr-defined]
        for bad_table in ("{not json", json.dumps({"server_list": [{"device": [{}]}]})):
            with pytest.raises(LLMException):
                engine.link("c", {1: 0, 2: 1}, bad_table)
    finally:
        engine.finalize()


def test_a_rank_table_that_places_a_listening_engine_elsewhere_is_refused() -> None:
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    engine.init({"llm.listenIpInfo": "127.0.0.1:0"})
    try:
        with pytest.raises(LLMException, match="listens on") as caught:
            engine.link("c", {1: 0, 2: 1}, rank_table(_free_port()))
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    finally:
        engine.finalize()


def test_a_linked_engine_that_does_not_listen_yet_starts_listening_for_a_rank_table(
        linked: tuple[LLMDataDist, LLMDataDist]) -> None:
    _, decoder = linked  # linked to the prompt, by its own dial: it does not listen
    assert decoder.listen_address is None
    third = LLMDataDist(LLMRole.DECODER, 3)
    third.init({})
    try:
        port = _free_port()
        table = rank_table(port)
        listener_comm = decoder.link("link", {DECODER: 0, 3: 1}, table)  # rank 0: it listens where the table says
        dialer_comm = third.link("link", {DECODER: 0, 3: 1}, table)
        assert wait_status(decoder, listener_comm) == RegisterMemStatus.OK
        assert wait_status(third, dialer_comm) == RegisterMemStatus.OK
        assert decoder.listen_address == ("127.0.0.1", port)
        decoder.check_link_status(PROMPT)  # the link it had is still there
        decoder.check_link_status(3)
    finally:
        third.finalize()


def _free_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# -- transfer_cache_async -------------------------------------------------------------------------
class Gate(LayerSynchronizer):
    """Layer l is "computed" once ``release(l)``; records the calls."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.events: dict[int, threading.Event] = {}
        self.calls: list[tuple[int, int | None]] = []
        self.fail_at = fail_at

    def release(self, *layers: int) -> None:
        for layer in layers:
            self.events.setdefault(layer, threading.Event()).set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append((layer_index, timeout_in_millis))
        if layer_index == self.fail_at:
            return False
        return self.events.setdefault(layer_index, threading.Event()).wait(30)


def wait_until(condition: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_transfer_cache_async_moves_each_layer_as_soon_as_it_is_computed(
        linked: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, decoder = linked
    source, target = arrays(8), arrays(8, fill=0.0)  # 4 layers of K, V
    src = prompt.cache_manager.register_blocks_cache(desc(8), ptrs(source), BlocksCacheKey(PROMPT, 0))
    decoder.cache_manager.register_blocks_cache(desc(8), ptrs(target), BlocksCacheKey(DECODER, 0))
    gate = Gate()
    config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 4), range(0, 4))
    task = prompt.cache_manager.transfer_cache_async(src, gate, [config], [0, 1, 4], [5, 2, 3])
    gate.release(0, 1)
    wait_until(lambda: all(np.array_equal(target[t][[5, 2, 3]], source[t][[0, 1, 4]]) for t in range(4)))
    assert task.synchronize(200) == LLMStatusCode.LLM_TIMEOUT  # layers 2 and 3 are not computed yet
    assert not any(target[t].any() for t in range(4, 8))  # and nothing of them moved
    gate.release(2, 3)
    assert task.synchronize() == LLMStatusCode.LLM_SUCCESS and task.get_results() == [LLMStatusCode.LLM_SUCCESS]
    for t in range(8):
        assert np.array_equal(target[t][[5, 2, 3]], source[t][[0, 1, 4]]) and not target[t][[0, 1, 4]].any()
    assert gate.calls == [(0, None), (1, None), (2, None), (3, None)]


def test_transfer_cache_async_layer_mappings_several_destinations_and_a_failed_synchronizer(
        linked: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, decoder = linked
    source, target, contiguous = arrays(4), arrays(4, fill=0.0), arrays(4, fill=0.0)
    src = prompt.cache_manager.register_blocks_cache(desc(4), ptrs(source), BlocksCacheKey(PROMPT, 0))
    decoder.cache_manager.register_blocks_cache(desc(4), ptrs(target), BlocksCacheKey(DECODER, 0))
    # layer 0 -> layer 1 (not the same layer: one push per layer, not the pusher)
    gate = Gate()
    gate.release(0, 1)
    task = prompt.cache_manager.transfer_cache_async(
        src, gate, [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 1), range(1, 2))])
    assert task.get_results() == [LLMStatusCode.LLM_SUCCESS] and gate.calls == [(0, None)]  # only layer 0 synced
    assert np.array_equal(target[2], source[0]) and np.array_equal(target[3], source[1])
    assert not target[0].any() and not target[1].any()
    # a contiguous source into a batch slot of the peer's contiguous cache (CacheKeyByIdAndIndex)
    slot_memory = arrays(4)  # registered by address: the caller keeps the memory alive
    slots = prompt.cache_manager.register_cache(desc(4), ptrs(slot_memory))
    peer_slots = decoder.cache_manager.register_cache(desc(4), ptrs(contiguous))
    gate = Gate()
    gate.release(0, 1)
    key = CacheKeyByIdAndIndex(DECODER, peer_slots.cache_id, 3)
    task = prompt.cache_manager.transfer_cache_async(slots, gate, [TransferWithCacheKeyConfig(key, range(0, 2),
                                                                                            range(0, 2), 2)])
    assert task.synchronize() == LLMStatusCode.LLM_SUCCESS
    assert all(np.array_equal(contiguous[t][3], slot_memory[t][2]) for t in range(4))
    assert not any(contiguous[t][[0, 1, 2, 4, 5]].any() for t in range(4))
    # the synchronizer says layer 1 will not be computed: layer 0 landed, the task stopped there
    for tensor in target:
        tensor.fill(0)
    gate = Gate(fail_at=1)
    gate.release(0)
    task = prompt.cache_manager.transfer_cache_async(
        src, gate, [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 2), range(0, 2))], [0], [0])
    assert task.get_results() == [LLMStatusCode.LLM_PARAM_INVALID]
    assert task.synchronize() == LLMStatusCode.LLM_PARAM_INVALID
    assert np.array_equal(target[0][0], source[0][0]) and not target[2].any()


def test_transfer_cache_async_failures_arrive_as_codes_and_bad_arguments_raise(
        linked: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, _ = linked
    memory = arrays(2)
    src = prompt.cache_manager.register_blocks_cache(desc(2), ptrs(memory), BlocksCacheKey(PROMPT, 0))
    gate = Gate()
    gate.release(0)
    to_nowhere = TransferWithCacheKeyConfig(BlocksCacheKey(9, 0), range(0, 1), range(0, 1))
    task = prompt.cache_manager.transfer_cache_async(src, gate, [to_nowhere], [0], [0])
    assert task.get_results() == [LLMStatusCode.LLM_NOT_YET_LINK]
    cm = prompt.cache_manager
    with pytest.raises(TypeError):
        cm.transfer_cache_async(None, gate, [to_nowhere])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cm.transfer_cache_async(src, None, [to_nowhere])  # type: ignore[arg-type]
    with pytest.raises(LLMException, match="blocks to cache"):
        cm.transfer_cache_async(src, gate, [to_nowhere], [0], None)
    with pytest.raises(LLMException, match="out of range"):
        cm.transfer_cache_async(src, gate, [TransferWithCacheKeyConfig(BlocksCacheKey(9), range(0, 2), range(0, 2))])
    with pytest.raises(LLMException) as caught:
        cm.transfer_cache_async(src, gate, [TransferConfig(9, [4096, 8192], range(0, 1))])
    assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    with pytest.raises(LLMException, match="size should be equal"):
        TransferWithCacheKeyConfig(BlocksCacheKey(9), range(0, 2), range(0, 1))
    with pytest.raises(LLMException, match="src_batch_index"):
        TransferWithCacheKeyConfig(BlocksCacheKey(9), range(0, 1), range(0, 1), 1)


def test_transfer_cache_async_from_a_contiguous_slot_into_the_peers_blocks(
        linked: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, decoder = linked
    slot_memory = arrays(4)  # 6 slots of 256 bytes
    slots = prompt.cache_manager.register_cache(desc(4), ptrs(slot_memory))
    small = [np.zeros((12, ROW // 2), np.float32) for _ in range(4)]  # 128-byte blocks: a slot is two of them
    decoder.cache_manager.register_blocks_cache(CacheDesc(4, [12, ROW // 2], DataType.DT_FLOAT, Placement.HOST),
                                                ptrs(small), BlocksCacheKey(DECODER, 0))
    gate = Gate()
    gate.release(0, 1)
    # as in LLM-DataDist, the source of a BlocksCacheKey config is slot 0 (src_batch_index must be 0 there)
    config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 2), range(0, 2))
    task = prompt.cache_manager.transfer_cache_async(slots, gate, [config], None, [7, 3], 128)
    assert task.get_results() == [LLMStatusCode.LLM_SUCCESS]
    for t in range(4):
        assert np.array_equal(small[t][7], slot_memory[t][0][:32])
        assert np.array_equal(small[t][3], slot_memory[t][0][32:])
        assert not small[t][[0, 1, 2, 4, 5, 6, 8, 9, 10, 11]].any()
    one_layer = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(1, 2), range(0, 1))
    gate = Gate()
    gate.release(1)
    task = prompt.cache_manager.transfer_cache_async(slots, gate, [one_layer], None, [10], 128)  # half a slot
    assert task.synchronize() == LLMStatusCode.LLM_SUCCESS
    assert np.array_equal(small[0][10], slot_memory[2][0][:32]) and np.array_equal(small[1][10], slot_memory[3][0][:32])
    for size in (0, 4 * BLOCKS * ROW):  # LLM-DataDist's bounds on the block size: a code, as there
        task = prompt.cache_manager.transfer_cache_async(slots, gate, [config], None, [7, 3], size)
        assert task.get_results() == [LLMStatusCode.LLM_PARAM_INVALID]
    with pytest.raises(LLMException, match="dst_block_indices"):
        prompt.cache_manager.transfer_cache_async(slots, gate, [config])


def test_pull_blocks_by_cache_key_into_several_blocks_consumes_the_key(
        linked: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, decoder = linked
    slots = prompt.cache_manager.allocate_cache(desc(2), [CacheKey(PROMPT, 5), CacheKey(PROMPT, 6)])
    theirs = slots.tensors  # numpy views of the memory kvpush allocated
    for t, tensor in enumerate(theirs):
        tensor[:] = arrays(2)[t]
    small = [np.zeros((12, ROW // 2), np.float32) for _ in range(2)]
    mine = decoder.cache_manager.register_blocks_cache(CacheDesc(2, [12, ROW // 2], DataType.DT_FLOAT,
                                                                 Placement.HOST), ptrs(small))
    decoder.cache_manager.pull_blocks(CacheKey(PROMPT, 6), mine, [], [9, 4])  # slot 1 into blocks 9 and 4
    for t in range(2):
        assert np.array_equal(small[t][9], theirs[t][1][:32]) and np.array_equal(small[t][4], theirs[t][1][32:])
    with pytest.raises(LLMException) as caught:  # consumed by the pull, as in LLM-DataDist
        decoder.cache_manager.pull_blocks(CacheKey(PROMPT, 6), mine, [], [0])
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    prompt.cache_manager.remove_cache_key(CacheKey(PROMPT, 6))  # a no-op now
    prompt.cache_manager.remove_cache_key(CacheKey(PROMPT, 5))
    prompt.cache_manager.deallocate_cache(slots)


# -- LLM-DataDist's layer defaults ----------------------------------------------------------------
def test_one_tensor_caches_with_the_default_tensor_num_per_layer(linked: tuple[LLMDataDist, LLMDataDist],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    prompt, decoder = linked
    theirs, ours = arrays(1), arrays(1, fill=0.0)
    prompt.cache_manager.register_blocks_cache(desc(1), ptrs(theirs), BlocksCacheKey(PROMPT, 0))
    mine = decoder.cache_manager.register_blocks_cache(desc(1), ptrs(ours), BlocksCacheKey(DECODER, 0))
    decoder.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), mine, [0, 1], [0, 2])  # every tensor, as there
    assert np.array_equal(ours[0][[0, 2]], theirs[0][[0, 1]]) and not ours[0][1].any()
    with caplog.at_level(logging.WARNING, logger="kvpush.compat"):
        decoder.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), mine, [1], [5])  # no layer: nothing moves
    assert np.array_equal(theirs[0], arrays(1)[0]) and "nothing moves" in caplog.text


def test_a_tensor_num_per_layer_that_does_not_divide_the_cache_moves_whole_layers_only(
        linked: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, decoder = linked
    theirs, ours = arrays(3, fill=0.0), arrays(3)
    prompt.cache_manager.register_blocks_cache(desc(3), ptrs(theirs), BlocksCacheKey(PROMPT, 0))
    mine = decoder.cache_manager.register_blocks_cache(desc(3), ptrs(ours), BlocksCacheKey(DECODER, 0))
    decoder.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), mine, [0], [0])  # 3 // 2 = 1 layer: tensors 0, 1
    assert np.array_equal(theirs[0][0], ours[0][0]) and np.array_equal(theirs[1][0], ours[1][0])
    assert not theirs[2].any()


def test_pull_blocks_from_a_batch_slot_and_the_checks_llm_datadist_makes(
        linked: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, decoder = linked
    slot_memory, ours = arrays(2), arrays(2, fill=0.0)
    slots = prompt.cache_manager.register_cache(desc(2), ptrs(slot_memory))
    mine = decoder.cache_manager.register_blocks_cache(desc(2), ptrs(ours))
    cm = decoder.cache_manager
    cm.pull_blocks(CacheKeyByIdAndIndex(PROMPT, slots.cache_id, 4), mine, [], [1])
    assert all(np.array_equal(ours[t][1], slot_memory[t][4]) for t in range(2)) and not ours[0][[0, 2]].any()
    for call in (lambda: cm.pull_blocks(CacheKeyByIdAndIndex(PROMPT, slots.cache_id), mine, [0], [1]),
                 lambda: cm.pull_blocks(BlocksCacheKey(PROMPT, 0), mine, [0], []),
                 lambda: cm.pull_cache(CacheKeyByIdAndIndex(PROMPT, slots.cache_id), mine),  # not contiguous
                 lambda: cm.pull_cache(CacheKey(PROMPT, (1 << 64) - 1), slots),  # neither req nor prefix id
                 lambda: cm.push_cache(CacheKeyByIdAndIndex(PROMPT, slots.cache_id), slots, size=8),
                 lambda: cm.deallocate_cache(mine),  # a blocks cache
                 lambda: cm.push_blocks(BlocksCacheKey(PROMPT, 0), mine, [0], [0], tensor_num_per_layer=0)):
        with pytest.raises(LLMException) as caught:
            call()
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as caught:
        cm.register_blocks_cache(CacheDesc(1, [4, 8], DataType.DT_FLOAT, Placement.HOST, 1), ptrs(arrays(1)))
    assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


# -- local copies ---------------------------------------------------------------------------------
def test_swap_blocks_between_device_and_host_caches(engines: tuple[LLMDataDist, LLMDataDist]) -> None:
    cm = engines[1].cache_manager
    device_memory, host_memory = arrays(2), arrays(2, fill=0.0, blocks=4)
    # a DEVICE cache described by hand: on this host its memory is host memory all the same
    device = Cache(-1, desc(2, Placement.DEVICE), ptrs(device_memory), True)
    host = Cache.create_cpu_cache(desc(2, blocks=4), ptrs(host_memory))
    cm.swap_blocks(device, host, {3: 0, 5: 2})  # swap out
    for t in range(2):
        assert np.array_equal(host_memory[t][[0, 2]], device_memory[t][[3, 5]]) and not host_memory[t][[1, 3]].any()
    host_memory[0][0] = -5.0
    cm.swap_blocks(host, device, {0: 1})  # swap in
    assert (device_memory[0][1] == -5).all() and np.array_equal(device_memory[1][1], device_memory[1][3])
    for call, code in ((lambda: cm.swap_blocks(host, Cache.create_cpu_cache(desc(2, blocks=4), ptrs(arrays(2))),
                                               {0: 0}), LLMStatusCode.LLM_PARAM_INVALID),  # HOST to HOST
                       (lambda: cm.swap_blocks(device, host, {6: 0}), LLMStatusCode.LLM_PARAM_INVALID),
                       (lambda: cm.swap_blocks(Cache(-1, desc(2, Placement.DEVICE), [4096, 8192], True), host,
                                               {0: 0}), LLMStatusCode.LLM_PARAM_INVALID)):  # not mapped: no crash
        with pytest.raises(LLMException) as caught:
            call()
        assert caught.value.status_code == code


def test_copy_cache_and_remap_registered_memory(engines: tuple[LLMDataDist, LLMDataDist]) -> None:
    cm = engines[1].cache_manager
    source, target = arrays(2), arrays(2, fill=0.0)
    src = cm.register_cache(desc(2), ptrs(source))
    dst = cm.allocate_cache(desc(2))
    cm.copy_cache(dst, src, dst_batch_index=4, src_batch_index=1, offset=8, size=16, req_id=7)
    for t in range(2):
        row = dst.tensors[t].view(np.float32).reshape(BLOCKS, ROW)[4]
        assert np.array_equal(row[2:6], source[t][1][2:6]) and not row[:2].any() and not row[6:].any()
    cm.copy_cache(dst, src)  # slot 0, whole
    assert np.array_equal(dst.tensors[0].view(np.float32).reshape(BLOCKS, ROW)[0], source[0][0])
    cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, src.tensor_addrs[0] + 16, 64))
    cm.remap_registered_memory([MemInfo(Memtype.MEM_TYPE_DEVICE, dst.tensor_addrs[1], 256)])
    for call in (lambda: cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_HOST, src.tensor_addrs[0], 1)),
                 lambda: cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 1)),
                 lambda: cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 1)),  # not registered
                 lambda: cm.remap_registered_memory("some val"),  # type: ignore[arg-type]
                 lambda: cm.copy_cache(dst, src, offset=BLOCKS * ROW * 4),
                 lambda: cm.copy_cache(dst, src, size=0)):
        with pytest.raises(LLMException) as caught:
            call()
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    cm.deallocate_cache(dst)
    with pytest.raises(LLMException) as caught:  # released: never touched again
        cm.copy_cache(dst, src)
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert target[0].sum() == 0
