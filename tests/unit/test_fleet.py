"""kvpush.fleet without etcd: discovery addresses, registry entries, a membership built from a
snapshot and events, load read from vLLM's /metrics; and the proxy's pools as members come and go."""

from __future__ import annotations

import pytest

from kvpush.fleet import FleetError, Instance, Load, Membership, parse_discovery, parse_load
from kvrouter.core.pools import Pool


def test_discovery_addresses() -> None:
    assert parse_discovery("etcd://10.0.0.1:2379") == [("10.0.0.1", 2379)]
    assert parse_discovery("etcd://a:1,b,[::1]:3") == [("a", 1), ("b", 2379), ("::1", 3)]
    for bad in ("http://x:1", "etcd://", "etcd://a:b", "etcd://a:99999", "etcd://a/b"):
        with pytest.raises(FleetError):
            parse_discovery(bad)


def test_an_entry_round_trips_and_a_bad_one_is_refused_with_the_reason() -> None:
    instance = Instance("i1", "prefill", "http://h:8100", "tiny", "c1", ("h:14579", "h:14581"), (7, 9), 2,
                        load=Load(2, 1, 0.5))
    again = Instance.from_json(instance.key, instance.to_json())
    assert again == instance and again.kv_address() == ("h", 14579)
    assert Instance.from_json(instance.key, instance.with_state("draining").to_json()).state == "draining"
    for key, value, words in ((instance.key, b"{", "registry entry"),
                              ("/kvpush/instances/decode/i1", instance.to_json(), "role"),  # key and body differ
                              ("/kvpush/instances/prefill/i2", Instance("i2", "prefill", "u", "m", "c").to_json(),
                               "without a kvpush address")):
        with pytest.raises(FleetError, match=words):
            Instance.from_json(key, value)


def test_membership_from_a_snapshot_then_events() -> None:
    one = Instance("a", "prefill", "http://a", "m", "c", ("a:1",))
    two = Instance("b", "decode", "http://b", "m", "c")
    both = Instance("c", "both", "http://c", "m", "c", ("c:1",))
    membership = Membership()
    membership.reset([(one.key, one.to_json()), ("/kvpush/instances/decode/x", b"junk")], revision=10)
    assert list(membership.instances) == [one.key] and "/kvpush/instances/decode/x" in membership.refused
    membership.apply("PUT", two.key, two.to_json(), 11)
    membership.apply("PUT", both.key, both.to_json(), 12)
    assert {i.id for i in membership.ready("prefill")} == {"a", "c"}
    assert {i.id for i in membership.ready("decode")} == {"b", "c"}
    membership.apply("PUT", one.key, one.with_state("draining").to_json(), 13)
    assert {i.id for i in membership.ready("prefill")} == {"c"}  # draining: no new requests
    membership.apply("DELETE", two.key, b"", 14)
    assert {i.id for i in membership.ready("decode")} == {"c"} and membership.revision == 14


def test_load_is_read_from_vllms_metrics() -> None:
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\nvllm:other 7\n')
    assert parse_load(text) == Load(3, 1, 0.25)
    assert parse_load("") == Load() and Load().requests == 0


def test_pools_follow_the_membership_and_weigh_registered_load() -> None:
    pool: Pool[str] = Pool(["a", "b"])
    pool.acquire("a")
    added, removed = pool.update(["b", "c"])
    assert (added, removed) == (["c"], ["a"])
    assert pool.pick() in ("b", "c")
    pool.release("a")  # a request that was in flight on a member that left ends as it would have
    pool.load = {"b": 5, "c": 0}
    assert pool.pick() == "c" and pool.pick() == "c"  # b is busier, as registered
    pool.acquire("c")
    pool.load = {"b": 0, "c": 0}
    assert pool.pick() == "b"
    assert pool.update([]) == ([], ["b", "c"]) and pool.pick() is None


def test_an_instance_registers_where_it_publishes_its_kv_events() -> None:
    from types import SimpleNamespace

    from kvpush.fleet import Instance
    from kvpush.integrations.vllm.fleet import events_endpoints

    config = SimpleNamespace(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557",
                             replay_endpoint="tcp://*:5558")
    assert events_endpoints(config, "10.0.0.5") == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert events_endpoints(SimpleNamespace(**{**vars(config), "replay_endpoint": None}), "::1") == (
        "tcp://[::1]:5557", "")
    assert events_endpoints(SimpleNamespace(**{**vars(config), "enable_kv_cache_events": False}), "h") == ("", "")
    assert events_endpoints(SimpleNamespace(**{**vars(config), "endpoint": "ipc:///tmp/x"}), "h") == ("", "")
    assert events_endpoints(None, "h") == ("", "")
    instance = Instance("i1", "both", "http://10.0.0.5:8000", "m", "c", ("10.0.0.5:14579",), events="tcp://e:1",
                        events_replay="tcp://e:2", block_size=32)
    again = Instance.from_json(instance.key, instance.to_json())
    assert again == instance and again.events_source() == ("tcp://e:1", "tcp://e:2")
    assert Instance("i2", "decode", "http://h:1", "m", "c").events_source() is None
