"""``kvpush proxy`` in front of two ``vllm serve`` processes with KvpushConnector, for real.

One module-scoped stack, its kvpush links authenticated with a token both servers read from
``KVPUSH_AUTH_TOKEN`` (the same outputs as without one): a prefill (``kv_producer``, OpenMP threads on core 0,
``--max-num-batched-tokens 64`` so long prompts are prefilled in chunks), a decode (``kv_consumer``,
core 1, ``kv_load_failure_policy`` recompute, a short ``transfer_timeout_s``) and ``kvpush proxy`` (a
subprocess of the kvpush CLI) in front of both; a single offline engine without a connector
(tests/vllm/single_reference.py) gives the reference tokens while the servers start. Greedy
decoding, loopback only. Every prompt is distinct (no shared first block), so the tokens a decode
reports as cached came from the pushed KV, not from its own prefix cache.

The failure tests come last, in this order: a client that leaves (mid-stream; while the decode waits
for the KV), a prefill whose HTTP server does not answer (its kvpush engine up), a hung prefill (woken up
after), a prefill killed mid-request, requests sent to the decode for a dead prefill. A test that finds the
prefill dead (run out of order) starts it again on the same ports. The proxy gives the decode its copy
of a request only once a prefill accepted one: to make the decode wait for KV, a test freezes the
prefill's worker process (its model and kvpush engine), not its API server.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpush.integrations.vllm.core import decode_request_params

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving import (  # noqa: E402
    KV_CONNECTOR,
    MODEL_NAME,
    Server,
    free_port,
    hang_up,
    healthy,
    log_lines,
    log_size,
    metric_sum,
    metrics,
    open_request,
    post,
    routable,
    start_proxy,
    start_vllm,
    start_vllm_router,
    stream_events,
    wait_for,
    wait_healthy,
)

MAX_TOKENS = 12
PREFILL_BATCH_TOKENS = 64  # the prefill's token budget per step: prompts longer than this are chunked
TRANSFER_TIMEOUT_S = 10.0  # the decode's deadline from allocation to the last byte
IDS_TIMEOUT_S = 10.0  # how long a prefill keeps a finished request's blocks for block ids that do not come
ABORT_GRACE_S = 3.0  # how long a decode waits for the prefill to confirm an abort
ACCEPT_TIMEOUT_S = 5.0  # the proxy's default: how long a prefill may take to accept a request
# how long the prefill holds a request for its decode's block ids (50 ms by default): long here, so a loaded
# host cannot make the pipelining test depend on timing
IDS_WAIT_MS = 5000
TOKEN = {"KVPUSH_AUTH_TOKEN": "a-shared-secret-of-this-test"}
DECODE_MODEL_LEN = 4096  # the decode's context (the tiny model's whole): long generations for clients that leave
STARTUP_S = 300.0
WORDS = ("the cache block layer prefill decode push token model engine request memory page tensor head value key "
         "attention batch queue stream socket link cluster transfer river mountain city garden window").split()

# token-id prompts: shorter than a block (32), around a block, several blocks, chunked on the prefill (> 64)
_rng = random.Random(20261211)


def _ids(n: int) -> list[int]:
    return [_rng.randrange(50, 1900) for _ in range(n)]


def _chat(words: int) -> list[dict[str, str]]:
    text = " ".join(_rng.choice(WORDS) for _ in range(words))
    return [{"role": "system", "content": f"Request {_rng.randrange(10**6)}."}, {"role": "user", "content": text}]


COMPLETIONS = [_ids(n) for n in (1, 5, 31, 32, 33, 64, 100, 300, 700)]
STREAMED = [_ids(n) for n in (2, 20, 48, 96, 257, 520)]
CONCURRENT = [_ids(n) for n in (3, 30, 33, 65, 128, 200, 350, 600)]
AFTER_ABORT = [_ids(n) for n in (7, 90)]
AFTER_LEAVE, HUNG, AFTER_HANG, KILLED, PREFILL_DOWN = _ids(36), _ids(120), _ids(66), _ids(150), _ids(70)
NO_HTTP, AFTER_NO_HTTP = _ids(90), _ids(45)
DEAD_PREFILL = [_ids(20 + 37 * i) for i in range(12)]  # more at once than the decode's 8 running slots
HELD = [_ids(n) for n in (20, 40, 65, 200)]  # each pushed during its prefill's forward (200: in 4 chunks)
NO_DECODE = _ids(50)  # a prefill request whose decode never comes
ABORTED, LEFT_WAITING = _ids(50), _ids(80)  # no reference: never answered
CHATS = [_chat(n) for n in (1, 6, 25, 60, 150, 300)]
STREAMED_CHATS = [_chat(n) for n in (10, 120)]
# behind vllm-router: the Mooncake contract (the last one streamed), prefill-first with the params relayed
MOONCAKE = [_ids(n) for n in (24, 70, 160, 110)]
RELAYED = [_ids(n) for n in (26, 90)]
LLMD = [_ids(n) for n in (40, 100, 230)]  # llm-d's sidecar's exact shapes: decode's leg before, with, after
REFUSED = [_ids(44), _ids(52)]  # decode legs naming an engine the bootstrap server lacks, or no prefill at all
LEG_MISSING = _ids(60)  # a Mooncake decode leg whose prefill leg never comes
PROMPTS = [*COMPLETIONS, *STREAMED, *CONCURRENT, *AFTER_ABORT, AFTER_LEAVE, HUNG, AFTER_HANG, KILLED, PREFILL_DOWN,
           NO_HTTP, AFTER_NO_HTTP, *HELD, *DEAD_PREFILL, *MOONCAKE, *RELAYED, *LLMD, *REFUSED, LEG_MISSING]
assert len({tuple(p[:32]) for p in PROMPTS + [ABORTED, LEFT_WAITING, NO_DECODE]}) == len(PROMPTS) + 3  # no shared
# first block


@dataclass
class Stack:
    prefill: Server
    decode: Server
    proxy: Server
    reference: dict[str, list[dict[str, Any]]]  # "prompts" (PROMPTS' order), "chats" (CHATS + STREAMED_CHATS)
    startup_s: float
    start_prefill: Callable[[], Server]  # the prefill again, on the same ports
    kv_port: int  # the prefill's kvpush engine listens on 127.0.0.1 at this port
    bootstrap_port: int  # the prefill serves the Mooncake bootstrap contract (GET /query) here
    work: Path

    def ref(self, prompt: list[int]) -> list[int]:
        tokens: list[int] = self.reference["prompts"][PROMPTS.index(prompt)]["tokens"]
        return tokens

    def chat_ref(self, chat: list[dict[str, str]]) -> dict[str, Any]:
        row: dict[str, Any] = self.reference["chats"][(CHATS + STREAMED_CHATS).index(chat)]
        return row


def _kv_config(role: str, kv_port: int, **extra: Any) -> dict[str, Any]:
    config = {**KV_CONNECTOR, "kv_role": role, "kv_port": kv_port, "kv_connector_extra_config": extra}
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = "recompute"
    return config


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("proxy")
    started = time.monotonic()
    requests = work / "requests.json"
    # (chats: the tiny model's tokenizer carries its chat template, as a real model's does: no --chat-template)
    requests.write_text(json.dumps({"prompts": PROMPTS, "chats": CHATS + STREAMED_CHATS, "max_tokens": MAX_TOKENS,
                                    "max_num_batched_tokens": PREFILL_BATCH_TOKENS}))
    reference_out = work / "reference.json"
    with open(work / "reference.log", "wb") as log:  # the child keeps its own copy of the descriptor
        reference = subprocess.Popen(
            [sys.executable, str(HERE / "single_reference.py"), str(tiny_model), "--requests", str(requests), "--out",
             str(reference_out), "--core", "1"], stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, VLLM_HOST_IP="127.0.0.1"), start_new_session=True)
    kv_port, prefill_port, bootstrap_port = free_port(span=2), free_port(), free_port()
    servers: dict[str, Server] = {}

    def start_prefill() -> Server:
        servers["prefill"] = start_vllm(
            "prefill", tiny_model, "0", _kv_config("kv_producer", kv_port, ids_timeout_s=IDS_TIMEOUT_S,
                                                       ids_wait_ms=IDS_WAIT_MS, bootstrap_port=bootstrap_port), work,
            "--max-num-batched-tokens", str(PREFILL_BATCH_TOKENS), port=prefill_port, env=TOKEN)
        return servers["prefill"]

    try:
        start_prefill()
        servers["decode"] = start_vllm("decode", tiny_model, "1", _kv_config(
            "kv_consumer", kv_port, transfer_timeout_s=TRANSFER_TIMEOUT_S, abort_grace_s=ABORT_GRACE_S), work,
            "--max-num-batched-tokens", "128", "--enable-log-requests", "--max-model-len", str(DECODE_MODEL_LEN),
            env=TOKEN)
        wait_healthy(list(servers.values()), STARTUP_S)
        assert reference.wait(timeout=max(10.0, STARTUP_S - (time.monotonic() - started))) == 0, \
            (work / "reference.log").read_text()[-4000:]
        servers["proxy"] = start_proxy("proxy", [f"{servers['prefill'].url}#kv={kv_port}"], [servers["decode"].url],
                                       work, "--static")
        wait_healthy([servers["proxy"]], 30)
        yield Stack(servers["prefill"], servers["decode"], servers["proxy"], json.loads(reference_out.read_text()),
                    time.monotonic() - started, start_prefill, kv_port, bootstrap_port, work)
    finally:
        if reference.poll() is None:
            reference.kill()
        reference.wait(timeout=30)
        for name in ("proxy", "decode", "prefill"):
            if name in servers:
                servers[name].stop()


@pytest.fixture
def pd(stack: Stack) -> Stack:
    """The stack with a live prefill (started again if a test killed it)."""
    if not stack.prefill.alive():
        stack.prefill.stop()
        stack.prefill = stack.start_prefill()
        wait_healthy([stack.prefill, stack.proxy], STARTUP_S)
    return stack


def _body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def _cached(usage: dict[str, Any] | None) -> int | None:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def _all_cached(prompt_len: int, cached: int | None) -> bool:
    """vLLM reports the whole prompt as cached when the connector loaded it (a one-token prompt has no
    KV to push: it is computed on the decode)."""
    return cached is not None and cached >= prompt_len - (1 if prompt_len == 1 else 0)


def _complete(url: str, prompt: list[int], timeout: float = 120) -> dict[str, Any]:
    status, answer = post(f"{url}/v1/completions", _body(prompt), timeout=timeout)
    assert status == 200, answer
    choice = answer["choices"][0]
    return {"tokens": choice["token_ids"], "finish": choice["finish_reason"], "cached": _cached(answer.get("usage")),
            "prompt_tokens": answer["usage"]["prompt_tokens"]}


def _stream(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    tokens: list[int] = []
    finish, usage, chunks = None, None, 0
    for event in stream_events(f"{url}{path}", {**body, "stream": True, "stream_options": {"include_usage": True}}):
        for choice in event.get("choices") or []:
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            chunks += 1
        usage = event.get("usage") or usage
    return {"tokens": tokens, "finish": finish, "cached": _cached(usage), "chunks": chunks,
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


def _check(rows: list[tuple[int, list[int], dict[str, Any]]], what: str, answered_cached: bool = True) -> None:
    """Print the equality table; assert every row equal to the reference and all its prompt cached (as the
    answer says; ``answered_cached`` False: a router that rewrites the answer's usage, checked by the caller on
    the decode's own counters instead)."""
    print(f"\n{what}\n| prompt tokens | tokens equal | cached tokens | finish |\n|---|---|---|---|")
    bad = []
    for length, expected, got in rows:
        equal = got["tokens"] == expected
        print(f"| {length} | {'yes' if equal else 'NO'} | {got['cached']} | {got['finish']} |")
        if not (equal and got["finish"] == "length" and (not answered_cached or _all_cached(length, got["cached"]))):
            bad.append((length, expected, got))
    assert not bad, bad


@pytest.mark.timeout(STARTUP_S + 200)
def test_completions_through_the_proxy_equal_a_single_instance_and_use_the_pushed_kv(pd: Stack) -> None:
    print(f"stack healthy and reference done in {pd.startup_s:.1f} s")
    rows = [(len(p), pd.ref(p), _complete(pd.proxy.url, p)) for p in COMPLETIONS]
    assert log_lines(pd.prefill, "ready over", "authenticated") and not log_lines(pd.prefill, "insecure")
    _check(rows, "/v1/completions through kvpush proxy")


def _pushes(server: Server) -> dict[str, float]:
    """The prefill's pushes so far: each layer during the forward that computed it, or after the forward."""
    values = metrics(server.url)
    return {when: metric_sum(values, "vllm:kvpush_pushes_total", f'when="{when}"')
            for when in ("in_forward", "after_forward")}


@pytest.mark.timeout(300)
def test_every_request_through_the_proxy_is_pushed_during_its_prefills_forward(pd: Stack) -> None:
    """The proxy sends both copies at once; with ``ids_wait_ms`` set, the prefill holds the request until the
    decode's block ids came, so every layer is pushed as its forward computes it (the tiny model's forward takes
    less time than the ids' way: without the hold they would join it late or come after it)."""
    before = _pushes(pd.prefill)
    rows = [(len(p), pd.ref(p), _complete(pd.proxy.url, p)) for p in HELD]
    _check(rows, "/v1/completions through kvpush proxy, one at a time")
    # a chunked prompt pushes once per chunk; the counters reach /metrics with the engine's next step
    assert wait_for(lambda: _pushes(pd.prefill)["in_forward"] - before["in_forward"] >= len(HELD), 15, 0.2)
    after = _pushes(pd.prefill)
    print(f"pushes during the forward {after['in_forward'] - before['in_forward']:g}, "
          f"after it {after['after_forward'] - before['after_forward']:g}")
    assert after["after_forward"] == before["after_forward"]


@pytest.mark.timeout(200)
def test_a_prefill_request_whose_decode_never_comes_is_held_no_longer_than_its_bound(pd: Stack) -> None:
    """A prefill's copy whose decode never sends block ids (the proxy lost the decode) runs once the hold
    ends and answers; its blocks wait for the ids ``ids_timeout_s`` and are freed."""
    before = _pushes(pd.prefill)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": uuid.uuid4().hex}
    status, answer = post(f"{pd.prefill.url}/v1/completions", {**_body(NO_DECODE, max_tokens=1),
                                                                "kv_transfer_params": params}, timeout=120)
    assert status == 200, answer
    assert len(answer["choices"][0]["token_ids"]) == 1
    assert _pushes(pd.prefill) == before  # nothing to push to
    assert _wait_idle(pd.prefill, IDS_TIMEOUT_S + 30)["kv_usage"] == 0


@pytest.mark.timeout(200)
def test_a_prefill_listening_where_other_hosts_reach_it_without_a_token_does_not_start(
        tiny_model: Path, tmp_path: Path) -> None:
    config = _kv_config("kv_producer", free_port(span=2), host="0.0.0.0")
    server = start_vllm("open-prefill", tiny_model, "0", config, tmp_path, env={"KVPUSH_AUTH_TOKEN": ""})
    try:
        assert wait_for(lambda: not server.alive(), 150, 0.5), "a prefill listening on 0.0.0.0 without a token started"
        refusal = log_lines(server, "KVPUSH_AUTH_TOKEN")
        print(refusal[-1][-400:] if refusal else server.tail())
        assert refusal and '"insecure": true' in refusal[-1] and "0.0.0.0" in refusal[-1]
    finally:
        server.stop()


@pytest.mark.timeout(200)
def test_streamed_completions_through_the_proxy_equal_a_single_instance(pd: Stack) -> None:
    """Greedy streams: the client gets the prefill's first token (when it comes before the decode's, as it
    does unless the host stalls the prefill after its forward) and then the decode's stream without its copy
    of that token; every stream equals a single instance's, token for token, whichever came first."""
    def first_tokens() -> dict[str, float]:
        values = metrics(pd.proxy.url)
        return {what: metric_sum(values, f"kvpush_proxy_first_token_{what}_total") for what in ("prefill", "mismatch")}

    before = first_tokens()
    rows = [(len(p), pd.ref(p), _stream(pd.proxy.url, "/v1/completions", _body(p))) for p in STREAMED]
    _check(rows, "/v1/completions, stream, through kvpush proxy")
    chunks = [got["chunks"] for _, _, got in rows]
    after = first_tokens()
    print(f"events per stream: {chunks}; first token from the prefill: {after['prefill'] - before['prefill']:g} "
          f"of {len(rows)}")
    # streamed, not one final chunk: a server that fell behind may hand a stream's 12 tokens over in one
    # event, but never every stream's
    assert sum(chunks) > len(rows), chunks
    assert after["mismatch"] == before["mismatch"]
    # the decode's first token needs the last layer landed and then a step of its own, so the prefill's
    # comes first for (almost) every stream; all six losing that race would mean leading never happens
    assert after["prefill"] > before["prefill"]


@pytest.mark.timeout(200)
def test_chat_completions_through_the_proxy_equal_a_single_instance(pd: Stack) -> None:
    """Chats through the proxy equal a single instance's; the proxy tokenizes them for placement with the model's
    chat template (after the first one, which vLLM's /tokenize also renders, showed that both give the same ids),
    not with a round trip to an instance per chat."""
    def chats_tokenized() -> dict[str, float]:
        values = metrics(pd.proxy.url)
        return {where: metric_sum(values, "kvpush_proxy_chats_tokenized_total", f'where="{where}"')
                for where in ("here", "instance")}

    # (the proxy loads the model's tokenizer in the background at start-up: importing transformers takes seconds)
    assert wait_for(lambda: metric_sum(metrics(pd.proxy.url), "kvpush_proxy_tokenizer_local") == 1, 120)
    before = chats_tokenized()
    rows = []
    for chat in CHATS:
        reference = pd.chat_ref(chat)
        status, answer = post(f"{pd.proxy.url}/v1/chat/completions", {
            "model": MODEL_NAME, "messages": chat, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True})
        assert status == 200, answer
        assert answer["prompt_token_ids"] == reference["prompt_ids"]  # the server rendered the chat as LLM.chat did
        choice = answer["choices"][0]
        rows.append((len(reference["prompt_ids"]), reference["tokens"], {
            "tokens": choice["token_ids"], "finish": choice["finish_reason"], "cached": _cached(answer["usage"])}))
    for chat in STREAMED_CHATS:
        reference = pd.chat_ref(chat)
        got = _stream(pd.proxy.url, "/v1/chat/completions", {
            "model": MODEL_NAME, "messages": chat, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True})
        assert got["prompt_tokens"] == len(reference["prompt_ids"])
        rows.append((len(reference["prompt_ids"]), reference["tokens"], got))
    _check(rows, "/v1/chat/completions through kvpush proxy (the last two streamed)")
    after = chats_tokenized()
    here, there = after["here"] - before["here"], after["instance"] - before["instance"]
    assert here + there == len(rows)  # (static placement: every chat's ids)
    # the one that decided; then the proxy's own rendering, as vLLM's gave the same ids
    assert there <= 1, f"{there:g} of {len(rows)} chats tokenized by vLLM: the proxy's rendering differed from vLLM's"
    assert len(rows) >= 6 and any(length > PREFILL_BATCH_TOKENS for length, _, _ in rows)


@pytest.mark.timeout(200)
def test_eight_concurrent_requests_through_the_proxy_all_equal(pd: Stack) -> None:
    before = metrics(pd.decode.url)
    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
        answers = list(pool.map(lambda p: _complete(pd.proxy.url, p), CONCURRENT))
    _check([(len(p), pd.ref(p), got) for p, got in zip(CONCURRENT, answers)], "8 concurrent /v1/completions")
    after = metrics(pd.decode.url)
    # vLLM's own count of prompt tokens that came from the connector ("external" prefix-cache hits)
    external = metric_sum(after, "vllm:external_prefix_cache_hits_total") - metric_sum(
        before, "vllm:external_prefix_cache_hits_total")
    print(f"decode external prefix-cache hits for the 8 requests: {external:g} tokens")
    assert external >= sum(len(p) - 1 for p in CONCURRENT)


# -- behind the field's routers: vllm-router (both of its P/D modes), llm-d's sidecar's shapes -------------------

@pytest.fixture(scope="module")
def routers(stack: Stack) -> Iterator[dict[str, Server]]:
    """vllm-router 0.1.17 in front of the stack's prefill and decode, once per P/D mode: ``mooncake`` (it asks
    the prefill's ``/query`` for its engine id before it serves, then sends the prefill's leg and the decode's
    with the Mooncake params) and ``nixl`` (prefill first, the prefill's ``kv_transfer_params`` relayed)."""
    started: dict[str, Server] = {}
    try:
        for mode in ("mooncake", "nixl"):
            started[mode] = start_vllm_router(f"vllm-router-{mode}", stack.prefill.url, stack.decode.url, stack.work,
                                              mode, stack.bootstrap_port if mode == "mooncake" else None)
        wait_healthy(list(started.values()), 150)
        yield started
    finally:
        for server in started.values():
            server.stop()


def _external_hits(server: Server) -> float:
    """vLLM's count of prompt tokens the connector claimed (its "external" prefix-cache hits: counted when
    claimed, so a load that then fails counts too)."""
    return metric_sum(metrics(server.url), "vllm:external_prefix_cache_hits_total")


def _received(server: Server) -> dict[str, float]:
    """The decode's transfers so far, by outcome (the connector's counters, in /metrics from the next step)."""
    values = metrics(server.url)
    return {outcome: metric_sum(values, "vllm:kvpush_transfers_total", f'outcome="{outcome}"')
            for outcome in ("landed", "failed")}


def _received_since(server: Server, before: dict[str, float], landed: int, failed: int) -> dict[str, float]:
    """Wait until the decode's counters moved by ``landed`` and ``failed`` transfers since ``before`` (bounded);
    the moves seen."""
    moved: dict[str, float] = {}

    def reached() -> bool:
        now = _received(server)
        moved.update({key: now[key] - before[key] for key in now})
        return moved["landed"] >= landed and moved["failed"] >= failed

    wait_for(reached, 15, 0.2)
    return moved


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["mooncake", "nixl"])
def test_vllm_router_drives_the_connector_unchanged_in_both_of_its_pd_modes(
        pd: Stack, routers: dict[str, Server], mode: str) -> None:
    """vllm-router 0.1.17 ``--vllm-pd-disaggregation --kv-connector mooncake``: it learnt the prefill's engine
    id from ``/query`` at start-up (it does not serve without it) and sends the Mooncake params; the decode
    finds the prefill's kvpush ranks from the same ``/query``. ``--kv-connector nixl``: the prefill's answer's
    params relayed. Either way every answer equals a single instance's and the decode loads the whole prompt
    (vLLM's external prefix-cache hits)."""
    prompts = MOONCAKE if mode == "mooncake" else RELAYED
    router, since = routers[mode], log_size(pd.decode)
    before, received = _external_hits(pd.decode), _received(pd.decode)
    rows = [(len(p), pd.ref(p), _complete(router.url, p)) for p in prompts[:3]]
    if mode == "mooncake":
        rows.append((len(prompts[3]), pd.ref(prompts[3]), _stream(router.url, "/v1/completions", _body(prompts[3]))))
    # vllm-router 0.1.17 answers the decode's tokens with usage that says nothing was cached (the decode's own
    # answer, asked directly, says every prompt token was): vLLM's counter of tokens the connector loaded decides
    _check(rows, f"/v1/completions through vllm-router --kv-connector {mode}", answered_cached=False)
    external = _external_hits(pd.decode) - before
    moved = _received_since(pd.decode, received, len(rows), 0)
    print(f"decode external prefix-cache hits: {external:g} tokens; transfers {moved}")
    assert external >= sum(len(p) - 1 for p in prompts) and moved == {"landed": len(rows), "failed": 0}
    assert not log_lines(pd.decode, "cannot be loaded", since=since)
    if mode == "mooncake":
        assert log_lines(pd.prefill, "Mooncake bootstrap contract")


def _llmd_legs(pd: Stack, prompt: list[int], order: str) -> dict[str, Any]:
    """One request as llm-d's routing sidecar sends it with ``--kv-connector mooncake``
    (llm-d/llm-d-router ``pkg/sidecar/proxy/connector_mooncake.go``, which cannot be installed from a package
    index): the engine id from the prefill's ``/query``, an ``xfer-`` transfer id, the prefill's leg capped to
    one token, not streamed, without ``min_tokens``, with ``X-data-parallel-rank``; the decode's the client's
    body with the Mooncake params. ``order``: the decode's leg before the prefill's, with it, or after it."""
    bootstrap = f"http://127.0.0.1:{pd.bootstrap_port}"
    with urllib.request.urlopen(f"{bootstrap}/query", timeout=10) as reply:
        dp_rank, entry = next(iter(json.loads(reply.read()).items()))
    transfer_id = f"xfer-{uuid.uuid4()}"
    body = _body(prompt)
    to_prefill = {**body, "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_prefill": False, "do_remote_decode": True, "transfer_id": transfer_id}}
    to_decode = {**body, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap, "remote_engine_id": entry["engine_id"]}}

    def prefill() -> tuple[int, dict[str, Any]]:
        return post(f"{pd.prefill.url}/v1/completions", to_prefill, headers={"X-data-parallel-rank": dp_rank})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        if order == "prefill-first":
            assert prefill()[0] == 200
        prefilled = pool.submit(prefill) if order == "together" else None
        decoded = pool.submit(post, f"{pd.decode.url}/v1/completions", to_decode)
        if order == "decode-first":
            assert _waiting(pd.decode), "the decode's leg did not come to wait for its KV"
            prefilled = pool.submit(prefill)
        status, answer = decoded.result()
        assert prefilled is None or prefilled.result()[0] == 200
    assert status == 200, answer
    choice = answer["choices"][0]
    return {"tokens": choice["token_ids"], "finish": choice["finish_reason"], "cached": _cached(answer.get("usage"))}


@pytest.mark.timeout(300)
def test_llm_d_s_concurrent_mooncake_legs_load_the_kv_whichever_leg_comes_first(pd: Stack) -> None:
    since, before = log_size(pd.decode), _received(pd.decode)
    rows = [(len(p), pd.ref(p), _llmd_legs(pd, p, order))
            for p, order in zip(LLMD, ("decode-first", "together", "prefill-first"))]
    _check(rows, "llm-d's sidecar's Mooncake legs: the decode's before, with, after the prefill's")
    assert _received_since(pd.decode, before, len(LLMD), 0) == {"landed": len(LLMD), "failed": 0}
    assert not log_lines(pd.decode, "cannot be loaded", since=since)
    assert _wait_idle(pd.prefill, IDS_TIMEOUT_S + 30)["kv_usage"] == 0  # every prefill block was released


@pytest.mark.timeout(300)
def test_a_decode_leg_naming_no_usable_prefill_is_refused_at_once_and_never_loads_from_a_guess(pd: Stack) -> None:
    """A Mooncake leg whose engine id the bootstrap server lacks (the prefill restarted), and a leg that names
    no prefill at all: refused at once with the reason (this decode's kv_load_failure_policy is recompute, so
    it computes them itself); nothing is loaded from anywhere."""
    since, before = log_size(pd.decode), _received(pd.decode)
    unknown = {"do_remote_prefill": True, "transfer_id": f"xfer-{uuid.uuid4()}",
               "remote_bootstrap_addr": f"http://127.0.0.1:{pd.bootstrap_port}", "remote_engine_id": "no-such-engine"}
    nameless = {"do_remote_prefill": True, "transfer_id": uuid.uuid4().hex}
    rows = []
    for prompt, params in zip(REFUSED, (unknown, nameless)):
        status, answer = post(f"{pd.decode.url}/v1/completions", {**_body(prompt), "kv_transfer_params": params},
                              timeout=TRANSFER_TIMEOUT_S)  # refused at once: never the transfer's deadline
        assert status == 200, answer
        rows.append((prompt, answer["choices"][0]["token_ids"]))
    assert all(tokens == pd.ref(prompt) for prompt, tokens in rows)
    assert _received_since(pd.decode, before, 0, 2) == {"landed": 0, "failed": 2}  # refused, nothing loaded
    refusals = log_lines(pd.decode, "cannot be loaded", since=since)
    print("\n".join(line[-300:] for line in refusals))
    assert any("serves no engine 'no-such-engine'" in line for line in refusals)
    assert any("name no prefill" in line for line in refusals)


@pytest.mark.timeout(300)
def test_a_mooncake_decode_leg_whose_prefill_leg_never_comes_is_computed_after_its_deadline_and_frees_all(
        pd: Stack) -> None:
    transfer_id = f"xfer-{uuid.uuid4()}"
    with urllib.request.urlopen(f"http://127.0.0.1:{pd.bootstrap_port}/query", timeout=10) as reply:
        engine_id = json.loads(reply.read())["0"]["engine_id"]
    params = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
              "remote_bootstrap_addr": f"http://127.0.0.1:{pd.bootstrap_port}", "remote_engine_id": engine_id}
    status, answer = post(f"{pd.decode.url}/v1/completions", {**_body(LEG_MISSING), "kv_transfer_params": params},
                          timeout=TRANSFER_TIMEOUT_S + 60)
    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == pd.ref(LEG_MISSING)  # recomputed (its policy) after the deadline
    assert _wait_idle(pd.decode, 30)["kv_usage"] == 0
    assert _wait_idle(pd.prefill, IDS_TIMEOUT_S + 30)["kv_usage"] == 0


def _idle(url: str) -> dict[str, float]:
    values = metrics(url)
    return {"running": metric_sum(values, "vllm:num_requests_running"),
            "waiting": metric_sum(values, "vllm:num_requests_waiting"),
            "kv_usage": metric_sum(values, "vllm:kv_cache_usage_perc")}


def _wait_idle(server: Server, timeout_s: float) -> dict[str, float]:
    """Wait until ``server`` runs and waits for nothing and uses no KV block (at most ``timeout_s``)."""
    state: dict[str, float] = {}

    def idle() -> bool:
        state.update(_idle(server.url))
        return not any(state.values())

    wait_for(idle, timeout_s, 0.5)
    return state


def _waiting(server: Server, timeout_s: float = 10) -> bool:
    """Wait until ``server`` has a request waiting (for remote KV, here) and holds KV blocks for it."""
    def waiting() -> bool:
        state = _idle(server.url)
        return state["waiting"] >= 1 and state["kv_usage"] > 0

    return wait_for(waiting, timeout_s)


def _aborted(server: Server, request_id: str, timeout_s: float = 15) -> list[str]:
    """Wait until ``server``'s log says it aborted the request (``--enable-log-requests``)."""
    wait_for(lambda: bool(log_lines(server, "Aborted request", request_id)), timeout_s)
    return log_lines(server, "Aborted request", request_id)


def _wake(server: Server, signal_all: bool, proxy_url: str) -> None:
    """SIGCONT a stopped server (its worker alone, or every process), then let it settle before the next
    request (on waking, its HTTP server closes the keep-alive connections whose idle timeout passed) and
    wait until the proxy routes to it again (a prefill whose kvpush engine did not answer is held out until
    it answers a probe)."""
    if signal_all:
        server.signal_group(signal.SIGCONT)
    else:
        server.signal_workers(signal.SIGCONT)
    wait_healthy([server], 30)
    assert wait_for(lambda: routable(proxy_url, server.url), 30), "the proxy did not route to it again"
    time.sleep(0.5)


def _kvpush_lines(server: Server, since: int) -> str:
    """The connector's log lines (vLLM's format) since byte ``since`` of ``server``'s log, for the report."""
    modules = ("consumer", "producer", "scheduler", "worker", "bridge")
    return "\n".join(line[-320:] for line in log_lines(server, since=since)
                     if any(f"[{module}.py:" in line for module in modules))


@pytest.mark.timeout(200)
def test_a_client_that_leaves_mid_stream_leaves_the_servers_healthy(pd: Stack) -> None:
    # as many tokens as the decode's context allows, so that the decode is still generating when the
    # client leaves after its first tokens, however fast the machine
    max_tokens, request_id = DECODE_MODEL_LEN - len(ABORTED), f"leave-mid-stream-{uuid.uuid4().hex}"
    finished_before = metric_sum(metrics(pd.decode.url), "vllm:request_success_total")
    events = stream_events(f"{pd.proxy.url}/v1/completions", _body(ABORTED, max_tokens=max_tokens, stream=True),
                           headers={"X-Request-Id": request_id})
    received: list[int] = []
    for event in events:
        received += event["choices"][0].get("token_ids") or []
        if received:
            break
    events.close()  # the client closes its connection mid-stream
    left = time.monotonic()
    aborted = _aborted(pd.decode, request_id)
    print(f"decode: {aborted[-1][-160:] if aborted else 'no abort logged'} ({time.monotonic() - left:.2f} s after "
          f"the client left with {len(received)} of {max_tokens} tokens)")
    finished = metric_sum(metrics(pd.decode.url), "vllm:request_success_total") - finished_before
    assert aborted, (f"the decode did not abort the request of the client that left ({finished:.0f} request(s) "
                     f"finished meanwhile); decode log: {log_lines(pd.decode, request_id)[-4:]}; proxy log: "
                     f"{log_lines(pd.proxy)[-6:]}")
    assert all(healthy(s.url) for s in (pd.proxy, pd.prefill, pd.decode))
    rows = [(len(p), pd.ref(p), _complete(pd.proxy.url, p)) for p in AFTER_ABORT]
    _check(rows, "/v1/completions after a client left mid-stream")
    decode_state, prefill_state = _wait_idle(pd.decode, 15), _wait_idle(pd.prefill, IDS_TIMEOUT_S + 10)
    print(f"then: decode {decode_state}, prefill {prefill_state}")
    assert not any(decode_state.values()) and not any(prefill_state.values()), (decode_state, prefill_state)


@pytest.mark.timeout(200)
def test_a_client_that_leaves_while_the_decode_waits_for_the_kv_frees_both_sides(pd: Stack) -> None:
    request_id, decode_log, prefill_log = f"leave-waiting-{uuid.uuid4().hex}", log_size(pd.decode), log_size(pd.prefill)
    assert pd.prefill.workers(), "no worker process found"
    pd.prefill.signal_workers(signal.SIGSTOP)  # its API server accepts the request, its kvpush engine never pushes
    try:
        connection = open_request(f"{pd.proxy.url}/v1/completions", _body(LEFT_WAITING, stream=True),
                                  {"X-Request-Id": request_id})
        assert _waiting(pd.decode), f"the decode never waited for the KV: {_idle(pd.decode.url)}"
        hang_up(connection)  # the client leaves before the first token
        left = time.monotonic()
        aborted = _aborted(pd.decode, request_id)
        state = _wait_idle(pd.decode, ABORT_GRACE_S + 10)
        freed = time.monotonic() - left
        print(f"decode {freed:.2f} s after the client left: {state}; {len(aborted)} abort line(s)\n"
              f"{_kvpush_lines(pd.decode, decode_log)}")
        assert aborted and not any(state.values()), state
    finally:
        _wake(pd.prefill, signal_all=False, proxy_url=pd.proxy.url)
    # the prefill's worker wakes up to a request whose client left: it still serves the next one
    _check([(len(AFTER_LEAVE), pd.ref(AFTER_LEAVE), _complete(pd.proxy.url, AFTER_LEAVE))],
           "through the prefill after its worker woke up")
    woke = time.monotonic()
    state = _wait_idle(pd.prefill, IDS_TIMEOUT_S + 10)
    print(f"prefill {time.monotonic() - woke:.2f} s after answering: {state}\n{_kvpush_lines(pd.prefill, prefill_log)}")
    assert not any(state.values()), state


@pytest.mark.timeout(200)
def test_a_prefill_whose_http_server_is_not_up_never_makes_the_decode_wait(pd: Stack) -> None:
    """The window of a prefill's restart (issue 19): its kvpush engine listens (it starts with the engine
    core) while its HTTP server does not answer yet. A decode given the request then linked, sent its block
    ids to an engine whose vLLM never got the request, and waited for its transfer_timeout_s. Here the
    prefill's API server is frozen, its engine running."""
    decode_log, request_id = log_size(pd.decode), f"no-http-{uuid.uuid4().hex}"
    os.kill(pd.prefill.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        status, answer = post(f"{pd.proxy.url}/v1/completions", _body(NO_HTTP), timeout=60,
                              headers={"X-Request-Id": request_id})
        elapsed = time.monotonic() - started
    finally:
        _wake(pd.prefill, signal_all=True, proxy_url=pd.proxy.url)
    lines = _kvpush_lines(pd.decode, decode_log)
    print(f"answer {elapsed:.2f} s after the request: status {status}\n{lines}")
    assert status == 200 and answer["choices"][0]["token_ids"] == pd.ref(NO_HTTP), answer
    assert "not landed" not in lines and not log_lines(pd.decode, request_id, "WAITING_FOR_REMOTE_KVS")
    assert elapsed < ACCEPT_TIMEOUT_S + 5
    _check([(len(AFTER_NO_HTTP), pd.ref(AFTER_NO_HTTP), _complete(pd.proxy.url, AFTER_NO_HTTP))],
           "through the prefill once its HTTP server answers again")


@pytest.mark.timeout(200)
def test_a_hung_prefill_is_passed_over_and_serves_again_once_it_wakes(pd: Stack) -> None:
    """A frozen prefill never accepts the request: after the proxy's accept timeout the decode computes it
    alone, at once (it never waits for KV)."""
    request_id, decode_log, prefill_log = f"hung-{uuid.uuid4().hex}", log_size(pd.decode), log_size(pd.prefill)
    pd.prefill.signal_group(signal.SIGSTOP)  # every process of it: its kvpush engine stops answering too
    try:
        started = time.monotonic()
        status, answer = post(f"{pd.proxy.url}/v1/completions", _body(HUNG), timeout=TRANSFER_TIMEOUT_S + 60,
                              headers={"X-Request-Id": request_id})
        elapsed = time.monotonic() - started
    finally:
        _wake(pd.prefill, signal_all=True, proxy_url=pd.proxy.url)
    print(f"answer {elapsed:.2f} s after the request to a frozen prefill: status {status}\n"
          f"{_kvpush_lines(pd.decode, decode_log)}")
    assert elapsed < ACCEPT_TIMEOUT_S + 5  # the proxy's accept timeout and the decode's own compute, never a hang
    assert status == 200, answer
    choice, cached = answer["choices"][0], _cached(answer["usage"])
    print(f"computed by the decode alone: tokens equal {choice['token_ids'] == pd.ref(HUNG)}, cached tokens {cached}")
    assert choice["token_ids"] == pd.ref(HUNG) and choice["finish_reason"] == "length"
    assert cached is not None and cached < len(HUNG)
    after = _complete(pd.proxy.url, AFTER_HANG)
    state = _wait_idle(pd.prefill, IDS_TIMEOUT_S + 10)  # the hung request too: cancelled, or its ids given up
    print(f"prefill after the next request: {state}")
    print(f"then: prefill\n{_kvpush_lines(pd.prefill, prefill_log)}\ndecode\n{_kvpush_lines(pd.decode, decode_log)}")
    # the prefill woke up to the proxy's copy of the request, which the proxy cancels after its grace: it
    # must survive that (an engine core that died here would make every later request recompute)
    assert pd.prefill.alive() and healthy(pd.prefill.url), pd.prefill.tail()
    _check([(len(AFTER_HANG), pd.ref(AFTER_HANG), after)], "through the prefill after it woke up")


@pytest.mark.timeout(200)
def test_a_prefill_killed_mid_request_makes_the_decode_recompute_promptly(pd: Stack) -> None:
    """Kills the module's prefill (a later test would start it again)."""
    prefill, request_id, decode_log = pd.prefill, f"killed-{uuid.uuid4().hex}", log_size(pd.decode)
    # the prefill's worker is stopped first, so the request is in the prefill when it dies: its API server
    # accepted it, the decode allocated its blocks, sent their ids to the prefill's (frozen) kvpush engine, and
    # waits for the KV
    assert prefill.workers(), "no worker process found"
    prefill.signal_workers(signal.SIGSTOP)
    result: dict[str, Any] = {}

    def request() -> None:
        started = time.monotonic()
        try:
            result["status"], result["answer"] = post(f"{pd.proxy.url}/v1/completions", _body(KILLED),
                                                      timeout=120, headers={"X-Request-Id": request_id})
        finally:
            result["elapsed"] = time.monotonic() - started

    client = threading.Thread(target=request)
    client.start()
    waiting = _waiting(pd.decode)
    prefill.signal_group(signal.SIGKILL)  # the API server, the engine core and its worker
    killed = time.monotonic()
    client.join(timeout=TRANSFER_TIMEOUT_S + ABORT_GRACE_S + 30)
    assert not client.is_alive(), "the request hung after its prefill was killed"
    after_kill = time.monotonic() - killed
    prefill.process.wait(timeout=30)
    print(f"the decode waited for the KV: {waiting}; answer {after_kill:.2f} s after the kill "
          f"({result['elapsed']:.2f} s after the request): status {result['status']}\n"
          f"{_kvpush_lines(pd.decode, decode_log)}")
    assert waiting, "the decode never waited for the KV: the kill was not mid-request"
    assert after_kill < TRANSFER_TIMEOUT_S / 2  # the lost link ended the wait, not the deadline
    if result["status"] == 200:  # recomputed: the same tokens, the prompt not (all) cached
        choice, cached = result["answer"]["choices"][0], _cached(result["answer"]["usage"])
        print(f"recomputed: tokens equal {choice['token_ids'] == pd.ref(KILLED)}, cached tokens {cached}")
        assert choice["token_ids"] == pd.ref(KILLED) and choice["finish_reason"] == "length"
        assert cached is not None and cached < len(KILLED)
    else:  # failed cleanly: an error status with an OpenAI error body
        print(f"failed cleanly: {result['answer']}")
        assert 500 <= result["status"] < 600 and "error" in result["answer"], result
    assert healthy(pd.decode.url) and not healthy(pd.proxy.url)  # the proxy's /health names the dead prefill
    # with the prefill gone, a request through the proxy is still answered right, by the decode alone
    started, decode_log = time.monotonic(), log_size(pd.decode)
    status, answer = post(f"{pd.proxy.url}/v1/completions", _body(PREFILL_DOWN), timeout=60)
    elapsed = time.monotonic() - started
    print(f"with the prefill down: status {status} in {elapsed:.2f} s\n{_kvpush_lines(pd.decode, decode_log)}")
    assert status == 200 and answer["choices"][0]["token_ids"] == pd.ref(PREFILL_DOWN), answer
    assert elapsed < TRANSFER_TIMEOUT_S / 2
    assert not any("not landed" in line for line in log_lines(pd.decode, since=decode_log))  # never waited for KV
    state = _wait_idle(pd.decode, 15)
    assert not any(state.values()), state


@pytest.mark.timeout(200)
def test_requests_for_a_dead_prefill_beyond_the_decodes_slots_are_computed_by_the_decode_at_once(
        stack: Stack) -> None:
    """A router that does not know the prefill died (or a stale one) sends the decode its half of more requests
    than the decode runs at once (``--max-num-seqs 8``), each naming the dead prefill's kvpush engine, before
    any link to it exists: none waits for KV that cannot come (the link is refused), each is computed by the
    decode alone, and nothing is held after. Leaves the prefill dead (``pd`` starts it again)."""
    if stack.prefill.alive():
        stack.prefill.signal_group(signal.SIGKILL)
    stack.prefill.process.wait(timeout=30)
    decode_log = log_size(stack.decode)

    def request(prompt: list[int]) -> tuple[int, dict[str, Any], float]:
        params = decode_request_params(uuid.uuid4().hex, "127.0.0.1", stack.kv_port)
        started = time.monotonic()
        status, answer = post(f"{stack.decode.url}/v1/completions", _body(prompt, kv_transfer_params=params),
                              timeout=120)
        return status, answer, time.monotonic() - started

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(DEAD_PREFILL)) as pool:
        answers = list(pool.map(request, DEAD_PREFILL))
    elapsed = time.monotonic() - started
    lines = _kvpush_lines(stack.decode, decode_log)
    print(f"{len(DEAD_PREFILL)} requests for the dead prefill answered in {elapsed:.2f} s (slowest "
          f"{max(a[2] for a in answers):.2f} s)\n{lines[-3000:]}")
    for prompt, (status, answer, _) in zip(DEAD_PREFILL, answers):
        assert status == 200, answer
        choice, cached = answer["choices"][0], _cached(answer["usage"])
        assert choice["token_ids"] == stack.ref(prompt) and choice["finish_reason"] == "length"
        assert cached is not None and cached < len(prompt)
    assert "not landed" not in lines  # no request waited for its transfer's deadline
    assert elapsed < TRANSFER_TIMEOUT_S
    state = _wait_idle(stack.decode, 15)
    assert not any(state.values()), state
