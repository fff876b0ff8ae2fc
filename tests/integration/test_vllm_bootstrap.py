"""The Mooncake bootstrap contract over real loopback HTTP: a prefill's ``GET /query`` server
(``BootstrapServer``, from the connector's settings) and a decode's lookup (``BootstrapResolver``)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest
from test_vllm_worker import BLOCK, HEADS

from kvpush.integrations.vllm import core
from kvpush.integrations.vllm.bootstrap import RETRY_AFTER_S, BootstrapResolver, BootstrapServer
from kvpush.integrations.vllm.settings import ConnectorSettings


def _settings(role: str, kv_port: int, tp: int = 1, dp: int = 1, engine_id: str = "engine-a",
              **extra: Any) -> ConnectorSettings:
    transfer = SimpleNamespace(kv_role=role, kv_port=kv_port, engine_id=engine_id, kv_connector_extra_config=extra)
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_index=0,
                               data_parallel_size=dp)
    model = SimpleNamespace(get_total_num_kv_heads=lambda: HEADS, model="tiny")
    cache = SimpleNamespace(block_size=BLOCK)
    return ConnectorSettings(SimpleNamespace(kv_transfer_config=transfer, cache_config=cache, parallel_config=parallel,
                                             model_config=model))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _settle(resolve: BootstrapResolver, bootstrap: core.Bootstrap) -> core.PeerAddress:
    """Ask as vLLM's scheduler does, step after step, until the lookup answered (bounded)."""
    for _ in range(500):
        found = resolve(bootstrap)
        if found is not None:
            return found
        time.sleep(0.01)
    raise AssertionError("the lookup never answered")


def test_settings_serve_the_bootstrap_only_when_asked_and_list_every_rank_by_the_port_rule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(core.BOOTSTRAP_PORT_ENV, raising=False)
    assert _settings("kv_producer", 14579).bootstrap_port is None
    monkeypatch.setenv(core.BOOTSTRAP_PORT_ENV, "28998")
    prefill = _settings("kv_producer", 14579, tp=2, dp=2, engine_id="base_dp0")
    assert prefill.bootstrap == core.Bootstrap("http://127.0.0.1:28998", "base_dp0")
    engines = prefill.bootstrap_engines()
    assert [engines[dp][0] for dp in (0, 1)] == ["base_dp0", "base_dp1"]
    assert [a.port for dp in (0, 1) for a in engines[dp][1]] == [14579, 14581, 14583, 14585]
    assert _settings("kv_consumer", 14579).bootstrap_port is None  # a decode serves none
    configured = _settings("kv_producer", 14579, bootstrap_port=9000, port=16000, cluster_id=40)
    assert configured.bootstrap_port == 9000 and configured.bootstrap_engines()[0][1][0].cluster_id == 40
    # vLLM's MooncakeConnector's key (Dynamo hands decodes this address): served there
    at = _settings("kv_producer", 14579, bootstrap_server_address="127.0.0.2:9100")
    assert (at.bootstrap_host, at.bootstrap_port) == ("127.0.0.2", 9100)
    assert at.bootstrap == core.Bootstrap("http://127.0.0.2:9100", "engine-a")
    with pytest.raises(core.ParamsError, match="disagree"):
        _settings("kv_producer", 14579, bootstrap_server_address="127.0.0.2:9100", bootstrap_port=9101)
    with pytest.raises(core.ParamsError, match="bootstrap_server_address"):
        _settings("kv_producer", 14579, bootstrap_server_address="nowhere")
    monkeypatch.setenv(core.BOOTSTRAP_PORT_ENV, "nope")
    with pytest.raises(core.ParamsError, match="VLLM_MOONCAKE_BOOTSTRAP_PORT"):
        _settings("kv_producer", 14579)


def test_query_is_served_in_vllm_s_shape_and_a_decode_resolves_the_prefill_from_it() -> None:
    prefill = _settings("kv_producer", 14579, tp=2, bootstrap_port=_free_port())
    assert prefill.bootstrap_port is not None and prefill.listen is not None
    server = BootstrapServer(prefill.listen[0], prefill.bootstrap_port, prefill.bootstrap_engines())
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{url}/query", timeout=5) as reply:
            answer = json.loads(reply.read())
        assert answer["0"]["engine_id"] == "engine-a"
        assert answer["0"]["worker_addr"] == {"0": {"0": "tcp://127.0.0.1:14579"}, "1": {"0": "tcp://127.0.0.1:14581"}}
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"{url}/register", timeout=5)
        clock = Clock()
        resolve = BootstrapResolver(2.0, clock=clock)
        found = _settle(resolve, core.Bootstrap(url, "engine-a"))
        assert found == prefill.local and found.of_rank(1) == prefill.local.of_rank(1)  # type: ignore[union-attr]
        assert resolve(core.Bootstrap(url, None)) == found  # one engine: it need not be named; kept, not asked again
        with pytest.raises(core.ParamsError, match="serves no engine 'restarted'"):
            resolve(core.Bootstrap(url, "restarted"))  # a fresh answer lacks it: refused
        clock.now += 5  # an older answer is asked again first
        assert resolve(core.Bootstrap(url, "restarted")) is None
        with pytest.raises(core.ParamsError, match="serves no engine 'restarted'"):
            _settle(resolve, core.Bootstrap(url, "restarted"))
    finally:
        server.close()


def test_a_bootstrap_server_that_does_not_answer_refuses_its_requests_then_is_asked_again() -> None:
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    clock = Clock()
    resolve = BootstrapResolver(2.0, clock=clock)
    with pytest.raises(core.ParamsError, match=f"the bootstrap server at {url} did not answer /query"):
        _settle(resolve, core.Bootstrap(url, "engine-a"))
    with pytest.raises(core.ParamsError, match="did not answer"):
        resolve(core.Bootstrap(url, "engine-a"))  # within the retry window: refused at once, no new lookup
    clock.now += RETRY_AFTER_S + 0.1
    assert resolve(core.Bootstrap(url, "engine-a")) is None  # looked up again


def test_the_bootstrap_port_taken_by_another_process_fails_the_start_loudly() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = BootstrapServer("127.0.0.1", taken.getsockname()[1], {0: ("e", [core.PeerAddress.of("127.0.0.1", 1)])})
        with pytest.raises(OSError):
            server.start()
        server.close()


def test_a_client_naming_many_bootstrap_servers_costs_bounded_lookups_and_memory() -> None:
    """Whoever sends the decode requests names the servers it asks: at most ``MAX_LOOKUPS`` run at once (past it,
    a request needing another is refused at once) and ``MAX_SERVERS`` answers are kept (the oldest dropped)."""
    from kvpush.integrations.vllm import bootstrap

    release = threading.Event()
    answer = core.bootstrap_answer({0: ("e", [core.PeerAddress.of("127.0.0.1", 14579)])})

    def slow(url: str, timeout_s: float) -> Any:
        release.wait(10)
        return answer

    resolve = BootstrapResolver(2.0, fetch=slow)
    names = [core.Bootstrap(f"http://127.0.0.1:{20000 + i}", "e") for i in range(bootstrap.MAX_LOOKUPS + 1)]
    assert all(resolve(name) is None for name in names[:-1])
    with pytest.raises(core.ParamsError, match="lookups are already running"):
        resolve(names[-1])
    release.set()
    assert all(_settle(resolve, name).port == 14579 for name in names[:-1])
    more = [core.Bootstrap(f"http://127.0.0.1:{30000 + i}", "e") for i in range(bootstrap.MAX_SERVERS)]
    for name in more:
        _settle(resolve, name)
    assert len(resolve.servers) == bootstrap.MAX_SERVERS and names[0].url not in resolve.servers


def test_a_lookup_that_fails_in_any_way_ends_and_ignores_the_environment_s_proxy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the fetch raises, the lookup ends (refusing its requests) rather than leaving them waiting; and a
    bootstrap server is asked directly even when ``http_proxy`` names a proxy (here one nothing listens on)."""
    import http.client

    def broken(url: str, timeout_s: float) -> Any:
        raise http.client.IncompleteRead(b"")  # not an OSError

    with pytest.raises(core.ParamsError, match="did not answer"):
        _settle(BootstrapResolver(2.0, fetch=broken), core.Bootstrap("http://127.0.0.1:1", "e"))
    prefill = _settings("kv_producer", 14579, bootstrap_port=_free_port())
    assert prefill.bootstrap_port is not None and prefill.listen is not None
    server = BootstrapServer(prefill.listen[0], prefill.bootstrap_port, prefill.bootstrap_engines())
    server.start()
    try:
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{_free_port()}")
        monkeypatch.setenv("no_proxy", "")
        found = _settle(BootstrapResolver(2.0), core.Bootstrap(f"http://127.0.0.1:{server.port}", "engine-a"))
        assert found == prefill.local
    finally:
        server.close()
