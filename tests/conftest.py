"""Shared fixtures: engines in this process (finalized after each test), the decode peer per transport and a real
etcd. Helpers live in modules (kvtest, peer, etcdserver, ...), never imported from here: every test directory may
have its own conftest, and ``conftest`` names a different module depending on which was collected last."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# UCX over tcp would also use the host's external interface: tests stay on loopback (peers inherit this).
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from etcdserver import Etcd, missing  # noqa: E402
from kvtest import TRANSPORTS, EngineFactory, decode_peer_with_kv  # noqa: E402
from netns import two_hosts  # noqa: E402, F401  (a fixture for every test directory)
from peer import Peer  # noqa: E402

from kvpush import LLMDataDist, LLMRole  # noqa: E402


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    """``await make_engine(cluster_id, listen=True, **options)``; every engine is finalized."""
    engines: list[LLMDataDist] = []

    async def factory(cluster_id: int, listen: bool = False, role: LLMRole = LLMRole.PROMPT,
                      **options: str) -> LLMDataDist:
        opts = {key.replace("__", "."): value for key, value in options.items()}
        if listen:
            opts["llm.listenIpInfo"] = "127.0.0.1:0"
        engine = LLMDataDist(role, cluster_id)
        await engine.init(opts)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        await engine.finalize()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="long fuzz/soak modes (e.g. >= 10 000 fuzz examples)")


@pytest.fixture(scope="session")
def long_mode(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--long"))


# -- the conformance suites run every case once per transport available here -----------------------
@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def decode_peer(transport: str) -> Iterator[Peer]:
    """A decode engine in another process, listening, with a blocks cache "kv" (model_id 0)."""

    with decode_peer_with_kv(transport) as peer:
        yield peer


@pytest.fixture
def etcd() -> Iterator[Etcd]:
    """A real etcd on loopback, stopped after the test. Without etcd the test is skipped, saying why; in CI (``CI``
    set) a missing etcd fails it instead."""
    problem = missing()
    if problem is not None:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(problem)
        pytest.skip(problem)
    server = Etcd().start()
    try:
        yield server
    finally:
        server.stop()
