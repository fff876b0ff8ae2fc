"""The HTTP side of ``kvpush proxy`` that holds no routing policy: relaying an upstream's answer to the
client as it arrives (``relay``, which may lead with the prefill's first token: ``first_token``), a
prefill's accepted copy drained in the background (``PrefillRun``), an upstream's health probe,
OpenAI-style error bodies, and the counters in Prometheus' text format."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web

from .core.first_token import Follow, Lead, Mismatch, event_of, is_content, lead_of
from .core.pools import Pool, Prefill

log = logging.getLogger(__name__)

# the longest line of an upstream's event stream read here (a chunk that carries a long prompt's token ids
# is one line: ~6 bytes a token)
MAX_LINE_BYTES = 16 << 20

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
    """One request to an upstream: ``method`` on ``upstream`` + the client's path; ``route`` and ``reason`` go
    back to the client as X-Kvpush-Route and X-Kvpush-Reason; ``resend``: a connection closed before any answer
    raises Unanswered."""

    method: str
    upstream: str
    json: Any = None
    data: bytes | None = None  # the body as it is (JSON), sent instead of ``json`` re-encoded
    headers: Mapping[str, str] | None = None
    route: str | None = None
    resend: bool = False
    reason: str | None = None


class Unanswered(Exception):
    """The decode refused the connection or closed it before any byte of its answer: nothing reached the
    client, so the request may go again."""


@dataclass
class Leading:
    """A request the client may get the prefill's first token of (``first_token.leads``): ``first``
    resolves to it (None: the prefill's answer cannot lead). ``relay`` says what came of it."""

    first: asyncio.Future[Lead | None]
    client_wants_ids: bool = False
    led: bool = False  # the client got the prefill's first token
    mismatched: bool = False  # ... and the decode's differed: the client's connection was cut


@dataclass(frozen=True)
class Refusal:
    """A prefill did not take its copy of a request: why, and whether the request itself was refused (4xx)."""

    reason: str
    client_error: bool = False


class Abandoned(Exception):
    """The decode's copy was given up before its answer began: its prefill refused (``refusal``)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


class PrefillRun:
    """A prefill's copy of one request, sent at once (``post``: the path, body and headers) and run by a task:
    ``settled`` resolves to None once the prefill accepted it (answered the head of its stream within
    ``accept_timeout_s``), or to its ``Refusal``; an accepted answer is drained until ``end``; with ``leading``,
    its first token is handed to ``leading.first``. It counts against ``prefill`` in ``pool`` until ``end``, which
    records how it went (accepted, or failed and backing off)."""

    def __init__(self, session: aiohttp.ClientSession, pool: Pool[Prefill], prefill: Prefill,  # noqa: PLR0913
                 post: tuple[str, Any, Mapping[str, str]], deadline: float, accept_timeout_s: float,
                 transfer_id: str, leading: Leading | None = None) -> None:
        self.prefill = prefill
        self.leading = leading
        self.transfer_id = transfer_id
        loop = asyncio.get_running_loop()
        self.settled: asyncio.Future[Refusal | None] = loop.create_future()
        self._pool = pool
        pool.acquire(prefill)
        self._task = loop.create_task(self._run(session, post, deadline, accept_timeout_s))

    async def _run(self, session: aiohttp.ClientSession, post: tuple[str, Any, Mapping[str, str]], deadline: float,
                   accept_timeout_s: float) -> None:
        url, body, headers = post
        remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
        reply: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(min(accept_timeout_s, remaining)):
                reply = await session.post(url, json=body, headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=remaining))
                if reply.status != 200:
                    text = (await reply.content.read(500)).decode("utf-8", "replace")
                    refusal = Refusal(f"answered {reply.status}: {text}", reply.status < 500)
                    reply.close()
                    self._settle(refusal)
                    return
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            if reply is not None:
                reply.close()
            self._settle(Refusal(describe(error)))
            return
        except BaseException:
            if reply is not None:
                reply.close()
            raise
        self._pool.accepted(self.prefill)
        self._settle(None)
        await self._drain(reply)

    def _settle(self, refusal: Refusal | None) -> None:
        if refusal is not None and not refusal.client_error:
            backoff = self._pool.failed(self.prefill, refusal.reason)
            log.warning("transfer %s: prefill %s did not accept the request (%s); skipped for %.2f s",
                        self.transfer_id, self.prefill.url, refusal.reason, backoff)
        if not self.settled.done():
            self.settled.set_result(refusal)
        if refusal is not None and self.leading is not None and not self.leading.first.done():
            self.leading.first.set_result(None)

    async def _drain(self, reply: aiohttp.ClientResponse) -> None:
        """Read the prefill's stream to its end; an error event in it is logged (the decode learns of a
        failed prefill from kvpush itself)."""
        first = None if self.leading is None else self.leading.first
        try:
            lines = _Lines(reply)
            while line := await lines.next():
                if line.startswith(b"data:") and b'"error"' in line:
                    log.warning("transfer %s: prefill %s: %s", self.transfer_id, self.prefill.url,
                                line[5:505].decode("utf-8", "replace").strip())
                elif first is not None and not first.done() and (event := event_of(line)) is not None:
                    assert self.leading is not None
                    first.set_result(lead_of(event, self.leading.client_wants_ids))
            reply.release()  # read to its end: the connection goes back to the pool
        except (aiohttp.ClientError, TimeoutError) as error:
            log.warning("transfer %s: prefill %s failed after accepting: %s", self.transfer_id, self.prefill.url,
                        describe(error))
        finally:
            if first is not None and not first.done():
                first.set_result(None)
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
            if not self.settled.done():
                self.settled.set_result(Refusal("cancelled"))
            if self.leading is not None and not self.leading.first.done():
                self.leading.first.set_result(None)
            self._pool.release(self.prefill)


async def relay(session: aiohttp.ClientSession, request: web.Request, hop: Hop, deadline: float,  # noqa: PLR0913
                fail: Callable[[int, str], web.Response], leading: Leading | None = None,
                answering: Callable[[], None] | None = None,
                settled: asyncio.Future[Refusal | None] | None = None) -> web.StreamResponse:
    """Pass the answer of ``hop.upstream`` to the request's path on to the client as it arrives:
    status, headers, body chunk by chunk. Before the first byte: a timeout is a 504, an unreachable
    upstream a 502 (the answers ``fail`` makes), or with ``hop.resend`` Unanswered (when a connection error
    says nothing was answered). ``hop.data``: the client's body as it came, passed on without re-encoding it.
    ``leading``: once the upstream answered a stream, the prefill's first token
    goes to the client as soon as it is there, unless the upstream's came first (``_follow``). ``answering``
    is called once, when the answer's first body bytes (or the prefill's first token) are there: the prompt
    has been computed. ``settled``: the prefill the upstream (a decode) waits for is sent its copy at the same
    time, and may refuse it: until it accepted, nothing goes to the client; if it refuses before the upstream's
    answer began, the upstream's request is cut (vLLM aborts it) and ``Abandoned`` raised."""
    response: web.StreamResponse | None = None
    remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
    upstream = hop.upstream
    try:
        headers = hop.headers
        if hop.data is not None:
            headers = {**(headers or {}), "Content-Type": "application/json"}
        opening = session.request(hop.method, upstream + request.path, json=hop.json, data=hop.data, headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=remaining))
        reply, initial = await _answer_begun(opening, settled)
        async with reply:
            passed = {name: value for name, value in reply.headers.items() if name.lower() not in _HOP_BY_HOP}
            if hop.route is not None:
                passed["X-Kvpush-Route"] = hop.route
            if hop.reason is not None:
                passed["X-Kvpush-Reason"] = hop.reason.encode("ascii", "replace").decode("ascii")
            response = web.StreamResponse(status=reply.status, reason=reply.reason, headers=passed)
            await response.prepare(request)
            lines = _Lines(reply, answering, initial)
            if leading is not None and reply.status == 200 and reply.content_type == "text/event-stream":
                await _follow(lines, response, leading)
            else:
                await lines.pass_on(response)
            await response.write_eof()
            return response
    except Mismatch as error:
        assert leading is not None
        leading.mismatched = True
        log.error("%s%s: %s; closing the client's connection", upstream, request.path, error)
        if request.transport is not None:
            request.transport.abort()
        assert response is not None
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


async def _answer_begun(opening: Awaitable[aiohttp.ClientResponse],
                        settled: asyncio.Future[Refusal | None] | None) -> tuple[aiohttp.ClientResponse, bytes]:
    """The upstream's response once it may go to the client, and the body bytes read meanwhile: at once
    without ``settled``; else once its prefill accepted (``settled`` None) or its answer's body began (a
    decode that gave up waiting answers alone), whichever is first. A refusal before either: the upstream's
    request is cut and ``Abandoned`` raised."""
    task: asyncio.Future[Any] = asyncio.ensure_future(opening)
    reply: aiohttp.ClientResponse | None = None
    try:
        while settled is not None and not settled.done():
            await asyncio.wait([task, settled], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                continue
            if reply is not None:  # the first body bytes (b"": its end) came before the prefill settled
                return reply, task.result()
            reply = task.result()
            if reply.status != 200:
                return reply, b""
            task = asyncio.ensure_future(reply.content.readany())  # its waiting, when cancelled, loses nothing
        refusal = settled.result() if settled is not None else None
        if refusal is not None:
            raise Abandoned(refusal)
        if reply is None:
            return await task, b""
        task.cancel()
        await asyncio.wait([task])
        return reply, b"" if task.cancelled() else task.result()
    except BaseException:
        task.cancel()
        await asyncio.wait([task])
        if reply is None and not task.cancelled() and task.exception() is None:
            reply = task.result()
        if reply is not None and isinstance(reply, aiohttp.ClientResponse):
            reply.close()  # drops the connection: vLLM aborts the request
        raise


class _Lines:
    """An upstream's event stream, line by line, up to ``MAX_LINE_BYTES`` a line (aiohttp's own readline
    stops at twice its read buffer, 512 KiB by default, and older versions take no bound of the caller's).
    Cancelling ``next`` loses nothing: bytes are kept here until a whole line is handed out."""

    def __init__(self, reply: aiohttp.ClientResponse, on_data: Callable[[], None] | None = None,
                 initial: bytes = b"") -> None:
        self._content = reply.content
        self._buffer = bytearray(initial)  # (bytes read before: ``_answer_begun``)
        self._on_data = on_data  # called once, at the first bytes read
        if initial:
            self.data()

    def data(self) -> None:
        """The answer has begun (its first bytes, or a token that leads it): ``on_data``, once."""
        if self._on_data is not None:
            on_data, self._on_data = self._on_data, None
            on_data()

    async def next(self) -> bytes:
        """The next line with its newline (at the end, what is left; b"" once nothing is)."""
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_LINE_BYTES:
                raise aiohttp.ClientPayloadError(f"an event line longer than {MAX_LINE_BYTES} bytes")
            chunk = await self._content.readany()
            if not chunk:
                line = bytes(self._buffer)
                self._buffer.clear()
                return line
            self.data()
            self._buffer += chunk
        line = bytes(self._buffer[:end + 1])
        del self._buffer[:end + 1]
        return line

    async def pass_on(self, response: web.StreamResponse) -> None:
        """Everything left, as it comes (what is buffered here first)."""
        if self._buffer:
            await response.write(bytes(self._buffer))
            self._buffer.clear()
        async for chunk in self._content.iter_any():
            self.data()
            await response.write(chunk)


async def _follow(lines: _Lines, response: web.StreamResponse, leading: Leading) -> None:
    """The decode's stream, led by the prefill's first token when that comes before the decode's own: the
    lines before either are passed on; then the lead goes and ``Follow`` rewrites the rest, or (the decode
    was first, or the prefill's answer cannot lead) the rest is passed on as it came."""
    follow: Follow | None = None
    while follow is None:
        line_read = asyncio.ensure_future(lines.next())
        try:
            either: list[asyncio.Future[Any]] = [line_read, leading.first]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not line_read.done():  # nothing is lost: the bytes stay in ``lines``
                line_read.cancel()
                await asyncio.wait([line_read])  # its wait on the stream ends before the next read
        if line_read.done() and not line_read.cancelled():  # the decode's line first (both: the decode's)
            line = line_read.result()
            if not line:
                return
            await response.write(line)
            if is_content(line):  # the decode's own first token came first: the rest as it comes
                await lines.pass_on(response)
                return
        elif (lead := leading.first.result()) is not None:
            lines.data()
            await response.write(lead.event)
            leading.led = True
            follow = Follow(lead)
        else:  # the prefill's answer cannot lead: the decode's as it comes
            await lines.pass_on(response)
            return
    while line := await lines.next():
        out = follow.line(line)
        if out is not None:
            await response.write(out)


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


def render_metrics(counters: Mapping[str, int], prefills: Pool[Prefill], decodes: Pool[str],  # noqa: PLR0913
                   indexes: Mapping[str, tuple[int, bool]] | None = None,
                   pending: Mapping[str, int] | None = None, tokenizer_local: bool = False) -> str:
    """The proxy's counters and upstream states in Prometheus' text exposition format; ``indexes``: each
    instance's cache index (block hashes, and whether its KV events are followed); ``pending``: the prompt
    tokens each instance was given to compute and has not begun to answer."""
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
              "# HELP kvpush_proxy_first_token_prefill_total Streams whose first token was the prefill's.",
              "# TYPE kvpush_proxy_first_token_prefill_total counter",
              f"kvpush_proxy_first_token_prefill_total {counters.get('first_token_prefill', 0)}",
              "# HELP kvpush_proxy_first_token_mismatch_total Streams cut: the decode's first token was not the "
              "prefill's.",
              "# TYPE kvpush_proxy_first_token_mismatch_total counter",
              f"kvpush_proxy_first_token_mismatch_total {counters.get('first_token_mismatch', 0)}",
              "# HELP kvpush_proxy_warmups_total Warm-up requests through prefill-decode pairs, by outcome.",
              "# TYPE kvpush_proxy_warmups_total counter",
              f'kvpush_proxy_warmups_total{{outcome="ok"}} {counters.get("warmup_ok", 0)}',
              f'kvpush_proxy_warmups_total{{outcome="failed"}} {counters.get("warmup_failed", 0)}',
              "# HELP kvpush_proxy_kv_probe_failed_total Probes of a prefill's kvpush side left unanswered.",
              "# TYPE kvpush_proxy_kv_probe_failed_total counter",
              f"kvpush_proxy_kv_probe_failed_total {counters.get('kv_probe_failed', 0)}",
              "# HELP kvpush_proxy_upstream_in_flight Requests in flight per upstream.",
              "# TYPE kvpush_proxy_upstream_in_flight gauge",
              "# HELP kvpush_proxy_upstream_up 1 unless the upstream is skipped (it refused a request, or its kvpush "
              "side does not answer).",
              "# TYPE kvpush_proxy_upstream_up gauge"]
    for role, pool in (("prefill", prefills), ("decode", decodes)):
        for state in pool.state():
            target = state["target"]
            url = label(target_url(target))
            lines.append(f'kvpush_proxy_upstream_in_flight{{role="{role}",url="{url}"}} {state["in_flight"]}')
            lines.append(f'kvpush_proxy_upstream_up{{role="{role}",url="{url}"}} {int(state["up"])}')
    lines += ["# HELP kvpush_proxy_decisions_total Placement decisions, by route and why.",
              "# TYPE kvpush_proxy_decisions_total counter"]
    lines += [f'kvpush_proxy_decisions_total{{route="{key.split(":")[1]}",why="{label(key.split(":", 2)[2])}"}} '
              f'{value}' for key, value in sorted(counters.items()) if key.startswith("decision:")]
    lines += ["# HELP kvpush_proxy_tokenize_failed_total Prompts placed by load alone: they could not be tokenized.",
              "# TYPE kvpush_proxy_tokenize_failed_total counter",
              f"kvpush_proxy_tokenize_failed_total {counters.get('tokenize_failed', 0)}",
              "# HELP kvpush_proxy_tokenized_head_total Long text prompts placed by their head's blocks alone: no "
              "instance held them, so the rest was not tokenized on the request's path.",
              "# TYPE kvpush_proxy_tokenized_head_total counter",
              f"kvpush_proxy_tokenized_head_total {counters.get('tokenized_head', 0)}",
              "# HELP kvpush_proxy_tokenized_after_known_total Long prompts that shared their beginning with one "
              "tokenized before (a conversation's next turn): only their rest was tokenized.",
              "# TYPE kvpush_proxy_tokenized_after_known_total counter",
              f"kvpush_proxy_tokenized_after_known_total {counters.get('tokenized_after_known', 0)}",
              "# HELP kvpush_proxy_chats_tokenized_total Chats tokenized for placement, by where: here (the "
              "tokenizer's chat template, once it rendered a chat as an instance did) or by an instance's /tokenize.",
              "# TYPE kvpush_proxy_chats_tokenized_total counter",
              f'kvpush_proxy_chats_tokenized_total{{where="here"}} {counters.get("chat_here", 0)}',
              f'kvpush_proxy_chats_tokenized_total{{where="instance"}} {counters.get("chat_instance", 0)}',
              "# HELP kvpush_proxy_chat_renderings_refuted_total Chats rendered here whose ids an instance's "
              "/tokenize, asked again off their path, gave otherwise: that rendering went back to the instances.",
              "# TYPE kvpush_proxy_chat_renderings_refuted_total counter",
              f"kvpush_proxy_chat_renderings_refuted_total {counters.get('chat_refuted', 0)}",
              "# HELP kvpush_proxy_tokenizer_local Whether the router tokenizes text prompts itself (--tokenizer): "
              "1, or 0 when it asks an instance's /tokenize.",
              "# TYPE kvpush_proxy_tokenizer_local gauge", f"kvpush_proxy_tokenizer_local {int(tokenizer_local)}",
              "# HELP kvpush_proxy_kv_events_total Instances' KV event batches, by what became of them.",
              "# TYPE kvpush_proxy_kv_events_total counter"]
    lines += [f'kvpush_proxy_kv_events_total{{kind="{label(key[len("events_"):])}"}} {value}'
              for key, value in sorted(counters.items()) if key.startswith("events_")]
    lines += ["# HELP kvpush_proxy_index_blocks Block hashes the proxy knows an instance holds.",
              "# TYPE kvpush_proxy_index_blocks gauge"]
    lines += [f'kvpush_proxy_index_blocks{{url="{label(url)}",source="{"events" if following else "guessed"}"}} '
              f'{blocks}' for url, (blocks, following) in sorted((indexes or {}).items())]
    lines += ["# HELP kvpush_proxy_pending_prompt_tokens Prompt tokens placed on an instance whose answers have not "
              "begun (what placement counts as its queue).",
              "# TYPE kvpush_proxy_pending_prompt_tokens gauge"]
    lines += [f'kvpush_proxy_pending_prompt_tokens{{url="{label(url)}"}} {tokens}'
              for url, tokens in sorted((pending or {}).items())]
    return "\n".join(lines) + "\n"
