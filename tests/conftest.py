"""Shared fixtures: engines in this process (finalized after each test) and helpers to link them."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# UCX over tcp would also use the host's external interface: tests stay on loopback (peers inherit this).
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from netns import two_hosts  # noqa: E402, F401  (a fixture for every test directory)

from kvpush import LLMClusterInfo, LLMDataDist, LLMRole  # noqa: E402

EngineFactory = Callable[..., Awaitable[LLMDataDist]]


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


def cluster(cluster_id: int, port: int, host: str = "127.0.0.1") -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_remote_ip_info(host, port)
    return info


async def link(engine: LLMDataDist, cluster_id: int, port: int) -> None:
    status, codes = await engine.link_clusters([cluster(cluster_id, port)], timeout=5000)
    assert status == 0 and codes == [0], (status, codes)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="long fuzz/soak modes (e.g. >= 10 000 fuzz examples)")


@pytest.fixture(scope="session")
def long_mode(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--long"))
