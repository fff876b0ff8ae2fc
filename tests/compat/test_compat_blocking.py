"""kvpush.compat.llm_datadist: LLM-DataDist's blocking API over the async engine.

Real engines and real sockets: the peer is an async kvpush engine in another process (``peer.Peer``);
the side under test is the blocking facade in this process, called from plain threads.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from peer import Peer

import kvpush
from kvpush.compat import llm_datadist as compat
from kvpush.compat.llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

TENSORS, BLOCKS, ROW = 4, 16, 256  # 2 layers of K, V; int32 rows: 1 KiB blocks
PEER_BLOCKS = 32
DESC = CacheDesc(TENSORS, [BLOCKS, ROW], DataType.DT_INT32, Placement.HOST)  # LLM-DataDist's default is DEVICE


def arrays(seed: int | None) -> list[np.ndarray[Any, Any]]:
    """Tensors the test owns: distinct values per tensor and block (zeros when seed is None)."""
    if seed is None:
        return [np.zeros((BLOCKS, ROW), np.int32) for _ in range(TENSORS)]
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 2**31 - 1, (BLOCKS, ROW), dtype=np.int32) for _ in range(TENSORS)]


def data_ptrs(tensors: list[np.ndarray[Any, Any]]) -> list[int]:
    """Raw int addresses, exactly what LLM-DataDist samples pass (``int(tensor.data_ptr())``)."""
    return [int(tensor.ctypes.data) for tensor in tensors]


def cluster(cluster_id: int, port: int | None = None) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    if port is not None:
        info.append_remote_ip_info("127.0.0.1", port)
    return info


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def in_thread(function: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Run ``function`` on a plain (non-main, loop-free) thread; return its result or raise its error."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["result"] = function()
        except BaseException as error:  # handed back to the test thread
            outcome["error"] = error

    worker = threading.Thread(target=body)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), "a blocking call did not return"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


@pytest.fixture
def decode_peer() -> Iterator[Peer]:
    """An async engine (cluster 2) in another process with a blocks cache, model_id 0, of PEER_BLOCKS blocks."""
    # keepalive (1 s by default) must not end the link while a test keeps the peer stopped for longer
    with Peer(2, options={"llm.listenIpInfo": "127.0.0.1:0", "kvpush.keepalive_timeout_ms": "10000"}) as peer:
        peer.call("allocate", name="kv", num_tensors=TENSORS, shape=[PEER_BLOCKS, ROW], dtype=int(DataType.DT_INT32),
                  model_id=0)
        yield peer


@pytest.fixture
def engines() -> Iterator[Callable[..., LLMDataDist]]:
    """``engines(cluster_id, options)``: initialised blocking engines, all finalized afterwards."""
    made: list[LLMDataDist] = []

    def make(cluster_id: int = 1, options: Any = None, role: LLMRole = LLMRole.PROMPT) -> LLMDataDist:
        engine = LLMDataDist(role, cluster_id)
        engine.init({} if options is None else options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.finalize()


def compat_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("kvpush-compat-")]


def no_compat_thread_left(seconds: float = 5.0) -> bool:
    """True once no loop thread of the facade runs (a crashed one may still be cleaning up)."""
    deadline = time.monotonic() + seconds
    while compat_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return compat_threads() == []


# -- the happy path, two processes ---------------------------------------------------------------------
def test_push_and_pull_blocking_from_plain_threads_with_raw_addresses(
        decode_peer: Peer, engines: Callable[..., LLMDataDist], tmp_path: Any) -> None:
    source, returned = arrays(seed=5), arrays(seed=None)
    engine = engines(1)
    cache_manager = engine.cache_manager
    cache = cache_manager.register_blocks_cache(DESC, data_ptrs(source), BlocksCacheKey(1, 0))
    assert cache.tensor_addrs == data_ptrs(source) and cache.is_blocks_cache and cache.cache_id == 1
    back = cache_manager.register_blocks_cache(DESC, data_ptrs(returned), BlocksCacheKey(1, 1))

    status, codes = in_thread(lambda: engine.link_clusters([cluster(2, decode_peer.port)], timeout=5000))
    assert status == LLMStatusCode.LLM_SUCCESS and codes == [LLMStatusCode.LLM_SUCCESS]
    src_blocks, dst_blocks = [0, 1, 2, 3], [9, 3, 20, 21]
    assert in_thread(lambda: cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, src_blocks, dst_blocks)) is None

    snapshot = decode_peer.snapshot("kv", tmp_path)  # the peer's memory, as bytes: [tensor, block, byte]
    for index, tensor in enumerate(source):
        assert np.array_equal(snapshot[index][dst_blocks], tensor.view(np.uint8)[src_blocks])
    untouched = [b for b in range(PEER_BLOCKS) if b not in dst_blocks]
    assert not snapshot[:, untouched].any()

    in_thread(lambda: cache_manager.pull_blocks(BlocksCacheKey(2, 0), back, src_blocks=dst_blocks,
                                                dst_blocks=[4, 5, 6, 7]))
    for index in range(TENSORS):
        assert np.array_equal(returned[index][4:8], source[index][src_blocks])
        assert not returned[index][:4].any() and not returned[index][8:].any()


def test_many_threads_push_through_one_instance_at_once(
        decode_peer: Peer, engines: Callable[..., LLMDataDist], tmp_path: Any) -> None:
    source = arrays(seed=9)
    engine = engines(1)
    cache = engine.cache_manager.register_blocks_cache(DESC, data_ptrs(source), BlocksCacheKey(1, 0))
    assert engine.link_clusters([cluster(2, decode_peer.port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
    plan = [([2 * i, 2 * i + 1], [30 - 2 * i, 31 - 2 * i]) for i in range(6)]
    start = threading.Barrier(len(plan))
    errors: list[BaseException] = []

    def push(src: list[int], dst: list[int]) -> None:
        try:
            start.wait(10)
            engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, src, dst)
        except BaseException as error:
            errors.append(error)

    workers = [threading.Thread(target=push, args=pair) for pair in plan]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert not any(worker.is_alive() for worker in workers) and errors == []
    snapshot = decode_peer.snapshot("kv", tmp_path)
    for src, dst in plan:
        for index, tensor in enumerate(source):
            assert np.array_equal(snapshot[index][dst], tensor.view(np.uint8)[src])


# -- no blocking inside an event loop ------------------------------------------------------------------
async def test_blocking_calls_inside_a_running_event_loop_raise_and_point_to_the_async_api() -> None:
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(RuntimeError) as caught:
        engine.init({})
    message = str(caught.value)
    assert "init()" in message and "running asyncio event loop" in message
    assert "from kvpush import LLMDataDist" in message and "await" in message
    assert compat_threads() == []  # refused before anything started

    await asyncio.to_thread(engine.init, {})  # a worker thread has no running loop: fine
    try:
        cache_manager = engine.cache_manager
        tensors = arrays(seed=None)
        for call in (lambda: engine.link_clusters([cluster(2, 1)], 1000),
                     lambda: engine.unlink_clusters([cluster(2)]),
                     lambda: engine.switch_role(LLMRole.DECODER),
                     lambda: cache_manager.register_blocks_cache(DESC, data_ptrs(tensors)),
                     lambda: cache_manager.push_blocks(BlocksCacheKey(2, 0), None, [0], [0]),  # type: ignore[arg-type]
                     engine.finalize):
            with pytest.raises(RuntimeError, match="kvpush import LLMDataDist"):
                call()
        # nothing reached the engine: the first registration still gets cache id 1
        cache = await asyncio.to_thread(cache_manager.register_blocks_cache, DESC, data_ptrs(tensors))
        assert cache.cache_id == 1 and engine.role == LLMRole.PROMPT
    finally:
        await asyncio.to_thread(engine.finalize)
    assert compat_threads() == []


# -- sync_kv_timeout -----------------------------------------------------------------------------------
def test_sync_kv_timeout_bounds_a_blocking_push_and_the_link_survives(decode_peer: Peer) -> None:
    config = LLMConfig()
    config.sync_kv_timeout = 400
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    engine.init(config.generate_options())
    try:
        source = arrays(seed=3)
        cache = engine.cache_manager.register_blocks_cache(DESC, data_ptrs(source), BlocksCacheKey(1, 0))
        assert engine.link_clusters([cluster(2, decode_peer.port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        decode_peer.signal(signal.SIGSTOP)  # alive for the kernel, silent for kvpush
        try:
            start = time.monotonic()
            with pytest.raises(LLMException) as caught:
                engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, [0, 1], [0, 1])
            elapsed = time.monotonic() - start
        finally:
            decode_peer.signal(signal.SIGCONT)
        assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert isinstance(caught.value.completed_layers, list)
        assert 0.38 <= elapsed < 3.0, elapsed
        engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, [2, 3], [4, 5])  # the link is still usable
    finally:
        engine.finalize()


def test_a_blocking_call_waits_as_long_as_sync_kv_timeout_allows(decode_peer: Peer,
                                                                 engines: Callable[..., LLMDataDist],
                                                                 tmp_path: Any) -> None:
    """No shorter deadline of the facade's own: a peer silent for 1.2 s, inside a 4 s timeout, is waited for."""
    source = arrays(seed=4)
    engine = engines(1, {"llm.SyncKvCacheWaitTime": "4000", "kvpush.keepalive_timeout_ms": "10000"})
    cache = engine.cache_manager.register_blocks_cache(DESC, data_ptrs(source), BlocksCacheKey(1, 0))
    assert engine.link_clusters([cluster(2, decode_peer.port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
    decode_peer.signal(signal.SIGSTOP)
    resume = threading.Timer(1.2, decode_peer.signal, (signal.SIGCONT,))
    resume.start()
    try:
        start = time.monotonic()
        engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, [0, 1], [10, 11])
        elapsed = time.monotonic() - start
    finally:
        resume.join()
        decode_peer.signal(signal.SIGCONT)
    assert elapsed >= 1.1, elapsed
    snapshot = decode_peer.snapshot("kv", tmp_path)
    assert np.array_equal(snapshot[0][[10, 11]], source[0].view(np.uint8)[[0, 1]])


# -- errors: the same classes and codes as the async engine ---------------------------------------------
def test_errors_before_init_after_finalize_and_at_init() -> None:
    with pytest.raises(TypeError):
        LLMDataDist("prompt", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, 2**64)
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(RuntimeError, match="init"):
        engine.cache_manager  # noqa: B018
    with pytest.raises(RuntimeError, match="init"):
        engine.link_clusters([cluster(2, 1)])
    with pytest.raises(LLMException) as caught:
        engine.init({"llm.SyncKvCacheWaitTim": "100"})
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "llm.SyncKvCacheWaitTim" in str(caught.value)
    assert compat_threads() == []  # a failed init leaves no thread behind
    engine.init({})  # and may be retried
    engine.init({"llm.listenIpInfo": "127.0.0.1:0"})  # a second init is a no-op
    assert engine.listen_address is None
    assert [thread.name for thread in compat_threads()] == ["kvpush-compat-1"]
    engine.finalize()
    engine.finalize()  # idempotent
    assert compat_threads() == []
    for call in (lambda: engine.cache_manager, lambda: engine.link_clusters([cluster(2, 1)]),
                 lambda: engine.init({})):
        with pytest.raises(LLMException) as finalized:
            call()
        assert finalized.value.status_code == LLMStatusCode.LLM_ENGINE_FINALIZED


def test_link_failures_are_returned_not_raised(engines: Callable[..., LLMDataDist]) -> None:
    engine = engines(1)
    status, codes = engine.link_clusters([cluster(2, free_port())], timeout=2000)
    assert status == LLMStatusCode.LLM_LINK_FAILED and codes == [LLMStatusCode.LLM_LINK_FAILED]
    with pytest.raises(LLMException) as caught:
        engine.link_clusters([cluster(2, free_port())], timeout=0)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        engine.link_clusters(cluster(2, 1))  # type: ignore[arg-type]
    assert engine.unlink_clusters([cluster(7)]) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
    with pytest.raises(TypeError):
        engine.switch_role(LLMRole.DECODER, {}, switch_options={})


def _mistakes(zeros: list[np.ndarray[Any, Any]]) -> dict[str, tuple[Callable[[Any], Any], bool]]:
    """Wrong calls, each as f(cache_manager-like, cache) -> result; True when it is a transfer (awaited)."""
    bad_desc = CacheDesc(TENSORS, [BLOCKS, ROW], DataType.DT_INT32, Placement.HOST)
    return {
        "zero address": (lambda cm, cache: cm.register_blocks_cache(bad_desc, [0] * TENSORS), False),
        "bool address": (lambda cm, cache: cm.register_blocks_cache(bad_desc, [True] * TENSORS), False),
        "negative address": (lambda cm, cache: cm.register_blocks_cache(bad_desc, [-1] * TENSORS), False),
        "too few addresses": (lambda cm, cache: cm.register_blocks_cache(bad_desc, data_ptrs(zeros)[:2]), False),
        "same model_id twice": (lambda cm, cache: cm.register_blocks_cache(
            bad_desc, data_ptrs(zeros), BlocksCacheKey(1, 0)), False),
        "unknown cache id": (lambda cm, cache: cm.unregister_cache(999), False),
        "not linked": (lambda cm, cache: cm.push_blocks(BlocksCacheKey(2, 0), cache, [0], [0]), True),
        "blocks not a list": (lambda cm, cache: cm.push_blocks(BlocksCacheKey(2, 0), cache, "ab", [0]), True),
        "negative block": (lambda cm, cache: cm.pull_blocks(BlocksCacheKey(2, 0), cache, [-1], [0]), True),
        "tensor_num_per_layer 0": (lambda cm, cache: cm.push_blocks(
            BlocksCacheKey(2, 0), cache, [0], [0], tensor_num_per_layer=0), True),
        "empty dst_blocks": (lambda cm, cache: cm.push_blocks(BlocksCacheKey(2, 0), cache, [], []), True),
        "local copy past the end": (lambda cm, cache: cm.copy_blocks(cache, {0: [BLOCKS]}), True),
        "kv form not linked": (lambda cm, cache: cm.push_kv_blocks(
            cache, CacheKeyByIdAndIndex(2, 1), [0], [0], KvCacheExtParam()), True),
        "kv form bad range": (lambda cm, cache: cm.pull_kv_blocks(
            CacheKeyByIdAndIndex(2, 1), cache, [0], [0], KvCacheExtParam((1, 0), (1, 0), 2)), True),
    }


def _outcome(run: Callable[[], Any]) -> tuple[str, Any]:
    try:
        result = run()
    except LLMException as error:
        return "LLMException", error.status_code
    except (TypeError, ValueError, RuntimeError) as error:
        return type(error).__name__, None
    return "returned", result


def test_mistakes_raise_exactly_what_the_async_engine_raises(engines: Callable[..., LLMDataDist]) -> None:
    own = arrays(seed=1)
    zeros = arrays(seed=None)
    engine = engines(1)
    blocking_cache = engine.cache_manager.register_blocks_cache(DESC, data_ptrs(own), BlocksCacheKey(1, 0))
    blocking = {name: _outcome(lambda call=call: call(engine.cache_manager, blocking_cache))
                for name, (call, _) in _mistakes(zeros).items()}

    async def async_outcomes() -> dict[str, tuple[str, Any]]:
        async with kvpush.LLMDataDist(LLMRole.PROMPT, 1) as reference:
            cm = reference.cache_manager
            cache = cm.register_blocks_cache(DESC, data_ptrs(arrays(seed=1)), BlocksCacheKey(1, 0))
            results = {}
            for name, (call, awaited) in _mistakes(arrays(seed=None)).items():
                async def run(call: Callable[[Any], Any] = call, awaited: bool = awaited) -> Any:
                    result = call(cm, cache)
                    return await result if awaited else result
                try:
                    results[name] = ("returned", await run())
                except LLMException as error:
                    results[name] = ("LLMException", error.status_code)
                except (TypeError, ValueError, RuntimeError) as error:
                    results[name] = (type(error).__name__, None)
            return results

    expected = asyncio.run(async_outcomes())
    assert blocking == expected
    # and they are the documented ones
    assert blocking["zero address"] == ("LLMException", LLMStatusCode.LLM_PARAM_INVALID)
    assert blocking["bool address"] == ("TypeError", None)
    assert blocking["negative address"] == ("ValueError", None)
    assert blocking["not linked"] == ("LLMException", LLMStatusCode.LLM_NOT_YET_LINK)
    assert blocking["unknown cache id"] == ("LLMException", LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    assert blocking["kv form not linked"] == ("returned", LLMStatusCode.LLM_NOT_YET_LINK)
    assert blocking["kv form bad range"] == ("returned", LLMStatusCode.LLM_PARAM_INVALID)


# -- LLMConfig ------------------------------------------------------------------------------------------
def test_llmconfig_fields_generate_llm_datadist_option_keys_and_take_effect(caplog: pytest.LogCaptureFixture) -> None:
    assert compat.LlmConfig is LLMConfig
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = "127.0.0.1:0"
    config.sync_kv_timeout = 1500
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.local_comm_res = ""
    config.mem_pool_cfg = '{"memory_size": 1073741824}'
    config.host_mem_pool_cfg = '{"memory_size": 1073741824}'
    config.link_total_time = 10000
    config.link_retry_count = 2
    config.rdma_traffic_class = 132
    config.rdma_service_level = 4
    options = config.generate_options()
    assert options == {  # exactly what llm_datadist's LlmConfig.generate_options() emits for these fields
        "ge.exec.deviceId": "0", "ge.session_device_id": "0", "llm.listenIpInfo": "127.0.0.1:0",
        "llm.SyncKvCacheWaitTime": "1500", "llm.MemoryUtilization": "0.95",
        "llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1", "llm.LocalCommRes": "",
        "llm.MemPoolConfig": '{"memory_size": 1073741824}', "llm.HostMemPoolConfig": '{"memory_size": 1073741824}',
        "llm.LinkTotalTime": "10000", "llm.LinkRetryCount": "2", "llm.RdmaTrafficClass": "132",
        "llm.RdmaServiceLevel": "4",
    }
    with pytest.raises(AttributeError):
        config.sync_kv_timeout_ms = 5  # type: ignore[attr-defined]

    engine = LLMDataDist(LLMRole.DECODER, 3)
    with caplog.at_level(logging.DEBUG, logger="kvpush.options"):
        engine.init(options)
    try:
        address = engine.listen_address
        assert address is not None and address[0] == "127.0.0.1" and address[1] > 0  # listen_ip_info took effect
        assert engine.engine.options.sync_kv_timeout_ms == 1500 and engine.engine.options.link_retry_count == 2
        noted = caplog.text
        for hardware_only in ("ge.exec.deviceId", "llm.LocalCommRes", "llm.MemPoolConfig", "llm.RdmaTrafficClass"):
            assert hardware_only in noted
    finally:
        engine.finalize()

    direct = LLMDataDist(LLMRole.PROMPT, 4)
    direct.init(config)  # the LLMConfig itself is accepted too
    direct.finalize()


# -- the loop thread ------------------------------------------------------------------------------------
def test_a_dead_loop_thread_fails_calls_instead_of_hanging(engines: Callable[..., LLMDataDist]) -> None:
    engine = engines(1)
    with socket.socket() as silent:  # accepts connections (backlog) but never speaks: a handshake waits
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        result: dict[str, Any] = {}

        def link() -> None:
            try:
                result["value"] = engine.link_clusters([cluster(2, silent.getsockname()[1])], timeout=20000)
            except BaseException as error:
                result["error"] = error

        worker = threading.Thread(target=link)
        worker.start()
        time.sleep(0.3)

        def die() -> None:
            raise SystemExit("simulated crash of the loop thread")

        engine.runner("crash").portal.call_soon(die)  # the only way to kill the private loop thread
        started = time.monotonic()
        worker.join(10)
        assert not worker.is_alive()
        assert time.monotonic() - started < 5
    assert isinstance(result.get("error"), RuntimeError) and "event loop" in str(result["error"])
    with pytest.raises(RuntimeError, match="event loop"):
        engine.cache_manager.register_blocks_cache(DESC, data_ptrs(arrays(seed=None)))
    assert no_compat_thread_left()


def test_finalize_ends_transfers_other_threads_are_waiting_for(decode_peer: Peer) -> None:
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    engine.init({"llm.SyncKvCacheWaitTime": "20000"})
    source = arrays(seed=8)
    cache = engine.cache_manager.register_blocks_cache(DESC, data_ptrs(source), BlocksCacheKey(1, 0))
    assert engine.link_clusters([cluster(2, decode_peer.port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
    decode_peer.signal(signal.SIGSTOP)
    outcome: dict[str, Any] = {}

    def push() -> None:
        try:
            engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, [0], [0])
        except BaseException as error:
            outcome["error"] = error
            outcome["at"] = time.monotonic()

    worker = threading.Thread(target=push)
    try:
        worker.start()
        time.sleep(0.3)
        started = time.monotonic()
        engine.finalize()
        worker.join(10)
    finally:
        decode_peer.signal(signal.SIGCONT)
    assert not worker.is_alive()
    assert isinstance(outcome.get("error"), LLMException), outcome
    assert outcome["at"] - started < 5  # promptly, not after the 20 s sync_kv_timeout
    assert compat_threads() == []


_INTERRUPTED = textwrap.dedent("""
    import sys, time
    import numpy as np
    from kvpush.compat.llm_datadist import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMDataDist,
                                            LLMRole, Placement)
    port = int(sys.argv[1])
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    engine.init({"llm.SyncKvCacheWaitTime": "10000"})  # only Ctrl-C ends the push in time
    tensors = [np.ones((16, 256), np.int32) for _ in range(4)]
    cache = engine.cache_manager.register_blocks_cache(CacheDesc(4, [16, 256], DataType.DT_INT32, Placement.HOST),
                                                       [int(t.ctypes.data) for t in tensors], BlocksCacheKey(1, 0))
    info = LLMClusterInfo()
    info.remote_cluster_id = 2
    info.append_remote_ip_info("127.0.0.1", port)
    assert engine.link_clusters([info], 5000)[0] == 0
    print("linked", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    try:
        engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, [0, 1, 2, 3], [0, 1, 2, 3])
        print("push returned", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted after {time.monotonic() - start:.3f}", flush=True)
    engine.finalize()
    print("finalized", flush=True)
""")


def test_ctrl_c_during_a_blocking_push_cancels_it_and_returns(decode_peer: Peer) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, str(decode_peer.port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "linked"
        decode_peer.signal(signal.SIGSTOP)  # the push cannot finish
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(0.4)
        interrupted_at = time.monotonic()
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=15)
        elapsed = time.monotonic() - interrupted_at
    finally:
        decode_peer.signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = output.split()
    assert proc.returncode == 0 and "interrupted" in lines and "finalized" in lines, output
    assert elapsed < 8, elapsed  # cancelled and cleaned up well before sync_kv_timeout (10 s), then returned
