"""What ``kvpush proxy`` decides, without I/O: the upstream specs (``Prefill``, ``base_url``,
``parse_prefill``), the pools it picks upstreams from (``Pool``: fewest requests in flight, ties in turn,
a member that did not accept a request is skipped for a back-off) and the copy of a request each upstream
gets (``prefill_body``, ``decode_body``, ``plain_body``). The aiohttp side is ``proxy``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qs, urlsplit

from kvpush.integrations.config import decode_request_params, prefill_request_params

from .kv_events import Source

DEFAULT_KV_PORT = 14579  # vLLM's KVTransferConfig.kv_port default: a prefill's connector listens there
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


def _fragment(spec: str, keys: tuple[str, ...]) -> dict[str, str]:
    fields = parse_qs(urlsplit(spec.strip()).fragment, keep_blank_values=True, strict_parsing=False)
    if set(fields) - set(keys) or any(len(values) > 1 for values in fields.values()):
        raise SpecError(f"{spec!r}: the fragment takes {', '.join(f'{k}=...' for k in keys)}, once each")
    return {key: values[0] for key, values in fields.items()}


def parse_events(spec: str) -> Source | None:
    """Where an upstream publishes its KV events, if its spec says (``#events=tcp://HOST:PORT`` and
    optionally ``&replay=tcp://HOST:PORT``); None: the router asks the instance. Raises SpecError."""
    fields = _fragment(spec, ("kv", "cluster", "events", "replay"))
    endpoint, replay = fields.get("events"), fields.get("replay")
    for name, value in (("events", endpoint), ("replay", replay)):
        if value is not None and not re.fullmatch(r"tcp://[^\s/]+:\d+", value):
            raise SpecError(f"{spec!r}: {name}={value!r} is not tcp://HOST:PORT")
    if endpoint is None:
        if replay is not None:
            raise SpecError(f"{spec!r}: replay= goes with events=")
        return None
    return Source(endpoint, replay)


def parse_decode(spec: str) -> tuple[str, Source | None]:
    """``URL`` with an optional ``#events=...&replay=...`` -> (base URL, where it publishes)."""
    _fragment(spec, ("events", "replay"))
    return base_url(spec), parse_events(spec)


def parse_prefill(spec: str, default_kv_port: int = DEFAULT_KV_PORT) -> Prefill:
    """``URL``, ``URL#kv=PORT``, ``URL#kv=HOST:PORT`` or ``[HOST]:PORT`` for IPv6, each with an optional
    ``&cluster=ID`` (and ``&events=...&replay=...``, see ``parse_events``) -> a Prefill; raises SpecError."""
    url = base_url(spec)
    host = urlsplit(spec.strip()).hostname or ""
    port, cluster_id = default_kv_port, None
    fields = {key: [value] for key, value in _fragment(spec, ("kv", "cluster", "events", "replay")).items()}
    parse_events(spec)
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


# -- the pools ---------------------------------------------------------------------------------------

BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 2.0


@dataclass
class Member(Generic[T]):
    """One upstream of a pool and what the proxy knows of it."""

    target: T
    in_flight: int = 0
    failures: int = 0  # consecutive requests it did not accept
    down_until: float = 0.0  # skipped until then (monotonic seconds)
    reason: str = ""  # why it was last skipped
    held_out: str = ""  # why it is skipped until ``restore`` (its kvpush side does not answer, say)


class Pool(Generic[T]):
    """Upstreams of one role. ``pick`` gives the one with the least load among those not backing off,
    ties in turn: its requests in flight from here plus what it registered (``load``, a fleet's); ``failed``
    makes a member sit out ``BACKOFF_FIRST_S``, doubling up to ``BACKOFF_MAX_S`` while it keeps failing
    (the next request after that is its probe); ``accepted`` ends the back-off. ``hold_out`` skips a member
    until ``restore``, whatever its requests do (a prefill whose kvpush side does not answer, while its HTTP
    side still accepts requests). ``update`` changes the
    members (a fleet's membership): requests in flight on one that left end as they would have.
    ``clock`` is monotonic seconds."""

    def __init__(self, targets: Sequence[T], clock: Callable[[], float] = time.monotonic) -> None:
        self.members = [Member(target) for target in targets]
        self.clock = clock
        self.load: dict[T, int] = {}
        self._next = 0
        self._gone: dict[T, Member[T]] = {}  # members that left with requests in flight

    @property
    def targets(self) -> list[T]:
        return [member.target for member in self.members]

    def _member(self, target: T) -> Member[T]:
        for member in self.members:
            if member.target == target:
                return member
        gone = self._gone.get(target)
        if gone is not None:
            return gone
        raise KeyError(target)

    def update(self, targets: Sequence[T]) -> tuple[list[T], list[T]]:
        """The members become ``targets`` (those staying keep their counts and back-off); returns (added,
        removed)."""
        current = {member.target: member for member in self.members}
        added = [target for target in targets if target not in current]
        removed = [target for target in current if target not in targets]
        for target in removed:
            if current[target].in_flight:
                self._gone[target] = current[target]
        self.members = [current.get(target) or self._gone.pop(target, None) or Member(target) for target in targets]
        self._next = self._next % len(self.members) if self.members else 0
        return added, removed

    def pick(self, exclude: Sequence[T] = ()) -> T | None:
        """The member to send the next request to, or None when every member is excluded or backing off."""
        now = self.clock()
        count = len(self.members)
        order = [self.members[(self._next + i) % count] for i in range(count)]
        up = [m for m in order if m.down_until <= now and not m.held_out and m.target not in exclude]
        if not up:
            return None
        chosen = min(up, key=lambda m: m.in_flight + self.load.get(m.target, 0))  # ties: the first, in turn
        self._next = (self.members.index(chosen) + 1) % count
        return chosen.target

    def up(self) -> list[T]:
        """Members not backing off nor held out, in turn: the one after the last picked first."""
        now, count = self.clock(), len(self.members)
        order = [self.members[(self._next + i) % count] for i in range(count)]
        return [m.target for m in order if m.down_until <= now and not m.held_out]

    def in_flight(self, target: T) -> int:
        """Requests in flight on ``target`` from here (0 for one that is not a member)."""
        try:
            return self._member(target).in_flight
        except KeyError:
            return 0

    def turn(self) -> None:
        """The next ``up`` starts one member later (ties between equally good members go in turn)."""
        if self.members:
            self._next = (self._next + 1) % len(self.members)

    def next_up_at(self, exclude: Sequence[T] = ()) -> float | None:
        """When the first member now backing off may be tried again (None: no member left to wait for)."""
        times = [m.down_until for m in self.members if m.target not in exclude and not m.held_out]
        return min(times) if times else None

    def acquire(self, target: T) -> None:
        """Count one more request in flight on ``target`` (until ``release``)."""
        self._member(target).in_flight += 1

    def release(self, target: T) -> None:
        member = self._member(target)
        member.in_flight -= 1
        if not member.in_flight:
            self._gone.pop(target, None)

    @contextmanager
    def lease(self, target: T) -> Iterator[T]:
        """``acquire`` for the block."""
        self.acquire(target)
        try:
            yield target
        finally:
            self.release(target)

    def failed(self, target: T, reason: str) -> float:
        """``target`` did not accept a request: it sits out a back-off. Returns the back-off in seconds."""
        try:
            member = self._member(target)
        except KeyError:  # it left meanwhile
            return 0.0
        backoff = min(BACKOFF_FIRST_S * 2.0 ** min(member.failures, 16), BACKOFF_MAX_S)
        member.failures += 1
        member.down_until = self.clock() + backoff
        member.reason = reason
        return backoff

    def hold_out(self, target: T, reason: str) -> bool:
        """Skip ``target`` until ``restore``; True when it was not held out already."""
        member = next((m for m in self.members if m.target == target), None)
        if member is None or member.held_out:
            if member is not None:
                member.held_out = reason
            return False
        member.held_out = reason
        return True

    def restore(self, target: T) -> bool:
        """End ``hold_out``; True when it was held out."""
        member = next((m for m in self.members if m.target == target), None)
        if member is None or not member.held_out:
            return False
        member.held_out = ""
        return True

    def probing(self, target: T) -> bool:
        """True while ``target``'s last request failed: check it is back before sending it real work."""
        return self._member(target).failures > 0

    def accepted(self, target: T) -> None:
        try:
            member = self._member(target)
        except KeyError:  # it left meanwhile
            return
        member.failures, member.down_until, member.reason = 0, 0.0, ""

    def state(self) -> list[dict[str, Any]]:
        """Plain data per member, for /metrics and logs."""
        now = self.clock()
        return [{"target": m.target, "in_flight": m.in_flight, "up": m.down_until <= now and not m.held_out,
                 "failures": m.failures, "reason": m.held_out or m.reason} for m in self.members]


# -- the copies of a request -------------------------------------------------------------------------

def prefill_body(body: Mapping[str, Any], transfer_id: str, first_token: bool = False) -> dict[str, Any]:
    """The prefill instance's copy: one token (``max_tokens``, and ``max_completion_tokens`` if set),
    streamed (the response's head says the prefill accepted it; the decode's copy goes at the same time),
    no ``stream_options`` or ``min_tokens``, the prefill's kv_transfer_params. ``first_token``: the client
    gets the prefill's first token (``first_token.leads``), asked for with its id."""
    copy = {key: value for key, value in body.items() if key not in ("stream_options", "min_tokens")}
    copy.update(kv_transfer_params=prefill_request_params(transfer_id), max_tokens=1, stream=True)
    if first_token:
        copy["return_token_ids"] = True
    if "max_completion_tokens" in copy:
        copy["max_completion_tokens"] = 1
    return copy


def decode_body(body: Mapping[str, Any], transfer_id: str, prefill: Prefill) -> dict[str, Any]:
    """The decode instance's copy: the client's request with the decode's kv_transfer_params."""
    params = decode_request_params(transfer_id, prefill.kv_host, prefill.kv_port, prefill.kv_cluster_id)
    return {**body, "kv_transfer_params": params}


def plain_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The decode's copy when no prefill accepted the request: the client's request, no KV expected (a
    client's own kv_transfer_params are dropped too: the decode computes the prompt itself)."""
    return {key: value for key, value in body.items() if key != "kv_transfer_params"}
