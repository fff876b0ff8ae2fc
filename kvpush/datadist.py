"""LLMDataDist: the engine instance — lifecycle, listening (``listen``), link/unlink, switch_role.

Several instances may live in one process and one event loop; each has its own registry, links
and listener. All methods must be called from the event loop the instance was initialised on.
Which link carries this side's transfers is ``kvpush.links``'s decision, the listener is
``kvpush.listening``'s; transfers live in ``cache_manager`` and below.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from transports import registry as transport_registry
from transports.base import Connection, TransportError

from . import validate as v
from .cache_manager import CacheManager
from .datapath import DataPaths
from .handshake import Identity, Probed
from .lag import LoopLag
from .link import Link
from .links import Adopted, LinkTable
from .listening import Listening
from .memory import CacheRegistry
from .notify import MAX_MESSAGE_BYTES, MESSAGE, NOTIFICATION, Delivery, Inbox
from .options import EngineOptions, is_loopback, parse_options
from .scope import TaskScope
from .serving import HeldGrants
from .status import LLMException, LLMStatusCode, param_invalid
from .types import LLMClusterInfo, LLMRole, check_int, check_ip

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0


def _overall(codes: Sequence[LLMStatusCode]) -> LLMStatusCode:
    return next((code for code in codes if code != LLMStatusCode.LLM_SUCCESS), LLMStatusCode.LLM_SUCCESS)


class LLMDataDist:
    """One kvpush engine. ``async with LLMDataDist(role, cluster_id, options) as dd:`` initialises
    it with ``options`` and finalizes it on exit."""

    def __init__(self, role: LLMRole, cluster_id: int, options: Any = None) -> None:
        if not isinstance(role, LLMRole):
            raise TypeError(f"role must be an LLMRole, got {type(role).__name__}")
        self.role = role
        self.cluster_id = check_int("cluster_id", cluster_id)
        self._options = EngineOptions()
        self.instance = os.urandom(8).hex()  # tells a restarted peer from a second link of the same one
        self.registry = CacheRegistry()
        self._control = transport_registry.control()
        self._one_sided = transport_registry.Opened([], [])
        self._pending_options = options
        self._initialized = False
        self._finalized = False
        self._links: LinkTable[Link] = LinkTable()
        self._linking: set[int] = set()
        # the listener's accept loop, handshakes, dials, held grants, closed links unwinding: finalize ends them
        self._tasks = TaskScope(f"kvpush-engine-{self.cluster_id}")
        self._listening = Listening(self._control, self._tasks, self._accept_one, self._listening_at)
        self._link_listeners: list[Callable[[Link, str | None], None]] = []
        self._held_caches = 0  # caches pinned for closed links (see held_caches)
        # per peer cluster: its closed links' tasks that may still land bytes or hold caches (see settled)
        self._settling: dict[int, set[asyncio.Task[None]]] = {}
        self.messages = Inbox()       # small ordered messages from linked peers (SPEC 10)
        self.notifications = Inbox()  # completion notifications of transfers that landed here
        self._cache_manager = CacheManager(self)
        #: this engine's event-loop stalls (``kvpush.lag``): a link does not blame its peer for them
        self.loop_lag = LoopLag(f"kvpush engine cluster {self.cluster_id}")

    def __repr__(self) -> str:
        return (f"<LLMDataDist cluster={self.cluster_id} role={self.role.name} "
                f"listen={self.listen_address} links={sorted(self._links.primaries)}>")

    # -- lifecycle --------------------------------------------------------------------------------
    async def init(self, options: Any = None) -> None:
        """Validate options and, if ``llm.listenIpInfo`` is set, start listening there. A second
        call is a no-op. Raises LLMException(LLM_PARAM_INVALID) naming a bad key."""
        if self._initialized:
            return
        if self._finalized:
            raise LLMException(LLMStatusCode.LLM_ENGINE_FINALIZED, "init: this instance was finalized")
        parsed = parse_options(options if options is not None else self._pending_options)
        self._options = parsed
        try:
            self._one_sided = transport_registry.open_one_sided(parsed.transport, asyncio.get_running_loop())
        except TransportError as error:
            raise LLMException(LLMStatusCode.LLM_FEATURE_NOT_ENABLED, str(error.strerror or error)) from None
        for reason in self._one_sided.unavailable:
            log.info("%s", reason)
        self.registry.mapper = next((t.registrar for t in self._one_sided.transports if t.registrar is not None),
                                    None)
        try:
            if parsed.listen is not None:
                self._listening.start(*parsed.listen)
        except BaseException:
            self._close_transports()
            raise
        self._tasks.spawn(self.loop_lag.watch(), f"kvpush-lag-{self.cluster_id}")
        self._initialized = True
        log.info("engine cluster=%d role=%s initialised (listen=%s)", self.cluster_id, self.role.name,
                 self.listen_address)

    async def finalize(self) -> None:
        """Stop listening, force-unlink every peer (in-flight transfers fail promptly with
        LLMException), release memory kvpush allocated. Idempotent."""
        if self._finalized or not self._initialized:
            self._finalized = True
            return
        self._finalized = True
        self._initialized = False
        self._listening.stop()
        links = self._links.all()
        for link in links:  # each one's closing is heard as ever (listeners, inboxes)
            link.close("engine finalized")
        self._links.clear()
        await asyncio.gather(*(link.wait_closed() for link in links))
        await self._tasks.aclose()
        self.registry.clear()
        self._close_transports()
        self.messages.close("engine finalized")
        self.notifications.close("engine finalized")

    def _close_transports(self) -> None:
        self.registry.mapper = None
        self._one_sided.close()

    async def __aenter__(self) -> LLMDataDist:
        await self.init()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.finalize()

    @property
    def options(self) -> EngineOptions:
        """The options in force (parsed at ``init``)."""
        return self._options

    @property
    def identity(self) -> Identity:
        """Who this engine is in a handshake."""
        return Identity(self.cluster_id, int(self.role), self.instance, self._options.auth_token)

    @property
    def max_pending_handshakes(self) -> int:
        """Connections in handshake at once; past it the oldest is dropped (``kvpush.listening``)."""
        return self._listening.max_pending_handshakes

    @max_pending_handshakes.setter
    def max_pending_handshakes(self, count: int) -> None:
        self._listening.max_pending_handshakes = count

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """The ``(host, port)`` actually bound (port 0 asked for any free port), or None when not listening."""
        return self._listening.address

    @property
    def cache_manager(self) -> CacheManager:
        """The instance's ``CacheManager`` (registration and transfers). RuntimeError before ``init``."""
        if not self._initialized:
            self.require_init("cache_manager")
        return self._cache_manager

    @property
    def links(self) -> dict[int, Link]:
        """Ready links by peer cluster id (a copy)."""
        return dict(self._links.primaries)

    def links_lost(self, cluster_id: int) -> int:
        """How many times this engine's link to ``cluster_id`` closed with no other link to it left
        (each time the link listeners heard of it); see ``Delivery.epoch``."""
        return self._links.losses(cluster_id)

    def link_stats(self) -> dict[int, dict[str, Any]]:
        """Per-link counters as plain dicts, keyed by peer cluster id."""
        return {cluster: link.stats() for cluster, link in self._links.primaries.items()}

    def add_link_listener(self, listener: Callable[[Link, str | None], None]) -> None:
        """Call ``listener(link, None)`` when a link becomes this engine's link to its cluster, and
        ``listener(link, reason)`` when that link closes (e.g. to report links in a server)."""
        self._link_listeners.append(listener)

    def require_init(self, api: str) -> None:
        """RuntimeError before ``init``; LLMException(LLM_ENGINE_FINALIZED) after ``finalize``."""
        if not self._initialized:
            if self._finalized:
                raise LLMException(LLMStatusCode.LLM_ENGINE_FINALIZED, f"{api}: the engine was finalized")
            raise RuntimeError(f"{api}: call init() first")

    # -- listening ----------------------------------------------------------------------------------
    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0 picks a free port) and return the address actually bound.

        Already listening there (port 0: anywhere on that host): nothing changes. Listening elsewhere:
        the listener moves - the new address is bound first, then the old listener stops, so a bind
        that fails (LLM_PARAM_INVALID, naming the address and the reason) leaves the old one as it was
        (moving to another host address on the same port has to let go of the port first; if the new
        bind then fails, the old address is bound again). Existing links, whichever side made them, are
        not touched (unlike ``switch_role``, which needs none to exist), and handshakes already under
        way on the old listener finish.

        Cancellation and timeout: nothing to wait for. The bind happens before the coroutine first
        yields, so a cancelled call either never ran (the listener is as it was) or has already moved it;
        it never blocks, so it needs no deadline."""
        api = "listen"
        self.require_init(api)
        if not isinstance(host, str):
            raise TypeError(f"{api}: host must be a str, got {type(host).__name__}")
        bound = self._listening.move(check_ip("host", host), check_int("port", port, 0, 65535))
        log.info("engine cluster=%d now listens on %s", self.cluster_id, bound)
        return bound

    def _listening_at(self, host: str, port: int) -> None:
        if not self._options.auth_token and not is_loopback(host):
            log.warning("engine cluster=%d listens on %s:%d, which other hosts may reach, without kvpush.auth_token: "
                        "any peer that reaches it can link and use the caches it may reach", self.cluster_id, host,
                        port)

    def _paths(self) -> DataPaths:
        return DataPaths(self._one_sided.transports, self._one_sided.unavailable)

    async def _accept_one(self, connection: Connection) -> None:
        """A connection the listener accepted: its handshake (bounded), then the link is adopted."""
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                link = await Link.establish(self, connection, self._paths(), dialer=False)
        except TimeoutError:
            log.warning("refused a link from %s: handshake timed out", connection.peer)
            return
        except Probed:
            log.debug("answered a probe from %s", connection.peer)
            return
        except Exception as error:  # whatever a peer sends, the listener goes on
            log.warning("refused a link from %s: %s", connection.peer, error)
            return
        self._adopt(link)

    def _adopt(self, link: Link) -> bool:
        """Make ``link`` a link to its cluster (``LinkTable.adopt``). False: not adopted (closed
        meanwhile, or finalized)."""
        if not self._initialized:
            link.close("engine finalized")
            return False
        if not link.ready:  # it closed between its handshake and now (the peer left, or misbehaved)
            return False
        if self._links.adopt(link) is Adopted.PRIMARY:
            for listener in self._link_listeners:
                listener(link, None)
        return True

    # -- LinkOwner, EngineServices -----------------------------------------------------------------
    def link_closed(self, link: Link, reason: str, held: HeldGrants | None) -> None:
        """Called by a link when it closes: it is forgotten, so linking again works; caches the peer
        may still be writing into are released when that is safe (a task this engine owns)."""
        cluster_id = link.peer_cluster_id
        if self._links.closed(link):  # the peer is lost: none of its grants, messages or links go on
            assert cluster_id is not None
            self.registry.drop_grants(cluster_id)  # a restarted peer of that id inherits none
            for inbox in (self.messages, self.notifications):
                inbox.peer_gone(cluster_id, reason)
            for listener in self._link_listeners:
                listener(link, reason)
        self._keep_grants(link, held)

    def _keep_grants(self, link: Link, held: HeldGrants | None) -> None:
        """The closed link's own tasks and the caches it still holds: owned by this engine until they end."""
        if self._finalized:  # finalize waits for the link's tasks itself
            if held is not None:
                held.release_now_or_keep()
            return
        settling = []
        if len(link.tasks):
            settling.append(self._tasks.spawn(link.wait_closed(), f"kvpush-closed-{link.peer_cluster_id}"))
        if held is not None:
            settling.append(self._tasks.spawn(self._release_held(held), f"kvpush-grants-{link.peer_cluster_id}"))
        cluster_id = link.peer_cluster_id
        if cluster_id is not None:
            for task in settling:
                self._settling.setdefault(cluster_id, set()).add(task)
                task.add_done_callback(functools.partial(self._unwound, cluster_id))

    def _unwound(self, cluster_id: int, task: asyncio.Task[None]) -> None:
        tasks = self._settling.get(cluster_id, set())
        tasks.discard(task)
        if not tasks:
            self._settling.pop(cluster_id, None)

    async def settled(self, cluster_id: int) -> None:
        """Return once nothing of ``cluster_id``'s closed links can still land here: at once, unless one of
        them left work unwinding or caches its peer may still write into (a same-host writer whose process
        lives on, a one-sided writer within its grace), then once that ended. Links still open are not
        waited for. Cancelling it stops the wait and nothing else; it has no timeout of its own."""
        pending = [task for task in self._settling.get(cluster_id, ()) if not task.done()]
        if pending:
            await asyncio.wait(pending)

    async def _release_held(self, held: HeldGrants) -> None:
        count = len(held.entries)
        self._held_caches += count
        try:
            await held.release_when_safe()
        finally:
            self._held_caches -= count

    @property
    def held_caches(self) -> int:
        """How many caches this engine keeps pinned for links that closed while their peer might still
        write into them (released once it cannot: its process exited, or a grace passed). A plain int:
        safe to read from any thread, e.g. for a metrics exporter."""
        return self._held_caches

    @property
    def link_count(self) -> int:
        """Ready links (one per linked peer cluster). Safe to read from any thread."""
        return len(self._links)

    def deliver(self, link: Link, channel: int, data: bytes) -> bool:
        """A peer's message or notification (LinkOwner): queued, or False when the inbox is full."""
        assert link.peer_cluster_id is not None
        inbox = self.notifications if channel == NOTIFICATION else self.messages
        return inbox.put(Delivery(link.peer_cluster_id, data, self._links.losses(link.peer_cluster_id)))

    async def send_message(self, cluster_id: int, data: bytes) -> None:
        """Send a small message (at most ``kvpush.MAX_MESSAGE_BYTES``) to a linked peer; messages to one
        peer arrive in the order sent. Returns when the peer queued it on its ``messages`` inbox.
        LLM_NOT_YET_LINK without a link, LLM_PARAM_INVALID when too big, LLM_LINK_BUSY when the peer's
        inbox is full, LLM_TIMEOUT when the link breaks first. Cancellation stops waiting for the
        peer's answer; the message may still arrive."""
        await self._send(MESSAGE, "send_message", cluster_id, data)

    async def send_notification(self, cluster_id: int, data: bytes) -> None:
        """Like ``send_message``, onto the peer's ``notifications`` inbox. Sent after every transfer
        that already completed on this link, so the peer sees it after their bytes landed."""
        await self._send(NOTIFICATION, "send_notification", cluster_id, data)

    async def _send(self, channel: int, api: str, cluster_id: int, data: bytes) -> None:
        self.require_init(api)
        check_int("cluster_id", cluster_id)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{api}: data must be bytes, got {type(data).__name__}")
        if len(data) > MAX_MESSAGE_BYTES:
            raise param_invalid(f"{api}: {len(data)} bytes exceed the limit of {MAX_MESSAGE_BYTES}")
        await self.link_for(api, cluster_id).send_message(channel, bytes(data))

    def registry_changed(self) -> None:
        """The registry changed: every peer gets the new table (a failing send closes its link)."""
        for link in self._links.all():  # a failing send closes its link
            link.registry_changed()

    def link_for(self, api: str, cluster_id: int) -> Link:
        """The ready link to ``cluster_id``, else LLMException(LLM_NOT_YET_LINK)."""
        link = self._links.primary(cluster_id)
        if link is None or not link.ready:
            raise LLMException(LLMStatusCode.LLM_NOT_YET_LINK, f"{api}: no link to cluster {cluster_id}")
        return link

    # -- links ---------------------------------------------------------------------------------------
    async def link_clusters(self, clusters: Sequence[LLMClusterInfo],
                            timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to every cluster concurrently; returns (overall, per-cluster codes) and never raises
        for a link that failed (LLM_LINK_FAILED, LLM_ALREADY_LINK, LLM_PARAM_INVALID). Each link is
        bounded by ``timeout`` ms; cancelling the call closes half-made connections."""
        api = "link_clusters"
        self.require_init(api)
        infos = v.check_clusters(api, clusters)
        seconds = v.check_timeout(api, timeout)
        seen: set[int] = set()
        codes: list[LLMStatusCode] = []
        jobs: dict[int, Coroutine[Any, Any, LLMStatusCode]] = {}
        for info in infos:
            cluster_id = info.remote_cluster_id
            assert cluster_id is not None
            if cluster_id in seen or not info.remote_ip_info:
                reason = "listed twice" if cluster_id in seen else "has no remote ip info"
                log.warning("%s: cluster %d %s", api, cluster_id, reason)
                codes.append(LLMStatusCode.LLM_PARAM_INVALID)
            else:
                jobs[len(codes)] = self._link_one(info, seconds)
                codes.append(LLMStatusCode.LLM_SUCCESS)  # (its code once its job ends)
            seen.add(cluster_id)
        for index, code in zip(jobs, await asyncio.gather(*jobs.values())):
            codes[index] = code
        return _overall(codes), codes

    async def _link_one(self, info: LLMClusterInfo, seconds: float) -> LLMStatusCode:
        """Dial the cluster's addresses in turn (each ``link_retry_count`` times) until one links,
        all within ``seconds``."""
        cluster_id = info.remote_cluster_id
        assert cluster_id is not None
        if cluster_id == self.cluster_id:
            log.warning("link_clusters: cluster %d is this engine itself", cluster_id)
            return LLMStatusCode.LLM_PARAM_INVALID
        existing = self._links.primary(cluster_id)
        if existing is not None and existing.ready:
            # linked by the peer: usable both ways, as if this call had made it (SPEC 3)
            return LLMStatusCode.LLM_ALREADY_LINK if existing.dialer else LLMStatusCode.LLM_SUCCESS
        if cluster_id in self._linking:
            return LLMStatusCode.LLM_PROCESSING_LINK
        self._linking.add(cluster_id)
        reasons: list[str] = []
        address = ""
        try:
            async with asyncio.timeout(seconds):
                for host, port in info.remote_ip_info:
                    address = f"{host}:{port}"
                    for _attempt in range(self.options.link_retry_count):
                        code = await self._dial_once(host, port, cluster_id, reasons)
                        if code is not None:
                            return code
        except TimeoutError:
            reasons.append(f"{address}: timed out")
        finally:
            self._linking.discard(cluster_id)
        log.warning("link_clusters: cluster %d failed: %s", cluster_id, "; ".join(reasons) or "timed out")
        return LLMStatusCode.LLM_LINK_FAILED

    async def _dial_once(self, host: str, port: int, cluster_id: int, reasons: list[str]) -> LLMStatusCode | None:
        """One dial, a task of this engine (finalize ends it); None when the next one may be tried (why not
        appended to ``reasons``). Cancelling the caller cancels the dial."""
        dial = self._tasks.spawn(self._dial(host, port, cluster_id), f"kvpush-dial-{cluster_id}")
        try:
            link = await dial
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the caller's (or its timeout's) cancellation
            return LLMStatusCode.LLM_LINK_FAILED  # the engine was finalized meanwhile
        except LLMException as error:
            if error.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED:
                log.warning("link_clusters: cluster %d: %s", cluster_id, error)
                return error.status_code
            reasons.append(f"{host}:{port}: {error}")
            return None
        except TransportError as error:
            reasons.append(f"{host}:{port}: {error}")
            return None
        if self._adopt(link):
            return LLMStatusCode.LLM_SUCCESS
        if not self._initialized:
            return LLMStatusCode.LLM_LINK_FAILED  # finalized meanwhile
        reasons.append(f"{host}:{port}: the link closed right after its handshake: {link.close_reason}")
        return None

    async def _dial(self, host: str, port: int, cluster_id: int) -> Link:
        connection = await self._control.connect(host, port)
        return await Link.establish(self, connection, self._paths(), dialer=True, expect_cluster_id=cluster_id)

    async def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000,
                              force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Non-force: tell each peer and wait for its acknowledgement (LLM_UNLINK_FAILED when it does
        not answer within ``timeout`` ms; the local end is closed either way). Force: close only the
        local end. Unlinking a cluster that has no link succeeds."""
        api = "unlink_clusters"
        self.require_init(api)
        infos = v.check_clusters(api, clusters)
        seconds = v.check_timeout(api, timeout)
        if not isinstance(force, bool):
            raise TypeError(f"{api}: force must be a bool")

        async def unlink(info: LLMClusterInfo) -> LLMStatusCode:
            assert info.remote_cluster_id is not None
            links = self._links.links_to(info.remote_cluster_id)
            if not links:
                return LLMStatusCode.LLM_SUCCESS
            if force:
                for link in links:
                    link.close("force unlinked")
                return LLMStatusCode.LLM_SUCCESS
            results = await asyncio.gather(*(link.unlink(seconds) for link in links))
            return LLMStatusCode.LLM_SUCCESS if all(results) else LLMStatusCode.LLM_UNLINK_FAILED

        codes = list(await asyncio.gather(*(unlink(info) for info in infos)))
        return _overall(codes), codes

    async def switch_role(self, role: LLMRole, options: dict[str, str] | None = None) -> None:
        """Change the role label. With ``llm.listenIpInfo`` in ``options`` the listener starts (or
        moves) there; without it the listener stops. LLM_EXIST_LINK while any link exists."""
        self.require_init("switch_role")
        if not isinstance(role, LLMRole):
            raise TypeError(f"switch_role: role must be an LLMRole, got {type(role).__name__}")
        if options is not None and not isinstance(options, dict):
            raise TypeError("switch_role: options must be a dict of str")
        if self._links:
            raise LLMException(LLMStatusCode.LLM_EXIST_LINK,
                               f"switch_role: unlink clusters {sorted(self._links.primaries)} first")
        listen = parse_options(options).listen if options else None
        self._listening.stop()
        if listen is not None:
            self._listening.start(*listen)
        self.role = role
