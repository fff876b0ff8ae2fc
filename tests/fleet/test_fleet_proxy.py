"""``kvpush proxy --discovery`` over a real etcd, with stand-in upstreams (tests/fakevllm.py) registered by
real registrars: it routes over whoever is registered and ready, takes a newcomer within a couple of
seconds, sends a draining instance nothing new, never pairs instances of different KV geometry, keeps
routing while etcd is away; and ``kvpush fleet --json`` lists what is registered."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from etcdserver import Etcd
from fakevllm import FakeVllm

from kvpush.fleet import Instance, parse_discovery
from kvpush.fleet.etcd import Registrar
from kvrouter import server as proxy
from kvrouter.core.placement import Policy


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


class Fleet:
    """Stand-in instances and their registrars (each a task, cancelled and awaited at the end)."""

    def __init__(self, etcd: Etcd) -> None:
        self.endpoints = parse_discovery(etcd.url)
        self.registrars: dict[str, tuple[Registrar, asyncio.Task[None]]] = {}
        self.servers: list[FakeVllm] = []

    async def add(self, name: str, role: str, kv_port: int = 0, compat: str = "geometry-1") -> FakeVllm:
        server = await FakeVllm(name).start()
        self.servers.append(server)
        kv = (f"127.0.0.1:{kv_port}",) if role != "decode" else ()
        registrar = Registrar(self.endpoints, Instance(name, role, server.url, "tiny", compat, kv), ttl=3,
                              refresh_s=0.2)
        self.registrars[name] = (registrar, asyncio.create_task(registrar.run()))
        await asyncio.wait_for(registrar.registered.wait(), 10)
        return server

    async def retire(self, name: str) -> None:
        registrar, task = self.registrars.pop(name)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await registrar.retire()

    async def close(self) -> None:
        for _, task in self.registrars.values():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for server in self.servers:
            assert server.runner is not None
            await server.runner.cleanup()


@pytest.fixture
async def fleet(etcd: Etcd) -> AsyncIterator[Fleet]:
    members = Fleet(etcd)
    yield members
    await members.close()


async def _ask(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as reply:
        await reply.read()
        return reply.status, reply.headers.get("X-Kvpush-Route", "")


async def test_the_proxy_routes_over_the_registered_fleet_as_it_changes(etcd: Etcd, fleet: Fleet) -> None:
    prefill1 = await fleet.add("prefill-1", "prefill", 14600)
    decode = await fleet.add("decode-1", "decode")
    odd = await fleet.add("prefill-odd", "prefill", 14700, compat="geometry-2")  # another model: never paired
    # kv_probe_s=0: nothing listens on these registered instances' kvpush ports (tests/integration/test_probe.py)
    config = proxy.ProxyConfig([], [], discovery=etcd.url, retry_for_s=10, kv_probe_s=0,
                                 policy=Policy(static=True), follow_events=False)
    runner = await proxy.start(config, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{proxy.bound_port(runner)}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            assert await _ask(session, url) == (200, "pd")
            for _ in range(3):
                assert await _ask(session, url) == (200, "pd")
            ports = [body["kv_transfer_params"]["remote_port"] for body in decode.bodies]
            assert set(ports) == {14600} and not odd.bodies  # the decode is sent to the compatible prefill
            # a newcomer gets requests within a couple of seconds
            prefill2 = await fleet.add("prefill-2", "prefill", 14601)
            started = time.monotonic()
            while not prefill2.bodies:
                assert time.monotonic() - started < 3, "the new prefill got no request"
                assert (await _ask(session, url))[0] == 200
            seen = time.monotonic() - started
            print(f"a newly registered prefill got its first request {seen:.2f} s after registering")
            # draining: no new request from then on
            await fleet.retire("prefill-2")
            await asyncio.sleep(0.5)
            before = len(prefill2.bodies)
            for _ in range(4):
                assert await _ask(session, url) == (200, "pd")
            assert len(prefill2.bodies) == before and not odd.bodies
            # etcd away: the proxy routes on the membership it last saw, and picks it up again after
            await asyncio.to_thread(etcd.kill)
            for _ in range(4):
                assert await _ask(session, url) == (200, "pd")
            await asyncio.to_thread(etcd.start)
            await fleet.add("prefill-3", "prefill", 14602)
            prefill3 = fleet.servers[-1]
            started = time.monotonic()
            while not prefill3.bodies:
                assert time.monotonic() - started < 10, "after etcd's restart a new prefill got no request"
                assert (await _ask(session, url))[0] == 200
            assert prefill1.bodies and not odd.bodies
    finally:
        await runner.cleanup()


async def test_a_request_waits_for_the_fleets_first_decode(etcd: Etcd, fleet: Fleet) -> None:
    await fleet.add("prefill-1", "prefill", 14600)
    # kv_probe_s=0: nothing listens on these registered instances' kvpush ports (tests/integration/test_probe.py)
    config = proxy.ProxyConfig([], [], discovery=etcd.url, retry_for_s=10, kv_probe_s=0,
                                 policy=Policy(static=True), follow_events=False)
    runner = await proxy.start(config, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{proxy.bound_port(runner)}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            asking = asyncio.create_task(_ask(session, url))
            await asyncio.sleep(1.0)
            assert not asking.done()  # no decode registered: it waits (up to --retry-for)
            await fleet.add("decode-1", "decode")
            assert await asyncio.wait_for(asking, 10) == (200, "pd")
    finally:
        await runner.cleanup()


async def test_kvpush_fleet_lists_the_registry(etcd: Etcd, fleet: Fleet) -> None:
    await fleet.add("prefill-1", "prefill", 14600)
    await fleet.add("decode-1", "decode")
    listed = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "kvpush", "fleet", "--discovery",
                                                      etcd.url, "--json"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = {row["role"]: row for row in json.loads(listed.stdout)}
    assert set(rows) == {"prefill", "decode"}
    assert rows["prefill"]["kv"] == "127.0.0.1:14600" and rows["prefill"]["state"] == "ready"
    assert rows["decode"]["url"] == fleet.servers[1].url and rows["decode"]["model"] == "tiny"
    table = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "kvpush", "fleet", "--discovery", etcd.url],
                                    capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "prefill" in table.stdout and "127.0.0.1:14600" in table.stdout
