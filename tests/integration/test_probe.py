"""``kvpush.probe`` against engines in other processes, and ``kvpush proxy`` holding out a prefill whose kvpush
side does not answer while its HTTP side does (its worker starved of its cores, or frozen: stopped here).

The prefills' HTTP sides are tests/fakevllm.py's stand-ins (the proxy's routing is what is tested); their
kvpush sides are real engines, each in its own process.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from fakevllm import FakeVllm
from kvtest import EngineFactory
from peer import Peer

from kvpush import LLMException, LLMStatusCode, probe
from kvrouter import server as proxy
from kvrouter.core.placement import Policy


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_running_engine_answers_a_probe_and_no_link_is_made(make_engine: EngineFactory,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    engine = await make_engine(2, listen=True, kvpush__auth_token="a-secret-the-prober-does-not-have")
    assert engine.listen_address is not None
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert await probe("127.0.0.1", engine.listen_address[1], timeout=5) < 5
        await asyncio.sleep(0.1)
    assert not engine.links and not [r for r in caplog.records if "refused a link" in r.getMessage()]


async def test_a_stopped_engine_does_not_answer_and_a_closed_port_refuses() -> None:
    with Peer(2) as peer:
        assert await probe("127.0.0.1", peer.port) >= 0
        peer.signal(signal.SIGSTOP)  # its kernel still accepts the connection
        try:
            with pytest.raises(LLMException) as caught:
                await probe("127.0.0.1", peer.port, timeout=0.5)
            assert caught.value.status_code == LLMStatusCode.LLM_TIMEOUT
        finally:
            peer.signal(signal.SIGCONT)
        assert await probe("127.0.0.1", peer.port) >= 0
    with pytest.raises(LLMException) as caught:
        await probe("127.0.0.1", closed_port())
    assert caught.value.status_code == LLMStatusCode.LLM_LINK_FAILED


async def test_something_else_listening_is_not_an_answer() -> None:
    fake = await FakeVllm("http").start()
    try:
        port = int(fake.url.rsplit(":", 1)[1])
        with pytest.raises(LLMException) as caught:
            await probe("127.0.0.1", port, timeout=2)
        assert caught.value.status_code in (LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_TIMEOUT)
    finally:
        assert fake.runner is not None
        await fake.runner.cleanup()


@pytest.fixture
async def fakes() -> AsyncIterator[dict[str, FakeVllm]]:
    servers = {name: await FakeVllm(name).start() for name in ("prefill1", "prefill2", "decode")}
    yield servers
    for server in servers.values():
        assert server.runner is not None
        await server.runner.cleanup()


async def _ask(session: aiohttp.ClientSession, url: str) -> str:
    async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as reply:
        assert reply.status == 200
        await reply.read()
        return reply.headers["X-Kvpush-Route"]


async def test_the_proxy_holds_out_a_prefill_whose_kvpush_side_does_not_answer(fakes: dict[str, FakeVllm]) -> None:
    with Peer(11) as kv1, Peer(12) as kv2:
        config = proxy.ProxyConfig([proxy.parse_prefill(f"{fakes['prefill1'].url}#kv={kv1.port}"),
                                    proxy.parse_prefill(f"{fakes['prefill2'].url}#kv={kv2.port}")],
                                   [fakes["decode"].url], kv_probe_s=0.2, kv_probe_timeout_s=0.5,
                                   policy=Policy(static=True), follow_events=False)
        runner = await proxy.start(config, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{proxy.bound_port(runner)}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
                for _ in range(4):  # both take requests
                    assert await _ask(session, url) == "pd"
                assert len(fakes["prefill1"].bodies) == len(fakes["prefill2"].bodies) == 2
                kv2.signal(signal.SIGSTOP)  # prefill2's HTTP side still answers; its kvpush side does not
                try:
                    await until(lambda: is_down(session, url, fakes["prefill2"].url))
                    before = len(fakes["prefill2"].bodies)
                    for _ in range(6):
                        assert await _ask(session, url) == "pd"  # through prefill1 alone
                    assert len(fakes["prefill2"].bodies) == before
                    async with session.get(f"{url}/metrics") as reply:
                        text = await reply.text()
                    assert "kvpush_proxy_kv_probe_failed_total 0" not in text
                    assert f'kvpush_proxy_upstream_up{{role="prefill",url="{fakes["prefill2"].url}"}} 0' in text
                finally:
                    kv2.signal(signal.SIGCONT)
                await until(lambda: prefill_up(session, url, fakes["prefill2"].url))
                before = len(fakes["prefill2"].bodies)
                for _ in range(4):
                    assert await _ask(session, url) == "pd"
                assert len(fakes["prefill2"].bodies) > before  # it takes requests again
        finally:
            await runner.cleanup()


async def is_down(session: aiohttp.ClientSession, url: str, prefill: str) -> bool:
    return not await prefill_up(session, url, prefill)


async def prefill_up(session: aiohttp.ClientSession, url: str, prefill: str) -> bool:
    """Whether the proxy at ``url`` routes to ``prefill`` now (its /metrics)."""
    async with session.get(f"{url}/metrics") as reply:
        text = await reply.text()
    return f'kvpush_proxy_upstream_up{{role="prefill",url="{prefill}"}} 1' in text


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
