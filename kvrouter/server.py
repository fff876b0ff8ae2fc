"""An OpenAI-compatible endpoint in front of vLLM instances running KvpushConnector (``kvpush proxy``; needs
``pip install 'kvpush[proxy]'``). What it does for users - placement, the P/D flow, faults and bounds - is in
docs/guides/router.md and docs/guides/vllm.md; the flags and metrics in docs/reference/router.md.

``POST /v1/completions`` and ``POST /v1/chat/completions``, for each request:

1. ``_place``: the prompt's token ids (``kvrouter.tokens``) hashed into prefix-cache blocks as vLLM hashes
   them (``core.hashing``), matched against each instance's view (``kvrouter.caches``), and decided by the
   pure ``core.placement.place`` (a decode alone, or a prefill and a decode; with its reason).
2. ``_attempt``/``_try``: for P/D, the prefill and the decode get their copies *at once*, under one transfer id the
   router mints (``PrefillRun``: ``max_tokens=1``, streamed; the decode's with the prefill's kvpush address in its
   ``kv_transfer_params``), so the decode's block ids reach the prefill while the prefill's request is on its
   way (no hop waits for another). The prefill must *accept* - answer its head - within ``accept_timeout_s``;
   one that refuses before the decode's answer began is skipped for a back-off, the decode's copy is cut (vLLM
   aborts it and frees its blocks), and the next prefill is tried, or the decode computes the request alone.
3. ``relay``: the decode's answer goes to the client as it comes, once its prefill accepted (or the decode
   answered alone); a streamed greedy completion is led by the prefill's first token (``core.first_token``).

Bounds: a request is answered or cut within ``timeout_s``; a decode that refuses or closes before any byte is
skipped for a back-off and the request goes again (a new transfer) to one that accepts, for at most
``retry_for_s``, then 503; past the first byte a broken upstream cuts the client's connection; a client that
disconnects cancels both upstream requests. Cancelling the server task (``runner.cleanup()``) cancels every
request in flight and the followers of KV events, probes and the fleet's watch. The proxy keeps nothing of one
request that another could read; its errors name upstreams and reasons, never request data.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.fleet import Membership, parse_discovery
from kvpush.integrations.config import new_transfer_id

from . import probing, warm
from .caches import Caches
from .config import GUESS_BLOCK_SIZE, ProxyConfig
from .core.first_token import leads
from .core.hashing import BlockHasher
from .core.kv_events import Source
from .core.placement import DECODE_ONLY, PD, Candidate, Decision, Prompt, place
from .core.pools import (
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
from .relay import (
    Abandoned,
    Hop,
    Leading,
    PrefillRun,
    Unanswered,
    error_response,
    healthy,
    relay,
    render_metrics,
    target_url,
)
from .tokens import Tokens, given_ids
from .warm import Warmer

__all__ = ["DEFAULT_KV_PORT", "Prefill", "ProxyConfig", "SpecError", "base_url", "bound_port", "parse_prefill",
           "start"]  # (what tests and tools used from here before the router had a package of its own)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
UPSTREAM_KEEPALIVE_S = 4.0
LEARN_AFTER_S = 0.005
MAX_LEARNING = 64  # requests placed without their ids whose ids are still being had for the guessed index
MAX_RESENDS = 3  # a request whose decode closed the connection before answering goes again this many times
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
_FORWARDED = ("Authorization", "X-Request-Id")  # request headers the upstreams get


@dataclass(frozen=True)
class _Prompt:
    """One request's prompt, as placement reads it: its length in tokens and its blocks' hashes."""

    tokens: int
    hashes: tuple[int, ...]
    exact: bool  # tokenized (else its length is estimated and it has no hashes)


class Proxy:
    """The proxy's state: the two pools, the caches' views, the counters and one client session (opened and
    closed with the app)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefills: Pool[Prefill] = Pool([*config.prefills, *config.both])
        self.decodes: Pool[str] = Pool([*config.decodes, *(b.url for b in config.both)])
        #: requests by route (pd, decode_only), decisions, errors by status, resends, clients that left, events
        self.counters: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()  # per instance: prompt tokens placed on it, not yet answered
        self.caches = Caches(self.counters, config.index_capacity, config.follow_events, config.block_size)
        self.tokens = Tokens(config.tokenizer, self.counters, config.chat_template)
        self._hashers: dict[int, BlockHasher] = {}
        self._session: aiohttp.ClientSession | None = None
        self.membership = Membership() if config.discovery is not None else None
        self._compat: dict[str, str] = {}  # upstream URL -> its KV-geometry fingerprint (fleet members)
        self._unpaired: set[str] = set()  # fleet members already logged as matching no peer
        self._registered_sources: dict[str, Any] = {}  # fleet members' event sources, by URL
        self._learning: set[asyncio.Task[None]] = set()  # ``_learn`` tasks in flight

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
        loop = asyncio.get_running_loop()
        tasks = []
        try:
            async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                             connector=connector) as self._session:
                self.caches.start(self._session)
                self._sync_caches()
                if self.decodes.targets:  # the tokenizer, off every request's path (``kvrouter.tokens``)
                    self.tokens.discover(self._session, self.decodes.targets[0])
                if self.config.warm_links:  # every pair's first transfer, off every client's path
                    headers = {"Authorization": f"Bearer {self.config.upstream_api_key}"} \
                        if self.config.upstream_api_key else {}
                    warmer = Warmer(self._session, self.counters, self.prefills, self._pairs, headers)
                    await warmer.warm(warm.AT_START_S)
                    tasks.append(loop.create_task(warmer.keep_warm(), name="kvpush-proxy-warm"))
                if self.config.kv_probe_s > 0:
                    tasks.append(loop.create_task(probing.watch(self.prefills, self.counters, self.config.kv_probe_s,
                                                                self.config.kv_probe_timeout_s),
                                                  name="kvpush-proxy-kv-probe"))
                if self.membership is not None and self.config.discovery is not None:
                    from kvpush.fleet.etcd import Watcher  # the fleet extra: an ImportError without it

                    watcher = Watcher(parse_discovery(self.config.discovery), self.membership, self._sync)
                    tasks.append(loop.create_task(watcher.run(), name="kvpush-proxy-fleet"))
                yield
        finally:
            for task in [*tasks, *self._learning]:
                task.cancel()
            await asyncio.gather(*tasks, *self._learning, return_exceptions=True)
            await self.tokens.close()
            await self.caches.close()
            self._session = None

    def _pairs(self) -> list[tuple[Prefill, str]]:
        """Every (prefill, decode) the router may send a request through (another instance, the same geometry)."""
        return [(prefill, decode) for decode in self.decodes.targets
                for prefill in self.prefills.targets
                if prefill.url != decode and prefill not in self._incompatible(decode)]

    def _sync(self) -> None:
        """The fleet's membership changed: the pools become its ready members (beside the static ones)."""
        assert self.membership is not None
        prefills, decodes = [*self.config.prefills, *self.config.both], [*self.config.decodes,
                                                                          *(b.url for b in self.config.both)]
        compat: dict[str, str] = {}
        sources: dict[str, Any] = {}
        for instance in self.membership.ready("prefill"):
            host, port = instance.kv_address()
            cluster = instance.cluster_ids[0] if instance.cluster_ids else None
            prefills.append(Prefill(instance.url, host, port, cluster))
            compat[instance.url] = instance.compat
        for instance in self.membership.ready("decode"):
            decodes.append(instance.url)
            compat[instance.url] = instance.compat
        for instance in self.membership.instances.values():
            registered = instance.events_source()
            sources[instance.url] = Source(*registered) if registered is not None else None
            if instance.block_size and self.caches.block_size is None:
                self.caches.block_size = instance.block_size
        self._compat, self._registered_sources = compat, sources
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
        self._sync_caches()

    def _sync_caches(self) -> None:
        """The caches' views follow the instances routed to: each with the source it was given or registered."""
        urls = {p.url for p in self.prefills.targets} | set(self.decodes.targets)
        given = self.config.sources
        self.caches.update((url, given.get(url) or self._registered_sources.get(url)) for url in urls)

    # -- completions -------------------------------------------------------------------------------
    async def completion(self, request: web.Request) -> web.StreamResponse:
        read = await self._read_body(request)
        if isinstance(read, web.Response):
            return read
        body, raw = read
        headers = self._upstream_headers(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_s
        give_up_waiting = min(deadline, loop.time() + self.config.retry_for_s)
        resends = 0
        prompt: _Prompt | None = None
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
                if prompt is None:
                    prompt = await self._prompt(request.path, body, decode, self._needs_ids(request.path, body))
                decision = self._place(prompt)
                if decision is None:
                    continue  # every decode went down meanwhile: wait for one
                try:
                    return await self._attempt(request, body, raw, headers, decision, prompt, deadline)
                except Unanswered as error:
                    backoff = self.decodes.failed(decision.decode, str(error))
                    resends += 1
                    self.counters["resent"] += 1
                    log.warning("decode %s did not take the request (%s); skipped for %.2f s, the request goes "
                                "again", decision.decode, error, backoff)
                    if resends > MAX_RESENDS:
                        return self._fail(502, f"decode instances closed the connection {resends} times before "
                                          f"answering; last: {decision.decode}: {error}")
        except asyncio.CancelledError:
            self.counters["client_left"] += 1
            raise

    async def _read_body(self, request: web.Request) -> tuple[dict[str, Any], bytes] | web.Response:
        """The request's JSON object and its bytes as they came, or the error answer to send instead."""
        try:
            raw = await request.read()
            body = json.loads(raw)
        except web.HTTPRequestEntityTooLarge:
            return self._fail(413, f"the request body exceeds this proxy's limit of {self.config.max_body_bytes} bytes")
        except ValueError as error:
            return self._fail(400, f"the request body is not JSON: {error}")
        if not isinstance(body, dict):
            return self._fail(400, "the request body must be a JSON object")
        if body.get("n") not in (None, 1):
            return self._fail(400, "n > 1 is not supported through the kvpush proxy (one KV transfer per request)")
        return body, raw

    async def _next_decode(self, deadline: float, give_up_waiting: float) -> str | web.Response:
        """A decode that is up, waiting while every one sits out a back-off (or a fleet has none yet) until
        ``give_up_waiting``; then the error answer (503, or 504 past ``deadline``)."""
        loop = asyncio.get_running_loop()
        while not (up := self.decodes.up()):
            wake = self.decodes.next_up_at()
            now = loop.time()
            if wake is None and self.membership is not None:
                wake = now + 0.2  # a fleet with no decode yet: one may register meanwhile
            if wake is None or now >= give_up_waiting:
                waited = now - (deadline - self.config.timeout_s)
                return self._fail(504 if now >= deadline else 503, "no decode instance accepted the request "
                                  f"within {waited:.1f} s: {self._down(self.decodes)}", {"Retry-After": "1"})
            await asyncio.sleep(min(max(wake - now, 0.01), give_up_waiting - now))
        return up[0]

    def _hasher(self) -> BlockHasher:
        size = self.config.block_size or self.caches.block_size_seen() or GUESS_BLOCK_SIZE
        hasher = self._hashers.get(size)
        if hasher is None:
            hasher = self._hashers[size] = BlockHasher(size, self.config.hash_algorithm, self.config.hash_seed)
        return hasher

    def _guessing(self, url: str) -> bool:
        """Whether ``url``'s index is guessed from the requests sent (its KV events are not followed)."""
        return not self.caches.view(url).following

    def _needs_ids(self, path: str, body: Mapping[str, Any]) -> bool:
        """Whether placement may depend on the prompt's token ids: not when one decode is up and the request
        cannot be disaggregated (no prefill is up, or the prompt is too short however it tokenizes:
        ``tokens.most_tokens``); then the ids are only what the guessed index learns, which ``_learn`` gets off the
        request's path."""
        if self.config.policy.static or len(self.decodes.up()) != 1 or given_ids(path, body):
            return True  # (token ids given: they cost nothing to have)
        bound = self.tokens.most_tokens(path, body)
        return bound is None or (bound >= self.config.policy.pd_min_tokens and bool(self.prefills.up()))

    async def _prompt(self, path: str, body: Mapping[str, Any], instance: str, needed: bool = True,
                      head_first: bool = True) -> _Prompt:
        """The request's prompt for placement: tokenized and hashed, or its length estimated (4 bytes a token;
        not ``needed``: not tokenized here, see ``_needs_ids``), or (``head_first``) its head's hashes where no
        instance holds the head's blocks (``tokens.head_ids``: the rest is not tokenized on the request's path;
        its length is estimated from the head's)."""
        head = self.tokens.head_ids(path, body) if needed and head_first else None
        if head is not None:
            head_ids, scale = head
            hashes = tuple(self._hasher().block_hashes(head_ids))[:-1]  # (its last block may differ in the whole)
            urls = {*self.decodes.up(), *(p.url for p in self.prefills.up())}
            if hashes and max(self.caches.match(url, hashes) for url in urls) < len(hashes):
                self.counters["tokenized_head"] += 1
                return _Prompt(round(len(head_ids) * scale), hashes, False)
        ids = await self.tokens.ids(path, body, self.session, instance) if needed else None
        if ids is None:
            self.counters["tokenize_failed"] += needed
            text = body.get("prompt") if "prompt" in body else body.get("messages")
            return _Prompt(max(1, len(str(text)) // 4), (), False)
        return _Prompt(len(ids), tuple(self._hasher().block_hashes(ids)), True)

    async def _learn(self, path: str, body: Mapping[str, Any], urls: Sequence[str]) -> None:
        """What a request placed without all its ids put in the caches of ``urls``, for their guessed indexes (an
        instance whose KV events are followed learns it from them), once its answer is out: tokenizing a long
        prompt takes a millisecond of CPU, which its answer's last bytes need no share of."""
        try:
            await asyncio.sleep(LEARN_AFTER_S)
            prompt = await self._prompt(path, body, urls[0], head_first=False)
            for url in urls:
                self.caches.sent(url, prompt.hashes)
        finally:
            self._learning.discard(asyncio.current_task())

    def _place(self, prompt: _Prompt) -> Decision | None:
        """The decision for ``prompt`` among the instances up now (ties: in turn)."""
        decodes, prefills = self.decodes.up(), self.prefills.up()
        self.decodes.turn()
        prefill_urls = {p.url for p in prefills}
        decode_urls = set(decodes)
        hashes = prompt.hashes
        candidates = []
        for url in [*decodes, *(p.url for p in prefills if p.url not in decode_urls)]:
            load = self.decodes.load.get(url, 0) if url in decode_urls else 0
            candidates.append(Candidate(url, url in prefill_urls, url in decode_urls, self.caches.match(url, hashes),
                                        self.decodes.in_flight(url) + load, self._prefilling(url),
                                        self._compat.get(url, ""), pending_tokens=self._pending[url]))
        return place(Prompt(prompt.tokens, self._hasher().block_size), candidates, self.config.policy)

    def _prefilling(self, url: str) -> int:
        return sum(self.prefills.in_flight(p) for p in self.prefills.targets if p.url == url)

    def _incompatible(self, decode: str) -> list[Prefill]:
        """Prefills whose KV geometry differs from ``decode``'s (fleet members; static ones always pair)."""
        mine = self._compat.get(decode)
        if mine is None:
            return []
        return [p for p in self.prefills.targets if self._compat.get(p.url, mine) != mine]

    async def _attempt(self, request: web.Request, body: dict[str, Any], raw: bytes,  # noqa: PLR0913
                       headers: Mapping[str, str], decision: Decision, prompt: _Prompt,
                       deadline: float) -> web.StreamResponse:
        """One try of ``decision``: for P/D, its prefill and its decode get their copies at once (the decode's
        waits for the KV); a prefill that refuses before the decode's answer began cuts the decode's copy, and the
        next prefill is tried, or the decode computes the request alone. Raises Unanswered."""
        only = [p for p in self.prefills.targets if p.url == decision.prefill] \
            if decision.route == PD and not self.config.policy.static else None
        tried: list[Prefill] = list(self._incompatible(decision.decode))
        refusals: list[str] = []
        alone = decision.route != PD
        while True:
            prefill = None if alone else self._next_prefill(only, tried)
            reason = decision.reason
            if decision.route == PD and prefill is None:
                refusal = "; ".join(refusals) or f"every prefill is skipped ({self._down(self.prefills)})"
                reason = f"{reason}; then the decode alone: {refusal}"
                log.warning("no prefill accepted the request (%s); the decode computes it alone", refusal)
            try:
                return await self._try(request, body, raw, headers, decision, prompt, deadline, prefill, reason)
            except Abandoned as abandoned:
                assert prefill is not None
                tried.append(prefill)
                refusals.append(f"prefill {prefill.url} did not accept it: {abandoned.refusal.reason}")
                # the request itself was refused (4xx): the decode answers it alone (and says what is wrong)
                alone = abandoned.refusal.client_error

    def _next_prefill(self, only: Sequence[Prefill] | None, tried: Sequence[Prefill]) -> Prefill | None:
        """The prefill for the next try: ``only`` these, else each in the pool's order; None: none is left."""
        if only is None:
            return self.prefills.pick(exclude=tried)
        return next((p for p in only if p not in tried), None)

    async def _try(self, request: web.Request, body: dict[str, Any], raw: bytes,  # noqa: PLR0913
                   headers: Mapping[str, str], decision: Decision, prompt: _Prompt, deadline: float,
                   prefill: Prefill | None, reason: str) -> web.StreamResponse:
        """The decode's answer relayed; with ``prefill``, the prefill's copy sent beside it (raises Abandoned when
        it refuses before the decode's answer began). Raises Unanswered."""
        transfer_id = new_transfer_id()
        decode = decision.decode
        leading = None
        run: PrefillRun | None = None
        if prefill is not None:
            if leads(request.path, body):
                leading = Leading(asyncio.get_running_loop().create_future(), body.get("return_token_ids") is True)
            post = (prefill.url + request.path, prefill_body(body, transfer_id, leading is not None), headers)
            run = PrefillRun(self.session, self.prefills, prefill, post, deadline, self.config.accept_timeout_s,
                             transfer_id, leading)
        answered = False
        # what each instance computes for this request, counted against it until the answer begins (its
        # prompt is computed then: what is left is decoding, which ``running`` counts)
        computes = {decode: decision.computed if decision.route == DECODE_ONLY else prompt.tokens} \
            if prefill is None else {prefill.url: decision.computed}
        self._pending.update(computes)

        def computed() -> None:  # at the answer's first bytes, and at the end (a no-op by then, if they came)
            nonlocal computes
            self._pending.subtract(computes)
            computes = {}
        try:
            if prefill is None:
                copy, route = plain_body(body), DECODE_ONLY
            else:
                copy, route = decode_body(body, transfer_id, prefill), PD
            log.info("transfer %s: %s: decode %s%s: %s", transfer_id, route, decode,
                     f", prefill {prefill.url}" if prefill is not None else "", reason)
            self.decodes.acquire(decode)
            try:
                # a request the decode gets as the client sent it goes as its bytes (no re-encoding)
                data = raw if route == DECODE_ONLY and "kv_transfer_params" not in body else None
                hop = Hop("POST", decode, json=copy if data is None else None, data=data, headers=headers, route=route,
                          resend=True, reason=reason)
                response = await relay(self.session, request, hop, deadline, self._fail, leading, computed,
                                       None if run is None else run.settled)
            finally:
                self.decodes.release(decode)
            if leading is not None:
                self.counters["first_token_prefill"] += leading.led
                self.counters["first_token_mismatch"] += leading.mismatched
            answered = True
            self.decodes.accepted(decode)
            self.counters[f"route_{route.replace('-', '_')}"] += 1
            self.counters[f"decision:{route}:{_why(decision.reason)}"] += 1
            learn = []  # guessed indexes of instances the request filled, when its ids were not all had
            for url in (decode, *(() if prefill is None else (prefill.url,))):
                if prompt.exact or not self._guessing(url):
                    self.caches.sent(url, prompt.hashes)
                else:
                    learn.append(url)
            if learn and len(self._learning) < MAX_LEARNING:  # (bounded: under a flood the guesses miss some)
                self._learning.add(asyncio.get_running_loop().create_task(self._learn(request.path, body, learn)))
            return response
        finally:  # the decode answered, failed, the prefill refused, or the client left (this handler is cancelled)
            computed()
            if run is not None:
                await run.end(self.config.prefill_grace_s if answered else 0.0)

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
        up = self.decodes.up()
        if not up:
            return self._fail(503, f"no decode instance is up: {self._down(self.decodes)}")
        deadline = asyncio.get_running_loop().time() + CONNECT_TIMEOUT_S
        hop = Hop("GET", up[0], headers=self._upstream_headers(request))
        return await relay(self.session, request, hop, deadline, self._fail)

    async def health(self, request: web.Request) -> web.Response:
        urls = sorted({prefill.url for prefill in self.prefills.targets} | set(self.decodes.targets))
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
        indexes = {url: (len(view.exact if view.following else view.guessed), view.following)
                   for url, view in self.caches.views.items()}
        return web.Response(text=render_metrics(self.counters, self.prefills, self.decodes, indexes, self._pending,
                                                 self.tokens.local),
                            content_type="text/plain", charset="utf-8")


def _why(reason: str) -> str:
    """A decision's reason without its numbers: what ``/metrics`` counts it under."""
    words = [w for w in reason.split(";")[0].split() if not any(ch.isdigit() for ch in w)]
    return " ".join(words)[:80]


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
