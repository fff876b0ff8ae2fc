"""transports.registry: names, aliases, and what auto tries, in order, from capabilities."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.peer import PeerTable, RemoteCache
from kvpush.protocol import ProtocolError
from transports import registry
from transports.base import TransportError


def test_names_and_aliases() -> None:
    assert registry.transport_names()[0] == "auto" and "tcp" in registry.transport_names()
    assert registry.canonical_transport("shm") == "cma" and registry.canonical_transport("same-host") == "cma"
    assert registry.canonical_transport("carrier-pigeon") is None


def test_auto_tries_same_host_transports_first() -> None:
    order = registry.auto_order()
    flags = [registry.capabilities(name).same_host_only for name in order]
    assert flags == sorted(flags, reverse=True) and set(order) == set(registry.transport_names()) - {"auto", "tcp"}
    assert not registry.capabilities("tcp").one_sided
    assert all(registry.capabilities(name).one_sided for name in order)


async def test_tcp_opens_no_one_sided_transport_and_auto_says_why_it_skips() -> None:
    loop = asyncio.get_running_loop()
    assert registry.open_one_sided("tcp", loop).transports == []
    opened = registry.open_one_sided("auto", loop)
    try:
        assert len(opened.transports) + len(opened.unavailable) == len(registry.auto_order())
        assert all(isinstance(reason, str) and reason for reason in opened.unavailable)
    finally:
        opened.close()


async def test_the_control_transport_refuses_a_bad_address_with_the_one_error_type() -> None:
    with pytest.raises(TransportError):
        registry.control().listen("256.0.0.1", 0)


def test_the_peer_table_is_replaced_whole_and_checked() -> None:
    table = PeerTable()
    table.apply({"caches": [{"id": 3, "model": 7, "blocks": True, "n": 2, "shape": [4, 8], "dtype": 1}]})
    found = table.by_model(7)
    assert isinstance(found, RemoteCache) and found.cache_id == 3 and table.by_id(3) is found
    table.apply({"caches": []})
    assert table.by_model(7) is None and table.updates == 2
    with pytest.raises(ProtocolError):
        table.apply({"caches": [{"id": 1}]})
    with pytest.raises(ProtocolError):
        table.apply({})
