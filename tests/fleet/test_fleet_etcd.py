"""The fleet's registry on a real etcd: registration under a lease, create-only keys, load and state
updates, a graceful leave, a killed instance leaving within its TTL, and etcd restarting under a
registered instance and a watching reader."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from etcdserver import Etcd

from kvpush.fleet import FleetError, Instance, Load, Membership, parse_discovery
from kvpush.fleet.etcd import Registrar, Watcher, snapshot

HERE = Path(__file__).resolve().parent


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def _instance(instance_id: str = "p1", role: str = "prefill") -> Instance:
    return Instance(instance_id, role, f"http://127.0.0.1:81{len(instance_id)}", "tiny", "compat-1",
                    ("127.0.0.1:14579",) if role != "decode" else ())


async def test_an_instance_registers_updates_its_load_and_leaves_gracefully(etcd: Etcd) -> None:
    endpoints = parse_discovery(etcd.url)
    membership = Membership()
    watcher = Watcher(endpoints, membership)
    loads = [Load(1, 0, 0.25)]

    async def load() -> Load:
        return loads[-1]

    registrar = Registrar(endpoints, _instance(), load=load, ttl=3, refresh_s=0.1)
    tasks = [asyncio.create_task(watcher.run()), asyncio.create_task(registrar.run())]
    key = _instance().key
    try:
        await _until(lambda: key in membership.instances, 10, "registered")
        assert membership.instances[key].load == Load(1, 0, 0.25) and membership.instances[key].state == "ready"
        loads.append(Load(3, 2, 0.5))
        await _until(lambda: membership.instances[key].load == Load(3, 2, 0.5), 5, "load refreshed")
        # create-only: another instance cannot take the key
        with pytest.raises(FleetError, match="registered by another instance"):
            await Registrar(endpoints, _instance(), ttl=3).run()
        assert membership.instances[key].load == Load(3, 2, 0.5)
        tasks[1].cancel()  # the instance shuts down: it stops refreshing, then leaves
        await asyncio.gather(tasks[1], return_exceptions=True)
        states: list[str] = []

        async def transfers_done() -> None:  # what a proxy sees while the instance's transfers finish
            await _until(lambda: membership.instances[key].state == "draining", 5, "draining")
            states.append(membership.instances[key].state)

        await registrar.retire(transfers_done)
        assert states == ["draining"]  # draining was visible while the transfers finished
        await _until(lambda: key not in membership.instances, 5, "revoked: gone at once")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_killed_instance_leaves_the_registry_within_its_ttl(etcd: Etcd) -> None:
    endpoints = parse_discovery(etcd.url)
    membership = Membership()
    watcher = asyncio.create_task(Watcher(endpoints, membership).run())
    process = subprocess.Popen([sys.executable, str(HERE / "register.py"), etcd.url, "decode", "d1",
                                "http://127.0.0.1:8200", "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert await asyncio.to_thread(process.stdout.readline) == "registered\n"
        await _until(lambda: _instance("d1", "decode").key in membership.instances, 5, "seen")
        process.kill()
        process.wait(10)
        gone_after = await _until(lambda: _instance("d1", "decode").key not in membership.instances, 6,
                                  "gone after the kill")
        print(f"a SIGKILLed instance left the registry {gone_after:.2f} s after (TTL 2 s)")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def test_etcd_restarting_under_a_registered_instance_and_a_reader_changes_nothing_for_them(etcd: Etcd) -> None:
    endpoints = parse_discovery(etcd.url)
    membership = Membership()
    watcher_object = Watcher(endpoints, membership)
    registrar = Registrar(endpoints, _instance("p2"), ttl=3, refresh_s=0.2)
    tasks = [asyncio.create_task(watcher_object.run()), asyncio.create_task(registrar.run())]
    key = _instance("p2").key
    try:
        await _until(lambda: key in membership.instances, 10, "registered")
        await asyncio.to_thread(etcd.kill)
        await asyncio.sleep(1.5)
        assert key in membership.instances  # the reader keeps the last membership it saw
        await asyncio.to_thread(etcd.start)
        await _until(lambda: watcher_object.synced.is_set() and registrar.registered.is_set(), 20, "reconnected")
        later = Registrar(endpoints, _instance("p3"), ttl=3, refresh_s=0.2)  # a newcomer after the restart is seen
        tasks.append(asyncio.create_task(later.run()))
        await _until(lambda: _instance("p3").key in membership.instances and key in membership.instances, 10,
                     "both registered after the restart")
        instances, refused = await snapshot(endpoints)
        assert {i.id for i in instances} == {"p2", "p3"} and not refused
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
