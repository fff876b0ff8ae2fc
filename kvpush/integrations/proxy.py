"""An OpenAI-compatible proxy that makes vLLM prefill and decode instances running KvpushConnector one
endpoint (``kvpush proxy``; needs aiohttp: ``pip install 'kvpush[proxy]'``).

    kvpush proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

``POST /v1/completions`` and ``POST /v1/chat/completions``: for each request the proxy makes a fresh
transfer id and sends, at the same time, the decode instance the client's request with the decode's
``kv_transfer_params`` (``do_remote_prefill``, the chosen prefill's kvpush address) and the prefill
instance a copy with the prefill's (``do_remote_decode``, ``max_tokens=1``, not streamed). The decode
allocates the request's blocks and tells the prefill where they go (decode first, see ``vllm_core``).
The client gets the decode's response as it is (status, body, usage), passed through chunk by chunk as
it arrives, so a ``stream`` request is streamed. The prefill's answer is never waited for before the
decode's: a prefill that fails is logged, and the decode recomputes the prompt (the connector reports
the blocks as load errors); once the decode answered, a prefill still running gets ``prefill_grace_s``
(default 2 s) and is then cancelled. Requests with ``n`` > 1 are refused (one transfer per request).

A prefill's kvpush address is the host of its URL and ``--prefill-kv-port`` (default 14579, vLLM's
``kv_port`` default, where a prefill's connector listens); one prefill's own goes in the URL's
fragment: ``http://10.0.0.5:8100#kv=10.0.0.5:14600`` (or ``#kv=14600``: the URL's host), with
``&cluster=ID`` when that prefill sets ``cluster_id`` in its extra config. The host must be spelt as the
prefill's connector listens (its ``VLLM_HOST_IP``; an IP address is safest): the decode derives the
prefill's cluster id from it.

Each request goes to the prefill and the decode with the fewest requests in flight, ties in turn (round
robin). ``GET /v1/models`` is a decode's answer; ``GET /health`` answers 200 when every upstream's
``/health`` does, else 503 naming those that did not.

Failures: an upstream's error status and body are passed through; an unreachable decode is a 502 and a
timeout a 504 (after the first byte went to the client its connection is cut instead). A client that
disconnects cancels both upstream requests (vLLM aborts them and frees their blocks). Every upstream
request is bounded by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qs, urlsplit

import aiohttp
from aiohttp import web

from .vllm_core import decode_request_params, new_transfer_id, prefill_request_params

log = logging.getLogger(__name__)

DEFAULT_KV_PORT = 14579  # vLLM's KVTransferConfig.kv_port default: a prefill's connector listens there
DEFAULT_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0
UPSTREAM_KEEPALIVE_S = 4.0
PREFILL_GRACE_S = 2.0  # after the decode answered, how long a prefill's answer may still come (then cancelled)
MAX_BODY_BYTES = 64 << 20
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
_FORWARDED = ("Authorization", "X-Request-Id")  # request headers the upstreams get
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                         "proxy-authenticate", "proxy-authorization", "date", "server"})

T = TypeVar("T")


class SpecError(ValueError):
    """An upstream URL (or its ``#kv=`` fragment) that cannot be used; says why."""


@dataclass(frozen=True)
class Prefill:
    """A prefill instance: its OpenAI server's base URL and where its kvpush connector listens."""

    url: str
    kv_host: str
    kv_port: int
    kv_cluster_id: int | None = None


def base_url(spec: str) -> str:
    """``spec`` without its fragment and trailing ``/``; raises SpecError unless http(s)://host[:port]."""
    parts = urlsplit(spec.strip())
    try:
        port = parts.port
    except ValueError as error:
        raise SpecError(f"{spec!r}: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecError(f"{spec!r} is not an http(s)://HOST[:PORT] URL")
    if parts.query:
        raise SpecError(f"{spec!r}: an upstream URL takes no query")
    netloc = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{netloc}{'' if port is None else f':{port}'}{parts.path.rstrip('/')}"


def _port(text: str, spec: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise SpecError(f"{spec!r}: {text!r} is not a TCP port")
    return int(text)


def parse_prefill(spec: str, default_kv_port: int = DEFAULT_KV_PORT) -> Prefill:
    """``URL``, ``URL#kv=PORT``, ``URL#kv=HOST:PORT`` or ``[HOST]:PORT`` for IPv6, each with an optional
    ``&cluster=ID`` -> a Prefill; raises SpecError."""
    url = base_url(spec)
    host = urlsplit(spec.strip()).hostname or ""
    port, cluster_id = default_kv_port, None
    fields = parse_qs(urlsplit(spec.strip()).fragment, keep_blank_values=True, strict_parsing=False)
    unknown = set(fields) - {"kv", "cluster"}
    if unknown or any(len(values) > 1 for values in fields.values()):
        raise SpecError(f"{spec!r}: the fragment takes kv=[HOST:]PORT and cluster=ID, once each")
    if "kv" in fields:
        kv = fields["kv"][0]
        if kv.startswith("["):
            kv_host, sep, kv_port = kv[1:].partition("]:")
            host, port = kv_host, _port(kv_port if sep else "", spec)
        elif kv.count(":") == 1:
            kv_host, _, kv_port = kv.partition(":")
            host, port = kv_host, _port(kv_port, spec)
        elif ":" in kv:
            raise SpecError(f"{spec!r}: an IPv6 kv host goes in brackets: kv=[HOST]:PORT")
        else:
            port = _port(kv, spec)
    if "cluster" in fields:
        text = fields["cluster"][0]
        if not text.isdigit() or int(text) >= 1 << 64:
            raise SpecError(f"{spec!r}: cluster={text!r} is not a uint64")
        cluster_id = int(text)
    if not host:
        raise SpecError(f"{spec!r}: no kvpush host")
    return Prefill(url, host, port, cluster_id)


@dataclass(frozen=True)
class ProxyConfig:
    """What ``kvpush proxy`` serves; ``timeout_s`` bounds every upstream request, streamed ones included."""

    prefills: Sequence[Prefill]
    decodes: Sequence[str]  # base URLs
    timeout_s: float = DEFAULT_TIMEOUT_S
    prefill_grace_s: float = PREFILL_GRACE_S

    def __post_init__(self) -> None:
        if not self.prefills or not self.decodes:
            raise SpecError("a proxy needs at least one prefill and one decode")
        if not self.timeout_s > 0 or not self.prefill_grace_s >= 0:
            raise SpecError(f"timeout {self.timeout_s} must be > 0 and prefill grace {self.prefill_grace_s} >= 0")


class Balancer(Generic[T]):
    """Upstreams of one kind: ``lease`` the one with the fewest requests in flight, ties in turn."""

    def __init__(self, members: Sequence[T]) -> None:
        self.members = tuple(members)
        self.in_flight = [0] * len(self.members)
        self._next = 0

    @contextmanager
    def lease(self) -> Iterator[T]:
        count = len(self.members)
        index = min(((self._next + i) % count for i in range(count)), key=self.in_flight.__getitem__)
        self._next = (index + 1) % count
        self.in_flight[index] += 1
        try:
            yield self.members[index]
        finally:
            self.in_flight[index] -= 1


def _error(status: int, message: str) -> web.Response:
    """An OpenAI-style error body."""
    return web.json_response({"error": {"message": message, "type": HTTPStatus(status).phrase, "code": status}},
                             status=status)


def prefill_body(body: Mapping[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill instance's copy: one token (``max_tokens``, and ``max_completion_tokens`` if set),
    not streamed (no ``stream_options``), no ``min_tokens``, the prefill's kv_transfer_params."""
    copy = {key: value for key, value in body.items() if key not in ("stream_options", "min_tokens")}
    copy.update(kv_transfer_params=prefill_request_params(transfer_id), max_tokens=1, stream=False)
    if "max_completion_tokens" in copy:
        copy["max_completion_tokens"] = 1
    return copy


def decode_body(body: Mapping[str, Any], transfer_id: str, prefill: Prefill) -> dict[str, Any]:
    """The decode instance's copy: the client's request with the decode's kv_transfer_params."""
    params = decode_request_params(transfer_id, prefill.kv_host, prefill.kv_port, prefill.kv_cluster_id)
    return {**body, "kv_transfer_params": params}


class Proxy:
    """The proxy's state: the two balancers and one client session (opened and closed with the app)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefills = Balancer(config.prefills)
        self.decodes = Balancer(config.decodes)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's app is not running")
        return self._session

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.cleanup_ctx.append(self._client)
        return app

    async def _client(self, app: web.Application) -> AsyncIterator[None]:
        total = self.config.timeout_s
        timeout = aiohttp.ClientTimeout(total=total, sock_connect=min(total, CONNECT_TIMEOUT_S))
        # Idle pooled connections are dropped before vLLM's HTTP server (uvicorn, 5 s keep-alive) closes
        # them: a POST on a connection the server is closing fails ("Server disconnected") and is not
        # retried, which would leave the decode waiting for KV its prefill never got the request for.
        connector = aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=connector) as self._session:
            yield
        self._session = None

    async def completion(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as error:
            return _error(400, f"the request body is not JSON: {error}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        if body.get("n") not in (None, 1):
            return _error(400, "n > 1 is not supported through the kvpush proxy (one KV transfer per request)")
        transfer_id = new_transfer_id()
        headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
        with self.prefills.lease() as prefill, self.decodes.lease() as decode:
            log.debug("transfer %s: prefill %s, decode %s", transfer_id, prefill.url, decode)
            prefilling = asyncio.create_task(self._prefill(prefill, request.path, prefill_body(body, transfer_id),
                                                           headers, transfer_id))
            answered = False
            try:
                response = await self._relay(request, "POST", decode + request.path, decode,
                                             json=decode_body(body, transfer_id, prefill), headers=headers)
                answered = True
                return response
            finally:  # the decode answered, failed, or the client left (this handler is being cancelled)
                await _end(prefilling, grace=self.config.prefill_grace_s if answered else 0.0)

    async def _prefill(self, prefill: Prefill, path: str, body: dict[str, Any], headers: Mapping[str, str],
                       transfer_id: str) -> None:
        """The prefill's request; its answer is only logged (the decode recomputes if it failed)."""
        try:
            async with self.session.post(prefill.url + path, json=body, headers=headers) as reply:
                text = await reply.read()
                if reply.status >= 400:
                    log.warning("transfer %s: prefill %s answered %d: %s", transfer_id, prefill.url, reply.status,
                                text[:500].decode("utf-8", "replace"))
        except (aiohttp.ClientError, TimeoutError) as error:
            log.warning("transfer %s: prefill %s failed (%s); the decode recomputes the prompt", transfer_id,
                        prefill.url, type(error).__name__ if isinstance(error, TimeoutError) else error)

    async def _relay(self, request: web.Request, method: str, url: str, upstream: str, json: Any = None,
                     headers: Mapping[str, str] | None = None) -> web.StreamResponse:
        """Pass the answer of ``upstream`` to ``method url`` on to the client as it arrives: status,
        headers, body chunk by chunk. An error before the first byte becomes a 502 or 504."""
        response: web.StreamResponse | None = None
        try:
            async with self.session.request(method, url, json=json, headers=headers) as reply:
                passed = {name: value for name, value in reply.headers.items() if name.lower() not in _HOP_BY_HOP}
                response = web.StreamResponse(status=reply.status, reason=reply.reason, headers=passed)
                await response.prepare(request)
                async for chunk in reply.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as error:
            what = "timed out" if isinstance(error, TimeoutError) else str(error) or type(error).__name__
            if response is None:
                log.warning("%s%s: %s", upstream, request.path, what)
                return _error(504 if isinstance(error, TimeoutError) else 502, f"upstream {upstream}: {what}")
            if request.transport is None or request.transport.is_closing():
                log.info("%s%s: the client left (%s)", upstream, request.path, what)
            else:
                log.warning("%s%s: cut after the response started (%s); closing the client's connection",
                            upstream, request.path, what)
                request.transport.abort()
            return response

    async def models(self, request: web.Request) -> web.StreamResponse:
        with self.decodes.lease() as decode:
            headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
            return await self._relay(request, "GET", decode + request.path, decode, headers=headers)

    async def health(self, request: web.Request) -> web.Response:
        urls = [prefill.url for prefill in self.config.prefills] + list(self.config.decodes)
        answers = await asyncio.gather(*(self._healthy(url) for url in urls))
        failing = {url: answer for url, answer in zip(urls, answers) if answer is not None}
        if failing:
            return _error(503, "unhealthy: " + "; ".join(f"{url}: {answer}" for url, answer in failing.items()))
        return web.json_response({"status": "ok", "upstreams": urls})

    async def _healthy(self, url: str) -> str | None:
        """None when ``url``'s /health answers 200, else why not."""
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)) as r:
                return None if r.status == 200 else f"status {r.status}"
        except (aiohttp.ClientError, TimeoutError) as error:
            return "timed out" if isinstance(error, TimeoutError) else str(error) or type(error).__name__


async def _end(task: asyncio.Task[None], grace: float) -> None:
    """Give ``task`` up to ``grace`` seconds to finish, then cancel it and wait until it ended."""
    try:
        if grace > 0:
            await asyncio.wait([task], timeout=grace)
    finally:
        task.cancel()
    await asyncio.wait([task])


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
