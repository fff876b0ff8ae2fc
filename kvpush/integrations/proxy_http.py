"""The HTTP side of ``kvpush proxy`` that holds no routing policy: relaying an upstream's answer to the
client as it arrives (``relay``), a prefill's accepted copy drained in the background (``PrefillRun``), an
upstream's health probe, OpenAI-style error bodies, and the counters in Prometheus' text format."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web

from .routing import Pool, Prefill

log = logging.getLogger(__name__)

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                         "proxy-authenticate", "proxy-authorization", "date", "server"})


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """An OpenAI-style error body."""
    return web.json_response({"error": {"message": message, "type": HTTPStatus(status).phrase, "code": status}},
                             status=status, headers=headers)


def describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    return str(error) or type(error).__name__


@dataclass(frozen=True)
class Hop:
    """One request to an upstream: ``method`` on ``upstream`` + the client's path; ``route`` goes back to
    the client as X-Kvpush-Route; ``resend``: a connection closed before any answer raises Unanswered."""

    method: str
    upstream: str
    json: Any = None
    headers: Mapping[str, str] | None = None
    route: str | None = None
    resend: bool = False


class Unanswered(Exception):
    """The decode refused the connection or closed it before any byte of its answer: nothing reached the
    client, so the request may go again."""


class PrefillRun:
    """A prefill's accepted copy of one request: its response is drained by a task until ``end``."""

    def __init__(self, pool: Pool[Prefill], prefill: Prefill, reply: aiohttp.ClientResponse, transfer_id: str) -> None:
        self.prefill = prefill
        self._pool = pool
        self._task = asyncio.get_running_loop().create_task(self._drain(reply, transfer_id))

    async def _drain(self, reply: aiohttp.ClientResponse, transfer_id: str) -> None:
        """Read the prefill's stream to its end; an error event in it is logged (the decode learns of a
        failed prefill from kvpush itself)."""
        try:
            async for line in reply.content:
                if line.startswith(b"data:") and b'"error"' in line:
                    log.warning("transfer %s: prefill %s: %s", transfer_id, self.prefill.url,
                                line[5:505].decode("utf-8", "replace").strip())
            reply.release()  # read to its end: the connection goes back to the pool
        except (aiohttp.ClientError, TimeoutError) as error:
            log.warning("transfer %s: prefill %s failed after accepting: %s", transfer_id, self.prefill.url,
                        describe(error))
        finally:
            if not reply.closed:
                reply.close()  # before its end: drops the connection, which makes vLLM abort the request

    async def end(self, grace: float) -> None:
        """Give the prefill up to ``grace`` seconds to finish, then cancel it; returns once it ended."""
        try:
            if grace > 0:
                await asyncio.wait([self._task], timeout=grace)
        finally:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._pool.release(self.prefill)


async def relay(session: aiohttp.ClientSession, request: web.Request, hop: Hop, deadline: float,
            fail: Callable[[int, str], web.Response]) -> web.StreamResponse:
    """Pass the answer of ``hop.upstream`` to the request's path on to the client as it arrives:
    status, headers, body chunk by chunk. Before the first byte: a timeout is a 504, an unreachable
    upstream a 502 (the answers ``fail`` makes), or with ``hop.resend`` Unanswered (when a connection error
    says nothing was answered)."""
    response: web.StreamResponse | None = None
    remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
    upstream = hop.upstream
    try:
        async with session.request(hop.method, upstream + request.path, json=hop.json, headers=hop.headers,
                                   timeout=aiohttp.ClientTimeout(total=remaining)) as reply:
            passed = {name: value for name, value in reply.headers.items() if name.lower() not in _HOP_BY_HOP}
            if hop.route is not None:
                passed["X-Kvpush-Route"] = hop.route
            response = web.StreamResponse(status=reply.status, reason=reply.reason, headers=passed)
            await response.prepare(request)
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as error:
        what = describe(error)
        if response is None:
            timed_out = isinstance(error, TimeoutError) and not isinstance(error, aiohttp.ConnectionTimeoutError)
            if hop.resend and not timed_out and isinstance(error, (aiohttp.ClientConnectionError, ConnectionError)):
                raise Unanswered(what) from None
            log.warning("%s%s: %s", upstream, request.path, what)
            return fail(504 if timed_out else 502, f"upstream {upstream}: {what}")
        if request.transport is None or request.transport.is_closing():
            log.info("%s%s: the client left (%s)", upstream, request.path, what)
        else:
            log.warning("%s%s: cut after the response started (%s); closing the client's connection",
                        upstream, request.path, what)
            request.transport.abort()
        return response


async def healthy(session: aiohttp.ClientSession, url: str, deadline: float) -> str | None:
    """None when ``url``'s /health answers 200 before ``deadline`` (loop time), else why not."""
    remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=remaining)) as r:
            return None if r.status == 200 else f"status {r.status}"
    except (aiohttp.ClientError, TimeoutError) as error:
        return describe(error)


def target_url(target: str | Prefill) -> str:
    return target if isinstance(target, str) else target.url


def render_metrics(counters: Mapping[str, int], prefills: Pool[Prefill], decodes: Pool[str]) -> str:
    """The proxy's counters and upstream states in Prometheus' text exposition format."""
    def label(text: str) -> str:
        return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    lines = ["# HELP kvpush_proxy_requests_total Requests answered by a decode, by route (pd: with a prefill's KV).",
             "# TYPE kvpush_proxy_requests_total counter"]
    lines += [f'kvpush_proxy_requests_total{{route="{route}"}} {counters.get(f"route_{route}", 0)}'
              for route in ("pd", "decode_only")]
    lines += ["# HELP kvpush_proxy_errors_total Requests the proxy answered with an error itself, by status.",
              "# TYPE kvpush_proxy_errors_total counter"]
    lines += [f'kvpush_proxy_errors_total{{status="{key[6:]}"}} {value}'
              for key, value in sorted(counters.items()) if key.startswith("error_")]
    lines += ["# HELP kvpush_proxy_resent_total Requests sent again after a decode closed the connection unanswered.",
              "# TYPE kvpush_proxy_resent_total counter", f"kvpush_proxy_resent_total {counters.get('resent', 0)}",
              "# HELP kvpush_proxy_clients_left_total Clients that disconnected before their answer ended.",
              "# TYPE kvpush_proxy_clients_left_total counter",
              f"kvpush_proxy_clients_left_total {counters.get('client_left', 0)}",
              "# HELP kvpush_proxy_upstream_in_flight Requests in flight per upstream.",
              "# TYPE kvpush_proxy_upstream_in_flight gauge",
              "# HELP kvpush_proxy_upstream_up 1 unless the upstream is skipped after refusing a request.",
              "# TYPE kvpush_proxy_upstream_up gauge"]
    for role, pool in (("prefill", prefills), ("decode", decodes)):
        for state in pool.state():
            target = state["target"]
            url = label(target_url(target))
            lines.append(f'kvpush_proxy_upstream_in_flight{{role="{role}",url="{url}"}} {state["in_flight"]}')
            lines.append(f'kvpush_proxy_upstream_up{{role="{role}",url="{url}"}} {int(state["up"])}')
    return "\n".join(lines) + "\n"
