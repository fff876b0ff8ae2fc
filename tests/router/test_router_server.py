"""kvrouter's HTTP side placing requests by what each instance caches: two kv_both stand-ins for vLLM
(tests/fakevllm.py: they record what they receive) that publish KV events in vLLM's wire format
(tests/fakepub.py) where the test says, or publish none. The decisions come back as X-Kvpush-Route and
X-Kvpush-Reason and are counted in /metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakepub import FakePublisher, stored
from fakevllm import FakeVllm

from kvrouter import server
from kvrouter.config import ProxyConfig
from kvrouter.core.hashing import BlockHasher
from kvrouter.core.placement import Policy
from kvrouter.core.pools import parse_prefill

BLOCK = 32
HASHER = BlockHasher(BLOCK)


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


class Fleet:
    def __init__(self, a: FakeVllm, b: FakeVllm, pub: FakePublisher, url: str) -> None:
        self.a, self.b, self.pub, self.url = a, b, pub, url

    async def ask(self, session: aiohttp.ClientSession, prompt: Any, path: str = "/v1/completions",
                  **fields: Any) -> tuple[str, str]:
        body = {"model": "tiny", "max_tokens": 2, **fields}
        body["messages" if path.endswith("chat/completions") else "prompt"] = prompt
        async with session.post(self.url + path, json=body) as reply:
            assert reply.status == 200, await reply.text()
            await reply.read()
            return reply.headers["X-Kvpush-Route"], reply.headers["X-Kvpush-Reason"]

    async def metrics(self, session: aiohttp.ClientSession) -> str:
        async with session.get(self.url + "/metrics") as reply:
            return await reply.text()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    """Instance a publishes no KV events (404 on /kv_event_sources); instance b publishes through ``pub``."""
    a, b = await FakeVllm("a").start(), await FakeVllm("b").start()
    pub = FakePublisher()
    b.event_sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub.endpoint,
                             "replay_endpoint": pub.replay, "topic": "kv"}}
    config = ProxyConfig([], [], [parse_prefill(f"{a.url}#kv=14600"), parse_prefill(f"{b.url}#kv=14601")],
                         kv_probe_s=0, policy=Policy(pd_min_tokens=256), block_size=BLOCK)
    runner = await server.start(config, "127.0.0.1", 0)
    try:
        yield Fleet(a, b, pub, f"http://127.0.0.1:{server.bound_port(runner)}")
    finally:
        await runner.cleanup()
        await pub.close()
        for fake in (a, b):
            assert fake.runner is not None
            await fake.runner.cleanup()


def prompt(seed: int, tokens: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1900 + 50 for i in range(tokens)]


async def test_a_request_goes_where_its_prefix_is_cached(fleet: Fleet) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        history = prompt(1, 20 * BLOCK)
        hashes = HASHER.block_hashes(history)

        async def b_holds_it() -> bool:
            await fleet.pub.publish([stored(hashes)])
            return "kvpush_proxy_index_blocks{url=\"" + fleet.b.url + "\",source=\"events\"} 20" in \
                await fleet.metrics(session)
        await until(b_holds_it)
        for turn in range(3):  # whatever the load order, b holds 640 of the 650 tokens: it computes 10
            route, reason = await fleet.ask(session, history + prompt(100 + turn, 10))
            assert route == "decode-only" and "holds 640 of 650" in reason, reason
            assert fleet.b.bodies[-1]["prompt"][:640] == history and "kv_transfer_params" not in fleet.b.bodies[-1]
        assert not fleet.a.bodies
        text = await fleet.metrics(session)
        assert 'kvpush_proxy_decisions_total{route="decode-only"' in text


async def test_a_long_uncached_prompt_is_disaggregated_and_remembered_where_it_went(fleet: Fleet) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        long = prompt(2, 40 * BLOCK)
        route, reason = await fleet.ask(session, long)
        assert route == "pd" and "uncached tokens on the decode" in reason, reason
        prefill = fleet.a if fleet.a.bodies and fleet.a.bodies[-1].get("kv_transfer_params", {}).get(
            "do_remote_decode") else fleet.b
        decode = fleet.b if prefill is fleet.a else fleet.a
        assert decode.bodies[-1]["kv_transfer_params"]["do_remote_prefill"] is True
        if decode is fleet.a:  # a publishes no events: the router guesses a holds what it loaded
            route, reason = await fleet.ask(session, long + prompt(3, 20))
            assert route == "decode-only" and "holds 1280 of 1300" in reason, reason
            assert fleet.a.bodies[-1]["prompt"][:1280] == long


async def test_chats_and_text_are_tokenized_by_an_instance(fleet: Fleet) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        route, _ = await fleet.ask(session, "hello there", temperature=0)
        assert route == "decode-only"
        route, _ = await fleet.ask(session, [{"role": "user", "content": "hi"}], path="/v1/chat/completions")
        assert route == "decode-only"
        tokenized = fleet.a.tokenized + fleet.b.tokenized
        assert any(t.get("prompt") == "hello there" for t in tokenized)
        assert any(t.get("messages") == [{"role": "user", "content": "hi"}] for t in tokenized)
        assert "kvpush_proxy_tokenize_failed_total 0" in await fleet.metrics(session)


async def test_a_prompt_counts_against_its_instance_until_its_answer_begins(fleet: Fleet) -> None:
    """Placement's queue of an instance: the prompt tokens placed on it whose answers have not begun. Once the
    first token is out the request only decodes, and the tokens no longer weigh (a conversation's next turn is
    not sent away from its history because the last one is still streaming)."""
    first, finish = asyncio.Event(), asyncio.Event()

    async def streams(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await first.wait()
        await response.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        await finish.wait()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    fleet.a.behaviour = fleet.b.behaviour = streams
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        async def pending() -> dict[str, int]:
            text, gauge = await fleet.metrics(session), "kvpush_proxy_pending_prompt_tokens{url="
            return {url: int(line.rsplit(" ", 1)[1]) for url in (fleet.a.url, fleet.b.url)
                    for line in text.splitlines() if line.startswith(f'{gauge}"{url}"')}

        body = {"model": "tiny", "max_tokens": 2, "stream": True, "prompt": prompt(5, 100)}
        async with session.post(fleet.url + "/v1/completions", json=body) as reply:
            assert reply.status == 200 and reply.headers["X-Kvpush-Route"] == "decode-only"

            async def queued() -> bool:
                return sorted(v for v in (await pending()).values() if v) == [100]
            await until(queued)  # the 100 prompt tokens count against the instance computing them
            first.set()
            assert (await reply.content.readline()).startswith(b"data:")

            async def begun() -> bool:
                return not any((await pending()).values())
            await until(begun)  # the answer began: they count no more, while the request still streams
            assert "kvpush_proxy_upstream_in_flight" in (text := await fleet.metrics(session))
            assert any(line.endswith(" 1") for line in text.splitlines()
                       if line.startswith('kvpush_proxy_upstream_in_flight{role="decode"'))
            finish.set()
            await reply.read()
