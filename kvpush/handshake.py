"""Link establishment: the handshake both ends run on a new connection, before any other frame.

Dialer -> HELLO (version, cluster id, role, instance, nonce, whether it has a token); the acceptor
checks it and answers HELLO with its own nonce and, with a token, an HMAC proof over both nonces;
the dialer checks that proof and sends AUTH with its own proof and its offers; the acceptor checks,
answers READY with its offers. Only then are cache tables, addresses or UCX rkeys sent. Offers are
what lets the peer move bytes one-sided: same-host cross-memory attach (a probe token in memory),
and this engine's UCX worker address. Each side then picks its own data path.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from typing import TYPE_CHECKING, Any

from transports import cma, ucp

from .onesided import OneSidedSender
from .protocol import PROTOCOL_VERSION, Kind, encode_json
from .status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from .link import Link

log = logging.getLogger(__name__)

_NONCE_BYTES = 32
HANDSHAKE_KINDS = frozenset({Kind.HELLO, Kind.AUTH, Kind.READY, Kind.BYE})


def _proof(token: str, label: bytes, first: bytes, second: bytes) -> str:
    return hmac.new(token.encode(), label + first + second, hashlib.sha256).hexdigest()


def offers(link: Link) -> dict[str, Any]:
    """What lets the peer move bytes one-sided with this process (sent only after authentication):
    same-host cross-memory attach, and this engine's UCX worker address."""
    offers: dict[str, Any] = {}
    wanted = link.owner.options.transport
    if wanted in ("auto", "cma") and cma.AVAILABLE:
        link._probe = cma.Probe()
        offers["cma"] = {"host": cma.host_identity(), **link._probe.describe()}
    if link.owner.ucx is not None:
        offers["ucx"] = link.owner.ucx.offer()
    return offers

def take_offers(link: Link, body: dict[str, Any]) -> None:
    offers = body.get("offers")
    link._peer_offers = offers if isinstance(offers, dict) else {}
    peer_cma = link._peer_offers.get("cma")
    link._share_addresses = (isinstance(peer_cma, dict) and link._probe is not None
                             and peer_cma.get("host") == cma.host_identity())
    link._share_rkeys = isinstance(link._peer_offers.get("ucx"), dict) and link.owner.ucx is not None

def choose_data_path(link: Link) -> None:
    """Pick how this side moves bytes: same host and a probe read of the peer's memory works ->
    cross-memory attach; else UCX when both ends offer it; else the link's stream (TCP). An
    explicit ``transport`` that cannot work raises LLM_FEATURE_NOT_ENABLED."""
    wanted = link.owner.options.transport
    if wanted == "tcp":
        return
    reasons = []
    if wanted in ("auto", "cma"):
        offer = link._peer_offers.get("cma")
        if not cma.AVAILABLE:
            reasons.append("cross-memory attach is not available on this platform")
        elif not isinstance(offer, dict):
            reasons.append("the peer offered no same-host path")
        elif offer.get("host") != cma.host_identity():
            reasons.append("the peer is on another host (or network/pid namespace)")
        else:
            try:
                mover = cma.CmaMover(cma.CmaPeer(offer), str(link.peer_cluster_id))
                link.onesided = OneSidedSender(link, mover)
                return
            except cma.CmaError as error:
                reasons.append(f"the kernel refused cross-memory attach: {error}")
    if wanted in ("auto", "ucx"):
        offer = link._peer_offers.get("ucx")
        if link.owner.ucx is None:
            reasons.append("UCX is not enabled in this engine")
        elif not isinstance(offer, dict):
            reasons.append("the peer offered no UCX endpoint")
        else:
            try:
                link.onesided = OneSidedSender(link, link.owner.ucx.connect(offer, link.close))
                return
            except ucp.UcpError as error:
                reasons.append(f"UCX could not connect: {error}")
    reason = "; ".join(reasons)
    if wanted in ("cma", "ucx"):
        raise LLMException(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                           f"transport {wanted!r} cannot reach cluster {link.peer_cluster_id}: {reason}")
    link.fallback_reason = reason

def _hello(link: Link, nonce: bytes, proof: str | None) -> bytes:
    owner = link.owner
    body = {"version": PROTOCOL_VERSION, "cluster_id": owner.cluster_id, "role": int(owner.role),
            "instance": owner.instance,
            "nonce": nonce.hex(), "auth": owner.options.auth_token is not None,
            "transports": [link.transport]}
    if proof is not None:
        body["proof"] = proof
    return encode_json(Kind.HELLO, 0, body)

async def _expect(link: Link, kind: Kind) -> dict[str, Any]:
    got, body = await link._handshake_inbox.get()
    if got == Kind.BYE:
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED, f"peer refused the link: {body.get('reason', '?')}")
    if got != kind:
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED, f"handshake: expected {kind.name}, got {got.name}")
    return body

def _check_hello(link: Link, body: dict[str, Any]) -> bytes:
    try:
        version = int(body["version"])
        cluster_id = int(body["cluster_id"])
        nonce = bytes.fromhex(str(body["nonce"]))
        role = int(body.get("role", 0))
        instance = str(body.get("instance", ""))
    except (KeyError, TypeError, ValueError, OverflowError):
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED, "handshake: malformed HELLO") from None
    if version != PROTOCOL_VERSION:
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED, f"peer speaks protocol {version}, "
                                                           f"this engine {PROTOCOL_VERSION}")
    if cluster_id == link.owner.cluster_id:
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED, f"peer has this engine's own cluster id {cluster_id}")
    if len(nonce) != _NONCE_BYTES:
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED, "handshake: bad nonce")
    token = link.owner.options.auth_token
    if bool(body.get("auth")) != (token is not None):
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED,
                           "authentication mismatch: only one side has an auth_token")
    link.peer_cluster_id, link.peer_role, link.peer_instance = cluster_id, role, instance
    return nonce

async def dial(link: Link, expect_cluster_id: int | None) -> None:
    token = link.owner.options.auth_token
    my_nonce = os.urandom(_NONCE_BYTES)
    link.stream.send(_hello(link, my_nonce, None))
    body = await _expect(link, Kind.HELLO)
    peer_nonce = _check_hello(link, body)
    if expect_cluster_id is not None and link.peer_cluster_id != expect_cluster_id:
        raise LLMException(LLMStatusCode.LLM_LINK_FAILED,
                           f"peer is cluster {link.peer_cluster_id}, not {expect_cluster_id}")
    proof = None
    if token is not None:
        expected = _proof(token, b"kvpush-acceptor", my_nonce, peer_nonce)
        if not hmac.compare_digest(str(body.get("proof", "")), expected):
            link.stream.send(encode_json(Kind.BYE, 0, {"reason": "authentication failed: the listener's proof "
                                                                 "does not match this dialer's token"}))
            raise LLMException(LLMStatusCode.LLM_LINK_FAILED, "authentication failed: peer's proof is wrong")
        proof = _proof(token, b"kvpush-dialer", peer_nonce, my_nonce)
    link._auth_sent = True
    link.stream.send(encode_json(Kind.AUTH, 0, {"proof": proof or "", "offers": offers(link)}))
    take_offers(link, await _expect(link, Kind.READY))

async def accept(link: Link) -> None:
    token = link.owner.options.auth_token
    body = await _expect(link, Kind.HELLO)
    try:
        peer_nonce = _check_hello(link, body)
    except LLMException as error:
        link.stream.send(encode_json(Kind.BYE, 0, {"reason": str(error)}))
        log.warning("refused a link: %s", error)
        raise
    my_nonce = os.urandom(_NONCE_BYTES)
    proof = _proof(token, b"kvpush-acceptor", peer_nonce, my_nonce) if token is not None else None
    link.stream.send(_hello(link, my_nonce, proof))
    auth = await _expect(link, Kind.AUTH)
    if token is not None:
        expected = _proof(token, b"kvpush-dialer", my_nonce, peer_nonce)
        if not hmac.compare_digest(str(auth.get("proof", "")), expected):
            reason = f"authentication failed for cluster {link.peer_cluster_id}"
            log.warning("refused a link: %s", reason)
            link.stream.send(encode_json(Kind.BYE, 0, {"reason": "authentication failed"}))
            raise LLMException(LLMStatusCode.LLM_LINK_FAILED, reason)
    mine = offers(link)
    take_offers(link, auth)
    link.stream.send(encode_json(Kind.READY, 0, {"offers": mine}))
    link.state = link.state.READY
