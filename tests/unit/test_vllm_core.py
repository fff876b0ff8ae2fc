"""kvpush.integrations.vllm.core: the vLLM connector's bookkeeping, without vLLM, torch or sockets.

The books run against a fake clock and fake effects that record what the engine was asked to do.
A simulated prefill/decode pair (``World``) moves real numbers through the books' pushes, so the
property tests check the bytes the decode ends up with, under any interleaving of steps, messages
and completions that hypothesis finds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.integrations.vllm import core
from kvpush.integrations.vllm.core import (
    Abort,
    BlockIds,
    ConnectorConfig,
    ConsumerBook,
    ConsumerState,
    Done,
    FinishedSend,
    Hello,
    LegInfo,
    MessageError,
    Outcome,
    ParamsError,
    PeerAddress,
    ProducerBook,
    ProducerState,
    RecvSpec,
    Scheduled,
    SchedulerBook,
    SendStep,
    Welcome,
)

PREFILL = PeerAddress.of("127.0.0.1", 14579)
DECODE_CLUSTER = 77


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- messages --------------------------------------------------------------------------------------

def test_every_message_kind_round_trips() -> None:
    for message in (
        BlockIds("t-1", 32, 70, 1, 2, 0, (5, 9)),
        BlockIds("ü-tid", 16, 1, 0, 1, 0, (0,)),
        BlockIds("empty", 16, 0, 0, 0, 0, ()),
        Abort("t-2", "client went away"),
        Abort("t-2"),
        Done("t-3", Outcome.LANDED, 12),
        Done("t-4", Outcome.MISMATCH, 0, "block size 16 vs 32"),
        BlockIds("t-5", 32, 70, 1, 2, 0, (5, 9), LegInfo(0, 1, 1, 2, legs=2)),
        BlockIds("t-6", 32, 70, 1, 0, 0, (), LegInfo(0, 0, 0, 1)),  # a rank told it pushes nothing
        Hello(GEOMETRY),
        Welcome(GEOMETRY),
        Welcome(GEOMETRY, "block size: prefill 16, decode 32"),
    ):
        assert core.decode(core.encode(message)) == message


GEOMETRY = core.Geometry("llama-abc123", "float32", 32, 32, 2, 2, 2, 1)


def test_legs_and_geometries_that_cannot_be_are_refused() -> None:
    with pytest.raises(MessageError, match="leg out of range"):
        core.encode(BlockIds("t", 32, 70, 0, 1, 0, (5,), LegInfo(0, 1, 2, 2)))  # heads 1..2 of 2
    with pytest.raises(MessageError, match="leg out of range"):
        core.encode(BlockIds("t", 32, 70, 0, 1, 0, (5,), LegInfo(0, 0, 1, 1, legs=0)))
    hello = bytearray(core.encode(Hello(GEOMETRY)))
    with pytest.raises(MessageError, match="HELLO"):
        core.decode(bytes(hello).replace(b'"tp_rank": 1', b'"tp_rank": 7'))  # rank 7 of 2
    with pytest.raises(MessageError, match="HELLO"):
        core.decode(bytes(hello[:-3]))


MLA = core.Geometry("deepseek-v2-abc", "float32", 16, 576, 2, 1, 2, 0, mla=True)


def test_an_mla_geometry_travels_and_an_mha_one_is_told_from_it() -> None:
    assert core.Geometry.from_wire(MLA.to_wire()) == MLA
    old_peer = {key: value for key, value in GEOMETRY.to_wire().items() if key != "mla"}
    assert core.Geometry.from_wire(old_peer) == GEOMETRY and not GEOMETRY.mla  # says nothing: MHA
    with pytest.raises(ValueError):
        core.Geometry.from_wire({**MLA.to_wire(), "kv_heads": 4})  # a latent is one head
    with pytest.raises(ValueError):
        core.Geometry.from_wire({**MLA.to_wire(), "mla": "yes"})
    mha = core.Geometry("deepseek-v2-abc", "float32", 16, 576, 2, 1, 2, 0)
    refusal = core.incompatibility(MLA, mha)
    assert refusal is not None and "attention: prefill MLA" in refusal and "decode MHA" in refusal


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_each_mla_decode_rank_reads_one_prefill_ranks_whole_latent(prefill_tp: int, decode_tp: int) -> None:
    legs = core.plan_legs(core.Sharding(1, prefill_tp), core.Sharding(1, decode_tp))
    assert [(leg.decode_rank, leg.src_head, leg.dst_head, leg.heads) for leg in legs] == [
        (d, 0, 0, 1) for d in range(decode_tp)]
    assert [leg.prefill_rank for leg in legs] == [d % prefill_tp for d in range(decode_tp)]
    prefill = core.Geometry("m", "float32", 16, 576, 2, 1, prefill_tp, 0, mla=True)
    decode = core.Geometry("m", "float32", 16, 576, 2, 1, decode_tp, 0, mla=True)
    assert core.incompatibility(prefill, decode) is None


def test_reasons_are_bounded_without_splitting_a_character() -> None:
    data = core.encode(Done("t", Outcome.FAILED, 0, "é" * 1000))
    reason = core.decode(data).reason  # type: ignore[union-attr]
    assert reason == "é" * (core.MAX_REASON_BYTES // 2)
    assert len(data) < 600


@pytest.mark.parametrize("mutate, words", [
    (lambda d: b"XXXX" + d[4:], "magic"),
    (lambda d: d[:4] + bytes([core.PROTOCOL_VERSION + 1]) + d[5:], f"version {core.PROTOCOL_VERSION + 1}"),
    (lambda d: d[:4] + bytes([1]) + d[5:], "version 1"),  # before legs: refused, never misread
    (lambda d: d[:5] + bytes([99]) + d[6:], "kind 99"),
    (lambda d: d[:-1], "carries"),
    (lambda d: d + b"\0\0\0\0\0", "carries"),
    (lambda d: d[:6] + bytes([0]) + d[7:], "transfer id length"),
    (lambda d: d[:8], "transfer id length"),
    (lambda d: d[:14], "truncated"),
    (lambda d: b"", "too short"),
])
def test_malformed_block_ids_are_refused_with_the_reason(mutate: Callable[[bytes], bytes], words: str) -> None:
    data = core.encode(BlockIds("tid", 32, 64, 0, 2, 0, (3, 4)))
    with pytest.raises(MessageError, match=words):
        core.decode(mutate(data))


def test_decode_refuses_inconsistent_geometry_oversize_and_non_bytes() -> None:
    bad_total = core.encode(BlockIds("tid", 32, 64, 0, 1, 0, (3, 4)))  # 2 ids in a list of 1
    with pytest.raises(MessageError, match="geometry"):
        core.decode(bad_total)
    with pytest.raises(MessageError, match="exceeds"):
        core.decode(b"KVPC" + bytes(core.MAX_MESSAGE_BYTES))
    with pytest.raises(MessageError, match="bytes"):
        core.decode("text")  # type: ignore[arg-type]
    done = bytearray(core.encode(Done("t", Outcome.LANDED, 1)))
    done[-7] = 9  # the outcome byte
    with pytest.raises(MessageError, match="outcome"):
        core.decode(bytes(done))


def test_encode_refuses_what_cannot_travel() -> None:
    with pytest.raises(MessageError, match="32 bits"):
        core.encode(BlockIds("t", 32, 64, 0, 1, 0, (1 << 32,)))
    with pytest.raises(MessageError, match="exceeds"):
        core.encode(BlockIds("t", 32, 1 << 20, 0, 20000, 0, tuple(range(20000))))
    with pytest.raises(MessageError, match="transfer id"):
        core.encode(Abort("x" * 200))
    with pytest.raises(TypeError):
        core.encode("hello")  # type: ignore[arg-type]


def test_long_block_lists_split_into_bounded_ordered_parts() -> None:
    blocks = list(range(100, 40100))
    frames = core.block_id_messages("tid", 16, 16 * 40000 + 5 * 16, 5, blocks)
    assert len(frames) == 3 and all(len(f) <= core.MAX_MESSAGE_BYTES for f in frames)
    parts = [core.decode(f) for f in frames]
    assert all(isinstance(p, BlockIds) for p in parts)
    assert [p.offset for p in parts] == [0, parts[0].blocks.__len__(), 2 * len(parts[0].blocks)]  # type: ignore[union-attr]
    assert [b for p in parts for b in p.blocks] == blocks  # type: ignore[union-attr]
    assert {p.total for p in parts} == {40000}  # type: ignore[union-attr]
    assert len(core.block_id_messages("tid", 16, 0, 0, [])) == 1
    small = core.block_id_messages("tid", 16, 160, 0, list(range(10)), limit=58)  # 3 ids per message
    assert len(small) == 4 and all(len(f) <= 58 for f in small)
    leg = LegInfo(1, 0, 1, 2, legs=3)
    assert {core.decode(f).leg for f in core.block_id_messages("tid", 16, 160, 0, list(range(10)), leg=leg)} == {
        leg}  # type: ignore[union-attr]


# -- configuration, addresses, params --------------------------------------------------------------

def test_config_defaults_and_validation() -> None:
    config = ConnectorConfig.from_extra_config(None)
    assert config == ConnectorConfig()
    config = ConnectorConfig.from_extra_config({"transport": "tcp", "transfer_timeout_s": 5, "port": 20000,
                                                "engine_options": {"kvpush.keepalive_interval_ms": "100"}})
    assert (config.transport, config.transfer_timeout_s, config.port) == ("tcp", 5.0, 20000)
    with pytest.raises(ParamsError, match="unknown key 'trasport'.*transport"):
        ConnectorConfig.from_extra_config({"trasport": "tcp"})
    with pytest.raises(ParamsError, match="transfer_timeout_s"):
        ConnectorConfig.from_extra_config({"transfer_timeout_s": 0})
    with pytest.raises(ParamsError, match="sync_kv_timeout_ms"):
        ConnectorConfig.from_extra_config({"sync_kv_timeout_ms": "100"})
    with pytest.raises(ParamsError, match="port"):
        ConnectorConfig.from_extra_config({"port": 70000})
    with pytest.raises(ParamsError, match="auth_token"):
        ConnectorConfig.from_extra_config({"auth_token": 5})
    with pytest.raises(ParamsError, match="engine_options"):
        ConnectorConfig.from_extra_config({"engine_options": {"a": 1}})
    assert config.ids_wait_ms == core.IDS_WAIT_MS
    assert ConnectorConfig.from_extra_config({"ids_wait_ms": 0}).ids_wait_ms == 0  # never held
    with pytest.raises(ParamsError, match="ids_wait_ms"):
        ConnectorConfig.from_extra_config({"ids_wait_ms": -1})
    assert not config.loop_yields and ConnectorConfig.from_extra_config({"loop_yields": True}).loop_yields
    with pytest.raises(ParamsError, match="loop_yields"):
        ConnectorConfig.from_extra_config({"loop_yields": "yes"})


def test_engine_options_from_config() -> None:
    config = ConnectorConfig(auth_token="s3cret", sync_kv_timeout_ms=250, transport="cma",
                             engine_options={"kvpush.transport": "tcp"})
    assert config.engine_options_for(("127.0.0.1", 14579)) == {
        "llm.SyncKvCacheWaitTime": "250", "kvpush.transport": "tcp", "kvpush.auth_token": "s3cret",
        "llm.listenIpInfo": "127.0.0.1:14579",
        "kvpush.keepalive_interval_ms": "500", "kvpush.keepalive_timeout_ms": "5000"}  # tolerant of a busy host
    tuned = ConnectorConfig(engine_options={"kvpush.keepalive_timeout_ms": "1000"}).engine_options_for(None)
    assert tuned["kvpush.keepalive_timeout_ms"] == "1000"  # engine_options win
    assert ConnectorConfig().engine_options_for(("::1", 9))["llm.listenIpInfo"] == "[::1]:9"
    assert "llm.listenIpInfo" not in ConnectorConfig().engine_options_for(None)


def test_cluster_ids_are_derived_from_addresses() -> None:
    assert core.derive_cluster_id("127.0.0.1", 14579) == (0x7F000001 << 16) | 14579
    assert core.derive_cluster_id("localhost", 14579) == core.derive_cluster_id("127.0.0.1", 14579)
    assert core.derive_cluster_id("127.0.0.1", 14579) != core.derive_cluster_id("127.0.0.1", 14580)
    v6 = core.derive_cluster_id("::1", 14579)
    assert v6 >> 63 == 1 and v6 == core.derive_cluster_id("[::1]", 14579) < 1 << 64
    assert core.derive_cluster_id("Prefill-0.example", 1) == core.derive_cluster_id("prefill-0.example", 1)
    assert core.derive_cluster_id("prefill-0.example", 1) >> 63 == 1
    with pytest.raises(ParamsError):
        core.derive_cluster_id("127.0.0.1", 0)


def test_listen_ports_follow_the_role() -> None:
    assert core.listen_port(14579, "kv_producer") == 14579
    assert core.listen_port(14579, "kv_both") == 14579
    assert core.listen_port(14579, "kv_consumer") == 14580
    assert core.listen_port(14579, "kv_producer", rank=1) == 14581
    with pytest.raises(ParamsError, match="kv_role"):
        core.listen_port(14579, "prefill")
    with pytest.raises(ParamsError):
        core.listen_port(65535, "kv_consumer")


def test_params_parse_for_both_sides() -> None:
    decode = core.decode_request_params("tid", "10.0.0.2", 15000)
    parsed = core.parse_params(decode)
    expected = PeerAddress("10.0.0.2", 15000, core.derive_cluster_id("10.0.0.2", 15000))
    assert parsed == core.ConsumerParams("tid", expected)
    explicit = core.parse_params(core.decode_request_params("tid", "10.0.0.2", 15000, prefill_cluster_id=5))
    assert isinstance(explicit, core.ConsumerParams) and explicit.remote.cluster_id == 5
    mooncake = core.parse_params({"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "xfer-1",
                                  "remote_bootstrap_addr": "http://10.0.0.2:8998", "remote_engine_id": "e-dp0"})
    assert mooncake == core.ConsumerParams("xfer-1", None, core.Bootstrap("http://10.0.0.2:8998", "e-dp0"))
    bare = core.parse_params({"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "[::1]:9/"})
    assert isinstance(bare, core.ConsumerParams) and bare.bootstrap == core.Bootstrap("http://[::1]:9", None)
    assert core.parse_params(core.prefill_request_params("tid")) == core.ProducerParams("tid")
    assert core.parse_params({"do_remote_decode": True}) == core.ProducerParams(None)
    assert core.parse_params(None) is None and core.parse_params({"other": 1}) is None
    for bad, words in [
        ({"do_remote_prefill": True}, "transfer_id"),
        ({"do_remote_prefill": True, "transfer_id": "t"}, "name no prefill"),  # never guessed
        ({"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "ftp://h:1"}, "http://HOST:PORT"),
        ({"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "http://h:70000"}, "HOST:PORT"),
        ({"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "http://h:1",
          "remote_engine_id": 5}, "remote_engine_id"),
        ({"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": "1"}, "remote_port"),
        ({"do_remote_prefill": True, "transfer_id": "t", "remote_port": 5}, "remote_host"),
        ({"do_remote_prefill": True, "transfer_id": 7}, "transfer_id"),
        ({"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": 1,
          "remote_cluster_id": -1}, "remote_cluster_id"),
    ]:
        with pytest.raises(ParamsError, match=words):
            core.parse_params(bad)
    assert len(core.new_transfer_id()) == 32 and core.new_transfer_id() != core.new_transfer_id()


# -- scheduler book --------------------------------------------------------------------------------

def consumer_book(block_size: int = 32) -> SchedulerBook:
    return SchedulerBook(block_size, produce=False, consume=True, name="decode")


def producer_book(block_size: int = 32) -> SchedulerBook:
    return SchedulerBook(block_size, produce=True, consume=False, local=PREFILL, name="prefill")


def test_decode_scheduler_claims_the_prompt_once_and_hands_its_blocks_to_the_worker() -> None:
    book = consumer_book()
    book.on_new_request("r1", core.decode_request_params("tid", "127.0.0.1", 14579), num_prompt_tokens=70)
    assert book.matched_tokens("r1", 0) == (70, True)
    assert book.matched_tokens("r1", 0) == (70, True)  # side-effect free
    book.after_alloc("r1", [7, 8, 9], num_external_tokens=70)
    meta = book.build_step([])
    assert meta.recv == [RecvSpec("r1", "tid", PREFILL, 0, (7, 8, 9), 70)]
    assert not book.build_step([])  # handed once
    assert book.matched_tokens("r1", 70) == (0, False)  # after the load, and after a preemption
    book.after_alloc("r1", [7, 8, 9], num_external_tokens=0)  # vLLM's second call
    assert not book.build_step([])
    book.connector_output(finished_recving=["r1"])
    assert book.request_finished("r1", ok=True) == (False, None)
    assert not book.build_step([])


def test_decode_prefix_hit_sends_only_the_missing_blocks() -> None:
    book = consumer_book()
    book.on_new_request("r1", core.decode_request_params("tid", "127.0.0.1", 14579), num_prompt_tokens=70)
    assert book.matched_tokens("r1", 32) == (38, True)
    book.after_alloc("r1", [4, 8, 9], num_external_tokens=38)
    (spec,) = book.build_step([]).recv
    assert (spec.first_block, spec.blocks, spec.num_tokens, spec.error) == (1, (8, 9), 70, None)


def test_decode_allocation_it_cannot_use_is_handed_over_as_an_error_never_dropped() -> None:
    book = consumer_book()
    book.on_new_request("short", core.decode_request_params("t1", "127.0.0.1", 14579), num_prompt_tokens=70)
    book.after_alloc("short", [7, 8], num_external_tokens=70)
    book.on_new_request("odd", core.decode_request_params("t2", "127.0.0.1", 14579), num_prompt_tokens=70)
    book.after_alloc("odd", [7, 8, 9], num_external_tokens=60)
    short, odd = book.build_step([]).recv
    assert "2 blocks allocated; block 2 is wanted for 70 tokens" in (short.error or "") and short.blocks == (7, 8)
    assert "not whole blocks" in (odd.error or "")


def test_decode_request_finished_while_waiting_is_aborted_in_the_worker() -> None:
    book = consumer_book()
    book.on_new_request("r1", core.decode_request_params("tid", "127.0.0.1", 14579), num_prompt_tokens=40)
    book.after_alloc("r1", [1, 2], 40)
    book.build_step([])
    assert book.request_finished("r1", ok=False) == (False, None)  # vLLM itself keeps the blocks
    assert book.build_step([]).recv_aborted == ["r1"]
    book.on_new_request("r2", core.decode_request_params("t2", "127.0.0.1", 14579), num_prompt_tokens=40)
    assert book.request_finished("r2", ok=False) == (False, None)  # never allocated: nothing to abort
    assert not book.build_step([])


def test_a_decode_request_naming_no_prefill_is_refused_with_load_errors_and_wrong_roles_are_served_locally() -> None:
    """A decode request whose params name no usable prefill (none at all: nothing guesses one) claims its tokens
    and gets a RecvSpec with the reason, which the worker reports as load errors at once (vLLM then fails or
    recomputes it, as its kv_load_failure_policy says); a request for the other role is computed here."""
    book = consumer_book()
    book.on_new_request("bad", {"do_remote_prefill": True}, 40)
    book.on_new_request("nameless", {"do_remote_prefill": True, "transfer_id": "t9"}, 40)
    book.on_new_request("wrong-side", core.prefill_request_params("t"), 40)
    for req_id in ("bad", "nameless"):
        assert book.matched_tokens(req_id, 0) == (40, True)
        book.after_alloc(req_id, [5, 6], 40)
    bad, nameless = book.build_step([]).recv
    assert "transfer_id" in (bad.error or "") and bad.remote is None and bad.blocks == (5, 6)
    assert "name no prefill" in (nameless.error or "") and nameless.remote is None
    assert book.matched_tokens("wrong-side", 0) == (0, False)
    assert book.request_finished("wrong-side", True) == (False, None)
    prefill = producer_book()
    prefill.on_new_request("wrong-side", core.decode_request_params("t", "h", 1), 40)
    assert prefill.matched_tokens("wrong-side", 0) == (0, False)


class FakeResolve:
    """A decode's lookup of prefills by bootstrap server (``core.Resolve``): pending until ``answer`` is set."""

    def __init__(self) -> None:
        self.asked: list[core.Bootstrap] = []
        self.answer: PeerAddress | ParamsError | None = None

    def __call__(self, bootstrap: core.Bootstrap) -> PeerAddress | None:
        self.asked.append(bootstrap)
        if isinstance(self.answer, ParamsError):
            raise self.answer
        return self.answer


MOONCAKE = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "xfer-7",
            "remote_bootstrap_addr": "http://127.0.0.1:8998", "remote_engine_id": "engine-a"}


def test_a_decode_request_named_by_bootstrap_server_waits_for_the_lookup_then_loads_from_the_address() -> None:
    """The Mooncake shape: while the lookup runs the request answers None (vLLM asks again next step, nothing
    blocks); once found, it loads from that address like any other; a lookup that fails refuses it."""
    resolve = FakeResolve()
    book = SchedulerBook(32, produce=False, consume=True, resolve=resolve, name="decode")
    book.on_new_request("r1", MOONCAKE, 40)
    assert book.matched_tokens("r1", 0) == (None, False)
    assert book.matched_tokens("r1", 0) == (None, False)
    assert resolve.asked == [core.Bootstrap("http://127.0.0.1:8998", "engine-a")] * 2
    resolve.answer = PREFILL
    assert book.matched_tokens("r1", 0) == (40, True)
    book.after_alloc("r1", [3, 4], 40)
    (spec,) = book.build_step([]).recv
    assert (spec.transfer_id, spec.remote, spec.blocks, spec.error) == ("xfer-7", PREFILL, (3, 4), None)
    resolve.answer = ParamsError("the bootstrap server at http://127.0.0.1:8998 serves no engine 'engine-a'")
    book.on_new_request("r2", {**MOONCAKE, "transfer_id": "xfer-8"}, 40)
    assert book.matched_tokens("r2", 0) == (40, True)
    book.after_alloc("r2", [5, 6], 40)
    (spec,) = book.build_step([]).recv
    assert spec.remote is None and "serves no engine" in (spec.error or "")
    unresolving = consumer_book()  # a decode that looks nothing up refuses such requests
    unresolving.on_new_request("r3", MOONCAKE, 40)
    assert unresolving.matched_tokens("r3", 0) == (40, True)


def test_the_prefill_answers_its_bootstrap_too_when_it_serves_one() -> None:
    bootstrap = core.Bootstrap("http://127.0.0.1:8998", "engine-a")
    book = SchedulerBook(32, produce=True, consume=False, local=PREFILL, name="prefill", bootstrap=bootstrap)
    book.on_new_request("p1", {"do_remote_decode": True, "transfer_id": "xfer-1"}, 40)
    book.build_step([Scheduled("p1", (1, 2), False, 0, 40)])
    _, params = book.request_finished("p1", ok=True)
    assert params is not None and params["remote_port"] == PREFILL.port
    assert (params["remote_bootstrap_addr"], params["remote_engine_id"]) == ("http://127.0.0.1:8998", "engine-a")


def test_the_bootstrap_answer_has_vllm_s_shape_and_a_decode_finds_its_engine_s_ranks_in_it() -> None:
    first = PeerAddress.of("10.0.0.2", 15000)
    engines = {0: ("e_dp0", [first, first.of_rank(1)]), 1: ("e_dp1", [first.of_rank(2), first.of_rank(3)])}
    answer = core.bootstrap_answer(engines)
    assert answer["1"]["engine_id"] == "e_dp1"
    assert answer["1"]["worker_addr"] == {"0": {"0": "tcp://10.0.0.2:15004"}, "1": {"0": "tcp://10.0.0.2:15006"}}
    found = core.bootstrap_address(answer, core.Bootstrap("http://10.0.0.2:8998", "e_dp1"))
    assert found == first.of_rank(2) and found.of_rank(1) == first.of_rank(3)
    with pytest.raises(ParamsError, match="must name one"):
        core.bootstrap_address(answer, core.Bootstrap("http://10.0.0.2:8998"))
    with pytest.raises(ParamsError, match="serves no engine 'gone'.*e_dp0, e_dp1"):
        core.bootstrap_address(answer, core.Bootstrap("http://10.0.0.2:8998", "gone"))
    configured = PeerAddress.of("0.0.0.0", 16000, 7)  # explicit cluster ids, listening everywhere
    answer = core.bootstrap_answer({0: ("solo", [configured, configured.of_rank(1)])})
    found = core.bootstrap_address(answer, core.Bootstrap("http://10.9.9.9:8998"))
    assert (found.host, found.port, found.cluster_id, found.of_rank(1).cluster_id) == ("10.9.9.9", 16000, 7, 8)
    vllm_mooncake = {"0": {"engine_id": "m", "worker_addr": {"0": {"0": "tcp://10.0.0.2:41234"}}}}
    with pytest.raises(ParamsError, match="not a KvpushConnector prefill"):
        core.bootstrap_address(vllm_mooncake, core.Bootstrap("http://10.0.0.2:8998", "m"))
    off_rule = core.bootstrap_answer({0: ("x", [first, PeerAddress.of("10.0.0.2", 15100)])})
    with pytest.raises(ParamsError, match="rank 1 listens at 10.0.0.2:15100"):
        core.bootstrap_address(off_rule, core.Bootstrap("http://10.0.0.2:8998", "x"))
    for junk in ([], {}, {"0": {"engine_id": "x", "worker_addr": {}, "kvpush": {"cluster_ids": "no"}}},
                 {"0": {"engine_id": "x", "worker_addr": {}, "kvpush": {"cluster_ids": {}}}}):
        with pytest.raises(ParamsError):
            core.bootstrap_address(junk, core.Bootstrap("http://10.0.0.2:8998", "x"))


def test_prefill_scheduler_describes_each_prompt_step_and_delays_the_free() -> None:
    book = producer_book()
    book.on_new_request("p1", core.prefill_request_params("tid"), num_prompt_tokens=100)
    assert book.matched_tokens("p1", 0) == (0, False)
    meta = book.build_step([Scheduled("p1", (10, 11), False, 0, 64)])
    assert meta.send == [SendStep("p1", "tid", (10, 11), 0, 64, 100)]
    meta = book.build_step([Scheduled("p1", (12, 13), False, 64, 36)])
    assert meta.send == [SendStep("p1", "tid", (10, 11, 12, 13), 64, 100, 100)]
    assert not book.build_step([Scheduled("p1", None, False, 100, 1)])  # decode steps: nothing to send
    assert book.build_step([Scheduled("p1", (20, 21, 22, 23), True, 100, 1)]).send == []
    delay, params = book.request_finished("p1", ok=True)
    assert delay is True
    assert params == core.decode_request_params("tid", PREFILL.host, PREFILL.port, PREFILL.cluster_id)
    assert book.build_step([]).send_finished == [FinishedSend("p1", "tid", True, True)]
    assert book.has_pending_push_work()
    book.connector_output(finished_sending=["p1"])
    assert not book.has_pending_push_work()


def test_prefill_scheduler_resumed_request_gets_its_new_blocks() -> None:
    book = producer_book()
    book.on_new_request("p1", core.prefill_request_params("tid"), num_prompt_tokens=100)
    book.build_step([Scheduled("p1", (10, 11), False, 0, 64)])
    (step,) = book.build_step([Scheduled("p1", (30, 31, 32, 33), True, 32, 68)]).send
    assert (step.blocks, step.computed_before, step.computed_after, step.resumed) == (
        ((30, 31, 32, 33),), 32, 100, True)


def test_prefill_request_never_scheduled_is_not_delayed_and_names_its_own_transfer() -> None:
    book = producer_book()
    book.on_new_request("p1", {"do_remote_decode": True}, num_prompt_tokens=10)
    tid = book.transfer_id("p1")
    assert tid == "prefill-p1"
    assert book.request_finished("p1", ok=False) == (False, None)
    assert book.build_step([]).send_finished == [FinishedSend("p1", tid, False, False)]
    book.on_new_request("x" * 300, {"do_remote_decode": True}, num_prompt_tokens=10)
    assert len((book.transfer_id("x" * 300) or "").encode()) <= core.MAX_TRANSFER_ID_BYTES


def held_book(ranks: int = 1, wait_s: float = 0.05) -> tuple[SchedulerBook, Clock]:
    clock = Clock()
    return SchedulerBook(32, produce=True, consume=False, local=PREFILL, name="prefill",
                         hold=core.IdsHold(wait_s, clock, ranks)), clock


def test_prefill_request_is_held_until_every_rank_has_its_block_ids() -> None:
    book, clock = held_book(ranks=2)
    book.on_new_request("p1", core.prefill_request_params("tid"), num_prompt_tokens=100)
    assert book.matched_tokens("p1", 0) == (None, False)  # held: vLLM asks again next step
    meta = book.build_step([], computes=False)
    assert not meta.computes and meta.holding  # an empty step while a request waits for its ids
    clock.advance(0.01)
    book.ids_in({"tid": 1})
    assert book.matched_tokens("p1", 0) == (None, False)  # one rank of two
    book.ids_in({"tid": 1, "other": 2})
    assert book.matched_tokens("p1", 0) == (0, False)
    assert not book.build_step([], computes=False).holding  # released
    assert book.stats == {"held": 1, "held_ids_in": 1}
    book.build_step([Scheduled("p1", (10, 11, 12, 13), False, 0, 100)])
    assert book.matched_tokens("p1", 100) == (0, False)  # a preempted request is never held again
    book.request_finished("p1", ok=True)


def test_prefill_request_is_held_at_most_its_bound_and_ids_before_it_hold_nothing() -> None:
    book, clock = held_book(wait_s=0.05)
    book.on_new_request("late", core.prefill_request_params("t1"), num_prompt_tokens=40)
    assert book.matched_tokens("late", 0) == (None, False)
    clock.advance(0.049)
    assert book.matched_tokens("late", 0) == (None, False)
    clock.advance(0.001)
    assert book.matched_tokens("late", 0) == (0, False)  # the bound: it runs, its push follows the forward
    book.ids_in({"t1": 1})
    assert book.matched_tokens("late", 0) == (0, False)
    book.ids_in({"t2": 1})  # the decode's ids before the request (the decode went first)
    book.on_new_request("early", core.prefill_request_params("t2"), num_prompt_tokens=40)
    assert book.matched_tokens("early", 0) == (0, False)
    book.on_new_request("own", {"do_remote_decode": True}, num_prompt_tokens=40)  # no decode named: none come
    assert book.matched_tokens("own", 0) == (0, False)
    assert book.stats == {"held": 1, "held_expired": 1}
    unheld, _ = held_book(wait_s=0)
    unheld.on_new_request("p", core.prefill_request_params("t3"), num_prompt_tokens=40)
    assert unheld.matched_tokens("p", 0) == (0, False)
    for transfer_id in range(core.IDS_IN_REMEMBERED + 10):  # ids for requests that never come: bounded
        book.ids_in({f"gone-{transfer_id}": 1})
    assert len(book._ids_in) == core.IDS_IN_REMEMBERED


# -- producer book ---------------------------------------------------------------------------------

@dataclass
class Push:
    peer: int
    src: list[int]
    dst: list[int]
    pipelined: bool
    layers: list[int] = field(default_factory=list)
    finished: bool = False
    cancelled: bool = False


class ProducerFx:
    def __init__(self) -> None:
        self.pushes: dict[int, Push] = {}
        self.notified: list[tuple[int, Any, str]] = []
        self.replies: list[tuple[int, Any]] = []

    def start_push(self, push_id: int, peer: int, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   pipelined: bool) -> None:
        assert push_id not in self.pushes
        self.pushes[push_id] = Push(peer, list(src_blocks), list(dst_blocks), pipelined)

    def push_layer(self, push_id: int, layer: int) -> None:
        push = self.pushes[push_id]
        assert push.pipelined and not push.finished and layer not in push.layers
        push.layers.append(layer)

    def finish_push(self, push_id: int) -> None:
        self.pushes[push_id].finished = True

    def cancel_push(self, push_id: int) -> None:
        self.pushes[push_id].cancelled = True

    def notify(self, peer: int, data: bytes, transfer_id: str) -> None:
        self.notified.append((peer, core.decode(data), transfer_id))

    def reply(self, peer: int, data: bytes) -> None:
        self.replies.append((peer, core.decode(data)))


def producer(layers: int = 2, block_size: int = 32, **config: Any) -> tuple[ProducerBook, ProducerFx, Clock]:
    fx, clock = ProducerFx(), Clock()
    return ProducerBook(block_size, layers, ConnectorConfig(**config), clock, fx), fx, clock


def ids(transfer_id: str = "tid", blocks: Sequence[int] = (50, 51, 52, 53), num_tokens: int = 100, first: int = 0,
        block_size: int = 32) -> list[BlockIds]:
    return [core.decode(f) for f in core.block_id_messages(transfer_id, block_size, num_tokens, first, blocks)]  # type: ignore[misc]


def give_ids(book: ProducerBook, peer: int = DECODE_CLUSTER, **kwargs: Any) -> None:
    for part in ids(**kwargs):
        book.on_message(peer, part)


def run_step(book: ProducerBook, sends: Sequence[SendStep], finished: Sequence[FinishedSend] = (),
             layers: int = 2) -> None:
    book.begin_step(sends, finished)
    for layer in range(layers):
        book.layer_saved(layer)
    book.end_step()


def test_ids_first_then_every_layer_is_pushed_as_it_is_saved() -> None:
    book, fx, _ = producer()
    give_ids(book)
    assert book.state_of("tid") == ProducerState.PUSHING and not fx.pushes  # nothing computed yet
    book.begin_step([SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    (push,) = fx.pushes.values()
    assert (push.src, push.dst, push.pipelined, push.layers) == ([10, 11, 12, 13], [50, 51, 52, 53], True, [])
    book.layer_saved(0)
    assert push.layers == [0] and not push.finished
    book.layer_saved(1)
    book.end_step()
    assert push.layers == [0, 1] and push.finished
    assert not fx.notified  # not before the bytes landed
    book.on_push_done(1, None)
    assert not fx.notified  # and not before vLLM finished the request (it may have more chunks)
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert fx.notified == [(DECODE_CLUSTER, Done("tid", Outcome.LANDED, 4), "tid")]
    assert book.state_of("tid") == ProducerState.NOTIFYING and not book.take_finished_sending()
    book.on_notified("tid", None)
    assert book.take_finished_sending() == {"p1"} and book.state_of("tid") is None
    assert book.ended("tid") == "landed" and len(book) == 0


def test_ids_before_the_request_are_reported_in_once_for_the_scheduler() -> None:
    book, fx, _ = producer()
    give_ids(book, blocks=(50, 51, 52, 53))
    assert book.take_ids_in() == ["tid"] and book.take_ids_in() == []
    give_ids(book, transfer_id="t2", blocks=(50,), num_tokens=20)
    run_step(book, [SendStep("p2", "t2", (9,), 0, 20, 20)])  # its request ran before the report was taken
    run_step(book, [SendStep("p3", "t3", (8,), 0, 20, 20)])
    give_ids(book, transfer_id="t3", blocks=(40,), num_tokens=20)  # after its request ran: not reported
    assert book.take_ids_in() == ["t2"]
    assert [p.pipelined for p in fx.pushes.values()] == [True]  # t2 pipelined; t3 waits for its request to end


def test_ids_during_the_forward_join_it_the_layers_in_memory_at_once_the_others_as_they_come() -> None:
    """Issue 42: no hold for the ids. Those that come while the forward runs (the worker takes them at the next
    layer) start a pipelined push of what the forward computes: the layers already in memory go at once, the
    rest as each is saved, and the forward's end finishes it."""
    book, fx, _ = producer(layers=4)
    book.begin_step([SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    book.layer_saved(0)
    book.layer_saved(1)
    assert not fx.pushes
    give_ids(book)
    (push,) = fx.pushes.values()
    assert (push.src, push.dst, push.pipelined, push.layers) == ([10, 11, 12, 13], [50, 51, 52, 53], True, [0, 1])
    book.layer_saved(2)
    assert push.layers == [0, 1, 2] and not push.finished
    book.layer_saved(3)
    book.end_step()
    assert push.layers == [0, 1, 2, 3] and push.finished and book.stats["pushes_pipelined"] == 1
    book.on_push_done(1, None)
    run_step(book, [], [FinishedSend("p1", "tid", True, True)], layers=4)
    assert fx.notified[-1][1] == Done("tid", Outcome.LANDED, 4)


def test_ids_during_a_later_chunks_forward_join_it_with_the_earlier_chunks_blocks() -> None:
    book, fx, _ = producer()
    blocks = (10, 11, 12, 13)
    run_step(book, [SendStep("p1", "tid", blocks, 0, 40, 100)])  # block 0 whole, 1 partial: nobody to push to
    book.begin_step([SendStep("p1", "tid", blocks, 40, 80, 100)])
    book.layer_saved(0)
    give_ids(book)
    (push,) = fx.pushes.values()
    assert (push.src, push.pipelined, push.layers) == ([10, 11, 12], True, [0])  # up to this chunk's partial block
    book.layer_saved(1)
    book.end_step()
    run_step(book, [SendStep("p1", "tid", blocks, 80, 100, 100)])
    assert (fx.pushes[2].src, fx.pushes[2].pipelined) == ([12, 13], True)  # the partial one again, whole now


def test_ids_after_the_forward_pass_are_served_by_one_push_of_every_layer() -> None:
    book, fx, _ = producer()
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert not fx.pushes and book.state_of("tid") == ProducerState.WAITING_IDS
    give_ids(book, blocks=(60, 61, 62), first=1)  # the decode holds block 0 already
    (push,) = fx.pushes.values()
    assert (push.src, push.dst, push.pipelined) == ([11, 12, 13], [60, 61, 62], False)
    book.on_push_done(1, None)
    assert fx.notified[-1][1] == Done("tid", Outcome.LANDED, 3)
    book.on_notified("tid", None)
    assert book.take_finished_sending() == {"p1"}


def test_chunked_prefill_pushes_each_chunk_and_repeats_only_the_partial_tail() -> None:
    book, fx, _ = producer()
    give_ids(book, blocks=(50, 51, 52, 53), num_tokens=100)
    blocks = (10, 11, 12, 13)
    run_step(book, [SendStep("p1", "tid", blocks, 0, 40, 100)])  # blocks 0 and 1 (partial)
    run_step(book, [SendStep("p1", "tid", blocks, 40, 80, 100)])  # blocks 1 (rest) and 2 (partial)
    run_step(book, [SendStep("p1", "tid", blocks, 80, 100, 100)])  # blocks 2 and 3
    assert [(p.src, p.dst) for p in fx.pushes.values()] == [
        ([10, 11], [50, 51]), ([11, 12], [51, 52]), ([12, 13], [52, 53])]
    assert all(p.layers == [0, 1] and p.finished for p in fx.pushes.values())
    for push_id in list(fx.pushes):
        book.on_push_done(push_id, None)
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert fx.notified[-1][1].outcome == Outcome.LANDED


def test_ids_arriving_mid_prefill_catch_up_whole_blocks_at_once_and_the_rest_with_the_next_chunk() -> None:
    book, fx, _ = producer()
    blocks = (10, 11, 12, 13)
    run_step(book, [SendStep("p1", "tid", blocks, 0, 72, 100)])  # blocks 0, 1 whole; 2 partial
    give_ids(book)
    (catch_up,) = fx.pushes.values()
    assert (catch_up.src, catch_up.pipelined) == ([10, 11], False)  # the partial block waits
    run_step(book, [SendStep("p1", "tid", blocks, 72, 100, 100)])
    assert (fx.pushes[2].src, fx.pushes[2].dst, fx.pushes[2].pipelined) == ([12, 13], [52, 53], True)
    book.on_push_done(2, None)
    book.on_push_done(1, None)
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert fx.notified[-1][1] == Done("tid", Outcome.LANDED, 4)


def test_blocks_the_decode_has_are_not_pushed() -> None:
    book, fx, _ = producer()
    give_ids(book, blocks=(52, 53), first=2)
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 64, 100)])  # only blocks 0, 1: not wanted
    assert not fx.pushes
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 64, 100, 100)])
    assert [(p.src, p.dst) for p in fx.pushes.values()] == [([12, 13], [52, 53])]


def test_layers_not_seen_by_save_kv_layer_are_pushed_after_the_forward() -> None:
    book, fx, _ = producer(layers=3)
    give_ids(book)
    book.begin_step([SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    book.layer_saved(1)
    book.end_step()
    assert fx.pushes[1].layers == [1, 0, 2] and fx.pushes[1].finished


def test_a_failed_push_stops_the_transfer_and_tells_the_decode_after_the_others_drained() -> None:
    book, fx, _ = producer()
    blocks = (10, 11, 12, 13)
    give_ids(book)
    run_step(book, [SendStep("p1", "tid", blocks, 0, 40, 100)])
    run_step(book, [SendStep("p1", "tid", blocks, 40, 80, 100)])
    book.on_push_done(2, "LLM_TIMEOUT: layer 1 not done")
    assert fx.pushes[1].cancelled and book.state_of("tid") == ProducerState.DRAINING
    assert not fx.notified  # push 1 may still land
    book.on_push_done(1, "cancelled")
    ((peer, done, _),) = fx.notified
    assert peer == DECODE_CLUSTER and done.outcome == Outcome.FAILED and "LLM_TIMEOUT" in done.reason
    run_step(book, [SendStep("p1", "tid", blocks, 80, 100, 100)])
    assert len(fx.pushes) == 2  # nothing more is pushed
    book.on_notified("tid", None)
    assert not book.take_finished_sending()  # the request still runs: its blocks are vLLM's
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert book.take_finished_sending() == {"p1"}
    assert "LLM_TIMEOUT" in (book.ended("tid") or "")


def test_an_abort_before_the_request_came_ends_the_transfer_at_once_and_a_late_request_pushes_nothing() -> None:
    """Both copies go at once (issue 42): a client that leaves can have the decode's ids reach the prefill and the
    decode abort before the prefill's copy ever came. Nothing waits ``transfer_timeout_s`` for it."""
    book, fx, _ = producer()
    give_ids(book)
    book.on_message(DECODE_CLUSTER, Abort("tid", "client disconnected"))
    assert fx.notified[0][1].outcome == Outcome.ABORTED
    book.on_notified("tid", None)
    assert len(book) == 0 and "client disconnected" in (book.ended("tid") or "")
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])  # its copy came after all
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert not fx.pushes and book.take_finished_sending() == {"p1"}


def test_abort_from_the_decode_cancels_and_confirms_when_nothing_can_land() -> None:
    book, fx, _ = producer()
    give_ids(book)
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    book.on_message(DECODE_CLUSTER, Abort("tid", "client disconnected"))
    assert fx.pushes[1].cancelled and not fx.notified
    book.on_push_done(1, "cancelled")
    assert fx.notified[0][1].outcome == Outcome.ABORTED and "client disconnected" in fx.notified[0][1].reason
    book.on_notified("tid", None)
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert book.take_finished_sending() == {"p1"}


def test_ids_that_never_come_release_the_blocks_after_the_deadline_and_late_ids_are_answered() -> None:
    book, fx, clock = producer(ids_timeout_s=5)
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    clock.advance(4.9)
    book.poll()
    assert not book.take_finished_sending()
    clock.advance(0.2)
    book.poll()
    assert book.take_finished_sending() == {"p1"} and not fx.notified
    give_ids(book)
    ((peer, answer),) = fx.replies
    assert peer == DECODE_CLUSTER and answer.outcome == Outcome.UNKNOWN and "no block ids" in answer.reason
    assert not fx.pushes


def test_ids_for_a_request_that_never_comes_are_forgotten_after_the_transfer_deadline() -> None:
    book, fx, clock = producer(transfer_timeout_s=10)
    give_ids(book)
    clock.advance(9)
    book.poll()
    assert book.state_of("tid") == ProducerState.PUSHING
    clock.advance(2)
    book.poll()
    assert fx.notified[0][1].outcome == Outcome.UNKNOWN
    book.on_notified("tid", None)
    assert book.state_of("tid") is None and not book.take_finished_sending()
    # the request turning up after all only keeps (and then frees) its blocks; the decode was answered
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert not fx.pushes and book.take_finished_sending() == {"p1"} and len(fx.notified) == 1


def test_the_orphan_deadline_stops_once_the_request_is_here() -> None:
    book, fx, clock = producer(transfer_timeout_s=10)
    give_ids(book)
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 50, 100)])
    clock.advance(60)
    book.poll()
    assert book.state_of("tid") == ProducerState.PUSHING and not fx.notified


@pytest.mark.parametrize("kwargs, words", [
    (dict(block_size=16, blocks=tuple(range(7))), "block size 16"),
    (dict(num_tokens=90, blocks=(1, 2, 3)), "expects 90 prompt tokens"),
    (dict(blocks=(1, 2, 3)), "do not cover"),
])
def test_disagreeing_sides_are_refused_without_a_push(kwargs: dict[str, Any], words: str) -> None:
    book, fx, _ = producer()
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    give_ids(book, **kwargs)
    assert not fx.pushes
    ((_, done, _),) = fx.notified
    assert done.outcome == Outcome.MISMATCH and words in done.reason


def test_a_second_decode_cannot_claim_a_transfer_nor_abort_it() -> None:
    book, fx, _ = producer()
    give_ids(book)
    give_ids(book, peer=99)
    book.on_message(99, Abort("tid"))
    assert [(peer, reply.outcome) for peer, reply in fx.replies] == [(99, Outcome.FAILED)]
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    assert fx.pushes[1].peer == DECODE_CLUSTER and not fx.pushes[1].cancelled


def test_an_abort_for_an_unknown_transfer_is_answered() -> None:
    book, fx, _ = producer()
    book.on_message(DECODE_CLUSTER, Abort("nope"))
    assert fx.replies == [(DECODE_CLUSTER, Done("nope", Outcome.UNKNOWN, 0, "no such transfer"))]


def test_block_id_parts_out_of_order_are_refused() -> None:
    book, fx, _ = producer(block_size=1)
    parts = [core.decode(f) for f in core.block_id_messages("tid", 1, 20000, 0, list(range(20000)))]
    book.on_message(DECODE_CLUSTER, parts[1])
    assert fx.notified[0][1].outcome == Outcome.MISMATCH and "out of order" in fx.notified[0][1].reason


def test_split_block_ids_are_assembled() -> None:
    book, fx, _ = producer(block_size=1, layers=1)
    blocks = list(range(1000, 21000))
    for frame in core.block_id_messages("tid", 1, 20000, 0, blocks):
        book.on_message(DECODE_CLUSTER, core.decode(frame))
    run_step(book, [SendStep("p1", "tid", tuple(range(20000)), 0, 20000, 20000)], layers=1)
    assert fx.pushes[1].dst == blocks


def test_prefill_request_aborted_tells_the_decode_and_frees_at_once() -> None:
    book, fx, _ = producer()
    give_ids(book)
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 40, 100)])
    book.on_push_done(1, None)
    run_step(book, [], [FinishedSend("p1", "tid", False, True)])
    assert fx.notified[0][1].outcome == Outcome.FAILED and "aborted" in fx.notified[0][1].reason
    book.on_notified("tid", None)
    assert book.take_finished_sending() == {"p1"}


def test_a_request_finished_before_its_prompt_was_computed_fails_the_transfer() -> None:
    book, fx, _ = producer()
    give_ids(book)
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 40, 100)])
    book.on_push_done(1, None)
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert fx.notified[0][1].outcome == Outcome.FAILED and "40 of 100" in fx.notified[0][1].reason


def test_orphan_ids_for_a_request_that_ended_unscheduled_are_answered_and_nothing_is_reported() -> None:
    book, fx, _ = producer()
    give_ids(book)
    run_step(book, [], [FinishedSend("p1", "tid", False, False)])
    assert fx.notified[0][1].outcome == Outcome.FAILED
    book.on_notified("tid", None)
    assert not book.take_finished_sending() and len(book) == 0


def test_a_lost_link_ends_the_transfer_and_the_blocks_come_back_when_the_request_finished() -> None:
    book, fx, _ = producer()
    give_ids(book)
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    book.on_link_lost(DECODE_CLUSTER, "keepalive timeout")
    book.on_push_done(1, "LLM_TIMEOUT: link broke")
    assert not fx.notified  # nobody to tell
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert book.take_finished_sending() == {"p1"} and "keepalive" in (book.ended("tid") or "")


def test_preempted_request_is_pushed_again_from_its_new_blocks() -> None:
    book, fx, _ = producer()
    give_ids(book)
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 64, 100)])
    book.on_push_done(1, None)
    run_step(book, [SendStep("p1", "tid", (30, 31, 32, 33), 32, 100, 100, resumed=True)])
    assert (fx.pushes[2].src, fx.pushes[2].dst) == ([30, 31, 32, 33], [50, 51, 52, 53])


def test_a_delayed_finish_the_book_does_not_know_is_still_reported() -> None:
    book, _, _ = producer()
    run_step(book, [], [FinishedSend("ghost", "never-seen", True, True)])
    assert book.take_finished_sending() == {"ghost"}


def test_orphan_ids_are_bounded() -> None:
    book, fx, _ = producer(max_transfers=2)
    for tid in ("a", "b", "c"):
        give_ids(book, transfer_id=tid)
    assert len(book) == 2 and [(r.transfer_id, r.outcome) for _, r in fx.replies] == [("c", Outcome.FAILED)]


def test_a_failed_notification_still_releases_the_blocks(caplog: pytest.LogCaptureFixture) -> None:
    book, fx, _ = producer()
    give_ids(book)
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    book.on_push_done(1, None)
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    with caplog.at_level(logging.WARNING):
        book.on_notified("tid", "LLM_NOT_YET_LINK")
    assert book.take_finished_sending() == {"p1"} and "will time out" in caplog.text


# -- consumer book ---------------------------------------------------------------------------------

class ConsumerFx:
    def __init__(self) -> None:
        self.sent: list[tuple[PeerAddress, list[Any], str]] = []
        self.aborts: list[tuple[int, Any]] = []
        self.open: dict[str, tuple[int, ...]] = {}  # transfer id -> the blocks opened to its prefill

    def send_ids(self, spec: RecvSpec, block_size: int) -> None:
        frames = core.block_id_messages(spec.transfer_id, block_size, spec.num_tokens, spec.first_block, spec.blocks)
        self.sent.append((spec.remote, [core.decode(f) for f in frames], spec.transfer_id))
        self.open[spec.transfer_id] = tuple(spec.blocks)

    def transfer_ended(self, transfer_id: str) -> None:
        self.open.pop(transfer_id, None)

    def send_abort(self, peer: int, data: bytes) -> None:
        self.aborts.append((peer, core.decode(data)))


def consumer(**config: Any) -> tuple[ConsumerBook, ConsumerFx, Clock]:
    fx, clock = ConsumerFx(), Clock()
    return ConsumerBook(32, ConnectorConfig(**config), clock, fx), fx, clock


def spec(req_id: str = "r1", transfer_id: str = "tid", blocks: tuple[int, ...] = (7, 8, 9), first: int = 0,
         num_tokens: int = 70, error: str | None = None) -> RecvSpec:
    return RecvSpec(req_id, transfer_id, PREFILL, first, blocks, num_tokens, error)


def landed(transfer_id: str = "tid", blocks: int = 3) -> Done:
    return Done(transfer_id, Outcome.LANDED, blocks)


def test_decode_sends_its_ids_and_reports_the_request_only_after_the_landed_notification() -> None:
    book, fx, _ = consumer()
    book.begin_step([spec()])
    ((remote, frames, tid),) = fx.sent
    assert remote == PREFILL and tid == "tid" and frames == [BlockIds("tid", 32, 70, 0, 3, 0, (7, 8, 9))]
    assert fx.open == {"tid": (7, 8, 9)}  # opened to the prefill with the ids, not before
    assert book.state_of("tid") == ConsumerState.SENDING_IDS
    book.on_ids_sent("tid")
    assert book.state_of("tid") == ConsumerState.WAITING_LANDED
    book.poll()
    assert book.take_finished() == core.Received(set(), set(), set())
    book.on_message(PREFILL.cluster_id, landed())
    assert book.take_finished() == core.Received({"r1"}, set(), set())
    assert fx.open == {}
    assert book.take_finished() == core.Received(set(), set(), set()) and len(book) == 0
    book.on_message(PREFILL.cluster_id, landed())  # a duplicate changes nothing
    assert not book.take_finished().finished


def test_a_notification_may_overtake_the_send_result() -> None:
    book, _, _ = consumer()
    book.begin_step([spec()])
    book.on_done(PREFILL.cluster_id, landed())
    book.on_ids_sent("tid")
    assert book.take_finished().finished == {"r1"}


def test_a_notification_from_another_cluster_or_with_the_wrong_count_never_completes() -> None:
    book, _, _ = consumer()
    book.begin_step([spec()])
    book.on_ids_sent("tid")
    book.on_done(12345, landed())
    assert book.state_of("tid") == ConsumerState.WAITING_LANDED
    book.on_done(PREFILL.cluster_id, landed(blocks=2))
    received = book.take_finished()
    assert received == core.Received({"r1"}, {"r1"}, {7, 8, 9})


def test_a_prefill_failure_reports_load_errors() -> None:
    book, _, _ = consumer()
    book.begin_step([spec(), spec("r2", "t2", (10, 11))])
    book.on_ids_sent("tid")
    book.on_done(PREFILL.cluster_id, Done("tid", Outcome.FAILED, 0, "LLM_TIMEOUT"))
    assert book.take_finished() == core.Received({"r1"}, {"r1"}, {7, 8, 9})
    assert book.state_of("t2") == ConsumerState.SENDING_IDS


def test_a_timeout_aborts_and_waits_for_the_prefill_to_confirm() -> None:
    book, fx, clock = consumer(transfer_timeout_s=10, abort_grace_s=2)
    book.begin_step([spec()])
    book.on_ids_sent("tid")
    clock.advance(10)
    book.poll()
    assert book.state_of("tid") == ConsumerState.FAILING
    assert fx.aborts == [(PREFILL.cluster_id, Abort("tid", "not landed within 10 s"))]
    assert not book.take_finished().finished  # bytes may still land: the blocks stay out of use
    book.on_done(PREFILL.cluster_id, Done("tid", Outcome.ABORTED, 0, "aborted by the decode"))
    assert book.take_finished() == core.Received({"r1"}, {"r1"}, {7, 8, 9})


def test_a_timeout_without_confirmation_frees_after_the_grace() -> None:
    book, _, clock = consumer(transfer_timeout_s=10, abort_grace_s=2)
    book.begin_step([spec()])
    book.on_ids_sent("tid")
    clock.advance(10)
    book.poll()
    clock.advance(1.9)
    book.poll()
    assert not book.take_finished().finished
    clock.advance(0.2)
    book.poll()
    assert book.take_finished() == core.Received({"r1"}, {"r1"}, {7, 8, 9})


def test_kv_that_lands_after_the_timeout_but_before_the_grace_is_used() -> None:
    book, _, clock = consumer(transfer_timeout_s=10)
    book.begin_step([spec()])
    book.on_ids_sent("tid")
    clock.advance(11)
    book.poll()
    book.on_done(PREFILL.cluster_id, landed())
    assert book.take_finished() == core.Received({"r1"}, set(), set())


def test_ids_that_never_left_fail_at_the_deadline_without_an_abort() -> None:
    book, fx, clock = consumer(transfer_timeout_s=1)
    book.begin_step([spec()])
    book.on_ids_sent("tid", "LLM_LINK_BUSY", retryable=True, delivered_any=False)
    clock.advance(1)
    book.poll()
    assert not fx.aborts and book.take_finished().failed == {"r1"}


def test_busy_peers_are_retried_with_backoff_until_the_deadline() -> None:
    book, fx, clock = consumer(transfer_timeout_s=1)
    book.begin_step([spec()])
    book.on_ids_sent("tid", "LLM_LINK_BUSY", retryable=True, delivered_any=False)
    book.poll()
    assert len(fx.sent) == 1  # not before the backoff
    clock.advance(0.05)
    book.poll()
    assert len(fx.sent) == 2
    book.on_ids_sent("tid", "LLM_LINK_BUSY", retryable=True, delivered_any=False)
    clock.advance(0.05)
    book.poll()
    assert len(fx.sent) == 2  # the backoff doubled
    clock.advance(0.06)
    book.poll()
    assert len(fx.sent) == 3
    book.on_ids_sent("tid")
    book.on_done(PREFILL.cluster_id, landed())
    assert book.take_finished() == core.Received({"r1"}, set(), set())


def test_a_link_that_cannot_be_made_fails_at_once() -> None:
    book, fx, _ = consumer()
    book.begin_step([spec()])
    book.on_ids_sent("tid", "LLM_LINK_FAILED: connection refused", retryable=False, delivered_any=False)
    received = book.take_finished()
    assert received == core.Received({"r1"}, {"r1"}, {7, 8, 9}) and not fx.aborts


def test_a_partly_sent_id_list_is_aborted() -> None:
    book, fx, _ = consumer()
    book.begin_step([spec()])
    book.on_ids_sent("tid", "LLM_LINK_BUSY", retryable=True, delivered_any=True)
    assert book.state_of("tid") == ConsumerState.FAILING and fx.aborts


def test_a_lost_link_fails_the_transfers_from_that_prefill_only() -> None:
    book, _, _ = consumer()
    other = PeerAddress.of("127.0.0.1", 20000)
    book.begin_step([spec(), RecvSpec("r2", "t2", other, 0, (3,), 10)])
    book.on_ids_sent("tid")
    book.on_ids_sent("t2")
    book.on_link_lost(PREFILL.cluster_id, "peer closed")
    assert book.take_finished() == core.Received({"r1"}, {"r1"}, {7, 8, 9})
    assert "peer closed" not in book.reason("t2") and book.state_of("t2") == ConsumerState.WAITING_LANDED


def test_a_request_finished_while_waiting_is_released_once_the_prefill_confirms() -> None:
    book, fx, _ = consumer()
    book.begin_step([spec()])
    book.on_ids_sent("tid")
    book.begin_step([], ["r1"])
    assert fx.aborts[0][1].transfer_id == "tid" and book.state_of("tid") == ConsumerState.ABORTING
    assert not book.take_finished().finished
    book.on_done(PREFILL.cluster_id, Done("tid", Outcome.ABORTED))
    assert book.take_finished() == core.Received({"r1"}, set(), set())  # released, not a load failure


def test_an_abort_before_anything_left_is_immediate() -> None:
    book, fx, _ = consumer()
    book.begin_step([spec()])
    book.on_ids_sent("tid", "LLM_LINK_BUSY", retryable=True, delivered_any=False)
    book.begin_step([], ["r1"])
    assert not fx.aborts and book.take_finished() == core.Received({"r1"}, set(), set())


def test_an_abort_of_a_landed_request_just_reports_it() -> None:
    book, fx, _ = consumer()
    book.begin_step([spec()])
    book.on_done(PREFILL.cluster_id, landed())
    book.begin_step([], ["r1"])
    assert not fx.aborts and book.take_finished().finished == {"r1"}


def test_an_abort_while_failing_keeps_waiting_then_releases_without_load_errors() -> None:
    book, fx, clock = consumer(transfer_timeout_s=1, abort_grace_s=1)
    book.begin_step([spec()])
    book.on_ids_sent("tid")
    clock.advance(1)
    book.poll()
    book.begin_step([], ["r1"])
    assert len(fx.aborts) == 1
    book.on_link_lost(PREFILL.cluster_id)
    assert book.take_finished() == core.Received({"r1"}, set(), set())


def test_specs_that_cannot_be_received_are_reported_failed_at_once() -> None:
    book, fx, _ = consumer(max_transfers=1)
    book.begin_step([spec(error="2 blocks allocated for 70 tokens", blocks=(7, 8)), spec("r2", "t2"),
                     spec("r3", "t2"), spec("r4", "t4")])
    received = book.take_finished()
    assert received.finished == received.failed == {"r1", "r3", "r4"}
    assert received.load_errors == {7, 8, 9}
    assert [tid for _, _, tid in fx.sent] == ["t2"]


# -- tensor parallelism: legs ---------------------------------------------------------------------

def test_a_prefill_rank_pushes_each_decode_rank_its_heads_and_releases_after_both() -> None:
    """Prefill TP 1 with 2 KV heads -> decode TP 2: decode rank r wants head r (LegInfo src_head=r)."""
    fx, clock = ProducerFx(), Clock()
    book = ProducerBook(32, 2, ConnectorConfig(), clock, fx, local_heads=2)
    for rank, peer in enumerate((81, 82)):
        leg = LegInfo(rank, 0, 1, 1, legs=2)
        for frame in core.block_id_messages("tid", 32, 64, 0, [50, 51], leg=leg):
            book.on_message(peer, core.decode(frame))
    run_step(book, [SendStep("p1", "tid", (10, 11), 0, 64, 64)])
    pushes = sorted(fx.pushes.values(), key=lambda push: push.peer)
    # kvpush blocks: vLLM block b, local head h -> b * local + h, on each side
    assert [(p.peer, p.src, p.dst) for p in pushes] == [(81, [20, 22], [50, 51]), (82, [21, 23], [50, 51])]
    for push_id in fx.pushes:
        book.on_push_done(push_id, None)
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert sorted(peer for peer, _, _ in fx.notified) == [81, 82]
    book.on_notified("tid", None, 81)
    assert not book.take_finished_sending()  # the other leg's decode was not told yet
    book.on_notified("tid", None, 82)
    assert book.take_finished_sending() == {"p1"} and len(book) == 0


def test_a_rank_told_it_pushes_nothing_answers_and_releases_with_its_request() -> None:
    book, fx, _ = producer()
    for frame in core.block_id_messages("tid", 32, 100, 0, [50, 51, 52, 53], leg=LegInfo(0, 0, 0, 1)):
        book.on_message(DECODE_CLUSTER, core.decode(frame))
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 100, 100)])
    run_step(book, [], [FinishedSend("p1", "tid", True, True)])
    assert not fx.pushes
    ((peer, done, _),) = fx.notified
    assert peer == DECODE_CLUSTER and done == Done("tid", Outcome.LANDED, 4)
    book.on_notified("tid", None, DECODE_CLUSTER)
    assert book.take_finished_sending() == {"p1"}


def test_legs_that_disagree_or_overflow_are_refused() -> None:
    book, fx, _ = producer()
    for frame in core.block_id_messages("tid", 32, 100, 0, [50, 51, 52, 53], leg=LegInfo(0, 0, 1, 1, legs=1)):
        book.on_message(81, core.decode(frame))
    for frame in core.block_id_messages("tid", 32, 100, 0, [60, 61, 62, 63], leg=LegInfo(0, 0, 1, 1, legs=1)):
        book.on_message(82, core.decode(frame))  # a second decode rank where one was announced
    assert [(peer, done.outcome) for peer, done in fx.replies] == [(82, Outcome.FAILED)]
    book2, fx2, _ = producer()
    for frame in core.block_id_messages("t2", 32, 100, 0, [50, 51, 52, 53], leg=LegInfo(1, 0, 1, 1)):
        book2.on_message(81, core.decode(frame))  # local head 1 of a rank holding 1
    assert fx2.notified[0][1].outcome == Outcome.MISMATCH and "holds 1" in fx2.notified[0][1].reason


def test_a_decode_rank_lands_only_when_every_leg_landed() -> None:
    book, fx, _ = consumer()
    book.begin_step([spec()])
    book.on_ids_sent("tid", peers=[PREFILL.cluster_id, 77])
    book.on_message(PREFILL.cluster_id, landed())
    assert not book.take_finished().finished
    book.on_message(99, landed())  # not one of its legs: ignored
    assert not book.take_finished().finished
    book.on_message(77, landed())
    assert book.take_finished() == core.Received({"r1"}, set(), set()) and fx.open == {}


def test_a_rank_lost_while_the_ids_still_go_out_ends_the_transfer_at_once() -> None:
    book, fx, clock = consumer(abort_grace_s=3)
    book.begin_step([spec()])
    book.on_legs("tid", [PREFILL.cluster_id, 77])  # planned; the ids to the first are still on their way
    book.on_link_lost(77, "connection reset")
    assert book.state_of("tid") == ConsumerState.FAILING  # not at a deadline: that rank is gone
    assert [peer for peer, _ in fx.aborts] == [PREFILL.cluster_id]
    clock.advance(3.1)
    book.poll()
    assert book.take_finished().failed == {"r1"}


def test_a_failed_leg_stops_the_others_and_the_blocks_wait_for_them() -> None:
    book, fx, clock = consumer(abort_grace_s=3)
    book.begin_step([spec()])
    book.on_ids_sent("tid", peers=[PREFILL.cluster_id, 77, 78])
    book.on_message(77, Done("tid", Outcome.FAILED, 0, "push failed"))
    assert sorted(peer for peer, _ in fx.aborts) == sorted([PREFILL.cluster_id, 78])  # the legs still writing
    assert not book.take_finished().finished and book.state_of("tid") == ConsumerState.FAILING
    book.on_link_lost(78)  # that one can write nothing more either
    book.on_message(PREFILL.cluster_id, Done("tid", Outcome.ABORTED, 0, "aborted"))
    received = book.take_finished()
    assert received == core.Received({"r1"}, {"r1"}, {7, 8, 9})
    book2, fx2, clock2 = consumer(abort_grace_s=3)
    book2.begin_step([spec()])
    book2.on_ids_sent("tid", peers=[PREFILL.cluster_id, 77])
    book2.on_link_lost(77)  # a rank died: the other is stopped; without its answer the grace ends the wait
    assert [peer for peer, _ in fx2.aborts] == [PREFILL.cluster_id]
    clock2.advance(3.1)
    book2.poll()
    assert book2.take_finished().failed == {"r1"}


# -- a simulated prefill/decode pair ---------------------------------------------------------------

class World:
    """A prefill and a decode book joined by an in-memory 'link'. Prefill memory holds, per layer and
    slot, the value its forward pass wrote (token * 10 + layer + 1; 0 = not written yet); a pushed
    layer copies the source blocks into the decode's memory when ``push_layer`` (or a whole push)
    starts, as the engine's ordered link would. Pending deliveries and completions are run in an
    order the test chooses."""

    def __init__(self, block_size: int, layers: int, prompt: int, first_block: int, prefill_cached: int,
                 chunks: list[int], fail_push: int | None = None) -> None:
        self.bs, self.layers, self.prompt = block_size, layers, prompt
        self.clock = Clock()
        self.config = ConnectorConfig(transfer_timeout_s=30, ids_timeout_s=30, abort_grace_s=5)
        n_blocks = core.blocks_for(prompt, block_size)
        self.src_blocks = [100 + 2 * i for i in range(n_blocks)]  # scattered on purpose
        self.dst_all = [500 + 3 * i for i in range(n_blocks)]
        self.first_block = first_block
        self.p_mem = np.zeros((layers, 1000, block_size), np.int64)
        self.d_mem = np.zeros((layers, 2000, block_size), np.int64)
        for i in range(first_block):  # the decode's prefix cache holds these already
            for layer in range(layers):
                self.d_mem[layer, self.dst_all[i]] = self.expected(i, layer)
        self.chunks, self.prefill_cached = chunks, prefill_cached
        self.pending: list[tuple[str, Callable[[], None]]] = []
        self.fail_push = fail_push
        self.producer = ProducerBook(block_size, layers, self.config, self.clock, self._PFx(self))
        self.consumer = ConsumerBook(block_size, self.config, self.clock, self._CFx(self))
        self.pushes: dict[int, tuple[list[int], list[int]]] = {}
        self.granted: set[int] = set()  # decode blocks open to the prefill (RemoteAccess.GRANTED)
        self.released: list[str] = []
        self.received: list[core.Received] = []

    def expected(self, block: int, layer: int) -> np.ndarray[Any, Any]:
        tokens = np.arange(block * self.bs, (block + 1) * self.bs)
        return np.where(tokens < self.prompt, tokens * 10 + layer + 1, 0)

    def copy(self, push_id: int, layer: int) -> None:
        src, dst = self.pushes[push_id]
        assert set(dst) <= self.granted, "the prefill wrote a block the decode had not opened to it (or closed)"
        self.d_mem[layer, dst] = self.p_mem[layer, src]

    class _PFx:
        def __init__(self, world: World) -> None:
            self.w = world

        def start_push(self, push_id: int, peer: int, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                       pipelined: bool) -> None:
            self.w.pushes[push_id] = (list(src_blocks), list(dst_blocks))
            if not pipelined:
                for layer in range(self.w.layers):
                    self.w.copy(push_id, layer)
                self.w.complete(push_id)

        def push_layer(self, push_id: int, layer: int) -> None:
            self.w.copy(push_id, layer)

        def finish_push(self, push_id: int) -> None:
            self.w.complete(push_id)

        def cancel_push(self, push_id: int) -> None:
            pass  # the completion already queued reports it

        def notify(self, peer: int, data: bytes, transfer_id: str) -> None:
            message = core.decode(data)
            self.w.pending.append(("notify", lambda: self.w.consumer.on_message(PREFILL.cluster_id, message)))
            self.w.pending.append(("notified", lambda: self.w.producer.on_notified(transfer_id, None)))

        def reply(self, peer: int, data: bytes) -> None:
            message = core.decode(data)
            self.w.pending.append(("reply", lambda: self.w.consumer.on_message(PREFILL.cluster_id, message)))

    class _CFx:
        def __init__(self, world: World) -> None:
            self.w = world

        def send_ids(self, spec: RecvSpec, block_size: int) -> None:
            self.w.granted |= set(spec.blocks)  # opened before the ids leave
            frames, transfer_id = core.block_id_messages(spec.transfer_id, block_size, spec.num_tokens,
                                                         spec.first_block, spec.blocks), spec.transfer_id

            def deliver() -> None:
                for frame in frames:
                    self.w.producer.on_message(DECODE_CLUSTER, core.decode(frame))
            self.w.pending.append(("ids", deliver))
            self.w.pending.append(("ids-sent", lambda: self.w.consumer.on_ids_sent(transfer_id)))

        def send_abort(self, peer: int, data: bytes) -> None:
            message = core.decode(data)
            self.w.pending.append(("abort", lambda: self.w.producer.on_message(DECODE_CLUSTER, message)))

        def transfer_ended(self, transfer_id: str) -> None:
            self.w.granted.clear()

    def complete(self, push_id: int) -> None:
        error = "LLM_TIMEOUT: injected" if push_id == self.fail_push else None
        self.pending.append(("push-done", lambda: self.producer.on_push_done(push_id, error)))

    def prefill_steps(self) -> list[Callable[[], None]]:
        steps: list[Callable[[], None]] = []
        before = self.prefill_cached
        for size in self.chunks:
            after = min(before + size, self.prompt)
            steps.append(self._compute_step(before, after))
            before = after
        finish = FinishedSend("p1", "tid", True, True)
        steps.append(lambda: self._step([], [finish]))
        return steps

    def _compute_step(self, before: int, after: int) -> Callable[[], None]:
        send = SendStep("p1", "tid", tuple(self.src_blocks), before, after, self.prompt)

        def step() -> None:
            if before == self.prefill_cached and before:  # prefill's own prefix cache: already in memory
                for token in range(before):
                    for layer in range(self.layers):
                        self._write(token, layer)
            self.producer.begin_step([send])
            for layer in range(self.layers):
                for token in range(before, after):
                    self._write(token, layer)
                self.producer.layer_saved(layer)
            self.producer.end_step()
            self._collect()
        return step

    def _write(self, token: int, layer: int) -> None:
        self.p_mem[layer, self.src_blocks[token // self.bs], token % self.bs] = token * 10 + layer + 1

    def _step(self, sends: list[SendStep], finished: list[FinishedSend]) -> None:
        self.producer.begin_step(sends, finished)
        self.producer.end_step()
        self._collect()

    def _collect(self) -> None:
        self.producer.poll()
        self.consumer.poll()
        self.released.extend(self.producer.take_finished_sending())
        received = self.consumer.take_finished()
        if received.finished:
            self.received.append(received)

    def start_decode(self) -> None:
        blocks = tuple(self.dst_all[self.first_block:])
        self.consumer.begin_step([RecvSpec("d1", "tid", PREFILL, self.first_block, blocks, self.prompt)])

    def run(self, choose: Callable[[int], int]) -> None:
        """Run prefill steps (in order), the decode's start and every pending delivery or completion, in
        the order ``choose`` picks, until nothing is left."""
        steps = self.prefill_steps()
        decode_started = False
        for _ in range(10000):
            options: list[tuple[str, Callable[[], None]]] = list(self.pending)
            if steps:
                options.append(("prefill-step", steps[0]))
            if not decode_started:
                options.append(("decode", self.start_decode))
            if not options:
                return
            name, action = options[choose(len(options) - 1)]
            if name == "prefill-step":
                steps.pop(0)
            elif name == "decode":
                decode_started = True
            else:
                self.pending.remove((name, action))
            action()
            self._collect()
        raise AssertionError("the simulation did not settle")


@st.composite
def worlds(draw: st.DrawFn, failures: bool = False) -> World:
    block_size = draw(st.sampled_from([2, 4, 16]))
    layers = draw(st.integers(1, 3))
    prompt = draw(st.integers(1, 6 * block_size))
    n_blocks = core.blocks_for(prompt, block_size)
    first_block = draw(st.integers(0, n_blocks - 1))  # the decode always needs the last block
    prefill_cached = draw(st.integers(0, (prompt - 1) // block_size)) * block_size
    chunks, left = [], prompt - prefill_cached
    while left > 0:
        size = draw(st.integers(1, left))
        chunks.append(size)
        left -= size
    fail_push = draw(st.integers(1, 4)) if failures else None
    return World(block_size, layers, prompt, first_block, prefill_cached, chunks, fail_push)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(), data=st.data())
def test_any_interleaving_lands_every_token_of_every_layer_exactly_once(world: World, data: st.DataObject) -> None:
    world.run(lambda top: data.draw(st.integers(0, top)))
    assert world.received == [core.Received({"d1"}, set(), set())]  # the decode: LANDED, once
    assert world.released == ["p1"]  # the prefill: blocks released once, after the finish
    for i, block in enumerate(world.dst_all):
        for layer in range(world.layers):
            assert (world.d_mem[layer, block] == world.expected(i, layer)).all(), (i, layer)
    assert len(world.producer) == len(world.consumer) == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(failures=True), data=st.data())
def test_a_failed_push_is_never_reported_as_landed_and_nothing_leaks(world: World, data: st.DataObject) -> None:
    world.run(lambda top: data.draw(st.integers(0, top)))
    assert world.released == ["p1"]
    (received,) = world.received
    assert received.finished == {"d1"}
    failed = world.fail_push is not None and world.fail_push in world.pushes
    if failed:
        assert received.failed == {"d1"} and received.load_errors == set(world.dst_all[world.first_block:])
    else:
        assert received == core.Received({"d1"}, set(), set())
    assert len(world.producer) == len(world.consumer) == 0


@pytest.mark.parametrize(("ok", "delayed"), [(False, True), (True, False), (False, False)])
def test_a_scheduled_request_that_ends_badly_before_any_ids_is_released_once(ok: bool, delayed: bool) -> None:
    # the prefill request ran (or was about to) and ended aborted or undelayed before a decode sent its
    # ids: nobody to tell, released at once, reported only if vLLM delayed the free - exactly once
    book, fx, _ = producer()
    run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), 0, 64, 100)])
    run_step(book, [], [FinishedSend("p1", "tid", ok, delayed)])
    assert book.take_finished_sending() == ({"p1"} if delayed else set())
    assert len(book) == 0 and not fx.notified and book.ended("tid") is not None
    give_ids(book)  # the decode's ids come late: answered with how it ended, nothing pushed
    assert [(r.transfer_id, r.outcome) for _, r in fx.replies] == [("tid", Outcome.UNKNOWN)] and not fx.pushes
    book.poll()
    assert not book.take_finished_sending() and len(book) == 0


_PRODUCER_EVENTS = ("ids", "step", "finish_ok", "finish_abort", "abort", "link_lost", "push_ok", "push_error",
                    "notified_ok", "notified_error", "tick")


class _ProducerScript:
    """One prefill request (100 tokens, 4 blocks) and its transfer driven by a drawn sequence of the
    events vLLM and the engine can produce, in any order the contracts allow."""

    def __init__(self) -> None:
        self.book, self.fx, self.clock = producer(transfer_timeout_s=30, ids_timeout_s=10)
        self.computed, self.handed, self.finished, self.delayed = 0, False, False, False
        self.completed: set[int] = set()
        self.answered = 0
        self.reported: list[str] = []

    def _collect(self) -> None:
        self.reported += sorted(self.book.take_finished_sending())

    def apply(self, event: str) -> None:
        book, fx = self.book, self.fx
        if event == "ids":
            give_ids(book)
        elif event == "step" and not self.finished and self.computed < 100:
            after = min(self.computed + 40, 100)
            run_step(book, [SendStep("p1", "tid", (10, 11, 12, 13), self.computed, after, 100)])
            self.computed, self.handed = after, True
        elif event in ("finish_ok", "finish_abort") and not self.finished:
            ok = event == "finish_ok" and self.computed == 100
            self.finished, self.delayed = True, self.handed
            run_step(book, [], [FinishedSend("p1", "tid", ok, self.handed)])
        elif event == "abort":
            book.on_message(DECODE_CLUSTER, Abort("tid", "the decode gave up"))
        elif event == "link_lost":
            book.on_link_lost(DECODE_CLUSTER, "keepalive")
        elif event in ("push_ok", "push_error"):
            ready = [i for i, p in sorted(fx.pushes.items()) if i not in self.completed
                     and (p.finished or p.cancelled or not p.pipelined)]
            if ready:
                self.completed.add(ready[0])
                book.on_push_done(ready[0], None if event == "push_ok" else "LLM_TIMEOUT: link broke")
        elif event in ("notified_ok", "notified_error") and self.answered < len(fx.notified):
            self.answered += 1
            book.on_notified("tid", None if event == "notified_ok" else "LLM_NOT_YET_LINK: gone")
        elif event == "tick":
            self.clock.advance(11)
            book.poll()
        self._collect()

    def drain(self) -> None:
        """What always happens in the end: vLLM finishes the request, the engine completes every push
        and answers every notification, time passes."""
        for _ in range(20):
            for event in ("finish_abort", "push_ok", "notified_ok", "tick"):
                self.apply(event)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(st.sampled_from(_PRODUCER_EVENTS), max_size=25))
def test_any_sequence_of_producer_events_releases_the_blocks_exactly_once(events: list[str]) -> None:
    script = _ProducerScript()
    for event in events:
        script.apply(event)  # never raises: an exception here would kill vLLM's engine core
    script.drain()
    assert script.reported == (["p1"] if script.delayed else [])
    assert len(script.book) == 0
    assert all(p.finished or p.cancelled or not p.pipelined for p in script.fx.pushes.values())
    assert len(script.fx.notified) <= 1  # the decode is told the outcome at most once


_CONSUMER_EVENTS = ("ids_ok", "ids_busy", "ids_failed", "ids_failed_partly", "landed", "prefill_failed",
                    "wrong_count", "link_lost", "abort", "tick")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(st.sampled_from(_CONSUMER_EVENTS), max_size=25))
def test_any_sequence_of_consumer_events_reports_the_request_exactly_once(events: list[str]) -> None:
    book, fx, clock = consumer(transfer_timeout_s=10, abort_grace_s=3)
    book.begin_step([spec()])
    answered, reports = 0, []

    def apply(event: str) -> None:
        nonlocal answered
        outstanding = answered < len(fx.sent)
        if event.startswith("ids_") and outstanding:  # the bridge answers every send once, in order
            answered += 1
            error = None if event == "ids_ok" else "LLM_LINK_BUSY" if event == "ids_busy" else "LLM_TIMEOUT"
            book.on_ids_sent("tid", error, retryable=event == "ids_busy", delivered_any=event == "ids_failed_partly")
        elif event == "landed":
            book.on_message(PREFILL.cluster_id, landed())
        elif event == "prefill_failed":
            book.on_message(PREFILL.cluster_id, Done("tid", Outcome.FAILED, 0, "push failed"))
        elif event == "wrong_count":
            book.on_message(PREFILL.cluster_id, landed(blocks=2))
        elif event == "link_lost":
            book.on_link_lost(PREFILL.cluster_id, "keepalive")
        elif event == "abort":
            book.begin_step([], aborted=["r1"])
        elif event == "tick":
            clock.advance(4)
            book.poll()
        received = book.take_finished()
        if received.finished:
            reports.append(received)

    for event in events:
        apply(event)  # never raises: an exception here would kill vLLM's engine core
    for _ in range(10):  # in the end every send is answered and time passes
        apply("ids_ok")
        apply("tick")
    assert [r.finished for r in reports] == [{"r1"}] and len(book) == 0
    assert fx.open == {}  # however it ended, its blocks are no longer open to the prefill
    (report,) = reports
    assert report.failed <= report.finished
    assert report.load_errors == ({7, 8, 9} if report.failed else set())
