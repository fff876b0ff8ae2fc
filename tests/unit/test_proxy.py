"""kvrouter (kvpush proxy): routing only. Small aiohttp servers stand in for a vLLM prefill and decode
(loopback) so the proxy's own behaviour can be checked: the two copies of a request, their
kv_transfer_params, both copies sent at once, a decode's copy cut and sent again plain when its prefill
refuses (the decode computing alone when no prefill accepts), streaming chunk by chunk, passthrough of usage
and errors, spreading, back-off, resending, bounds, cancellation. Real vLLM servers behind the proxy are tested
in tests/vllm."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakevllm import USAGE, FakeVllm

from kvrouter import server as proxy
from kvrouter.core.placement import Policy


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

async def hang(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    await asyncio.sleep(3600)
    raise AssertionError("not reached")


async def accept_then_hang(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """A prefill that accepts (answers the head of a streamed response) and never finishes."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(3600)
    return response


@pytest.fixture
async def fakes() -> AsyncIterator[dict[str, FakeVllm]]:
    servers = {name: await FakeVllm(name).start() for name in ("prefill", "prefill2", "decode", "decode2")}
    yield servers
    for server in servers.values():
        assert server.runner is not None
        await server.runner.cleanup()


Start = Callable[..., Awaitable[str]]


@pytest.fixture
async def start_proxy() -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []

    async def start(prefills: list[str], decodes: list[str], **options: Any) -> str:
        options.setdefault("kv_probe_s", 0)  # these fakes have no kvpush side (tests/integration/test_probe.py)
        # every request through a prefill: these tests are about the two copies of a request (placement by
        # cache and load: tests/router)
        options.setdefault("policy", Policy(static=True))
        options.setdefault("follow_events", False)
        config = proxy.ProxyConfig([proxy.parse_prefill(spec) for spec in prefills],
                                   [proxy.base_url(url) for url in decodes], **options)
        runner = await proxy.start(config, "127.0.0.1", 0)
        runners.append(runner)
        return f"http://127.0.0.1:{proxy.bound_port(runner)}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


def waits_for_kv(fake: FakeVllm, landed: asyncio.Event | None = None, port: int | None = None) -> None:
    """As vLLM's decode: a copy that expects a prefill's KV (from ``port``, or any) is answered once ``landed``
    is set (None: never, until the proxy cuts it); any other copy at once."""
    async def behaviour(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_prefill") and port in (None, params.get("remote_port")):
            await (landed or asyncio.Event()).wait()
        return await fake.answer(request, body)
    fake.behaviour = behaviour


# -- the two copies of a request ---------------------------------------------------------------------

async def test_completion_copies_share_a_transfer_id_and_the_client_gets_the_decode_answer(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    request = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0, "min_tokens": 2}
    async with client.post(url + "/v1/completions", json=request, headers={"Authorization": "Bearer k"}) as reply:
        assert reply.status == 200
        assert reply.headers["X-Kvpush-Route"] == "pd"
        answer = await reply.json()
    assert answer == {"id": "cmpl-decode", "object": "text_completion",
                      "choices": [{"index": 0, "text": "from decode"}], "usage": USAGE}
    [decode_body], [prefill_body] = fakes["decode"].bodies, fakes["prefill"].bodies
    decode_params, prefill_params = decode_body.pop("kv_transfer_params"), prefill_body.pop("kv_transfer_params")
    assert decode_body == request  # everything else as the client sent it
    # streamed: the head of its answer says the prefill accepted it
    assert prefill_body == {"model": "tiny", "prompt": "hello", "max_tokens": 1, "temperature": 0, "stream": True}
    assert decode_params == {"do_remote_prefill": True, "do_remote_decode": False,
                             "transfer_id": prefill_params["transfer_id"],
                             "remote_host": "127.0.0.1", "remote_port": proxy.DEFAULT_KV_PORT}
    assert prefill_params == {"do_remote_decode": True, "do_remote_prefill": False,
                              "transfer_id": decode_params["transfer_id"]}
    assert fakes["decode"].headers[0]["Authorization"] == fakes["prefill"].headers[0]["Authorization"] == "Bearer k"


async def test_every_request_gets_a_fresh_transfer_id_and_the_prefill_kv_address_from_its_spec(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    url = await start_proxy([fakes["prefill"].url + "#kv=10.1.2.3:14600&cluster=7"], [fakes["decode"].url])
    for _ in range(3):
        async with client.post(url + "/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}],
                                     "max_completion_tokens": 5}) as reply:
            assert reply.status == 200
    ids = [body["kv_transfer_params"]["transfer_id"] for body in fakes["decode"].bodies]
    assert len(set(ids)) == 3
    assert ids == [body["kv_transfer_params"]["transfer_id"] for body in fakes["prefill"].bodies]
    params = fakes["decode"].bodies[0]["kv_transfer_params"]
    assert (params["remote_host"], params["remote_port"], params["remote_cluster_id"]) == ("10.1.2.3", 14600, 7)
    assert fakes["prefill"].bodies[0]["max_completion_tokens"] == 1


# -- streaming ----------------------------------------------------------------------------------------

async def test_streaming_passes_each_chunk_through_as_it_comes_usage_included(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    next_chunk = asyncio.Event()
    events = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
              b'data: {"choices":[],"usage":' + json.dumps(USAGE).encode() + b"}\n\n", b"data: [DONE]\n\n"]

    async def stream(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(events[0])
        await next_chunk.wait()  # the rest only after the client saw the first
        for event in events[1:]:
            await response.write(event)
        await response.write_eof()
        return response

    fakes["decode"].behaviour = stream
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
               "stream_options": {"include_usage": True}}
    async with client.post(url + "/v1/chat/completions", json=request) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"] == "text/event-stream"
        first = await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5)
        assert first == events[0]
        next_chunk.set()
        rest = await reply.read()
    assert rest == b"".join(events[1:])
    assert fakes["decode"].bodies[0]["stream"] is True
    assert fakes["decode"].bodies[0]["stream_options"] == {"include_usage": True}
    prefill_body = fakes["prefill"].bodies[0]
    assert prefill_body["stream"] is True and "stream_options" not in prefill_body and prefill_body["max_tokens"] == 1


# -- the first token from the prefill ------------------------------------------------------------------

def _vllm_event(completion_id: str, text: str, finish: str | None, **extra: Any) -> bytes:
    chunk = {"id": completion_id, "object": "text_completion", "created": 1, "model": "tiny",
             "choices": [{"index": 0, "text": text, "finish_reason": finish, "stop_reason": None, **extra}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _first_token_prefill(token: str) -> Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]:
    """A prefill streaming its one token as vLLM does for ``max_tokens=1`` with ``return_token_ids``."""
    async def answer(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        # a long prompt's ids: one line of ~800 KB, past aiohttp's own line limit (512 KiB)
        ids = {"prompt_token_ids": list(range(120_000)), "token_ids": [7]} if body.get("return_token_ids") else {}
        await response.write(_vllm_event("cmpl-p", token, "length", **ids) + b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    return answer


def _decode_stream(tokens: list[str], go: asyncio.Event) -> Callable[[web.Request, dict[str, Any]],
                                                                       Awaitable[web.StreamResponse]]:
    """A decode that answers its head at once and streams ``tokens`` once ``go`` is set."""
    async def answer(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await go.wait()
        for index, token in enumerate(tokens):
            await response.write(_vllm_event("cmpl-d", token, "length" if index == len(tokens) - 1 else None))
        await response.write(b'data: {"id": "cmpl-d", "choices": [], "usage": {"completion_tokens": 3}}\n\n'
                             b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    return answer


async def _events(reply: aiohttp.ClientResponse) -> list[Any]:
    """The data of each event of a stream to its end."""
    out = []
    for line in (await reply.read()).split(b"\n"):
        if line.startswith(b"data: "):
            out.append(line[6:].decode() if line == b"data: [DONE]" else json.loads(line[6:]))
    return out


async def test_a_greedy_stream_gets_the_prefill_first_token_before_the_decode_streams_anything(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    go = asyncio.Event()
    fakes["prefill"].behaviour = _first_token_prefill(" the")
    fakes["decode"].behaviour = _decode_stream([" the", " cat", " sat"], go)
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    request = {"model": "tiny", "prompt": [1, 2], "max_tokens": 3, "temperature": 0, "stream": True}
    async with client.post(url + "/v1/completions", json=request) as reply:
        assert reply.status == 200 and reply.headers["X-Kvpush-Route"] == "pd"
        first = await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5)  # the decode has streamed nothing
        assert json.loads(first[6:])["choices"] == [{"index": 0, "text": " the", "finish_reason": None,
                                                    "stop_reason": None}]
        go.set()
        rest = await _events(reply)
    assert [event["choices"][0]["text"] for event in rest[:-2]] == [" cat", " sat"]  # the decode's " the" went
    assert rest[1]["choices"][0]["finish_reason"] == "length" and rest[2]["usage"] == {"completion_tokens": 3}
    assert {event["id"] for event in rest[:-1]} == {json.loads(first[6:])["id"]} and rest[-1] == "[DONE]"
    assert fakes["prefill"].bodies[0]["return_token_ids"] is True
    assert "return_token_ids" not in fakes["decode"].bodies[0]  # the decode's copy is the client's request
    async with client.get(url + "/metrics") as reply:
        text = await reply.text()
    assert "kvpush_proxy_first_token_prefill_total 1" in text
    assert "kvpush_proxy_first_token_mismatch_total 0" in text


async def test_a_decode_whose_first_token_differs_from_the_prefill_cuts_the_client(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    go = asyncio.Event()
    fakes["prefill"].behaviour = _first_token_prefill(" the")
    fakes["decode"].behaviour = _decode_stream([" a", " cat"], go)
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    request = {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 0, "stream": True}
    async with client.post(url + "/v1/completions", json=request) as reply:
        await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5)
        go.set()
        with pytest.raises(aiohttp.ClientPayloadError):
            await reply.read()  # never " a" after " the": the stream is cut
    async with client.get(url + "/metrics") as reply:
        assert "kvpush_proxy_first_token_mismatch_total 1" in await reply.text()


async def test_a_decode_that_streams_first_or_a_request_that_does_not_lead_is_relayed_as_it_came(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    go = asyncio.Event()
    go.set()
    prefill_done = asyncio.Event()

    async def late_prefill(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)  # accepted at once, its token only after the decode answered
        await prefill_done.wait()
        return await _first_token_prefill(" the")(request, body)

    fakes["prefill"].behaviour = late_prefill
    fakes["decode"].behaviour = _decode_stream([" the", " cat"], go)
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url], prefill_grace_s=0.2)
    for request in ({"prompt": "x", "max_tokens": 2, "temperature": 0, "stream": True},  # the decode first
                    {"prompt": "x", "max_tokens": 2, "temperature": 0.8, "stream": True}):  # sampled: no lead
        async with client.post(url + "/v1/completions", json=request) as reply:
            events = await _events(reply)
        assert [event["choices"][0]["text"] for event in events[:2]] == [" the", " cat"]
        assert {event["id"] for event in events[:-1]} == {"cmpl-d"}
    assert "return_token_ids" not in fakes["prefill"].bodies[1]
    async with client.get(url + "/metrics") as reply:
        assert "kvpush_proxy_first_token_prefill_total 0" in await reply.text()


async def test_both_copies_go_at_once_and_the_answer_waits_for_the_kv(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    """The push pattern (the router mints the transfer's id): the decode's copy does not wait for the prefill to
    accept, so its block ids reach the prefill while the prefill's request is on its way."""
    accept, landed = asyncio.Event(), asyncio.Event()

    async def slow_to_accept(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await accept.wait()
        landed.set()
        return await fakes["prefill"].answer(request, body)

    fakes["prefill"].behaviour = slow_to_accept
    waits_for_kv(fakes["decode"], landed)
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    reply_task = asyncio.create_task(client.post(url + "/v1/completions", json={"prompt": "x"}))
    await asyncio.wait_for(fakes["prefill"].started.wait(), 5)
    await asyncio.wait_for(fakes["decode"].started.wait(), 5)  # before the prefill accepted
    params = fakes["decode"].bodies[0]["kv_transfer_params"]
    assert params["transfer_id"] == fakes["prefill"].bodies[0]["kv_transfer_params"]["transfer_id"]
    await asyncio.sleep(0.2)
    assert not reply_task.done()
    accept.set()
    async with await asyncio.wait_for(reply_task, 5) as reply:
        assert reply.status == 200 and reply.headers["X-Kvpush-Route"] == "pd"
        assert (await reply.json())["id"] == "cmpl-decode"
    assert len(fakes["decode"].bodies) == 1 and not fakes["decode"].cancelled.is_set()


async def test_the_decode_answer_does_not_wait_for_an_accepting_prefill_which_is_then_cancelled(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    fakes["prefill"].behaviour = accept_then_hang
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url], prefill_grace_s=0.5)
    async with client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as reply:
        assert reply.status == 200
        assert (await reply.json())["usage"] == USAGE
    assert not fakes["prefill"].cancelled.is_set()  # the answer came while the prefill still ran
    await asyncio.wait_for(fakes["prefill"].cancelled.wait(), 5)  # after the grace it is cancelled


async def test_a_prefill_that_does_not_accept_in_time_is_cancelled_and_the_decode_computes_alone(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    fakes["prefill"].behaviour = hang  # takes the connection, never answers (a frozen server)
    waits_for_kv(fakes["decode"])
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url], accept_timeout_s=0.3)
    request = {"prompt": "x", "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}}
    async with client.post(url + "/v1/completions", json=request) as reply:
        assert reply.status == 200 and reply.headers["X-Kvpush-Route"] == "decode-only"
        assert (await reply.json())["id"] == "cmpl-decode"
    # its copy that waited for the KV was cut (vLLM aborts it); then it got the request plain: no KV expected
    assert fakes["decode"].bodies[0]["kv_transfer_params"]["do_remote_prefill"] is True
    assert fakes["decode"].bodies[1:] == [{"prompt": "x", "max_tokens": 2}]
    await asyncio.wait_for(fakes["decode"].cancelled.wait(), 5)
    await asyncio.wait_for(fakes["prefill"].cancelled.wait(), 5)


async def test_a_refusing_or_unreachable_prefill_is_skipped_and_the_decode_computes_alone(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession,
        caplog: pytest.LogCaptureFixture) -> None:
    async def refuse(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"error": {"message": "no"}}, status=503)

    fakes["prefill"].behaviour = refuse
    waits_for_kv(fakes["decode"])
    url = await start_proxy([fakes["prefill"].url, "http://127.0.0.1:9"], [fakes["decode"].url])
    async with client.post(url + "/v1/completions", json={"prompt": "x"}) as reply:
        assert reply.status == 200 and reply.headers["X-Kvpush-Route"] == "decode-only"
        assert (await reply.json())["id"] == "cmpl-decode"
    assert len(fakes["prefill"].bodies) == 1
    # a copy for each prefill tried, each cut when it refused; then the request plain
    # (a copy cut when its prefill refused; none for the unreachable one, refused before it went; then plain)
    assert "kv_transfer_params" in fakes["decode"].bodies[0] and "kv_transfer_params" not in fakes["decode"].bodies[-1]
    warnings = [record.getMessage() for record in caplog.records if record.name.startswith("kvrouter")]
    assert any("answered 503" in text and "skipped" in text for text in warnings)
    assert any("127.0.0.1:9" in text and "did not accept" in text for text in warnings)
    assert any("no prefill accepted" in text and "computes it alone" in text for text in warnings)
    # both sit out their back-off: the next request goes straight to the decode, alone
    async with client.post(url + "/v1/completions", json={"prompt": "y"}) as reply:
        assert reply.status == 200 and reply.headers["X-Kvpush-Route"] == "decode-only"
    assert len(fakes["prefill"].bodies) == 1
    async with client.get(url + "/metrics") as reply:
        text = await reply.text()
    assert 'kvpush_proxy_requests_total{route="decode_only"} 2' in text
    assert f'kvpush_proxy_upstream_up{{role="prefill",url="{fakes["prefill"].url}"}} 0' in text


async def test_a_prefill_that_refuses_leaves_the_request_to_the_next_prefill(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    waits_for_kv(fakes["decode"], port=14600)  # (the KV from 14601 is there at once)
    url = await start_proxy(["http://127.0.0.1:9#kv=14600", fakes["prefill2"].url + "#kv=14601"],
                            [fakes["decode"].url])
    for _ in range(2):
        async with client.post(url + "/v1/completions", json={"prompt": "x"}) as reply:
            assert reply.status == 200 and reply.headers["X-Kvpush-Route"] == "pd"
    # the copy waiting on the unreachable one was cut; then the next prefill's; then it sits out its back-off
    assert [body["kv_transfer_params"]["remote_port"] for body in fakes["decode"].bodies] == [14600, 14601, 14601]
    ids = [body["kv_transfer_params"]["transfer_id"] for body in fakes["decode"].bodies]
    assert len(set(ids)) == 3  # each try a transfer of its own


async def test_a_request_made_invalid_by_the_client_goes_to_the_decode_which_answers_it(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    error = {"object": "error", "message": "max_tokens is too large", "type": "BadRequestError", "code": 400}

    async def bad_request(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(error, status=400)

    fakes["prefill"].behaviour = fakes["decode"].behaviour = bad_request
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    for _ in range(2):
        async with client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 10**9}) as reply:
            assert reply.status == 400 and await reply.json() == error
    assert len(fakes["prefill"].bodies) == 2  # not skipped: the prefill is fine, the request is not


# -- errors -------------------------------------------------------------------------------------------

async def test_upstream_errors_pass_through_with_their_status_and_body(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    error = {"object": "error", "message": "max_tokens is too large", "type": "BadRequestError", "code": 400}

    async def bad_request(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(error, status=400)

    fakes["decode"].behaviour = bad_request
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    async with client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 10**9}) as reply:
        assert reply.status == 400
        assert await reply.json() == error


async def test_proxy_errors_unreachable_decode_timeout_and_bad_requests(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    unreachable = await start_proxy([fakes["prefill"].url], ["http://127.0.0.1:9"], retry_for_s=0.5)
    started = asyncio.get_running_loop().time()
    async with client.post(unreachable + "/v1/completions", json={"prompt": "x"}) as reply:
        assert reply.status == 503 and reply.headers["Retry-After"] == "1"
        message = (await reply.json())["error"]["message"]
    assert "127.0.0.1:9" in message and "no decode instance accepted" in message, message
    assert asyncio.get_running_loop().time() - started >= 0.5  # it waited for a decode, and no longer than told
    # the decode was tried once with a prefill's copy; after that only its /health, until it is back
    assert len(fakes["prefill"].bodies) == 1
    fakes["decode"].behaviour = hang
    slow = await start_proxy([fakes["prefill"].url], [fakes["decode"].url], timeout_s=0.3)
    async with client.post(slow + "/v1/completions", json={"prompt": "x"}) as reply:
        assert reply.status == 504
    await asyncio.wait_for(fakes["decode"].cancelled.wait(), 5)
    for body, why in ((b"{not json", "not JSON"), (b"[1]", "JSON object"), (b'{"prompt": "x", "n": 2}', "n > 1")):
        async with client.post(slow + "/v1/completions", data=body) as reply:
            assert reply.status == 400
            assert why in (await reply.json())["error"]["message"]


async def test_a_decode_cut_mid_stream_cuts_the_client(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    async def cut(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: {}\n\n")
        await asyncio.sleep(0.1)
        assert request.transport is not None
        request.transport.abort()
        return response

    fakes["decode"].behaviour = cut
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    async with client.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as reply:
        assert reply.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await reply.read()


async def test_a_request_waits_for_a_restarting_decode_within_its_bounds(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    port = _free_port()
    url = await start_proxy([fakes["prefill"].url], [f"http://127.0.0.1:{port}"], retry_for_s=20)
    reply_task = asyncio.create_task(client.post(url + "/v1/completions", json={"prompt": "x"}))
    await asyncio.sleep(0.6)  # refused a few times meanwhile
    late = await FakeVllm("late-decode").start(port)
    assert late.runner is not None
    try:
        async with await asyncio.wait_for(reply_task, 10) as reply:
            assert reply.status == 200 and reply.headers["X-Kvpush-Route"] == "pd"
            assert (await reply.json())["id"] == "cmpl-late-decode"
        assert len(late.bodies) == 1 and len(fakes["prefill"].bodies) == 2  # one copy per try of a decode
        # bounded by the whole request's timeout too: a decode that never comes back is a 504 in time
        bounded = await start_proxy([fakes["prefill"].url], ["http://127.0.0.1:9"], retry_for_s=60, timeout_s=0.5)
        async with client.post(bounded + "/v1/completions", json={"prompt": "x"}) as reply:
            assert reply.status == 504
    finally:
        await late.runner.cleanup()


async def test_a_decode_that_closes_the_connection_unanswered_gets_the_request_again(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    async def drop(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()  # a decode killed while it held the request
        await asyncio.sleep(3600)
        raise AssertionError("not reached")

    fakes["decode"].behaviour = drop
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url, fakes["decode2"].url])
    async with client.post(url + "/v1/completions", json={"prompt": "x"}) as reply:
        assert reply.status == 200 and (await reply.json())["id"] == "cmpl-decode2"
    ids = [body["kv_transfer_params"]["transfer_id"] for body in fakes["decode"].bodies + fakes["decode2"].bodies]
    assert len(ids) == 2 and len(set(ids)) == 2  # sent again as a new transfer, with a new prefill copy
    assert [b["kv_transfer_params"]["transfer_id"] for b in fakes["prefill"].bodies] == ids
    async with client.get(url + "/metrics") as reply:
        assert "kvpush_proxy_resent_total 1" in await reply.text()


# -- spreading ----------------------------------------------------------------------------------------

async def test_requests_spread_over_two_decodes_and_two_prefills(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    prefills = [fakes["prefill"].url + "#kv=14600", fakes["prefill2"].url + "#kv=14601"]
    url = await start_proxy(prefills, [fakes["decode"].url, fakes["decode2"].url])
    for _ in range(4):
        async with client.post(url + "/v1/completions", json={"prompt": "x"}) as reply:
            assert reply.status == 200
    assert [len(fakes[name].bodies) for name in ("prefill", "prefill2", "decode", "decode2")] == [2, 2, 2, 2]
    kv_port_of = {body["kv_transfer_params"]["transfer_id"]: port
                  for name, port in (("prefill", 14600), ("prefill2", 14601)) for body in fakes[name].bodies}
    for name in ("decode", "decode2"):
        for body in fakes[name].bodies:  # each decode is told the kv port of the prefill that got its twin
            params = body["kv_transfer_params"]
            assert params["remote_port"] == kv_port_of[params["transfer_id"]]


async def test_a_busy_decode_gets_no_new_requests_until_the_other_is_as_busy(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    release = asyncio.Event()

    async def held(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await release.wait()
        return await fakes["decode"].answer(request, body)

    fakes["decode"].behaviour = held
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url, fakes["decode2"].url])

    async def post() -> int:
        async with client.post(url + "/v1/completions", json={"prompt": "x"}) as reply:
            await reply.read()
            return int(reply.status)

    first = asyncio.create_task(post())
    await asyncio.wait_for(fakes["decode"].started.wait(), 5)
    assert await post() == 200 and await post() == 200  # decode is busy: both to decode2
    assert (len(fakes["decode"].bodies), len(fakes["decode2"].bodies)) == (1, 2)
    release.set()
    assert await first == 200


# -- client disconnect --------------------------------------------------------------------------------

@pytest.mark.parametrize("streaming", [False, True])
async def test_a_client_that_disconnects_cancels_both_upstream_requests(
        fakes: dict[str, FakeVllm], start_proxy: Start, streaming: bool) -> None:
    async def stream_then_hang(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: {}\n\n")
        await asyncio.sleep(3600)
        return response

    fakes["prefill"].behaviour = accept_then_hang
    fakes["decode"].behaviour = stream_then_hang if streaming else hang
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    async with aiohttp.ClientSession() as session:
        request = {"prompt": "x", "stream": streaming}
        reply_task = asyncio.create_task(session.post(url + "/v1/completions", json=request))
        await asyncio.wait_for(asyncio.gather(fakes["decode"].started.wait(), fakes["prefill"].started.wait()), 5)
        if streaming:
            reply = await asyncio.wait_for(reply_task, 5)
            assert await reply.content.readuntil(b"\n\n") == b"data: {}\n\n"
            reply.close()  # drop the connection mid-stream
        else:
            reply_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reply_task
    await asyncio.wait_for(asyncio.gather(fakes["decode"].cancelled.wait(), fakes["prefill"].cancelled.wait()), 5)


# -- passthroughs -------------------------------------------------------------------------------------

async def test_models_and_health(fakes: dict[str, FakeVllm], start_proxy: Start,
                                 client: aiohttp.ClientSession) -> None:
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url])
    async with client.get(url + "/v1/models") as reply:
        assert reply.status == 200
        assert (await reply.json())["data"] == [{"id": "tiny", "owned_by": "decode"}]
    async with client.get(url + "/health") as reply:
        assert reply.status == 200
    fakes["prefill"].health_status = 503
    async with client.get(url + "/health") as reply:
        assert reply.status == 503
        assert fakes["prefill"].url in (await reply.json())["error"]["message"]


# -- secure defaults ----------------------------------------------------------------------------------

async def test_an_api_key_guards_every_route_but_health_and_goes_on_to_the_upstreams(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url], api_key="k-123")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-123"}):
        async with client.post(url + "/v1/completions", json={"prompt": "x"}, headers=headers) as reply:
            assert reply.status == 401 and "Unauthorized" in (await reply.json())["error"]["message"]
        async with client.get(url + "/v1/models", headers=headers) as reply:
            assert reply.status == 401
        async with client.get(url + "/metrics", headers=headers) as reply:
            assert reply.status == 401
    assert not fakes["decode"].bodies and not fakes["prefill"].bodies  # nothing reached an upstream
    async with client.get(url + "/health") as reply:  # for load balancers: no key
        assert reply.status == 200
    good = {"Authorization": "Bearer k-123"}
    async with client.post(url + "/v1/completions", json={"prompt": "x"}, headers=good) as reply:
        assert reply.status == 200
    assert fakes["decode"].headers[0]["Authorization"] == fakes["prefill"].headers[0]["Authorization"] == "Bearer k-123"
    other = await start_proxy([fakes["prefill"].url], [fakes["decode"].url], api_key="k-123",
                              upstream_api_key="upstream-key")
    async with client.post(other + "/v1/completions", json={"prompt": "x"}, headers=good) as reply:
        assert reply.status == 200
    assert fakes["decode"].headers[1]["Authorization"] == "Bearer upstream-key"  # instead of the client's


async def test_a_body_over_the_limit_is_refused_before_any_upstream_sees_it(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url], max_body_bytes=4096)
    async with client.post(url + "/v1/completions", json={"prompt": "x" * 5000}) as reply:
        assert reply.status == 413 and "4096" in (await reply.json())["error"]["message"]
    async with client.post(url + "/v1/completions", json={"prompt": "x" * 3000}) as reply:
        assert reply.status == 200
    assert len(fakes["decode"].bodies) == 1


async def test_concurrent_clients_each_get_only_their_own_answer(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    async def echo(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(0.01 * (hash(body["prompt"]) % 5))  # answers finish out of order
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in (body["prompt"][:8], body["prompt"][8:]):
            await response.write(f"data: {json.dumps({'text': piece})}\n\n".encode())
            await asyncio.sleep(0.005)
        await response.write_eof()
        return response

    fakes["decode"].behaviour = fakes["decode2"].behaviour = echo
    url = await start_proxy([fakes["prefill"].url], [fakes["decode"].url, fakes["decode2"].url])

    async def ask(secret: str) -> str:
        async with client.post(url + "/v1/completions", json={"prompt": secret, "stream": True}) as reply:
            return (await reply.read()).decode()

    secrets_ = [f"client-{i}-secret-{i * 7919}" for i in range(24)]
    answers = await asyncio.gather(*(ask(secret) for secret in secrets_))
    for secret, answer in zip(secrets_, answers):
        assert secret[:8] in answer and secret[8:] in answer
        assert not any(other in answer for other in secrets_ if other != secret)


# -- specs and the command ----------------------------------------------------------------------------

def test_prefill_specs() -> None:
    assert proxy.parse_prefill("http://10.0.0.5:8100/") == proxy.Prefill("http://10.0.0.5:8100", "10.0.0.5", 14579)
    assert proxy.parse_prefill("http://h:8100", default_kv_port=15000).kv_port == 15000
    assert proxy.parse_prefill("http://h:8100#kv=14600") == proxy.Prefill("http://h:8100", "h", 14600)
    assert proxy.parse_prefill("http://h:8100#kv=10.0.0.6:14600&cluster=9") == proxy.Prefill(
        "http://h:8100", "10.0.0.6", 14600, 9)
    assert proxy.parse_prefill("http://[::1]:8100#kv=[::1]:14600") == proxy.Prefill("http://[::1]:8100", "::1", 14600)
    for spec in ("ftp://h:1", "h:8100", "http://h:8100?x=1", "http://h:8100#kv=0", "http://h:8100#kv=h:x",
                 "http://h:8100#kv=::1:5", "http://h:8100#port=5", "http://h:8100#cluster=-1", "http://h:99999"):
        with pytest.raises(proxy.SpecError):
            proxy.parse_prefill(spec)


def test_the_command_serves_until_sigterm() -> None:
    command = [sys.executable, "-m", "kvpush", "proxy", "--prefill", "http://127.0.0.1:9", "--decode",
               "http://127.0.0.1:9", "--port", "0"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as process:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("kvpush proxy: serving http://127.0.0.1:"), line
        assert "kvpush 127.0.0.1:14579" in line
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0


def test_the_command_takes_its_api_key_from_the_environment() -> None:
    import urllib.error
    import urllib.request

    command = [sys.executable, "-m", "kvpush", "proxy", "--prefill", "http://127.0.0.1:9", "--decode",
               "http://127.0.0.1:9", "--port", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVPUSH_PROXY_API_KEY": "from-the-environment"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as process:
        assert process.stdout is not None
        try:
            url = process.stdout.readline().split("serving ")[1].split(" ")[0]
            request = urllib.request.Request(url + "/metrics")
            try:
                urllib.request.urlopen(request, timeout=5)
                raise AssertionError("the key was not asked for")
            except urllib.error.HTTPError as error:
                assert error.code == 401
            request.add_header("Authorization", "Bearer from-the-environment")
            with urllib.request.urlopen(request, timeout=5) as reply:
                assert reply.status == 200
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(10) == 0


def test_the_command_refuses_a_bad_url() -> None:
    from kvpush.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["proxy", "--prefill", "ftp://x", "--decode", "http://127.0.0.1:8200"])
    assert exit_info.value.code == 2


# -- warm links ---------------------------------------------------------------------------------------

async def test_each_pair_carries_a_warm_up_before_any_client_and_a_late_one_in_the_background(
        fakes: dict[str, FakeVllm], start_proxy: Start, client: aiohttp.ClientSession) -> None:
    """Issue 42: a pair's first transfer (the decode's link to the prefill) is made before any client's request:
    the pairs up at start before the router listens, one that comes up later in the background."""
    fakes["prefill2"].health_status = 503  # still starting
    url = await start_proxy([fakes["prefill"].url + "#kv=14600", fakes["prefill2"].url + "#kv=14601"],
                            [fakes["decode"].url], warm_links=True)
    # already done when the router listens: one request through (prefill, decode), both copies at once
    (warm_prefill,) = fakes["prefill"].bodies
    warm_decode = next(b for b in fakes["decode"].bodies if b["kv_transfer_params"]["remote_port"] == 14600)
    assert warm_prefill["kv_transfer_params"]["transfer_id"] == warm_decode["kv_transfer_params"]["transfer_id"]
    assert warm_prefill["max_tokens"] == 1 and warm_decode["max_tokens"] == 1
    assert not fakes["prefill2"].bodies
    fakes["prefill2"].health_status = 200

    async def warmed() -> bool:
        async with client.get(url + "/metrics") as reply:
            return 'kvpush_proxy_warmups_total{outcome="ok"} 2' in await reply.text()
    for _ in range(100):
        if await warmed():
            break
        await asyncio.sleep(0.1)
    assert await warmed()
    assert len(fakes["prefill2"].bodies) == 1
    async with client.get(url + "/metrics") as reply:
        text = await reply.text()
    assert 'kvpush_proxy_requests_total{route="pd"} 0' in text  # warm-ups are not clients' requests
