"""An OpenAI-compatible proxy that makes vLLM prefill and decode instances running KvpushConnector one
endpoint (``kvpush proxy``; needs aiohttp: ``pip install 'kvpush[proxy]'``).

    kvpush proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

``POST /v1/completions`` and ``POST /v1/chat/completions``, for each request:

1. A decode is picked (fewest requests in flight, ties in turn; see ``routing.Pool``).
2. A prefill gets a copy with a fresh transfer id (``do_remote_decode``, ``max_tokens=1``, streamed) and
   must *accept* it - answer the head of its response - within ``accept_timeout_s``. A prefill that is
   refused, reset, times out or answers an error before that is skipped for a back-off and the next one
   is tried.
3. The decode gets the client's request: with the accepting prefill's kvpush address in its
   ``kv_transfer_params`` (it allocates the blocks and sends their ids to that prefill, which pushes the
   KV layer by layer; the prefill holds its copy until those ids came, at most its connector's
   ``ids_wait_ms``, so it pushes each layer as its forward computes it), or - when no prefill accepted - as
   a plain request that the decode computes alone,
   whatever its ``kv_load_failure_policy`` says. The response carries ``X-Kvpush-Route: pd`` or
   ``decode-only``, the proxy logs why, and ``/metrics`` counts it. The decode only ever waits for KV
   from a prefill that holds the request, so a prefill that is down or starting up never makes it wait.
4. The client gets the decode's response as it comes (status, body, usage), chunk by chunk, so a
   ``stream`` request is streamed. The prefill's stream is drained meanwhile; once the decode answered,
   a prefill still running gets ``prefill_grace_s`` and is then cancelled.
   A streamed greedy ``/v1/completions`` request (``first_token.leads`` says which) gets the prefill's
   first token as soon as the prefill streams it, once the decode answered its head, instead of waiting
   for the decode to compute the same token again; the decode's copy of it is dropped and checked (a
   different one cuts the client's connection: ``first_token_mismatch`` in ``/metrics``). The client
   receives what the decode alone would have streamed, earlier by the transfer's tail and a decode step.

A prefill's HTTP side may accept requests while its kvpush engine does not run (its worker starved of its
cores, frozen): every ``kv_probe_s`` the proxy asks each prefill's kvpush engine whether it answers
(``kvpush.probe``), and one that does not within ``kv_probe_timeout_s`` gets no request until it does
(``kv_probe_failed`` in ``/metrics``; its ``upstream_up`` is 0 meanwhile).

Bounds: a request is answered or cut within ``timeout_s`` of arriving, streamed ones included. A decode
that refuses the connection, or closes it before any byte of its answer, is skipped for a back-off and
the request goes again (new transfer, from step 1) to a decode that accepts, waiting for one for at most
``retry_for_s``; then a 503 names why each decode was skipped. Past the first byte to the client, an
upstream that breaks cuts the client's connection (nothing else can tell a streaming client). A timeout
before any byte is a 504. A client that disconnects cancels both upstream requests (vLLM aborts them and
frees their blocks). Requests with ``n`` > 1 are refused (one transfer per request).

A prefill's kvpush address is the host of its URL and ``--prefill-kv-port`` (default 14579, vLLM's
``kv_port`` default, where a prefill's connector listens); one prefill's own goes in the URL's fragment:
``http://10.0.0.5:8100#kv=10.0.0.5:14600`` (or ``#kv=14600``: the URL's host), with ``&cluster=ID`` when
that prefill sets ``cluster_id`` in its extra config. The host must be spelt as the prefill's connector
listens (its ``VLLM_HOST_IP``; an IP address is safest): the decode derives the prefill's cluster id from it.

Fleet (``discovery``, ``etcd://HOST:PORT[,...]``; ``kvpush.integrations.fleet``): the upstreams are the
instances registered there, read at start and then watched: a new one gets requests as soon as it is
seen, a deleted or ``draining`` one none from then on; the load they register is added to the proxy's
own counts; a prefill and a decode are paired only when their KV-geometry fingerprints match (an
instance matching no peer is logged once). If etcd goes away the proxy routes on the last membership it
saw and reconnects. Static ``prefills``/``decodes`` may be given beside it.

``GET /v1/models`` is a decode's answer; ``GET /health`` answers 200 when every upstream's ``/health``
does, else 503 naming those that did not; ``GET /metrics`` is the proxy's counters in Prometheus' text
format (requests by route, errors by status, retries, and each upstream's requests in flight and state).

Clients: with ``api_key`` set, every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (as
vLLM's ``--api-key``; else 401), and that header goes on to the upstreams, unless ``upstream_api_key``
is set, which the upstreams get instead. A request body above ``max_body_bytes`` is refused (413). The
proxy keeps nothing of one request that another could read: each answer is relayed from its own upstream
request to its own client, and an error the proxy writes names upstreams and reasons, never request data.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvpush import LLMException, probe

from .first_token import leads
from .fleet import Membership, parse_discovery
from .proxy_http import (
    Hop,
    Leading,
    PrefillRun,
    Unanswered,
    describe,
    error_response,
    healthy,
    relay,
    render_metrics,
    target_url,
)
from .routing import (
    DEFAULT_KV_PORT,
    Pool,
    Prefill,
    SpecError,
    base_url,
    decode_body,
    parse_prefill,
    plain_body,
    prefill_body,
)
from .vllm_core import new_transfer_id

__all__ = ["DEFAULT_KV_PORT", "Prefill", "ProxyConfig", "SpecError", "base_url", "bound_port", "parse_prefill",
           "start"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
ACCEPT_TIMEOUT_S = 5.0  # a healthy vLLM answers a streamed request's head within milliseconds
RETRY_FOR_S = 30.0
CONNECT_TIMEOUT_S = 10.0
UPSTREAM_KEEPALIVE_S = 4.0
PREFILL_GRACE_S = 2.0  # after the decode answered, how long a prefill's answer may still come (then cancelled)
MAX_BODY_BYTES = 32 << 20  # far above a 128k-token prompt as JSON (~1 MB); images inline may need more
MAX_RESENDS = 3  # a request whose decode closed the connection before answering goes again this many times
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# A prefill whose kvpush engine does not answer within KV_PROBE_TIMEOUT_S gets no request until it does: a
# decode sent to it would wait for a link it cannot make (its own link timeout is 3 s)
KV_PROBE_S = 1.0
KV_PROBE_TIMEOUT_S = 1.5
_FORWARDED = ("Authorization", "X-Request-Id")  # request headers the upstreams get



@dataclass(frozen=True)
class ProxyConfig:
    """What ``kvpush proxy`` serves. ``timeout_s`` bounds a client's request from its arrival to the last
    byte of the answer; ``accept_timeout_s`` how long a prefill may take to accept its copy;
    ``retry_for_s`` how long a request waits for a decode to accept it; ``prefill_grace_s`` how long a
    prefill may still run after the decode answered."""

    prefills: Sequence[Prefill]
    decodes: Sequence[str]  # base URLs
    timeout_s: float = DEFAULT_TIMEOUT_S
    prefill_grace_s: float = PREFILL_GRACE_S
    accept_timeout_s: float = ACCEPT_TIMEOUT_S
    retry_for_s: float = RETRY_FOR_S
    api_key: str | None = None  # clients must send it (Authorization: Bearer)
    upstream_api_key: str | None = None  # what the upstreams get instead of the client's Authorization
    max_body_bytes: int = MAX_BODY_BYTES
    discovery: str | None = None  # etcd://HOST:PORT[,...]: the fleet's registry
    kv_probe_s: float = KV_PROBE_S  # how often each prefill's kvpush side is probed (0: never)
    kv_probe_timeout_s: float = KV_PROBE_TIMEOUT_S  # a probe unanswered this long holds the prefill out

    def __post_init__(self) -> None:
        if self.discovery is not None:
            parse_discovery(self.discovery)  # FleetError (a ValueError) naming what is wrong
        elif not self.prefills or not self.decodes:
            raise SpecError("a proxy needs at least one prefill and one decode, or a fleet to discover them in")
        if not (self.timeout_s > 0 and self.accept_timeout_s > 0 and self.prefill_grace_s >= 0
                and self.retry_for_s >= 0):
            raise SpecError(f"timeout {self.timeout_s} and accept timeout {self.accept_timeout_s} must be > 0, "
                            f"prefill grace {self.prefill_grace_s} and retry window {self.retry_for_s} >= 0")
        if not (self.kv_probe_s >= 0 and self.kv_probe_timeout_s > 0):
            raise SpecError(f"kv probe interval {self.kv_probe_s} must be >= 0 and its timeout "
                            f"{self.kv_probe_timeout_s} > 0")
        if self.max_body_bytes < 1:
            raise SpecError(f"max body size {self.max_body_bytes} must be >= 1 byte")


class _Refused(Exception):
    def __init__(self, message: str, client_error: bool) -> None:
        super().__init__(message)
        self.client_error = client_error



class Proxy:
    """The proxy's state: the two pools, the counters and one client session (opened and closed with the
    app)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefills: Pool[Prefill] = Pool(config.prefills)
        self.decodes: Pool[str] = Pool(config.decodes)
        #: requests by route (pd, decode_only), errors by status, resends, clients that left
        self.counters: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self.membership = Membership() if config.discovery is not None else None
        self._compat: dict[str, str] = {}  # upstream URL -> its KV-geometry fingerprint (fleet members)
        self._unpaired: set[str] = set()  # fleet members already logged as matching no peer

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's app is not running")
        return self._session

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._authorize])
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.cleanup_ctx.append(self._client)
        return app

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With an API key, every route but /health needs ``Authorization: Bearer <key>``."""
        key = self.config.api_key
        if key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return self._fail(401, "Unauthorized: this proxy needs 'Authorization: Bearer <api key>'")
        response: web.StreamResponse = await handler(request)
        return response

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        """The client's headers the upstreams get (Authorization replaced by ``upstream_api_key`` if set)."""
        headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
        if self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        return headers

    async def _client(self, app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s,
                                        sock_connect=min(self.config.timeout_s, CONNECT_TIMEOUT_S))
        # Idle pooled connections are dropped before vLLM's HTTP server (uvicorn, 5 s keep-alive) closes
        # them: a POST on a connection the server is closing fails ("Server disconnected").
        connector = aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        watching = None
        probing = (asyncio.get_running_loop().create_task(self._probe_prefills(), name="kvpush-proxy-kv-probe")
                   if self.config.kv_probe_s > 0 else None)
        if self.membership is not None and self.config.discovery is not None:
            from .fleet_etcd import Watcher  # the fleet extra: a clear ImportError without it

            watcher = Watcher(parse_discovery(self.config.discovery), self.membership, self._sync)
            watching = asyncio.get_running_loop().create_task(watcher.run(), name="kvpush-proxy-fleet")
        try:
            async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                             connector=connector) as self._session:
                yield
        finally:
            self._session = None
            for task in (watching, probing):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

    async def _probe_prefills(self) -> None:
        """Every ``kv_probe_s``: probe each prefill's kvpush side (``kvpush.probe``). One that does not answer
        within ``kv_probe_timeout_s`` gets no request until it does, however its HTTP side answers: its
        process may take requests while its kvpush engine's loop does not run (starved of its cores), and a
        decode sent there would wait for a link it cannot make. Until cancelled."""
        while True:
            started = asyncio.get_running_loop().time()
            prefills = self.prefills.targets
            answers = await asyncio.gather(*(self._probe(p) for p in prefills))
            for prefill, problem in zip(prefills, answers):
                if problem is None:
                    if self.prefills.restore(prefill):
                        log.warning("prefill %s: its kvpush side answers again; it gets requests", prefill.url)
                    continue
                self.counters["kv_probe_failed"] += 1
                if self.prefills.hold_out(prefill, f"kvpush side not answering: {problem}"):
                    log.warning("prefill %s: its kvpush side does not answer (%s); it gets no request until it "
                                "does", prefill.url, problem)
            await asyncio.sleep(max(0.0, self.config.kv_probe_s - (asyncio.get_running_loop().time() - started)))

    async def _probe(self, prefill: Prefill) -> str | None:
        try:
            await probe(prefill.kv_host, prefill.kv_port, self.config.kv_probe_timeout_s)
        except LLMException as error:
            return str(error).partition(": ")[2] or str(error)
        return None

    def _sync(self) -> None:
        """The fleet's membership changed: the pools become its ready members (beside the static ones)."""
        assert self.membership is not None
        prefills, decodes = list(self.config.prefills), list(self.config.decodes)
        compat: dict[str, str] = {}
        for instance in self.membership.ready("prefill"):
            host, port = instance.kv_address()
            cluster = instance.cluster_ids[0] if instance.cluster_ids else None
            prefills.append(Prefill(instance.url, host, port, cluster))
            compat[instance.url] = instance.compat
        for instance in self.membership.ready("decode"):
            decodes.append(instance.url)
            compat[instance.url] = instance.compat
        self._compat = compat
        for role, pool, targets in (("prefill", self.prefills, prefills), ("decode", self.decodes, decodes)):
            added, removed = pool.update(targets)  # type: ignore[arg-type]
            for target in added:
                log.info("fleet: %s %s joined", role, target_url(target))
            for target in removed:
                log.info("fleet: %s %s left (or is draining)", role, target_url(target))
        loads = {i.url: i.load.requests for i in self.membership.instances.values()}
        self.prefills.load = {p: loads.get(p.url, 0) for p in self.prefills.targets}
        self.decodes.load = {d: loads.get(d, 0) for d in self.decodes.targets}
        for url, fingerprint in compat.items():
            peers = [u for u, f in compat.items() if f == fingerprint and u != url]
            if not peers and url not in self._unpaired and len(compat) > 1:
                self._unpaired.add(url)
                log.warning("fleet: %s has a KV geometry (%s) no other instance shares: it is never paired", url,
                            fingerprint)

    def _incompatible(self, decode: str) -> list[Prefill]:
        """Prefills whose KV geometry differs from ``decode``'s (fleet members; static ones always pair)."""
        mine = self._compat.get(decode)
        if mine is None:
            return []
        return [p for p in self.prefills.targets if self._compat.get(p.url, mine) != mine]

    # -- completions -------------------------------------------------------------------------------
    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        headers = self._upstream_headers(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_s
        give_up_waiting = min(deadline, loop.time() + self.config.retry_for_s)
        resends = 0
        try:
            while True:
                decode = await self._next_decode(deadline, give_up_waiting)
                if isinstance(decode, web.Response):
                    return decode
                if self.decodes.probing(decode):  # back after failing? (no prefill works for a decode that is not)
                    problem = await healthy(self.session, decode, deadline)
                    if problem is not None:
                        self.decodes.failed(decode, problem)
                        continue
                try:
                    return await self._attempt(request, body, headers, decode, deadline)
                except Unanswered as error:
                    backoff = self.decodes.failed(decode, str(error))
                    resends += 1
                    self.counters["resent"] += 1
                    log.warning("decode %s did not take the request (%s); skipped for %.2f s, the request goes "
                                "again", decode, error, backoff)
                    if resends > MAX_RESENDS:
                        return self._fail(502, f"decode instances closed the connection {resends} times before "
                                          f"answering; last: {decode}: {error}")
        except asyncio.CancelledError:
            self.counters["client_left"] += 1
            raise

    async def _read_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The request's JSON object, or the error answer to send instead."""
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return self._fail(413, f"the request body exceeds this proxy's limit of {self.config.max_body_bytes} bytes")
        except ValueError as error:
            return self._fail(400, f"the request body is not JSON: {error}")
        if not isinstance(body, dict):
            return self._fail(400, "the request body must be a JSON object")
        if body.get("n") not in (None, 1):
            return self._fail(400, "n > 1 is not supported through the kvpush proxy (one KV transfer per request)")
        return body

    async def _next_decode(self, deadline: float, give_up_waiting: float) -> str | web.Response:
        """A decode to try, waiting while every one sits out a back-off (or a fleet has none yet) until
        ``give_up_waiting``; then the error answer (503, or 504 past ``deadline``)."""
        loop = asyncio.get_running_loop()
        while (decode := self.decodes.pick()) is None:
            wake = self.decodes.next_up_at()
            now = loop.time()
            if wake is None and self.membership is not None:
                wake = now + 0.2  # a fleet with no decode yet: one may register meanwhile
            if wake is None or now >= give_up_waiting:
                waited = now - (deadline - self.config.timeout_s)
                return self._fail(504 if now >= deadline else 503, "no decode instance accepted the request "
                                  f"within {waited:.1f} s: {self._down(self.decodes)}", {"Retry-After": "1"})
            await asyncio.sleep(min(max(wake - now, 0.01), give_up_waiting - now))
        return decode

    async def _attempt(self, request: web.Request, body: dict[str, Any], headers: Mapping[str, str], decode: str,
                       deadline: float) -> web.StreamResponse:
        """One try: a prefill (if any accepts), then the decode's answer relayed. Raises Unanswered."""
        transfer_id = new_transfer_id()
        leading = None
        if leads(request.path, body):
            leading = Leading(asyncio.get_running_loop().create_future(), body.get("return_token_ids") is True)
        prefill = await self._open_prefill(request.path, body, headers, transfer_id, deadline,
                                           self._incompatible(decode), leading)
        answered = False
        try:
            if prefill is None:
                copy, route, leading = plain_body(body), "decode-only", None
            else:
                copy, route = decode_body(body, transfer_id, prefill.prefill), "pd"
                log.debug("transfer %s: prefill %s, decode %s", transfer_id, prefill.prefill.url, decode)
            self.decodes.acquire(decode)
            try:
                hop = Hop("POST", decode, json=copy, headers=headers, route=route, resend=True)
                response = await relay(self.session, request, hop, deadline, self._fail, leading)
            finally:
                self.decodes.release(decode)
            if leading is not None:
                self.counters["first_token_prefill"] += leading.led
                self.counters["first_token_mismatch"] += leading.mismatched
            answered = True
            self.decodes.accepted(decode)
            self.counters[f"route_{route.replace('-', '_')}"] += 1
            return response
        finally:  # the decode answered, failed, or the client left (this handler is being cancelled)
            if prefill is not None:
                await prefill.end(self.config.prefill_grace_s if answered else 0.0)

    async def _open_prefill(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str],  # noqa: PLR0913
                            transfer_id: str, deadline: float, skip: Sequence[Prefill] = (),
                            leading: Leading | None = None) -> PrefillRun | None:
        """The first prefill (in the pool's order, ``skip`` aside) that accepts its copy of the request, or
        None: then the decode computes the request alone. ``leading``: the prefill's first token is
        asked for (with its token id) and handed to it."""
        loop = asyncio.get_running_loop()
        tried: list[Prefill] = list(skip)
        reasons: list[str] = []
        while (prefill := self.prefills.pick(exclude=tried)) is not None:
            tried.append(prefill)
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self.prefills.acquire(prefill)
            reply: aiohttp.ClientResponse | None = None
            try:
                async with asyncio.timeout(min(self.config.accept_timeout_s, remaining)):
                    reply = await self.session.post(prefill.url + path,
                                                    json=prefill_body(body, transfer_id, leading is not None),
                                                    headers=headers, timeout=aiohttp.ClientTimeout(total=remaining))
                    if reply.status != 200:
                        text = (await reply.content.read(500)).decode("utf-8", "replace")
                        raise _Refused(f"answered {reply.status}: {text}", client_error=reply.status < 500)
            except (aiohttp.ClientError, TimeoutError, OSError, _Refused) as error:
                self.prefills.release(prefill)
                if reply is not None:
                    reply.close()
                reason = describe(error)
                reasons.append(f"{prefill.url}: {reason}")
                if isinstance(error, _Refused) and error.client_error:
                    break  # the request itself was refused: the decode answers it (and says what is wrong)
                backoff = self.prefills.failed(prefill, reason)
                log.warning("transfer %s: prefill %s did not accept the request (%s); skipped for %.2f s", transfer_id,
                            prefill.url, reason, backoff)
                continue
            except BaseException:
                self.prefills.release(prefill)
                if reply is not None:
                    reply.close()
                raise
            self.prefills.accepted(prefill)
            return PrefillRun(self.prefills, prefill, reply, transfer_id, leading)
        if reasons:
            log.warning("transfer %s: no prefill accepted the request (%s); the decode computes it alone", transfer_id,
                        "; ".join(reasons))
        else:  # every prefill sits out a back-off (its failure was logged when it began)
            log.debug("transfer %s: every prefill is skipped (%s); the decode computes the request alone", transfer_id,
                      self._down(self.prefills))
        return None

    def _fail(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
        self.counters[f"error_{status}"] += 1
        if status >= 500:
            log.warning("answered %d: %s", status, message)
        return error_response(status, message, headers)

    @staticmethod
    def _down(pool: Pool[Any]) -> str:
        """Each member of ``pool`` and why it was last skipped."""
        return "; ".join(f"{target_url(state['target'])}: {state['reason'] or 'up'}" for state in pool.state())

    # -- the rest ----------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.StreamResponse:
        decode = self.decodes.pick()
        if decode is None:
            return self._fail(503, f"no decode instance is up: {self._down(self.decodes)}")
        deadline = asyncio.get_running_loop().time() + CONNECT_TIMEOUT_S
        hop = Hop("GET", decode, headers=self._upstream_headers(request))
        return await relay(self.session, request, hop, deadline, self._fail)

    async def health(self, request: web.Request) -> web.Response:
        urls = [prefill.url for prefill in self.prefills.targets] + list(self.decodes.targets)
        if not urls:
            return error_response(503, "unhealthy: no prefill and no decode instance (is the fleet registry "
                                  "reachable?)")
        deadline = asyncio.get_running_loop().time() + CONNECT_TIMEOUT_S
        answers = await asyncio.gather(*(healthy(self.session, url, deadline) for url in urls))
        failing = {url: answer for url, answer in zip(urls, answers) if answer is not None}
        if failing:
            return error_response(503, "unhealthy: " + "; ".join(f"{url}: {answer}" for url, answer in failing.items()))
        return web.json_response({"status": "ok", "upstreams": urls})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render_metrics(self.counters, self.prefills, self.decodes),
                            content_type="text/plain", charset="utf-8")


async def start(config: ProxyConfig, host: str = "127.0.0.1", port: int = 8000) -> web.AppRunner:
    """Serve ``config`` on ``host:port`` (port 0: a free one, see ``bound_port``) until the returned
    runner's ``cleanup()``. A client that disconnects cancels its handler, so its upstream requests."""
    runner = web.AppRunner(Proxy(config).app(), handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The port a started runner listens on."""
    for address in runner.addresses:
        return int(address[1])
    raise RuntimeError("the runner listens nowhere")
