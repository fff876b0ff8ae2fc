"""KvpushConnector's worker side with real kvpush engines and no vLLM: two ``WorkerSide``s in this process.

Each side registers a vLLM-like CPU KV cache (one buffer, one contiguous ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` view per layer) and is driven through the calls vLLM's hooks make
(begin_step = bind_connector_metadata, layer_saved = save_kv_layer, end_step = wait_for_save,
results = get_transfer_results). The decode's blocks must end up holding exactly the prefill's bytes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from peer import Peer

from kvpush import LLMStatusCode
from kvpush.integrations.vllm import core
from kvpush.integrations.vllm.core import FinishedSend, RecvSpec, SendStep, StepMeta
from kvpush.integrations.vllm.settings import ConnectorSettings, cache_desc
from kvpush.integrations.vllm.worker import WorkerSide

LAYERS, BLOCKS, HEADS, BLOCK, WIDTH = 2, 64, 2, 4, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def settings(role: str, kv_port: int, tp: int = 1, tp_rank: int = 0, kv_heads: int = HEADS,
             **extra: Any) -> ConnectorSettings:
    transfer = SimpleNamespace(kv_role=role, kv_port=kv_port, engine_id=f"test-{role}",
                               kv_connector_extra_config=extra)
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_index=0)
    cache = SimpleNamespace(block_size=BLOCK)
    model = SimpleNamespace(get_total_num_kv_heads=lambda: kv_heads, model="tiny")
    return ConnectorSettings(SimpleNamespace(kv_transfer_config=transfer, cache_config=cache, parallel_config=parallel,
                                             model_config=model), tp_rank)


class Side:
    def __init__(self, role: str, kv_port: int, tp: int = 1, tp_rank: int = 0, kv_heads: int = HEADS,
                 **extra: Any) -> None:
        local = max(1, kv_heads // tp)
        self.buffer = np.zeros((LAYERS, BLOCKS, local, BLOCK, WIDTH), np.float32)
        self.worker = WorkerSide(settings(role, kv_port, tp, tp_rank, kv_heads, **extra))
        self.worker.register(NAMES, [self.buffer[i] for i in range(LAYERS)])
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()
        self.load_errors: set[int] = set()

    def step(self, meta: StepMeta, compute: Callable[[int], None] | None = None) -> None:
        """One engine step: bind, the layers of the forward (``compute(layer)`` writes that layer's KV),
        wait_for_save, get_transfer_results."""
        self.worker.begin_step(meta)
        if compute is not None:
            for layer in range(LAYERS):
                compute(layer)
                self.worker.layer_saved(NAMES[layer])
        self.worker.end_step()
        self.collect()

    def collect(self) -> None:
        sending, recving, failed = self.worker.results()
        self.sending |= sending
        self.recving |= recving
        self.failed |= failed
        self.load_errors |= self.worker.take_load_errors()


def kv_value(block: int, layer: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(block * 100 + layer)
    return rng.standard_normal((HEADS, BLOCK, WIDTH)).astype(np.float32)


def compute_tokens(side: Side, blocks: list[int], start: int, end: int) -> Callable[[int], None]:
    """The prefill's forward for tokens [start, end): writes those slots of each layer's blocks."""
    def compute(layer: int) -> None:
        for token in range(start, end):
            index, slot = divmod(token, BLOCK)
            side.buffer[layer, blocks[index], :, slot, :] = kv_value(index, layer)[:, slot, :]
    return compute


def until(condition: Callable[[], bool], *sides: Side, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        for side in sides:
            side.step(StepMeta())  # an empty engine step: what a busy-stepping vLLM engine does
        time.sleep(0.002)


@pytest.fixture(params=["tcp", "cma"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Side, Side]]:
    port = free_port()
    prefill = Side("kv_producer", port, transport=request.param, ids_timeout_s=5, transfer_timeout_s=5)
    decode = Side("kv_consumer", port, transport=request.param, transfer_timeout_s=5, abort_grace_s=2)
    yield prefill, decode
    decode.worker.close()
    prefill.worker.close()


def recv_spec(prefill: Side, tid: str, dst: list[int], num_tokens: int, first: int = 0) -> RecvSpec:
    remote = prefill.worker.settings.local
    assert remote is not None
    return RecvSpec(f"d-{tid}", tid, remote, first, tuple(dst), num_tokens)


def assert_landed(prefill: Side, decode: Side, src: list[int], dst: list[int]) -> None:
    for layer in range(LAYERS):
        assert np.array_equal(decode.buffer[layer, dst], prefill.buffer[layer, src]), layer


def test_decode_first_chunked_prefill_pushes_each_layer_and_reports_after_landing(pair: tuple[Side, Side]) -> None:
    prefill, decode = pair
    src, dst, tokens = [3, 9, 10, 20], [40, 41, 7, 33], 14
    decode.step(StepMeta(recv=[recv_spec(prefill, "t1", dst, tokens)]))
    until(lambda: bool(prefill.worker.producer and prefill.worker.producer.state_of("t1")), prefill, decode)
    for start, end in ((0, 6), (6, 14)):  # two chunks; block 1 is split between them
        send = SendStep("p-t1", "t1", tuple(src), start, end, tokens)
        prefill.step(StepMeta(send=[send]), compute_tokens(prefill, src, start, end))
    assert not decode.recving
    prefill.step(StepMeta(send_finished=[FinishedSend("p-t1", "t1", True, True)]))
    until(lambda: "d-t1" in decode.recving and "p-t1" in prefill.sending, prefill, decode)
    assert not decode.failed and not decode.load_errors
    assert_landed(prefill, decode, src, dst)
    stats = prefill.worker.stats()
    assert stats["producer.pushes_pipelined"] == 2 and "producer.pushes_after_forward" not in stats
    if prefill.worker.settings.config.transport == "tcp":  # the prefill's own CPU copies: after each forward
        assert stats["producer.pushes_deferred"] == 2
    assert decode.worker.stats() == {"consumer.ids_sent": 1, "consumer.landed": 1}


def test_over_cma_vllms_thread_marks_each_layer_ready_and_the_decode_copies_it() -> None:
    """Once the decode said it reads the prefill (its answer to the link's first lease request), a pipelined
    push offers every layer when the forward starts, and vLLM's thread lets each go by marking it in the
    prefill's memory: the decode copies it, the prefill's event loop does not wake for it."""
    port = free_port()
    prefill = Side("kv_producer", port, transport="cma", ids_timeout_s=5, transfer_timeout_s=5)
    decode = Side("kv_consumer", port, transport="cma", transfer_timeout_s=5, abort_grace_s=2)
    try:
        for n, (src, dst) in enumerate((([1, 2], [10, 11]), ([3, 4, 5], [20, 21, 22]), ([6], [30]))):
            tid, tokens = f"t{n}", 4 * len(src)
            decode.step(StepMeta(recv=[recv_spec(prefill, tid, dst, tokens)]))
            until(lambda t=tid: bool(prefill.worker.producer and prefill.worker.producer.state_of(t)), prefill, decode)
            prefill.step(StepMeta(send=[SendStep(f"p-{tid}", tid, tuple(src), 0, tokens, tokens)]),
                         compute_tokens(prefill, src, 0, tokens))
            prefill.step(StepMeta(send_finished=[FinishedSend(f"p-{tid}", tid, True, True)]))
            until(lambda t=tid: f"d-{t}" in decode.recving and f"p-{t}" in prefill.sending, prefill, decode)
            assert_landed(prefill, decode, src, dst)
        stats = prefill.worker.stats()
        assert stats["producer.pushes_marked"] >= 2  # every push after the decode's answer
        assert stats["producer.pushes_marked"] + stats["producer.pushes_deferred"] == 3
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_over_tcp_to_this_host_no_layer_leaves_before_the_forward_is_over() -> None:
    """A vLLM forward keeps its cores busy, and over TCP to a decode on this host the prefill's kernel copies
    (and receives) every byte: a layer sent during the forward only slows it. The layers wait for
    ``wait_for_save``, then land exactly."""
    port = free_port()
    prefill = Side("kv_producer", port, transport="tcp", ids_timeout_s=5, transfer_timeout_s=5)
    decode = Side("kv_consumer", port, transport="tcp", transfer_timeout_s=5, abort_grace_s=2)
    try:
        src, dst, tokens = [5, 6], [30, 31], 8
        decode.step(StepMeta(recv=[recv_spec(prefill, "t1", dst, tokens)]))
        until(lambda: bool(prefill.worker.producer and prefill.worker.producer.state_of("t1")), prefill, decode)
        bridge = decode.worker.engine
        assert bridge is not None

        def received() -> dict[int, dict[str, Any]]:
            async def read() -> dict[int, dict[str, Any]]:
                return bridge.dd.link_stats()
            return bridge.thread.run(read(), timeout=5)  # type: ignore[no-any-return]
        prefill.worker.begin_step(StepMeta(send=[SendStep("p-t1", "t1", tuple(src), 0, tokens, tokens)]))
        compute = compute_tokens(prefill, src, 0, tokens)
        for layer in range(LAYERS):
            compute(layer)
            prefill.worker.layer_saved(NAMES[layer])
        time.sleep(0.2)  # room for a layer to leave, were it let go
        assert all(counters.get("bytes_received", 0) == 0 for counters in received().values())
        prefill.worker.end_step()
        prefill.step(StepMeta(send_finished=[FinishedSend("p-t1", "t1", True, True)]))
        until(lambda: "d-t1" in decode.recving and "p-t1" in prefill.sending, prefill, decode)
        assert_landed(prefill, decode, src, dst)
        assert prefill.worker.stats()["producer.pushes_deferred"] == 1
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_ids_after_the_forward_are_served_by_one_push_and_prefix_hits_are_skipped(pair: tuple[Side, Side]) -> None:
    prefill, decode = pair
    src, tokens = [5, 6, 7], 12
    prefill.step(StepMeta(send=[SendStep("p-t2", "t2", tuple(src), 0, tokens, tokens)]),
                 compute_tokens(prefill, src, 0, tokens))
    prefill.step(StepMeta(send_finished=[FinishedSend("p-t2", "t2", True, True)]))
    decode.buffer[:, 50] = prefill.buffer[:, 5]  # the decode's prefix cache already holds block 0
    decode.step(StepMeta(recv=[recv_spec(prefill, "t2", [51, 52], tokens, first=1)]))
    until(lambda: "d-t2" in decode.recving and "p-t2" in prefill.sending, prefill, decode)
    assert_landed(prefill, decode, src, [50, 51, 52])
    assert prefill.worker.stats()["producer.pushes_after_forward"] == 1
    assert prefill.worker.stats()["producer.blocks_pushed"] == 2
    assert prefill.worker.stats()["producer.bytes_pushed"] == 2 * prefill.buffer[:, 5].nbytes  # every layer of both


def test_an_empty_step_waits_for_the_landing_instead_of_returning_at_once() -> None:
    """vLLM takes empty steps back to back while a decode's requests wait for their KV. Such a step, with
    nothing to report yet, waits for the engine's news (here as long as it takes: ``idle_wait_ms`` is a
    minute) and reports the transfer that landed meanwhile; a step that computes never waits."""
    port = free_port()
    prefill = Side("kv_producer", port, transport="cma")
    decode = Side("kv_consumer", port, transport="cma", idle_wait_ms=60_000)
    try:
        src, dst, tokens = [1, 2], [31, 32], 8
        decode.step(StepMeta(recv=[recv_spec(prefill, "t9", dst, tokens)]))  # computes: returns at once
        until(lambda: bool(prefill.worker.producer and prefill.worker.producer.state_of("t9")), prefill)

        reported = threading.Event()

        def prefill_engine() -> None:  # its forward, then steps until the decode reported the landing
            time.sleep(0.2)  # the decode is waiting in its empty step by now
            prefill.step(StepMeta(send=[SendStep("p-t9", "t9", tuple(src), 0, tokens, tokens)]),
                         compute_tokens(prefill, src, 0, tokens))
            prefill.step(StepMeta(send_finished=[FinishedSend("p-t9", "t9", True, True)]))
            until(reported.is_set, prefill)

        engine = threading.Thread(target=prefill_engine)
        engine.start()
        decode.worker.begin_step(StepMeta(computes=False))
        try:
            _, recving, failed = decode.worker.results()  # one empty step
        finally:
            reported.set()
            engine.join()
        assert recving == {"d-t9"} and not failed
        assert_landed(prefill, decode, src, dst)
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_an_empty_step_of_a_prefill_holding_a_request_waits_for_its_block_ids() -> None:
    """A prefill holds a request until its decode's block ids came (``ids_wait_ms``); its empty steps meanwhile
    wait for them, so the step that sees them reports them to the scheduler."""
    port = free_port()
    prefill = Side("kv_producer", port, transport="cma", idle_wait_ms=60_000)
    decode = Side("kv_consumer", port, transport="cma")
    try:
        sender = threading.Timer(0.2, lambda: decode.step(StepMeta(recv=[recv_spec(prefill, "t10", [5], 8)])))
        sender.start()
        prefill.worker.begin_step(StepMeta(computes=False, holding=True))
        assert prefill.worker.results() == (set(), set(), set())
        sender.join()
        assert prefill.worker.take_ids_in() == ["t10"]
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_block_ids_that_come_during_the_forward_join_it(pair: tuple[Side, Side]) -> None:
    """No hold (issue 42): the prefill's forward starts before its decode's block ids came; they come after its
    first layer, the worker takes them at the next one, and the push goes with the forward: the first layer at
    once, the others as they are computed. Every byte lands."""
    prefill, decode = pair
    src, dst = [3, 4], [13, 14]
    compute = compute_tokens(prefill, src, 0, 8)
    prefill.worker.begin_step(StepMeta(send=[SendStep("p-t11", "t11", tuple(src), 0, 8, 8)]))
    compute(0)
    prefill.worker.layer_saved(NAMES[0])
    decode.step(StepMeta(recv=[recv_spec(prefill, "t11", dst, 8)]))
    deadline = time.monotonic() + 10
    while prefill.worker.events.empty():  # the ids reached the prefill's engine (mid-forward)
        assert time.monotonic() < deadline, "the decode's block ids did not come"
        time.sleep(0.005)
    for layer in range(1, LAYERS):
        compute(layer)
        prefill.worker.layer_saved(NAMES[layer])
    prefill.worker.end_step()
    prefill.collect()
    prefill.step(StepMeta(send_finished=[FinishedSend("p-t11", "t11", True, True)]))
    until(lambda: "d-t11" in decode.recving and "p-t11" in prefill.sending, prefill, decode)
    assert not decode.failed
    assert_landed(prefill, decode, src, dst)
    stats = prefill.worker.stats()
    assert stats.get("producer.pushes_pipelined") == 1 and not stats.get("producer.pushes_after_forward")


def test_a_prefill_that_dies_fails_the_decode_at_once_with_load_errors(pair: tuple[Side, Side]) -> None:
    prefill, decode = pair
    decode.step(StepMeta(recv=[recv_spec(prefill, "t3", [11, 12], 8)]))
    until(lambda: bool(prefill.worker.producer and prefill.worker.producer.state_of("t3")), prefill, decode)
    started = time.monotonic()
    prefill.worker.close()
    until(lambda: "d-t3" in decode.recving, decode)
    assert time.monotonic() - started < 3  # the closed link, not the 5 s deadline
    assert decode.failed == {"d-t3"} and decode.load_errors == {11, 12}


def test_a_decode_abort_stops_the_prefill_and_is_confirmed(pair: tuple[Side, Side]) -> None:
    prefill, decode = pair
    src = [1, 2]
    decode.step(StepMeta(recv=[recv_spec(prefill, "t4", [21, 22], 8)]))
    until(lambda: bool(prefill.worker.producer and prefill.worker.producer.state_of("t4")), prefill, decode)
    decode.step(StepMeta(recv_aborted=["d-t4"]))
    until(lambda: "d-t4" in decode.recving, prefill, decode)
    assert not decode.failed and not decode.load_errors  # released, not a failed load
    prefill.step(StepMeta(send=[SendStep("p-t4", "t4", tuple(src), 0, 8, 8)]), compute_tokens(prefill, src, 0, 8))
    prefill.step(StepMeta(send_finished=[FinishedSend("p-t4", "t4", True, True)]))
    until(lambda: "p-t4" in prefill.sending, prefill)
    assert not decode.buffer[:, [21, 22]].any()  # nothing was pushed after the abort
    assert "producer.blocks_pushed" not in prefill.worker.stats()


def test_a_prefill_that_never_gets_the_request_answers_and_the_decode_fails(pair: tuple[Side, Side]) -> None:
    prefill, decode = pair
    decode.step(StepMeta(recv=[recv_spec(prefill, "t5", [30], 3)]))
    until(lambda: "d-t5" in decode.recving, prefill, decode, timeout=15)  # after the prefill's 5 s
    assert decode.failed == {"d-t5"} and decode.load_errors == {30}


def test_many_concurrent_transfers_all_land(pair: tuple[Side, Side]) -> None:
    prefill, decode = pair
    requests = {f"c{i}": ([2 * i, 2 * i + 1], [40 + 2 * i, 41 + 2 * i]) for i in range(8)}
    decode.step(StepMeta(recv=[recv_spec(prefill, tid, dst, 8) for tid, (_, dst) in requests.items()]))
    sends = [SendStep(f"p-{tid}", tid, tuple(src), 0, 8, 8) for tid, (src, _) in requests.items()]

    def compute(layer: int) -> None:
        for _, (src, _) in requests.items():
            compute_tokens(prefill, src, 0, 8)(layer)
    until(lambda: len(prefill.worker.producer or ()) == 8, prefill, decode)
    prefill.step(StepMeta(send=sends), compute)
    prefill.step(StepMeta(send_finished=[FinishedSend(f"p-{tid}", tid, True, True) for tid in requests]))
    until(lambda: len(decode.recving) == 8 and len(prefill.sending) == 8, prefill, decode)
    assert not decode.failed
    for src, dst in requests.values():
        assert_landed(prefill, decode, src, dst)


def test_cache_desc_refuses_what_kvpush_cannot_move() -> None:
    views = [np.zeros((4, 2, 4, 8), np.float32) for _ in range(2)]
    assert cache_desc(NAMES, views).shape == (4, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="on cuda:0"):
        cache_desc(["l0"], [SimpleNamespace(device="cuda:0", shape=(4,), dtype="torch.float32")])
    with pytest.raises(NotImplementedError, match="one shape and dtype"):
        cache_desc(NAMES, [views[0], np.zeros((5, 2, 4, 8), np.float32)])
    with pytest.raises(NotImplementedError, match="not contiguous"):
        cache_desc(["l0"], [np.zeros((4, 8, 2), np.float32).transpose(0, 2, 1)])
    with pytest.raises(NotImplementedError, match="int32 is not supported"):
        cache_desc(["l0"], [np.zeros((4, 2), np.int32)])


def test_settings_follow_the_role_and_vllm_defaults() -> None:
    prefill = settings("kv_producer", 14579)
    assert prefill.listen == ("127.0.0.1", 14579) and prefill.cluster_id == core.derive_cluster_id("127.0.0.1", 14579)
    assert prefill.local == core.PeerAddress.of("127.0.0.1", 14579)
    decode = settings("kv_consumer", 14579)
    assert decode.listen is None and 1 << 48 <= decode.cluster_id < 1 << 62
    assert decode.bootstrap is None and prefill.bootstrap is None  # no bootstrap port: no /query served
    both = settings("kv_both", 15000, port=16000, cluster_id=7, host="::1")
    assert both.listen == ("::1", 16000) and both.cluster_id == 7 and both.produce and both.consume
    with pytest.raises(core.ParamsError, match="unknown key"):
        settings("kv_producer", 14579, bogus=1)
    def vllm(tp: int, pp: int = 1, **extra: Any) -> SimpleNamespace:
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role="kv_producer", kv_port=20000, engine_id="x",
                                                                  kv_connector_extra_config=extra),
                               cache_config=SimpleNamespace(block_size=16),
                               parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    # tensor parallelism: rank r listens on port + 2 r, with the cluster id of that address (or the set one + r)
    rank1 = ConnectorSettings(vllm(2), tp_rank=1)
    assert rank1.listen == ("127.0.0.1", 20002) and rank1.cluster_id == core.derive_cluster_id("127.0.0.1", 20002)
    assert ConnectorSettings(vllm(2, port=30000, cluster_id=7), tp_rank=1).listen[1:] == (30002,)  # type: ignore[index]
    assert ConnectorSettings(vllm(2, cluster_id=7), tp_rank=1).cluster_id == 8
    assert core.PeerAddress.of("127.0.0.1", 20000).of_rank(1) == core.PeerAddress.of("127.0.0.1", 20002)
    assert core.PeerAddress("127.0.0.1", 20000, 7).of_rank(1) == core.PeerAddress("127.0.0.1", 20002, 8)
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        ConnectorSettings(vllm(1, pp=2))


def test_ids_that_came_over_a_link_that_died_are_never_pushed_over_the_next_one(pair: tuple[Side, Side]) -> None:
    prefill, decode = pair
    assert prefill.worker.engine is not None and decode.worker.engine is not None
    peer = prefill.worker.settings.cluster_id
    decode.step(StepMeta(recv=[recv_spec(prefill, "t6a", [25], 4)]))  # makes the link
    until(lambda: bool(prefill.worker.producer and prefill.worker.producer.state_of("t6a")), prefill, decode)
    # the prefill's engine stalls; the decode's ids for t6 reach its socket, then the decode's link goes: the
    # decode reports t6 and t6a failed and vLLM may reuse their blocks at once
    prefill.worker.engine.thread.call_soon(time.sleep, 1.0)
    decode.step(StepMeta(recv=[recv_spec(prefill, "t6", [26, 27], 8)]))
    time.sleep(0.3)

    async def close_link() -> None:
        decode.worker.engine.dd.links[peer].close("the test cut it")  # type: ignore[union-attr]
    decode.worker.engine.thread.run(close_link(), timeout=5)
    until(lambda: {"d-t6", "d-t6a"} <= decode.recving, decode)
    assert decode.failed == {"d-t6", "d-t6a"}
    # a new transfer links again; then the prefill runs t6's request: nothing of it may land
    src6, src7 = [1, 2], [3, 4]
    decode.step(StepMeta(recv=[recv_spec(prefill, "t7", [30, 31], 8)]))
    until(lambda: bool(prefill.worker.producer and prefill.worker.producer.state_of("t7")), prefill, decode)
    sends = [SendStep("p-t6", "t6", tuple(src6), 0, 8, 8), SendStep("p-t7", "t7", tuple(src7), 0, 8, 8)]

    def compute(layer: int) -> None:
        compute_tokens(prefill, src6, 0, 8)(layer)
        compute_tokens(prefill, src7, 0, 8)(layer)
    prefill.step(StepMeta(send=sends), compute)
    prefill.step(StepMeta(send_finished=[FinishedSend("p-t6", "t6", True, True),
                                         FinishedSend("p-t7", "t7", True, True)]))
    until(lambda: "d-t7" in decode.recving and {"p-t6", "p-t7"} <= prefill.sending, prefill, decode)
    assert "d-t7" not in decode.failed
    assert_landed(prefill, decode, src7, [30, 31])
    assert not decode.buffer[:, [25, 26, 27]].any()  # t6a and t6: nothing pushed after the link died


def test_a_stranger_linked_to_either_side_reads_nothing_and_writes_nowhere(tmp_path: Any) -> None:
    """A third kvpush engine (another process) that links to the prefill and to a listening decode: the
    prefill's KV is neither listed nor readable, and the decode's blocks refuse it even while they are
    open to the prefill for a transfer, under the exact block ids that transfer uses."""
    port, decode_port = free_port(), free_port()
    prefill = Side("kv_producer", port, transport="tcp", ids_timeout_s=5, transfer_timeout_s=5)
    decode = Side("kv_consumer", port, transport="tcp", port=decode_port, transfer_timeout_s=5)
    try:
        prefill.buffer[:] = 7.0
        dst = [40, 41]
        decode.step(StepMeta(recv=[recv_spec(prefill, "t8", dst, 8)]))  # open to the prefill from now on
        until(lambda: bool(prefill.worker.producer and prefill.worker.producer.state_of("t8")), prefill, decode)
        assert decode.worker.engine is not None
        decode_id = decode.worker.settings.cluster_id
        with Peer(99, options={"llm.listenIpInfo": "127.0.0.1:0", "kvpush.transport": "tcp"}) as stranger:
            # the decode's geometry as its cache table shows it: one kvpush block per (vLLM block, KV head)
            stranger.call("allocate", name="kv", num_tensors=LAYERS, shape=[BLOCKS * HEADS, BLOCK * WIDTH],
                          dtype=0, model_id=0, seed=3)
            for cluster, at in ((prefill.worker.settings.cluster_id, port), (decode_id, decode_port)):
                assert stranger.call("link", cluster_id=cluster, port=at)["status"] == 0
            not_exist = int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
            pulled = stranger.call("try_pull", name="kv", cluster_id=prefill.worker.settings.cluster_id,
                                   src_blocks=[1, 2], dst_blocks=[1, 2])
            assert pulled["status"] == not_exist
            pushed = stranger.call("try_push", name="kv", cluster_id=prefill.worker.settings.cluster_id,
                                   src_blocks=[1], dst_blocks=[1])
            assert pushed["status"] == not_exist
            heads_of_dst = [block * HEADS + head for block in dst for head in range(HEADS)]
            pushed = stranger.call("try_push", name="kv", cluster_id=decode_id, src_blocks=[1, 2, 3, 4],
                                   dst_blocks=heads_of_dst)
            assert pushed["status"] == int(LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        assert not decode.buffer[:, dst].any() and (prefill.buffer == 7.0).all()
    finally:
        decode.worker.close()
        prefill.worker.close()



def test_a_listener_other_hosts_reach_needs_a_token_or_an_explicit_opt_out(monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("KVPUSH_AUTH_TOKEN", raising=False)
    for host in ("0.0.0.0", "10.1.2.3", "::", "prefill.example"):
        with pytest.raises(core.ParamsError, match="KVPUSH_AUTH_TOKEN") as refused:
            settings("kv_producer", 14579, host=host)
        assert host in str(refused.value) and '"insecure": true' in str(refused.value)
    assert settings("kv_producer", 14579).listen == ("127.0.0.1", 14579)  # loopback: nothing to configure
    assert settings("kv_consumer", 14579, host="::1", port=15000).auth_token is None
    assert settings("kv_producer", 14579, host="0.0.0.0", auth_token="s").auth_token == "s"
    monkeypatch.setenv("KVPUSH_AUTH_TOKEN", "from-env")
    with_env = settings("kv_producer", 14579, host="0.0.0.0")
    assert with_env.auth_token == "from-env" and not with_env.insecure_listener
    assert with_env.config.engine_options_for(with_env.listen, with_env.auth_token)["kvpush.auth_token"] == "from-env"
    monkeypatch.delenv("KVPUSH_AUTH_TOKEN")
    opted_out = settings("kv_producer", free_port(), host="0.0.0.0", insecure=True)
    assert opted_out.insecure_listener
    with pytest.raises(core.ParamsError, match="true or false"):
        settings("kv_producer", 14579, insecure="yes")
    # the opt-out is logged at every start
    worker = WorkerSide(opted_out)
    buffer = np.zeros((LAYERS, BLOCKS, HEADS, BLOCK, WIDTH), np.float32)
    try:
        worker.register(NAMES, [buffer[i] for i in range(LAYERS)])
    finally:
        worker.close()
    assert any("insecure" in record.getMessage() and record.levelname == "WARNING" for record in caplog.records)


@pytest.mark.parametrize("transport", ["tcp", "cma"])
@pytest.mark.parametrize("kv_heads, p_tp, d_tp", [(2, 2, 1), (2, 1, 2), (2, 2, 2), (2, 4, 1), (4, 2, 4)])
def test_tensor_parallel_ranks_push_every_head_of_every_block_exactly_where_it_belongs(
        transport: str, kv_heads: int, p_tp: int, d_tp: int) -> None:
    """Each rank is its own worker and engine holding its share of the KV heads (replicated when the model
    has fewer heads than ranks); every decode rank must end with exactly its heads of the prefill's blocks."""
    from kvpush.integrations.vllm.core import Sharding

    port = free_port()
    prefill_sharding, decode_sharding = Sharding(kv_heads, p_tp), Sharding(kv_heads, d_tp)
    prefills = [Side("kv_producer", port, p_tp, r, kv_heads, transport=transport, ids_timeout_s=5,
                     transfer_timeout_s=5) for r in range(p_tp)]
    decodes = [Side("kv_consumer", port, d_tp, r, kv_heads, transport=transport, transfer_timeout_s=5)
               for r in range(d_tp)]
    sides = prefills + decodes
    try:
        src, dst, tokens = [3, 9, 10], [40, 7, 33], 10  # block 2 holds 2 of its 4 slots

        def value(block_index: int, layer: int, head: int) -> np.ndarray[Any, Any]:
            rng = np.random.default_rng(block_index * 100 + layer * 10 + head)
            return rng.standard_normal((BLOCK, WIDTH)).astype(np.float32)

        def compute(side: Side, rank: int) -> Callable[[int], None]:
            def write(layer: int) -> None:
                for token in range(tokens):
                    index, slot = divmod(token, BLOCK)
                    for local, head in enumerate(prefill_sharding.heads(rank)):
                        side.buffer[layer, src[index], local, slot, :] = value(index, layer, head)[slot]
            return write

        remote = prefills[0].worker.settings.local
        assert remote is not None
        for decode in decodes:
            decode.step(StepMeta(recv=[RecvSpec("d-tp", "tp", remote, 0, tuple(dst), tokens)]))
        for rank, prefill in enumerate(prefills):
            prefill.step(StepMeta(send=[SendStep("p-tp", "tp", tuple(src), 0, tokens, tokens)]),
                         compute(prefill, rank))
            prefill.step(StepMeta(send_finished=[FinishedSend("p-tp", "tp", True, True)]))
        until(lambda: all("d-tp" in d.recving for d in decodes) and all("p-tp" in p.sending for p in prefills),
              *sides, timeout=20)
        for rank, decode in enumerate(decodes):
            assert not decode.failed and not decode.load_errors, (rank, decode.failed)
            for index, block in enumerate(dst):
                for local, head in enumerate(decode_sharding.heads(rank)):
                    for layer in range(LAYERS):
                        got = decode.buffer[layer, block, local]
                        used = min(BLOCK, tokens - index * BLOCK)
                        assert np.array_equal(got[:used], value(index, layer, head)[:used]), (rank, index, head, layer)
            untouched = np.delete(decode.buffer, dst, axis=1)
            assert not untouched.any()
        pushed = sum(p.worker.stats().get("producer.blocks_pushed", 0) for p in prefills)
        legs = core.plan_legs(prefill_sharding, decode_sharding)
        assert pushed == len(legs) * len(dst)  # each leg pushed the request's blocks once: no head twice
    finally:
        for side in reversed(sides):
            side.worker.close()


def test_an_incompatible_pair_is_refused_at_link_time_naming_both_values(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    prefill = Side("kv_producer", port, 1, 0, 2, transport="tcp")  # 2 KV heads
    decode = Side("kv_consumer", port, 2, 0, 4, transport="tcp", transfer_timeout_s=5)  # 4 over 2 ranks: 2 per block
    try:
        started = time.monotonic()
        decode.step(StepMeta(recv=[recv_spec(prefill, "t9", [5, 6], 8)]))
        until(lambda: "d-t9" in decode.recving, prefill, decode)
        assert time.monotonic() - started < 3  # refused at once, not at a deadline
        assert decode.failed == {"d-t9"} and decode.load_errors == {5, 6} and not decode.buffer.any()
        refusals = [r.getMessage() for r in caplog.records if "KV heads: prefill 2, decode 4" in r.getMessage()]
        assert any("refused to send KV" in text for text in refusals), refusals  # the prefill's log
        assert any("cannot send KV to this decode" in text for text in refusals), refusals  # the decode's
        assert prefill.worker.engine is not None and not prefill.worker.engine.dd.links  # unlinked
    finally:
        decode.worker.close()
        prefill.worker.close()
