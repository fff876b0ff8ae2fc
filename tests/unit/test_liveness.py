"""``kvpush.integrations.liveness``: whether a process still listens where it did, on real loopback sockets."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from kvpush.integrations import liveness
from kvpush.integrations.liveness import Watches, gone, gone_after_close, gone_async, split_host_port


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


class _Listener:
    """A loopback listener on the test's loop that counts the connections it accepted."""

    def __init__(self) -> None:
        self.accepted = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted += 1
            writer.close()
        self.server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_a_peer_that_stops_listening_a_moment_after_its_link_closed_is_found_gone() -> None:
    """A dying process's control socket can outlive its link by a moment: asked again, it is found gone."""
    listener = _Listener()
    port = await listener.start()
    watch = asyncio.ensure_future(gone_after_close("127.0.0.1", port, lambda: False, lambda: True, within=10))
    while listener.accepted < 2:  # it accepted the first probe and was asked again: bounded by the test timeout
        await asyncio.sleep(0.01)
    await listener.close()
    verdict = await watch
    assert verdict is not None and "refused" in verdict


async def test_a_live_peer_is_asked_while_something_waits_and_until_it_links_again() -> None:
    listener = _Listener()
    port = await listener.start()
    try:
        assert await gone_after_close("127.0.0.1", port, lambda: False, lambda: True, within=0.1, until=0.3) is None
        assert listener.accepted > 1  # asked again while something waited, past the quick phase too
    finally:
        await listener.close()
    # linked again, or nothing waits once the quick phase is over: asked once
    for relinked, waiting, within in ((True, True, 10.0), (False, False, 0.0)):
        listener = _Listener()
        port = await listener.start()
        try:
            assert await gone_after_close("127.0.0.1", port, lambda r=relinked: r, lambda w=waiting: w,
                                          within=within) is None
            await asyncio.sleep(0.05)  # the accept callback of the probe has run
            assert listener.accepted == 1, (relinked, waiting)
        finally:
            await listener.close()
    verdict = await gone_after_close("127.0.0.1", port, lambda: True, lambda: False)
    assert verdict is not None and "refused" in verdict  # gone is gone, whatever else came up


async def test_the_quick_phase_asks_even_when_nothing_waits() -> None:
    """A link's close fails the rooms it carried, and SGLang clears them at once: the dying peer is still asked
    again for the quick phase, so that its bootstrap is dropped."""
    listener = _Listener()
    port = await listener.start()
    watch = asyncio.ensure_future(gone_after_close("127.0.0.1", port, lambda: False, lambda: False, within=10))
    while listener.accepted < 2:  # bounded by the test timeout
        await asyncio.sleep(0.01)
    await listener.close()
    verdict = await watch
    assert verdict is not None and "refused" in verdict


def _answers(monkeypatch: pytest.MonkeyPatch, *answers: OSError | TimeoutError | None) -> list[int]:
    """Make the watch's connection attempts answer ``answers`` in turn; returns the attempts' count (a list)."""
    made = [0]

    async def attempt(host: str, port: int, timeout: float) -> OSError | TimeoutError | None:
        made[0] += 1
        return answers[made[0] - 1]
    monkeypatch.setattr(liveness, "_attempt", attempt)
    return made


async def test_once_a_peer_accepted_only_a_refusal_makes_it_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """After an accepted connection a time-out says more of the network than of the process, and a connection
    this host could not even try (out of descriptors) says nothing of the peer: neither makes it gone."""
    made = _answers(monkeypatch, None, TimeoutError(), OSError(errno.EMFILE, "too many open files"),
                    TimeoutError(), ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    verdict = await gone_after_close("127.0.0.1", 9, lambda: False, lambda: True, within=10)
    assert verdict is not None and "refused" in verdict and made == [5]
    made = _answers(monkeypatch, TimeoutError(), ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    verdict = await gone_after_close("127.0.0.1", 9, lambda: False, lambda: True, accepted=True)  # seen by the caller
    assert verdict is not None and "refused" in verdict and made == [2]
    made = _answers(monkeypatch, TimeoutError())  # never accepted: no answer is an answer
    verdict = await gone_after_close("127.0.0.1", 9, lambda: False, lambda: True)
    assert verdict is not None and "did not answer" in verdict and made == [1]


async def test_cancelling_the_watch_stops_it() -> None:
    listener = _Listener()
    port = await listener.start()
    try:
        watch = asyncio.ensure_future(gone_after_close("127.0.0.1", port, lambda: False, lambda: True, within=60))
        while listener.accepted < 1:
            await asyncio.sleep(0.01)
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch
        asked = listener.accepted
        await asyncio.sleep(0.2)
        assert listener.accepted == asked
    finally:
        await listener.close()


async def test_one_watch_runs_per_peer_at_a_time() -> None:
    started: list[str] = []
    release = asyncio.Event()

    async def watch(key: str) -> None:
        started.append(key)
        await release.wait()
    watches = Watches(asyncio.ensure_future)
    for key in ("a", "a", "b"):
        watches.start(key, lambda key=key: watch(key))  # type: ignore[misc]
    await asyncio.sleep(0)
    assert started == ["a", "b"] and len(watches) == 2
    release.set()
    for _ in range(100):  # bounded: the two watches end at their next turn
        if not len(watches):
            break
        await asyncio.sleep(0.01)
    assert len(watches) == 0
    release.clear()
    watches.start("a", lambda: watch("a"))  # a watch that ended can be started again
    await asyncio.sleep(0)
    assert started == ["a", "b", "a"]
    release.set()
    await asyncio.sleep(0.01)
