"""The fleet's store, etcd v3 through ``aetcd`` (``pip install 'kvpush[fleet]'``).

``Registrar.run`` keeps one instance registered: a lease (``TTL_S``) kept alive every ``REFRESH_S``
with the instance's current state and load, its key written create-only (two instances never overwrite
one key), registered again after etcd lost the lease (a long outage, or etcd's own restart).
``Registrar.retire`` marks it ``draining``, waits for what the caller says, then revokes the lease.
``Watcher.run`` keeps a ``Membership`` current: a prefix read, then a watch from that revision; after any
failure it reads again and keeps the last membership meanwhile. ``snapshot`` reads the registry once.

Neither ``run`` ever ends on an etcd failure: it is logged (once per outage) and retried, so an instance
starts, and a proxy routes, whether etcd is up or not. Every call has a deadline; gRPC's keepalive pings
(5 s apart, as etcd allows by default) notice an etcd that hangs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .membership import PREFIX, REFRESH_S, TTL_S, FleetError, Instance, Load, Membership

try:
    import aetcd
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError(f"fleet discovery needs aetcd: pip install 'kvpush[fleet]' ({error})") from None

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 2
_OPTIONS = {"grpc.initial_reconnect_backoff_ms": 100, "grpc.min_reconnect_backoff_ms": 100,
            "grpc.max_reconnect_backoff_ms": 1000, "grpc.keepalive_time_ms": 5000,
            "grpc.keepalive_timeout_ms": 2000, "grpc.keepalive_permit_without_calls": 1,
            "grpc.http2.max_pings_without_data": 0, "grpc.http2.ping_timeout_ms": 2000}
_RETRY_S = (0.2, 0.5, 1.0, 2.0)


class _Endpoints:
    """etcd endpoints, tried in turn: ``client()`` is a connected client to the current one, and
    ``failed()`` moves on to the next."""

    def __init__(self, endpoints: Sequence[tuple[str, int]]) -> None:
        if not endpoints:
            raise FleetError("no etcd endpoint")
        self.endpoints = list(endpoints)
        self._index = 0
        self._client: Any = None

    async def client(self) -> Any:
        if self._client is None:
            host, port = self.endpoints[self._index]
            self._client = aetcd.Client(host=host, port=port, timeout=CALL_TIMEOUT_S, options=_OPTIONS)
            await self._client.connect()
        return self._client

    async def failed(self) -> None:
        await self.close()
        self._index = (self._index + 1) % len(self.endpoints)

    @property
    def current(self) -> str:
        host, port = self.endpoints[self._index]
        return f"{host}:{port}"

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception as error:  # noqa: BLE001 - closing a broken client: nothing to do about it
                log.debug("closing the etcd client: %s", error)


class _Outage:
    """Logs an outage once when it starts and once when it ends."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0

    def failed(self, where: str, error: BaseException) -> float:
        if self.failures == 0:
            log.warning("%s: etcd at %s failed (%s: %s); retrying", self.what, where, type(error).__name__, error)
        self.failures += 1
        return _RETRY_S[min(self.failures - 1, len(_RETRY_S) - 1)]

    def ok(self) -> None:
        if self.failures:
            log.info("%s: etcd answers again", self.what)
        self.failures = 0


class Registrar:
    """Keeps ``instance`` registered while ``run`` runs; ``load`` (if given) is read before each refresh."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], instance: Instance,
                 load: Callable[[], Awaitable[Load]] | None = None, ttl: int = TTL_S,
                 refresh_s: float = REFRESH_S) -> None:
        self._etcd = _Endpoints(endpoints)
        self.instance = instance
        self._load = load
        self._ttl = ttl
        self._refresh_s = refresh_s
        self._lease: Any = None
        self._written: bytes | None = None
        self._outage = _Outage(f"registration of {instance.key}")
        self.registered = asyncio.Event()

    async def run(self) -> None:
        """Register, then refresh every ``refresh_s``, until cancelled (then the lease is left to expire)."""
        try:
            while True:
                try:
                    await self._once()
                    self._outage.ok()
                    self.registered.set()
                    delay = self._refresh_s
                except (aetcd.ClientError, OSError, TimeoutError) as error:
                    self._written = None  # the lease may have survived (it is refreshed, or found gone, next time)
                    self.registered.clear()
                    delay = self._outage.failed(self._etcd.current, error)
                    await self._etcd.failed()
                await asyncio.sleep(delay)
        finally:
            await self._etcd.close()

    async def _once(self) -> None:
        client = await self._etcd.client()
        if self._load is not None and self.instance.state == "ready":
            try:
                self.instance = self.instance.with_state("ready", await self._load())
            except Exception as error:  # noqa: BLE001 - an unreadable load is reported as unknown
                log.debug("load of %s unknown: %s", self.instance.url, error)
                self.instance = self.instance.with_state("ready", Load())
        value = self.instance.to_json()
        if self._lease is not None:
            answer = await client.refresh_lease(self._lease.id)
            if answer.TTL <= 0:  # etcd let the lease go (it was down, or hung, longer than the TTL)
                log.info("registration of %s: the lease expired; registering again", self.instance.key)
                self._lease, self._written = None, None
        if self._lease is None:
            lease = await client.lease(self._ttl)
            key = self.instance.key.encode()
            transactions = client.transactions
            created, _ = await client.transaction(compare=[transactions.create(key) == 0],
                                                  success=[transactions.put(key, value, lease=lease)], failure=[])
            if not created:
                await lease.revoke()
                raise FleetError(f"{self.instance.key} is registered by another instance")
            self._lease, self._written = lease, value
            log.info("registered %s (%s) in etcd at %s", self.instance.key, self.instance.url, self._etcd.current)
        elif value != self._written:
            await client.put(self.instance.key.encode(), value, lease=self._lease.id)
            self._written = value

    async def retire(self, wait: Callable[[], Awaitable[None]] | None = None, timeout_s: float = 30.0) -> None:
        """Graceful leave, once ``run`` was cancelled and has ended: mark ``draining`` (a proxy sends no new
        request), await ``wait`` (at most ``timeout_s``), then revoke the lease (the key goes at once).
        Best effort: etcd may be away (the key then expires within the TTL)."""
        self.instance = self.instance.with_state("draining")
        try:
            client = await self._etcd.client()
            if self._lease is not None:
                await client.put(self.instance.key.encode(), self.instance.to_json(), lease=self._lease.id)
        except (aetcd.ClientError, OSError, TimeoutError) as error:
            log.info("could not mark %s draining: %s", self.instance.key, error)
        if wait is not None:
            try:
                await asyncio.wait_for(wait(), timeout_s)
            except TimeoutError:
                log.warning("%s: transfers still open after %g s; leaving anyway", self.instance.key, timeout_s)
        try:
            if self._lease is not None:
                await (await self._etcd.client()).revoke_lease(self._lease.id)
                log.info("unregistered %s", self.instance.key)
        except (aetcd.ClientError, OSError, TimeoutError) as error:
            log.info("could not revoke the lease of %s (it expires within %d s): %s", self.instance.key, self._ttl,
                     error)
        finally:
            self._lease = None
            await self._etcd.close()


class Watcher:
    """Keeps ``membership`` current while ``run`` runs; ``on_change`` is called after every change."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], membership: Membership,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self._etcd = _Endpoints(endpoints)
        self.membership = membership
        self._on_change = on_change
        self._outage = _Outage("fleet membership")
        self.synced = asyncio.Event()

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self._follow()
                except (aetcd.ClientError, OSError, TimeoutError) as error:
                    self.synced.clear()
                    delay = self._outage.failed(self._etcd.current, error)
                    await self._etcd.failed()
                    await asyncio.sleep(delay)
        finally:
            await self._etcd.close()

    async def _follow(self) -> None:
        client = await self._etcd.client()
        read = await client.get_prefix(PREFIX.encode())
        self.membership.reset(((kv.key.decode(), kv.value) for kv in read), read.header.revision)
        self._outage.ok()
        self.synced.set()
        self._on_change()
        watch = await client.watch_prefix(PREFIX.encode(), start_revision=read.header.revision + 1)
        try:
            async for event in watch:
                self.membership.apply(str(event.kind), event.kv.key.decode(), event.kv.value, event.kv.mod_revision)
                self._on_change()
        finally:
            await watch.cancel()


async def snapshot(endpoints: Sequence[tuple[str, int]]) -> tuple[list[Instance], dict[str, str]]:
    """The registry as it is now: its instances, and the entries that could not be read (key -> why).
    Raises FleetError when no endpoint answers."""
    etcd = _Endpoints(endpoints)
    problems = []
    try:
        for _ in etcd.endpoints:
            try:
                client = await etcd.client()
                membership = Membership()
                read = await client.get_prefix(PREFIX.encode())
                membership.reset(((kv.key.decode(), kv.value) for kv in read), read.header.revision)
                return sorted(membership.instances.values(), key=lambda i: (i.role, i.url)), membership.refused
            except (aetcd.ClientError, OSError, TimeoutError) as error:
                problems.append(f"{etcd.current}: {type(error).__name__}: {error}")
                await etcd.failed()
        raise FleetError("no etcd endpoint answered: " + "; ".join(problems))
    finally:
        await etcd.close()
