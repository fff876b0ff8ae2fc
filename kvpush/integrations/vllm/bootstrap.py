"""vLLM's Mooncake bootstrap contract, both ends: a prefill's ``GET /query`` server (``BootstrapServer``) and a
decode's lookup of the prefill a request names by it (``BootstrapResolver``).

The routers that speak the Mooncake contract (vllm-router and llm-d's routing sidecar with ``--kv-connector
mooncake``, Dynamo's ``MooncakeConnectorProtocol``) mint a transfer id, send the prefill ``do_remote_decode``
and the decode ``do_remote_prefill`` with ``remote_bootstrap_addr`` (``http://PREFILL:PORT``) and
``remote_engine_id``; vllm-router and llm-d learn the engine ids from ``/query`` (``core.bootstrap_answer``'s
shape). The answer lists each rank's kvpush address; the decode finds its prefill there
(``core.bootstrap_address``). The shape and every check are in ``core``; here are the sockets and threads.

``/query`` needs no credentials, as the routers send none: it says where the prefill's kvpush engines listen
and their engine ids, which a link still needs the deployment's token to use (docs/guides/security.md).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import core

log = logging.getLogger(__name__)

#: a lookup that failed is not tried again for this long (requests meanwhile are refused at once)
RETRY_AFTER_S = 1.0
#: an answer that lacks a request's engine is asked again if it is older than this (the prefill may have restarted)
REFRESH_AFTER_S = 1.0
MAX_ANSWER_BYTES = 1 << 20
#: bootstrap servers a decode keeps answers of (the oldest dropped past it), and lookups it runs at once (past
#: it a request that needs another is refused): a client that names many servers costs bounded memory and threads
MAX_SERVERS = 256
MAX_LOOKUPS = 16


class BootstrapServer:
    """``GET /query`` on ``host:port`` in vLLM's MooncakeConnector shape (``core.bootstrap_answer``): this
    instance's data-parallel ranks, each with its engine id and every tensor-parallel rank's kvpush address.
    Anything else gets 404. ``start`` raises ``OSError`` when the port cannot be bound (the operator asked for
    it: the instance must not come up without it)."""

    def __init__(self, host: str, port: int, engines: Mapping[int, tuple[str, Sequence[core.PeerAddress]]]) -> None:
        self.body = json.dumps(core.bootstrap_answer(engines)).encode()
        self.host, self.port = host, port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        body = self.body

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0].rstrip("/") != "/query":
                    self.send_error(404, "only GET /query is served here")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                log.debug("bootstrap server: " + format, *args)

        self._server = (_Server6 if ":" in self.host else ThreadingHTTPServer)((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="kvpush-bootstrap", daemon=True)
        self._thread.start()
        log.info("KvpushConnector: the Mooncake bootstrap contract (GET /query) is served at http://%s:%d",
                 self.host, self.port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # returns once serve_forever has (within poll_interval)
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


#: straight to the prefill: an ``http_proxy`` in the environment is for the Internet, not for a bootstrap server
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_get_json(url: str, timeout_s: float) -> Any:
    """GET ``url``'s JSON (at most ``MAX_ANSWER_BYTES``), in ``timeout_s``, through no proxy."""
    with _DIRECT.open(url, timeout=timeout_s) as reply:
        data = reply.read(MAX_ANSWER_BYTES + 1)
    if len(data) > MAX_ANSWER_BYTES:
        raise ValueError(f"more than {MAX_ANSWER_BYTES} bytes")
    return json.loads(data)


class _Entry:
    __slots__ = ("answer", "error", "at", "pending")

    def __init__(self) -> None:
        self.answer: Any = None
        self.error: str | None = None
        self.at = 0.0
        self.pending = True


class BootstrapResolver:
    """A decode's ``core.Resolve``: the prefill a request names by its bootstrap server, looked up once per
    server (``GET /query`` on a thread of its own, bounded by ``timeout_s``) and kept. It never blocks its caller
    (vLLM's scheduler): while a lookup runs it answers None, and vLLM asks again at its next step. A lookup
    that fails refuses the requests that need it for ``RETRY_AFTER_S``, then is tried again; an answer that
    lacks a request's engine is asked again once it is ``REFRESH_AFTER_S`` old."""

    def __init__(self, timeout_s: float, fetch: Callable[[str, float], Any] = _http_get_json,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def __call__(self, bootstrap: core.Bootstrap) -> core.PeerAddress | None:
        with self._lock:
            entry = self._entries.get(bootstrap.url)
            now = self._clock()
            if entry is not None and entry.pending:
                return None
            if entry is not None and entry.error is not None and now - entry.at < RETRY_AFTER_S:
                raise core.ParamsError(entry.error)
            if entry is not None and entry.error is None:
                try:
                    return core.bootstrap_address(entry.answer, bootstrap)
                except core.ParamsError:
                    if now - entry.at < REFRESH_AFTER_S:
                        raise
            self._look_up(bootstrap.url)
            return None

    @property
    def servers(self) -> tuple[str, ...]:
        """The bootstrap servers whose answers are kept or asked for, oldest first."""
        with self._lock:
            return tuple(self._entries)

    def _look_up(self, url: str) -> None:
        """Start a lookup of ``url`` (the lock held)."""
        if sum(entry.pending for entry in self._entries.values()) >= MAX_LOOKUPS:
            raise core.ParamsError(f"{MAX_LOOKUPS} bootstrap server lookups are already running; {url} is not asked")
        self._entries.pop(url, None)
        while len(self._entries) >= MAX_SERVERS:  # the oldest kept answer goes (insertion order)
            oldest = next((key for key, kept in self._entries.items() if not kept.pending), None)
            if oldest is None:
                break
            del self._entries[oldest]
        entry = self._entries[url] = _Entry()
        threading.Thread(target=self._run, args=(url, entry), name="kvpush-bootstrap-lookup", daemon=True).start()

    def _run(self, url: str, entry: _Entry) -> None:
        answer, error = None, None
        try:
            answer = self._fetch(f"{url}/query", self.timeout_s)
        except Exception as problem:  # noqa: BLE001 - refused, timed out, an HTTP error, not JSON: whatever it is,
            # the entry must end, or the requests that wait for it would wait for ever
            error = f"the bootstrap server at {url} did not answer /query: {problem!r}"
            log.warning("KvpushConnector: %s", error)
        with self._lock:
            entry.answer, entry.error, entry.at, entry.pending = answer, error, self._clock(), False

