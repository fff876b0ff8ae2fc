"""``kvpush.integrations.liveness``: whether a process still listens where it did, on real loopback sockets."""

from __future__ import annotations

import socket

import pytest

from kvpush.integrations.liveness import gone, gone_async, split_host_port


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_a_listening_process_is_not_gone_and_a_closed_port_is_refused() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        assert gone("127.0.0.1", port) is None
    verdict = gone("127.0.0.1", port)
    assert verdict is not None and "refused" in verdict and f"127.0.0.1:{port}" in verdict


async def test_the_async_probe_gives_the_same_verdicts() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        assert await gone_async("127.0.0.1", listener.getsockname()[1]) is None
    port = _closed_port()
    verdict = await gone_async("127.0.0.1", port)
    assert verdict is not None and "refused" in verdict


def test_addresses_split_as_sglang_writes_them() -> None:
    assert split_host_port("127.0.0.1:8998") == ("127.0.0.1", 8998)
    assert split_host_port("[::1]:8998") == ("::1", 8998)
    for bad in ("8998", "host:", "host:port"):
        with pytest.raises(ValueError):
            split_host_port(bad)
