"""Link establishment: the handshake both ends run on a new connection, before any other frame.

Dialer -> HELLO (version, cluster id, role, instance, nonce, whether it has a token); the acceptor
checks it and answers HELLO with its own nonce and, with a token, an HMAC proof over both nonces;
the dialer checks that proof and sends AUTH with its own proof and its offers; the acceptor checks,
answers READY with its offers. Only then are cache tables, addresses or one-sided descriptors sent.

``Handshake`` is driven over two things it is handed - ``send`` (bytes out) and ``deliver`` (frames
in, called by the link for every frame before the link is ready) - and returns a
``HandshakeResult``; it never touches a link, so it is tested without sockets.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .protocol import PROTOCOL_VERSION, Kind, ProtocolError, encode_json
from .status import LLMException, LLMStatusCode

log = logging.getLogger(__name__)

NONCE_BYTES = 32
# The largest handshake frame meta accepted (HELLO, AUTH and READY with offers are well under 2 KiB):
# before the handshake is over a stranger can make the engine hold only this much per connection.
HANDSHAKE_META_LIMIT = 8 << 10
_MAX_QUEUED = 4  # a conforming peer never has more than one handshake frame outstanding
HANDSHAKE_KINDS = frozenset({Kind.HELLO, Kind.AUTH, Kind.READY, Kind.BYE})


@dataclass(frozen=True)
class Identity:
    """Who this engine is, as the handshake presents it."""

    cluster_id: int
    role: int
    instance: str  # tells a restarted peer from a second link of the same one
    auth_token: str | None


@dataclass(frozen=True)
class HandshakeResult:
    peer_cluster_id: int
    peer_role: int
    peer_instance: str
    peer_offers: dict[str, Any] = field(default_factory=dict)


def proof(token: str, label: bytes, first: bytes, second: bytes) -> str:
    """HMAC-SHA256 over a label and both nonces: proves the token without sending it."""
    return hmac.new(token.encode(), label + first + second, hashlib.sha256).hexdigest()


def _fail(reason: str) -> LLMException:
    return LLMException(LLMStatusCode.LLM_LINK_FAILED, reason)


class Probed(LLMException):
    """The dialer only probed whether this engine answers (``kvpush.probe``): it was answered, no link."""

    def __init__(self) -> None:
        super().__init__(LLMStatusCode.LLM_LINK_FAILED, "a probe, answered")


def probe_hello() -> bytes:
    """A prober's HELLO: it asks for an answer, not a link (it holds no token and learns nothing but that the
    listener's event loop runs)."""
    return encode_json(Kind.HELLO, 0, {"version": PROTOCOL_VERSION, "probe": True})


class Handshake:
    """One side of one handshake. ``offers`` is called once, after the peer authenticated, for what
    this side offers for one-sided transfers."""

    def __init__(self, identity: Identity, send: Callable[[bytes], object],
                 offers: Callable[[], dict[str, Any]], *, dialer: bool) -> None:
        self.identity = identity
        self.dialer = dialer
        self._send = send
        self._offers = offers
        self._inbox: asyncio.Queue[tuple[Kind, dict[str, Any]]] = asyncio.Queue()
        self._auth_sent = False

    # -- frames in (from the link) ------------------------------------------------------------------
    def deliver(self, kind: Kind, body: dict[str, Any]) -> bool:
        """A frame arrived before the link was ready. True when it was READY: the link is ready from
        this frame on (the acceptor's next frames, its cache table, may arrive in the same read).
        ``ProtocolError`` for a frame no conforming peer sends now."""
        if kind not in HANDSHAKE_KINDS:
            raise ProtocolError(f"{kind.name} before the handshake completed")
        if kind == Kind.READY and not (self.dialer and self._auth_sent):
            raise ProtocolError("READY before authentication")
        if self._inbox.qsize() >= _MAX_QUEUED:
            raise ProtocolError("handshake frames sent out of turn")
        self._inbox.put_nowait((kind, body))
        return kind == Kind.READY

    def stream_closed(self, reason: str) -> None:
        """The connection went away: a waiting step fails with the reason."""
        self._inbox.put_nowait((Kind.BYE, {"reason": reason}))

    # -- the two roles -------------------------------------------------------------------------------
    async def dial(self, expect_cluster_id: int | None = None) -> HandshakeResult:
        """The dialer's side. Raises LLMException(LLM_LINK_FAILED) with the reason."""
        token = self.identity.auth_token
        my_nonce = os.urandom(NONCE_BYTES)
        self._send(self._hello(my_nonce, None))
        body = await self._expect(Kind.HELLO)
        peer, peer_nonce = self._check_hello(body)
        if expect_cluster_id is not None and peer.peer_cluster_id != expect_cluster_id:
            raise _fail(f"peer is cluster {peer.peer_cluster_id}, not {expect_cluster_id}")
        my_proof = ""
        if token is not None:
            expected = proof(token, b"kvpush-acceptor", my_nonce, peer_nonce)
            if not hmac.compare_digest(str(body.get("proof", "")), expected):
                self._send(encode_json(Kind.BYE, 0, {"reason": "authentication failed: the listener's proof "
                                                               "does not match this dialer's token"}))
                raise _fail("authentication failed: peer's proof is wrong")
            my_proof = proof(token, b"kvpush-dialer", peer_nonce, my_nonce)
        self._auth_sent = True
        self._send(encode_json(Kind.AUTH, 0, {"proof": my_proof, "offers": self._offers()}))
        ready = await self._expect(Kind.READY)
        return HandshakeResult(peer.peer_cluster_id, peer.peer_role, peer.peer_instance, _offers_of(ready))

    async def accept(self) -> HandshakeResult:
        """The acceptor's side; the link is ready when this returns (READY was sent)."""
        token = self.identity.auth_token
        body = await self._expect(Kind.HELLO)
        if body.get("probe") is True:
            self._send(encode_json(Kind.BYE, 0, {"reason": "probe answered", "probe": True}))
            raise Probed()
        try:
            peer, peer_nonce = self._check_hello(body)
        except LLMException as error:
            self._send(encode_json(Kind.BYE, 0, {"reason": str(error)}))
            log.warning("refused a link: %s", error)
            raise
        my_nonce = os.urandom(NONCE_BYTES)
        my_proof = proof(token, b"kvpush-acceptor", peer_nonce, my_nonce) if token is not None else None
        self._send(self._hello(my_nonce, my_proof))
        auth = await self._expect(Kind.AUTH)
        if token is not None:
            expected = proof(token, b"kvpush-dialer", my_nonce, peer_nonce)
            if not hmac.compare_digest(str(auth.get("proof", "")), expected):
                reason = f"authentication failed for cluster {peer.peer_cluster_id}"
                log.warning("refused a link: %s", reason)
                self._send(encode_json(Kind.BYE, 0, {"reason": "authentication failed"}))
                raise _fail(reason)
        mine = self._offers()
        self._send(encode_json(Kind.READY, 0, {"offers": mine}))
        return HandshakeResult(peer.peer_cluster_id, peer.peer_role, peer.peer_instance, _offers_of(auth))

    # -- steps ---------------------------------------------------------------------------------------
    def _hello(self, nonce: bytes, hello_proof: str | None) -> bytes:
        me = self.identity
        body: dict[str, Any] = {"version": PROTOCOL_VERSION, "cluster_id": me.cluster_id, "role": me.role,
                                "instance": me.instance, "nonce": nonce.hex(), "auth": me.auth_token is not None}
        if hello_proof is not None:
            body["proof"] = hello_proof
        return encode_json(Kind.HELLO, 0, body)

    async def _expect(self, kind: Kind) -> dict[str, Any]:
        got, body = await self._inbox.get()
        if got == Kind.BYE:
            raise _fail(f"peer refused the link: {body.get('reason', '?')}")
        if got != kind:
            raise _fail(f"handshake: expected {kind.name}, got {got.name}")
        return body

    def _check_hello(self, body: dict[str, Any]) -> tuple[HandshakeResult, bytes]:
        try:
            version = int(body["version"])
            cluster_id = int(body["cluster_id"])
            nonce = bytes.fromhex(str(body["nonce"]))
            role = int(body.get("role", 0))
            instance = str(body.get("instance", ""))
        except (KeyError, TypeError, ValueError, OverflowError):
            raise _fail("handshake: malformed HELLO") from None
        if version != PROTOCOL_VERSION:
            raise _fail(f"peer speaks protocol {version}, this engine {PROTOCOL_VERSION}")
        if cluster_id == self.identity.cluster_id:
            raise _fail(f"peer has this engine's own cluster id {cluster_id}")
        if len(nonce) != NONCE_BYTES:
            raise _fail("handshake: bad nonce")
        if bool(body.get("auth")) != (self.identity.auth_token is not None):
            raise _fail("authentication mismatch: only one side has an auth_token")
        return HandshakeResult(cluster_id, role, instance), nonce


def _offers_of(body: dict[str, Any]) -> dict[str, Any]:
    offers = body.get("offers")
    return offers if isinstance(offers, dict) else {}
