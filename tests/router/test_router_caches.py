"""kvrouter.caches.Caches: an instance that leaves takes its index with it, one that joins starts empty, and
where an instance publishes is read from vLLM's /kv_event_sources answer."""

from __future__ import annotations

from collections import Counter

from kvrouter.caches import Caches, source_from_config
from kvrouter.core.kv_events import Source


def test_views_come_and_go_with_the_instances() -> None:
    caches = Caches(Counter(), capacity=100, follow=False)
    caches.update([("http://a", None), ("http://b", None)])
    caches.sent("http://b", [1, 2, 3])
    assert caches.match("http://b", [1, 2, 3]) == 3 and caches.match("http://a", [1]) == 0
    caches.update([("http://a", None)])  # b left
    assert set(caches.views) == {"http://a"}
    caches.update([("http://a", None), ("http://b", None)])  # b joined again: nothing of the old b
    assert caches.match("http://b", [1, 2, 3]) == 0


def test_where_an_instance_publishes_is_read_from_its_own_answer() -> None:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": "tcp://*:5558", "topic": "kv"}
    assert source_from_config("http://10.0.0.5:8000", config) == Source("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558",
                                                                        "kv")
    assert source_from_config("http://[::1]:8000", {**config, "replay_endpoint": None}) == Source("tcp://[::1]:5557",
                                                                                                 None, "kv")
    assert source_from_config("http://h:1", {**config, "endpoint": "tcp://10.0.0.9:6000"}).endpoint == \
        "tcp://10.0.0.9:6000"  # a named host stays
    for off in ({**config, "enable_kv_cache_events": False}, {**config, "publisher": "null"},
                {**config, "endpoint": "ipc:///tmp/kv"}, "not a config"):
        assert source_from_config("http://h:1", off) is None
