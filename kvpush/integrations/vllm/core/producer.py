"""The prefill worker's side: ``ProducerBook``, every transfer keyed by its id from the first of its
request's step or its decode's block ids to the release of its blocks, and ``ProducerState``. It pushes
the blocks each step touches layer by layer, serves late block ids with a push after the forward pass,
answers aborts, notifies the decode of the outcome and only then lets vLLM free the blocks.

With tensor parallelism a transfer has one *leg* per decode rank that sends this rank block ids (each
``BlockIds`` says which heads, ``LegInfo``, and how many legs to expect); the legs push, fail and are
answered independently, and the request's blocks are released once every leg ended.

A model with several KV cache groups (sliding windows, recurrent state: ``families.Groups``) has a block list
per group; a leg's block ids are then one per entry of ``Groups.entries`` (by position, then group), and a
push of positions ``[start, end)`` moves the entries in them, skipping those the decode holds no block for.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...config import ConnectorConfig
from ...families import PLAIN, Groups, LayoutError
from ...topology import Leg, LegInfo
from .effects import Clock, ProducerEffects
from .messages import Abort, BlockIds, Done, Message, Outcome, encode
from .steps import FinishedSend, SendStep, blocks_for

log = logging.getLogger(__name__)

TOMBSTONES = 4096  # ended transfer ids remembered, so late messages get an answer


class ProducerState(enum.Enum):
    WAITING_IDS = "waiting for the decode's block ids"
    PUSHING = "pushing layers"
    DRAINING = "waiting for pushes to finish"
    NOTIFYING = "notifying the decode"
    RELEASABLE = "waiting for the request to finish"


@dataclass(eq=False)
class _Request:
    """A prefill request (by transfer id): what vLLM's scheduler said of it, and its legs."""

    transfer_id: str
    created: float
    req_id: str | None = None
    blocks: list[list[int]] = field(default_factory=list)  # one list per KV cache group
    num_prompt_tokens: int | None = None
    computed_upto: int = 0
    step_after: int = 0
    finished: bool = False
    delayed: bool = False
    in_step: bool = False  # this step's forward computes some of its prompt
    legs: dict[int, _Outgoing] = field(default_factory=dict)  # by decode peer
    expected: int | None = None  # legs announced (None: no block ids yet)
    failure: str | None = None  # the request itself failed: every leg, present or late, fails with it
    ids_deadline: float | None = None
    gave_up: str | None = None  # why legs that never came were given up (remembered when it ends)
    ids_reported: bool = False  # its block ids were reported in (for the scheduler's hold)


@dataclass(eq=False)
class _Outgoing:
    """One leg: what this rank pushes of a request to one decode rank (``peer``)."""

    request: _Request
    peer: int
    first_block: int = 0
    dst_blocks: list[int] | None = None  # one per entry (``Groups.entries``), 0: the decode holds none
    entries: tuple[np.ndarray, np.ndarray] | None = None  # (group, position) of each of dst_blocks
    num_tokens: int = 0
    parts: list[int] = field(default_factory=list)
    parts_total: int = 0
    leg: LegInfo | None = None
    pushed_upto: int = 0  # block index (in the prefill's list) below which every block was pushed
    pushes: set[int] = field(default_factory=set)
    failure: str | None = None
    outcome: Outcome = Outcome.LANDED
    notify_state: str = ""  # "", "sent", "done"
    released: bool = False

    @property
    def transfer_id(self) -> str:
        return self.request.transfer_id


_ORDER = (ProducerState.WAITING_IDS, ProducerState.PUSHING, ProducerState.DRAINING, ProducerState.NOTIFYING,
          ProducerState.RELEASABLE)


class ProducerBook:
    """The prefill worker's transfers, keyed by transfer id; see the package docstring.

    A transfer's blocks are released (its request reported in ``take_finished_sending``) only when
    the request finished in vLLM, no push of it is in flight and every leg's decode was told the
    outcome (or cannot be). Block ids that never come are given up ``ids_timeout_s`` after the request
    finished; ids for a request not seen yet wait ``transfer_timeout_s``. ``local_heads``: the KV heads
    this worker holds per block (its registered cache has that many kvpush blocks per vLLM block).
    ``groups``: the model's KV cache groups (see the module docstring).
    """

    def __init__(self, block_size: int, num_layers: int, config: ConnectorConfig, clock: Clock,
                 effects: ProducerEffects, local_heads: int = 1, groups: Groups = PLAIN) -> None:
        self.block_size = block_size
        self.num_layers = num_layers
        self.config = config
        self.clock = clock
        self.effects = effects
        self.local_heads = local_heads
        self.groups = groups
        self._requests: dict[str, _Request] = {}
        self._push_owner: dict[int, _Outgoing] = {}
        self._step: list[_Request] = []  # this step's requests
        self._step_pushes: list[int] = []  # this step's pipelined pushes
        self._step_layers: dict[int, set[int]] = {}
        self._saved: set[int] = set()  # the layers of this step's forward in memory so far
        self._next_push = 1
        self._finished_sending: set[str] = set()
        self._ids_in: list[str] = []  # transfers whose every leg's ids came before their request ran
        self._ended: OrderedDict[str, str] = OrderedDict()  # transfer id -> how it ended
        #: pushes_pipelined / pushes_after_forward / blocks_pushed / landed / failed (legs) / released (requests)
        self.stats: Counter[str] = Counter()

    # -- introspection -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._requests)

    def state_of(self, transfer_id: str) -> ProducerState | None:
        """The least advanced state of the transfer's legs (WAITING_IDS before any came)."""
        r = self._requests.get(transfer_id)
        if r is None:
            return None
        states = [self._leg_state(t) for t in r.legs.values() if not t.released]
        if not states:
            return ProducerState.WAITING_IDS if r.failure is None and not r.legs else ProducerState.RELEASABLE
        return min(states, key=_ORDER.index)

    def _leg_state(self, t: _Outgoing) -> ProducerState:
        failure = t.failure or t.request.failure
        if t.pushes:
            return ProducerState.PUSHING if failure is None else ProducerState.DRAINING
        if t.notify_state == "sent":
            return ProducerState.NOTIFYING
        if failure is None and t.dst_blocks is None:
            return ProducerState.WAITING_IDS
        if failure is None and t.notify_state != "done":
            return ProducerState.PUSHING  # between the steps of a chunked prefill
        return ProducerState.RELEASABLE

    def ended(self, transfer_id: str) -> str | None:
        """How a released transfer ended ("landed" or the reason), while remembered."""
        return self._ended.get(transfer_id)

    # -- vLLM step hooks ---------------------------------------------------------------------------
    def begin_step(self, sends: Sequence[SendStep], finished: Sequence[FinishedSend] = ()) -> None:
        """Before the forward pass: start a pipelined push for every leg whose decode blocks are known
        and whose blocks this step touches; then take note of finished requests."""
        for item in finished:
            self._finish(item)
        self._saved = set()
        for send in sends:
            r = self._in_step(send)
            self._step.append(r)
            for t in list(r.legs.values()):
                if t.failure is None and r.failure is None and t.dst_blocks is not None and not t.released:
                    self._join_step(t)

    def _join_step(self, t: _Outgoing) -> bool:
        """A pipelined push of what this step computes of leg ``t``'s request: at the step's start, or when its
        block ids come during the forward (its layers already in memory go at once, the others as they come).
        False: this step computes nothing of it that was not pushed."""
        r = t.request
        end = min(blocks_for(r.step_after, self.block_size), self._end_block(t))
        if t.pushed_upto >= end:
            return False
        push_id = self._start(t, t.pushed_upto, end, pipelined=True)
        t.pushed_upto = max(t.pushed_upto, self._end_block(t) if r.step_after >= t.num_tokens
                            else r.step_after // self.block_size)
        if push_id is not None:
            self._step_pushes.append(push_id)
            for layer in sorted(self._saved):
                self._step_layers[push_id].add(layer)
                self.effects.push_layer(push_id, layer)
        return True

    def _in_step(self, send: SendStep) -> _Request:
        """The request ``send`` computes in this step, created on its first step, brought up to date."""
        r = self._requests.get(send.transfer_id)
        if r is None:
            r = self._requests[send.transfer_id] = _Request(send.transfer_id, self.clock())
            gone = self._ended.get(send.transfer_id)
            if gone is not None:  # its decode already gave up (and was answered): only keep the blocks
                r.failure = f"ended before its request ran: {gone}"
                r.expected = 0
        if r.req_id is None:
            r.ids_deadline = None  # the request is here; its ids are awaited from when it finishes
        r.req_id = send.req_id
        r.blocks = [list(group) for group in send.blocks]
        if send.resumed:
            log.info("transfer %s: request %s was preempted; its blocks are pushed again", r.transfer_id,
                     send.req_id)
            for t in r.legs.values():
                t.pushed_upto = t.first_block
        if r.num_prompt_tokens is None:
            r.num_prompt_tokens = send.num_prompt_tokens
            for t in list(r.legs.values()):
                self._check_tokens(t)
        r.computed_upto = send.computed_before
        r.step_after = send.computed_after
        r.in_step = True
        return r

    def layer_saved(self, layer: int) -> None:
        """Layer ``layer``'s KV of this step is in memory: push it for every pipelined push."""
        self._saved.add(layer)
        for push_id in self._step_pushes:
            if push_id in self._step_layers:
                self._step_layers[push_id].add(layer)
                self.effects.push_layer(push_id, layer)

    def end_step(self) -> None:
        """After the forward pass: every pipelined push gets its missing layers (a model whose layers
        did not all reach ``save_kv_layer``) and is finished; late block ids are served."""
        step, pushes, self._step, self._step_pushes = self._step, self._step_pushes, [], []
        self._saved = set()
        for r in step:
            r.computed_upto = max(r.computed_upto, r.step_after)
            r.in_step = False
        for push_id in pushes:
            if push_id in self._step_layers:
                for layer in range(self.num_layers):
                    if layer not in self._step_layers[push_id]:
                        self.effects.push_layer(push_id, layer)
                del self._step_layers[push_id]
                self.effects.finish_push(push_id)
        for r in step:
            for t in list(r.legs.values()):
                self._settle(t)

    # -- engine events -----------------------------------------------------------------------------
    def on_message(self, peer: int, message: Message) -> None:
        if isinstance(message, BlockIds):
            self._on_ids(peer, message)
            self._note_ids_in(message.transfer_id)
        elif isinstance(message, Abort):
            r = self._requests.get(message.transfer_id)
            t = r.legs.get(peer) if r is not None else None
            if t is None:
                log.debug("abort for transfer %s from cluster %d: nothing to abort", message.transfer_id, peer)
                if r is None:
                    self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.UNKNOWN, 0, "no such transfer")))
                return
            reason = f"aborted by the decode ({message.reason or 'no reason given'})"
            if r is not None and r.req_id is None:
                # its request never came here (the router cut both copies): nothing will need its blocks, so
                # nothing waits for it; one that still comes finds the transfer ended (``_in_step``)
                self._fail_request(r, reason, Outcome.ABORTED)
                return
            self._fail(t, reason, Outcome.ABORTED)
        else:
            log.warning("prefill side got a %s message from cluster %d; ignored", type(message).__name__, peer)

    def on_push_done(self, push_id: int, error: str | None) -> None:
        t = self._push_owner.pop(push_id, None)
        if t is None:
            return
        t.pushes.discard(push_id)
        if error is not None:
            self._fail(t, f"push failed: {error}", Outcome.FAILED)
        else:
            self._settle(t)

    def on_notified(self, transfer_id: str, error: str | None, peer: int | None = None) -> None:
        """The decode ``peer`` was told the outcome of its leg (``error``: could not be)."""
        r = self._requests.get(transfer_id)
        if r is None:
            return
        for t in [t for t in r.legs.values() if peer is None or t.peer == peer]:
            if t.notify_state != "sent":
                continue
            if error is not None:
                log.warning("transfer %s: could not tell the decode (cluster %s) the outcome: %s; it will time out",
                            transfer_id, t.peer, error)
            t.notify_state = "done"
            self._settle(t)

    def on_link_lost(self, peer: int, reason: str = "link closed") -> None:
        for t in [t for r in list(self._requests.values()) for t in r.legs.values() if t.peer == peer]:
            t.notify_state = t.notify_state or "done"  # nobody to tell
            self._fail(t, f"link to the decode (cluster {peer}) lost: {reason}", Outcome.FAILED)

    def poll(self) -> None:
        """Give up transfers whose request or block ids did not come in time."""
        now = self.clock()
        for r in [r for r in self._requests.values() if r.ids_deadline is not None and now >= r.ids_deadline]:
            r.ids_deadline = None
            if r.req_id is None:
                waited = self.config.transfer_timeout_s
                self._fail_request(r, f"its request did not reach this prefill within {waited:g} s", Outcome.UNKNOWN)
                continue
            waiting = [t for t in r.legs.values() if t.dst_blocks is None and t.failure is None]
            missing = (r.expected if r.expected is not None else 1) - len(r.legs)
            if waiting or missing > 0:
                r.gave_up = f"no block ids from a decode within {self.config.ids_timeout_s:g} s"
                log.warning("transfer %s (request %s): %s (%d decode rank(s) missing)", r.transfer_id, r.req_id,
                            r.gave_up, len(waiting) + max(missing, 0))
            r.expected = len(r.legs)  # no more legs are waited for
            for t in waiting:
                self._fail(t, f"no block ids from a decode within {self.config.ids_timeout_s:g} s", Outcome.FAILED)
            self._release_if_done(r)

    @property
    def ids_in_pending(self) -> bool:
        """Block ids came in that ``take_ids_in`` has not handed out yet."""
        return bool(self._ids_in)

    def take_ids_in(self) -> list[str]:
        """Transfers whose decode's block ids all came (or whose legs ended) before their request's first
        step here, each once: the scheduler holds such a request until they came (see ``SchedulerBook``)."""
        ids_in, self._ids_in = self._ids_in, []
        return ids_in

    def take_finished_sending(self) -> set[str]:
        done, self._finished_sending = self._finished_sending, set()
        return done

    # -- internals ---------------------------------------------------------------------------------
    def _note_ids_in(self, transfer_id: str) -> None:
        r = self._requests.get(transfer_id)
        if r is not None and r.req_id is None and not r.ids_reported and not self._waiting_ids(r):
            r.ids_reported = True
            self._ids_in.append(transfer_id)

    def _end_block(self, t: _Outgoing) -> int:
        """One past the last prefill block the decode wants."""
        return blocks_for(t.num_tokens, self.block_size) if t.dst_blocks is not None else t.first_block

    def _start(self, t: _Outgoing, start: int, end: int, pipelined: bool) -> int | None:
        r = t.request
        start = max(start, t.first_block)
        end = min(end, self._end_block(t), self.groups.known(r.blocks) if r.blocks else 0)
        if start >= end or t.dst_blocks is None or t.entries is None or (t.leg is not None and t.leg.heads == 0):
            return None
        groups, positions = t.entries
        lo, hi = (int(i) for i in np.searchsorted(positions, (start, end)))
        dst_blocks = np.asarray(t.dst_blocks[lo:hi], np.int64)
        held = self.groups.held(dst_blocks)
        try:
            src_blocks = self.groups.select(r.blocks, groups[lo:hi][held], positions[lo:hi][held])
        except LayoutError as error:
            self._fail(t, f"the prefill's blocks: {error}", Outcome.FAILED)
            return None
        if not self.groups.held(src_blocks).all():
            where = positions[lo:hi][held][~self.groups.held(src_blocks)]
            self._fail(t, f"the prefill holds no block at position(s) {where.tolist()[:8]} the decode holds "
                          f"(KV cache groups {self.groups})", Outcome.FAILED)
            return None
        dst_blocks = dst_blocks[held]
        if not len(dst_blocks):
            return None
        push_id = self._next_push
        self._next_push += 1
        info = t.leg or LegInfo(0, 0, self.local_heads, self.local_heads)
        leg = Leg(0, 0, info.src_head, info.dst_head, info.heads)
        src, dst = leg.block_ids(src_blocks, dst_blocks, self.local_heads, info.dst_local)
        t.pushes.add(push_id)
        self._push_owner[push_id] = t
        if pipelined:
            self._step_layers[push_id] = set()
        self.stats["pushes_pipelined" if pipelined else "pushes_after_forward"] += 1
        self.stats["blocks_pushed"] += len(dst_blocks)
        self.effects.start_push(push_id, t.peer, src.tolist(), dst.tolist(), pipelined)
        return push_id

    def _finish(self, item: FinishedSend) -> None:
        r = self._requests.get(item.transfer_id)
        if r is None:
            if item.delayed:  # never leak blocks, even for a request this book somehow lost
                self._finished_sending.add(item.req_id)
            return
        r.req_id = item.req_id
        r.finished = True
        r.delayed = item.delayed
        r.ids_deadline = None  # it came and went: from now on only its block ids are waited for
        if not item.ok:
            self._fail_request(r, "the prefill request was aborted", Outcome.FAILED)
        elif not item.delayed:
            self._fail_request(r, "the prefill request ended before it was scheduled", Outcome.FAILED)
        elif r.failure is None and self._waiting_ids(r):
            r.ids_deadline = self.clock() + self.config.ids_timeout_s
        for t in list(r.legs.values()):
            self._settle(t)
        self._release_if_done(r)

    def _on_ids(self, peer: int, message: BlockIds) -> None:
        t = self._leg_for(peer, message)
        if t is None:
            return
        r = t.request
        if t.failure is not None or r.failure is not None or t.released:
            self._settle(t)  # answers with the failure (once its pushes drained)
            return
        problem = self._mismatch(t, message)
        if problem is not None:
            self._fail(t, problem, Outcome.MISMATCH)
            return
        t.parts.extend(message.blocks)
        t.parts_total = message.total
        t.leg = message.leg
        if len(t.parts) < message.total:
            return
        num_blocks = blocks_for(message.num_tokens, self.block_size)
        try:
            entries = self.groups.entries(num_blocks, message.first_block)
        except LayoutError as error:
            self._fail(t, f"block ids from block {message.first_block} for {message.num_tokens} tokens: {error}",
                       Outcome.MISMATCH)
            return
        if message.total != len(entries[0]):
            self._fail(t, f"{message.total} blocks from block {message.first_block} do not cover "
                          f"{message.num_tokens} tokens (KV cache groups {self.groups}: {len(entries[0])})",
                       Outcome.MISMATCH)
            return
        t.dst_blocks, t.parts, t.entries = t.parts, [], entries
        t.first_block = message.first_block
        t.num_tokens = message.num_tokens
        t.pushed_upto = max(t.pushed_upto, t.first_block)
        if r.req_id is not None and not self._waiting_ids(r):
            r.ids_deadline = None  # its request is here and every leg's ids are in
        if not self._check_tokens(t):
            return
        self._settle(t)

    def _leg_for(self, peer: int, message: BlockIds) -> _Outgoing | None:
        """The leg ``peer``'s block ids belong to, made on its first part; None when the decode was answered at
        once instead (the transfer ended, too many transfers, the request failed or its legs are all taken)."""
        r = self._requests.get(message.transfer_id)
        if r is None:
            gone = self._ended.get(message.transfer_id)
            if gone is not None:
                self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.UNKNOWN, 0,
                                                     f"already ended: {gone}")))
                return None
            if len(self._requests) >= self.config.max_transfers:
                self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.FAILED, 0,
                                                     f"prefill tracks {len(self._requests)} transfers already")))
                return None
            r = self._requests[message.transfer_id] = _Request(message.transfer_id, self.clock())
            r.ids_deadline = r.created + self.config.transfer_timeout_s
        t = r.legs.get(peer)
        if t is None and r.failure is not None:  # the request failed before this leg came: say so at once
            self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.FAILED, 0, r.failure)))
            return None
        if t is None:
            if r.expected is not None and len(r.legs) >= r.expected:
                owners = ", ".join(str(other) for other in r.legs)
                self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.FAILED, 0,
                                                     f"transfer already belongs to cluster(s) {owners}")))
                return None
            t = r.legs[peer] = _Outgoing(r, peer)
        if r.expected is None:
            r.expected = message.leg.legs if message.leg is not None else 1
        return t

    def _mismatch(self, t: _Outgoing, message: BlockIds) -> str | None:
        """Why this part of leg ``t``'s block ids cannot be taken, or None."""
        legs = message.leg.legs if message.leg is not None else 1
        if legs != t.request.expected:
            return f"decode ranks announce {legs} and {t.request.expected} legs"
        if t.dst_blocks is not None:
            return "block ids sent twice"
        if message.block_size != self.block_size:
            return f"decode block size {message.block_size}, prefill {self.block_size}"
        if message.leg is not None and message.leg.src_head + message.leg.heads > self.local_heads:
            return (f"decode asks for local heads {message.leg.src_head}..+{message.leg.heads}, this rank "
                    f"holds {self.local_heads}")
        if message.offset != len(t.parts) or (t.parts and message.total != t.parts_total):
            return f"block id part at {message.offset} of {message.total} out of order"
        return None

    @staticmethod
    def _waiting_ids(r: _Request) -> bool:
        """Some leg's block ids have not (all) come."""
        return (r.expected is None or len(r.legs) < r.expected
                or any(t.dst_blocks is None and t.failure is None for t in r.legs.values()))

    def _check_tokens(self, t: _Outgoing) -> bool:
        wanted = t.request.num_prompt_tokens
        if t.dst_blocks is not None and wanted is not None and t.num_tokens != wanted:
            self._fail(t, f"decode expects {t.num_tokens} prompt tokens, prefill has {wanted}", Outcome.MISMATCH)
            return False
        return True

    def _fail(self, t: _Outgoing, reason: str, outcome: Outcome) -> None:
        if t.failure is None and not t.released:
            t.failure, t.outcome = reason, outcome
            log.warning("transfer %s (request %s): %s", t.transfer_id, t.request.req_id, reason)
            for push_id in sorted(t.pushes):
                self.effects.cancel_push(push_id)
        self._settle(t)

    def _fail_request(self, r: _Request, reason: str, outcome: Outcome) -> None:
        """The request itself failed: every leg fails, and so will any that comes late."""
        if r.failure is None:
            r.failure = reason
        r.ids_deadline = None
        for t in list(r.legs.values()):
            self._fail(t, reason, outcome)
        self._release_if_done(r)

    def _settle(self, t: _Outgoing) -> None:
        """Move leg ``t`` on as far as it can go now: catch-up pushes, the Done notification, release.
        Does nothing for a leg already released (a caller may settle what a nested call released)."""
        r = t.request
        if t.pushes or t.released or self._requests.get(r.transfer_id) is not r:
            return
        failure = t.failure or r.failure
        if failure is None and not self._all_pushed(t):
            return
        if not t.notify_state:
            t.notify_state = "sent"
            if failure is None:
                done = Done(t.transfer_id, Outcome.LANDED, len(t.dst_blocks or ()))
            else:
                done = Done(t.transfer_id, t.outcome if t.failure else Outcome.FAILED, 0, failure)
            self.effects.notify(t.peer, encode(done), t.transfer_id)
            return
        if t.notify_state == "sent":
            return
        if r.req_id is not None and not r.finished:
            return  # the request still computes into (and owns) its blocks
        t.released = True
        self.stats["landed" if failure is None else "failed"] += 1
        self._release_if_done(r)

    def _all_pushed(self, t: _Outgoing) -> bool:
        """Leg ``t`` (not failed) has pushed every block of its finished request; else start the catch-up pushes
        it can (or fail it when its request finished short of the tokens it announced) and say False."""
        r = t.request
        if t.dst_blocks is None:
            return False
        if r.finished and r.computed_upto < t.num_tokens:
            self._fail(t, f"request finished with {r.computed_upto} of {t.num_tokens} prompt tokens computed",
                       Outcome.FAILED)
            return False
        if r.in_step:  # its ids came during the forward: it joins it
            if self._join_step(t):
                return False
        else:
            # Blocks every layer of which is in memory and that no later step writes: all of them
            # once the request finished, else the whole blocks below the computed tokens.
            limit = self._end_block(t) if r.finished else r.computed_upto // self.block_size
            if t.pushed_upto < limit:
                start, t.pushed_upto = t.pushed_upto, limit
                if self._start(t, start, limit, pipelined=False) is not None:
                    return False
        return r.finished and t.pushed_upto >= self._end_block(t)

    def _release_if_done(self, r: _Request) -> None:
        """Release the request once it finished (or never came) and every leg it will have ended."""
        if self._requests.get(r.transfer_id) is not r or any(not t.released for t in r.legs.values()):
            return
        if r.req_id is not None and not r.finished:
            return
        if r.failure is None and (r.ids_deadline is not None
                                  or len(r.legs) < (1 if r.expected is None else r.expected)):
            return  # block ids may still come
        del self._requests[r.transfer_id]
        self.stats["released"] += 1
        if r.finished and r.delayed and r.req_id is not None:
            self._finished_sending.add(r.req_id)
        failures = [t.failure for t in r.legs.values() if t.failure] + [why for why in (r.failure, r.gave_up) if why]
        self._ended[r.transfer_id] = "landed" if not failures else failures[0]
        while len(self._ended) > TOMBSTONES:
            self._ended.popitem(last=False)
        log.debug("transfer %s (request %s) released: %s", r.transfer_id, r.req_id, self._ended[r.transfer_id])
