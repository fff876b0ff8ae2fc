"""What the router knows each instance caches (``Caches``): one ``CacheView`` per instance, followed by the
instance's KV events where it publishes them (``kvrouter.events.Follower``), guessed from the requests the
router sent it where it does not.

Where an instance publishes: given in its URL's fragment (``#events=tcp://HOST:PORT&replay=tcp://HOST:PORT``),
registered in the fleet's etcd, or asked of the instance itself (vLLM's ``GET /kv_event_sources``, whose
``tcp://*:PORT`` endpoints are read as the instance's own host). An instance that leaves takes its view and
its follower with it; one that joins starts with an empty view (filled from its replay buffer when it has
one).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio

from .core.index import DEFAULT_CAPACITY, CacheView
from .core.kv_events import Source
from .events import Follower

log = logging.getLogger(__name__)

DISCOVER_TIMEOUT_S = 2.0
REDISCOVER_S = 10.0  # an instance that published nothing (yet) is asked again this often


def source_from_config(url: str, config: object) -> Source | None:
    """A vLLM ``KVEventsConfig`` (as ``/kv_event_sources`` answers it, one per rank) -> where to follow it."""
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events") or config.get("publisher") != "zmq":
        return None
    host = urlsplit(url).hostname or "127.0.0.1"

    def reachable(endpoint: object) -> str | None:
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            return None  # ipc/inproc endpoints are the instance's own machine's
        address = endpoint[len("tcp://"):]
        name, _, port = address.rpartition(":")
        if name in ("*", "0.0.0.0", "[::]", "::", ""):
            name = f"[{host}]" if ":" in host else host
        return f"tcp://{name}:{port}"

    endpoint = reachable(config.get("endpoint"))
    if endpoint is None:
        return None
    return Source(endpoint, reachable(config.get("replay_endpoint")), str(config.get("topic") or ""))


class Caches:
    """The views of the instances the router routes to (by URL), and the followers of their events."""

    def __init__(self, counters: Counter[str], capacity: int = DEFAULT_CAPACITY, follow: bool = True,
                 block_size: int | None = None) -> None:
        self.counters = counters
        self.capacity = capacity
        self.follow = follow
        self.block_size = block_size
        self.views: dict[str, CacheView] = {}
        self.sources: dict[str, Source | None] = {}  # given (None: ask the instance)
        self._tasks: dict[str, asyncio.Task[None]] = {}  # per instance: finding its source, then following it
        self._followers: dict[str, Follower] = {}
        self._context: zmq.asyncio.Context | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        self._context = zmq.asyncio.Context()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._context is not None:
            self._context.term()
            self._context = None

    def block_size_seen(self) -> int | None:
        """The instances' block size: given, registered, or read from the first KV event of one of them."""
        if self.block_size is not None:
            return self.block_size
        return next((f.block_size for f in self._followers.values() if f.block_size is not None), None)

    def view(self, url: str) -> CacheView:
        view = self.views.get(url)
        if view is None:
            view = self.views[url] = CacheView(self.capacity)
        return view

    def match(self, url: str, hashes: Sequence[int]) -> int:
        return self.view(url).match(hashes) if hashes else 0

    def sent(self, url: str, hashes: Sequence[int]) -> None:
        if hashes:
            self.view(url).sent(hashes)

    def update(self, instances: Iterable[tuple[str, Source | None]]) -> None:
        """The instances routed to are now these (URL, where it publishes or None to ask it): views and
        followers of the others go; new ones start (once ``start`` was called)."""
        wanted = dict(instances)
        for url in [u for u in self.views if u not in wanted]:
            self._drop(url)
        for url, source in wanted.items():
            self.view(url)
            if self.sources.get(url, "unset") != source:
                self.sources[url] = source
                self._stop_following(url)
            if self.follow and self._context is not None and url not in self._tasks:
                self._tasks[url] = asyncio.get_running_loop().create_task(self._discover_and_follow(url),
                                                                          name=f"kvrouter-events-{url}")

    def _drop(self, url: str) -> None:
        self._stop_following(url)
        self.views.pop(url, None)
        self.sources.pop(url, None)
        log.info("instance %s left: its cache index goes with it", url)

    def _stop_following(self, url: str) -> None:
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()

    async def _discover_and_follow(self, url: str) -> None:
        """Ask the instance where it publishes (unless given) until it says, then follow it; a follower that
        fails (its socket cannot be made) starts again after a back-off (1 s, doubling to 30 s)."""
        backoff = 1.0
        try:
            while True:
                source = self.sources.get(url)
                while source is None:
                    source = await self._ask(url)
                    if source is None:
                        await asyncio.sleep(REDISCOVER_S)
                assert self._context is not None
                log.info("instance %s: following its KV events at %s%s", url, source.endpoint,
                         f" (replay {source.replay})" if source.replay else " (no replay socket)")
                follower = self._followers[url] = Follower(url, source, self.view(url), self.counters, self._context,
                                                           self.block_size)
                try:
                    await follower.run()
                except (zmq.ZMQError, OSError) as error:
                    self.counters["events_errors"] += 1
                    log.warning("instance %s: following its KV events failed (%s); again in %.0f s", url, error,
                                backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
        finally:
            if self._tasks.get(url) is asyncio.current_task():
                self._tasks.pop(url, None)
                self._followers.pop(url, None)

    async def _ask(self, url: str) -> Source | None:
        assert self._session is not None
        try:
            async with self._session.get(f"{url}/kv_event_sources",
                                         timeout=aiohttp.ClientTimeout(total=DISCOVER_TIMEOUT_S)) as reply:
                if reply.status != 200:
                    return None
                configs = await reply.json()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        if not isinstance(configs, dict) or not configs:
            return None
        first = configs.get("0", next(iter(configs.values())))  # data parallel rank 0 (one engine per instance)
        return source_from_config(url, first)
