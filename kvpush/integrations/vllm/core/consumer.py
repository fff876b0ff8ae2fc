"""The decode worker's side: ``ConsumerBook``, every transfer from its ``RecvSpec`` to the one report
of how it ended (``Received``: landed, failed with its blocks as load errors, or aborted), and
``ConsumerState``. It sends the block ids (retrying a link that is not up yet), waits for the
prefill's ``Done`` within the deadlines, and aborts when vLLM no longer needs the request.

With tensor parallelism the engine sends the ids to every prefill rank that pushes some of this rank's
heads (its legs; ``on_ids_sent`` names them): the transfer lands when each of them said so, and when one
fails the others are told to stop and the blocks are reported only once none of them can still write.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...config import ConnectorConfig, PeerAddress
from ...families import PLAIN, Groups
from .effects import Clock, ConsumerEffects
from .messages import Abort, Done, Message, Outcome, encode
from .steps import RecvSpec

log = logging.getLogger(__name__)


class ConsumerState(enum.Enum):
    SENDING_IDS = "sending block ids"
    WAITING_LANDED = "waiting for the landed notification"
    LANDED = "landed"
    FAILING = "failed; waiting for the prefill to confirm nothing more lands"
    FAILED = "failed"
    ABORTING = "aborted; waiting for the prefill to confirm nothing more lands"
    ABORTED = "aborted"


_REPORTABLE = (ConsumerState.LANDED, ConsumerState.FAILED, ConsumerState.ABORTED)


@dataclass(frozen=True)
class Received:
    """What the decode worker reports in one step: ``finished`` goes to vLLM's finished_recving (every
    ended transfer, failed ones included), ``failed`` to failed_recving, ``load_errors`` are the failed
    transfers' destination blocks (get_block_ids_with_load_errors)."""

    finished: set[str]
    failed: set[str]
    load_errors: set[int]


_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 1.0


@dataclass
class _Incoming:
    spec: RecvSpec
    state: ConsumerState
    deadline: float
    grace_deadline: float = 0.0
    sending: bool = False  # a send_ids is in flight
    delivered: bool = False  # some of the ids may have reached the prefill
    retry_at: float | None = None
    backoff: float = _RETRY_FIRST_S
    reason: str = ""
    peers: frozenset[int] | None = None  # the prefill ranks its legs go to (None: not known yet)
    landed: set[int] = field(default_factory=set)  # peers whose Done said every byte landed
    settled: set[int] = field(default_factory=set)  # peers that will write nothing more (answered or gone)

    @property
    def remote(self) -> PeerAddress:
        """The prefill (a spec without one is refused before a transfer is made of it)."""
        assert self.spec.remote is not None
        return self.spec.remote

    def expected(self) -> frozenset[int]:
        return self.peers if self.peers is not None else frozenset({self.remote.cluster_id})

    def outstanding(self) -> frozenset[int]:
        """Peers that may still write into the blocks."""
        return self.expected() - self.settled


class ConsumerBook:
    """The decode worker's transfers; see the package docstring.

    Every transfer ends reported exactly once by ``take_finished``: LANDED (the prefill's Done said
    every byte landed), FAILED (its blocks are load errors) or ABORTED (vLLM finished the request while
    it waited). A transfer whose ids may have reached the prefill is reported FAILED or ABORTED only
    once the prefill confirmed nothing more will land, the link to it is gone, or ``abort_grace_s``
    passed; every other wait ends at ``transfer_timeout_s``.
    """

    def __init__(self, block_size: int, config: ConnectorConfig, clock: Clock, effects: ConsumerEffects,
                 groups: Groups = PLAIN) -> None:
        self.block_size = block_size
        self.groups = groups  # a RecvSpec's 0s are no blocks of it unless the layout is plain
        self.config = config
        self.clock = clock
        self.effects = effects
        self._transfers: dict[str, _Incoming] = {}
        self._by_req: dict[str, str] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()
        #: ids_sent / landed / failed / aborted
        self.stats: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._transfers)

    def state_of(self, transfer_id: str) -> ConsumerState | None:
        t = self._transfers.get(transfer_id)
        return t.state if t is not None else None

    def reason(self, transfer_id: str) -> str:
        t = self._transfers.get(transfer_id)
        return t.reason if t is not None else ""

    # -- vLLM step hooks ---------------------------------------------------------------------------
    def begin_step(self, recv: Sequence[RecvSpec], aborted: Sequence[str] = ()) -> None:
        now = self.clock()
        for spec in recv:
            if spec.transfer_id in self._transfers or spec.req_id in self._by_req:
                self._report_now(spec, "this transfer id is already being received")
                continue
            if spec.error is not None or len(self._transfers) >= self.config.max_transfers:
                reason = spec.error or f"{len(self._transfers)} transfers already in flight"
                self._report_now(spec, reason)
                continue
            t = _Incoming(spec, ConsumerState.SENDING_IDS, now + self.config.transfer_timeout_s)
            self._transfers[spec.transfer_id] = t
            self._by_req[spec.req_id] = spec.transfer_id
            self._send_ids(t)
        for req_id in aborted:
            transfer_id = self._by_req.get(req_id)
            waiting = self._transfers.get(transfer_id) if transfer_id is not None else None
            if waiting is not None:
                self._abort(waiting, now)

    def poll(self) -> None:
        """Deadlines and retries."""
        now = self.clock()
        for t in list(self._transfers.values()):
            if t.state in (ConsumerState.SENDING_IDS, ConsumerState.WAITING_LANDED):
                if now >= t.deadline:
                    self._give_up(t, f"not landed within {self.config.transfer_timeout_s:g} s", now)
                elif t.retry_at is not None and now >= t.retry_at and not t.sending:
                    t.retry_at = None
                    self._send_ids(t)
            elif t.state in (ConsumerState.FAILING, ConsumerState.ABORTING) and now >= t.grace_deadline:
                log.warning("transfer %s: no confirmation from the prefill within %g s; releasing its blocks anyway",
                            t.spec.transfer_id, self.config.abort_grace_s)
                self._end(t, ConsumerState.FAILED if t.state == ConsumerState.FAILING else ConsumerState.ABORTED)

    def take_finished(self) -> Received:
        """The requests to report this step (each exactly once), which of them failed, and their blocks."""
        received = Received(self._finished, self._failed, self._load_errors)
        self._finished, self._failed, self._load_errors = set(), set(), set()
        return received

    # -- engine events -----------------------------------------------------------------------------
    def on_ids_sent(self, transfer_id: str, error: str | None = None, retryable: bool = False,
                    delivered_any: bool = True, peers: Sequence[int] | None = None) -> None:
        """The engine's answer to ``send_ids``: ``peers`` are the prefill ranks the ids went to (every leg's,
        on success; those that may have some, on failure; None: the one ``RecvSpec.remote``)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return
        t.sending = False
        if peers is not None:
            t.peers = frozenset(peers) | (t.peers or frozenset())
        if error is None:
            t.delivered = True
            if t.peers is None:
                t.peers = frozenset({t.remote.cluster_id})
            if t.state == ConsumerState.SENDING_IDS:
                t.state = ConsumerState.WAITING_LANDED
            self._check(t)
            return
        t.delivered = t.delivered or delivered_any
        now = self.clock()
        if t.state in (ConsumerState.ABORTING, ConsumerState.FAILING) and not t.delivered:
            # nothing reached the prefill, so nothing can land: no need to wait for its confirmation
            self._end(t, ConsumerState.ABORTED if t.state == ConsumerState.ABORTING else ConsumerState.FAILED)
        elif t.state != ConsumerState.SENDING_IDS:
            return
        elif retryable and not t.delivered and now + t.backoff < t.deadline:
            log.info("transfer %s: sending block ids failed (%s); again in %.2f s", transfer_id, error, t.backoff)
            t.retry_at = now + t.backoff
            t.backoff = min(t.backoff * 2, _RETRY_MAX_S)
        else:
            self._give_up(t, f"could not send block ids to {t.remote.host}:{t.remote.port}: {error}", now)

    def on_legs(self, transfer_id: str, peers: Sequence[int]) -> None:
        """The engine planned the transfer's legs: the prefill ranks its ids go to (sent next)."""
        t = self._transfers.get(transfer_id)
        if t is not None and t.peers is None:
            t.peers = frozenset(peers)

    def on_done(self, peer: int, message: Done) -> None:
        t = self._transfers.get(message.transfer_id)
        if t is None:
            log.debug("notification for transfer %s, which is not waiting here", message.transfer_id)
            return
        if peer not in t.expected() and (t.peers is not None or t.delivered):
            log.warning("transfer %s: notification from cluster %d, expected %s; ignored", message.transfer_id, peer,
                        ", ".join(str(p) for p in sorted(t.expected())))
            return
        complete = message.outcome == Outcome.LANDED and message.num_blocks == len(t.spec.blocks)
        if t.state in (ConsumerState.ABORTING, ConsumerState.FAILING):
            t.settled.add(peer)  # whatever it says, that rank writes nothing more
            if complete and t.state == ConsumerState.FAILING:
                t.landed.add(peer)  # after our timeout, say: if every leg lands, the bytes are there
                if t.peers is not None and t.landed >= t.peers:
                    self._end(t, ConsumerState.LANDED)
                    return
            self._check(t)
            return
        if t.state not in (ConsumerState.SENDING_IDS, ConsumerState.WAITING_LANDED):
            return
        if complete:
            t.landed.add(peer)
            t.settled.add(peer)
            self._check(t)
            return
        if message.outcome == Outcome.LANDED:
            t.reason = f"prefill pushed {message.num_blocks} blocks, {len(t.spec.blocks)} expected"
        else:
            t.reason = t.reason or f"prefill reports {message.outcome.name}: {message.reason}"
        t.settled.add(peer)
        self._give_up(t, t.reason, self.clock())

    def on_message(self, peer: int, message: Message) -> None:
        if isinstance(message, Done):
            self.on_done(peer, message)
        else:
            log.warning("decode side got a %s message from cluster %d; ignored", type(message).__name__, peer)

    def on_link_lost(self, peer: int, reason: str = "link closed") -> None:
        for t in [t for t in self._transfers.values() if peer in t.expected()]:
            if t.state in (ConsumerState.ABORTING, ConsumerState.FAILING):
                t.settled.add(peer)
                self._check(t)
            elif t.state == ConsumerState.WAITING_LANDED or (
                    t.state == ConsumerState.SENDING_IDS and (t.delivered or t.peers is not None)):
                t.reason = t.reason or f"link to the prefill (cluster {peer}) lost: {reason}"
                t.settled.add(peer)
                self._give_up(t, t.reason, self.clock())

    # -- internals ---------------------------------------------------------------------------------
    def _send_ids(self, t: _Incoming) -> None:
        t.sending = True
        self.stats["ids_sent"] += 1
        self.effects.send_ids(t.spec, self.block_size)

    def _give_up(self, t: _Incoming, reason: str, now: float) -> None:
        t.reason = t.reason or reason
        log.warning("transfer %s (request %s): %s", t.spec.transfer_id, t.spec.req_id, t.reason)
        self._stop(t, ConsumerState.FAILING, now)

    def _abort(self, t: _Incoming, now: float) -> None:
        if t.state in _REPORTABLE or t.state == ConsumerState.ABORTING:
            return
        if t.state == ConsumerState.FAILING:
            t.state = ConsumerState.ABORTING  # the aborts already went out; vLLM no longer needs the blocks
            return
        t.reason = "request finished while waiting for its KV"
        self._stop(t, ConsumerState.ABORTING, now)

    def _stop(self, t: _Incoming, state: ConsumerState, now: float) -> None:
        """Tell every prefill rank that may still write to stop, and wait for them (``abort_grace_s`` at
        most) before the blocks are reported; with none that could, end at once."""
        final = ConsumerState.FAILED if state == ConsumerState.FAILING else ConsumerState.ABORTED
        if not (t.delivered or t.sending) or not t.outstanding():
            self._end(t, final)
            return
        t.state = state
        t.grace_deadline = now + self.config.abort_grace_s
        for peer in sorted(t.outstanding()):
            self.effects.send_abort(peer, encode(Abort(t.spec.transfer_id, t.reason)))

    def _check(self, t: _Incoming) -> None:
        """End ``t`` if nothing more is waited for: every leg landed, or every rank stopped."""
        if t.state == ConsumerState.WAITING_LANDED and t.peers is not None and t.landed >= t.peers:
            self._end(t, ConsumerState.LANDED)
        elif t.state in (ConsumerState.ABORTING, ConsumerState.FAILING) and not t.sending and not t.outstanding():
            self._end(t, ConsumerState.ABORTED if t.state == ConsumerState.ABORTING else ConsumerState.FAILED)

    def _end(self, t: _Incoming, state: ConsumerState) -> None:
        t.state = state
        self.stats[state.name.lower()] += 1
        del self._transfers[t.spec.transfer_id]
        self._by_req.pop(t.spec.req_id, None)
        self.effects.transfer_ended(t.spec.transfer_id)
        self._finished.add(t.spec.req_id)
        if state == ConsumerState.FAILED:
            self._failed.add(t.spec.req_id)
            self._load_errors.update(self._blocks(t.spec))
        log.debug("transfer %s (request %s): %s", t.spec.transfer_id, t.spec.req_id, state.value)

    def _report_now(self, spec: RecvSpec, reason: str) -> None:
        self.stats["failed"] += 1
        log.warning("request %s (transfer %s): %s", spec.req_id, spec.transfer_id, reason)
        self._finished.add(spec.req_id)
        self._failed.add(spec.req_id)
        self._load_errors.update(self._blocks(spec))

    def _blocks(self, spec: RecvSpec) -> list[int]:
        """The blocks a transfer writes into (vLLM's load errors when it fails)."""
        ids = np.asarray(spec.blocks, np.int64)
        return list(map(int, ids[self.groups.held(ids)]))
