"""The prefill worker's side: ``ProducerBook``, every transfer keyed by its id from the first of its
request's step or its decode's block ids to the release of its blocks, and ``ProducerState``. It pushes
the blocks each step touches layer by layer, serves late block ids with a push after the forward pass,
answers aborts, notifies the decode of the outcome and only then lets vLLM free the blocks.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .config import ConnectorConfig
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


@dataclass
class _Outgoing:
    transfer_id: str
    created: float
    req_id: str | None = None
    # from the decode
    peer: int | None = None
    first_block: int = 0
    dst_blocks: list[int] | None = None
    num_tokens: int = 0
    parts: list[int] = field(default_factory=list)
    parts_total: int = 0
    # from the prefill's scheduler
    blocks: list[int] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    computed_upto: int = 0
    step_after: int = 0
    pushed_upto: int = 0  # block index (in the prefill's list) below which every block was pushed
    finished: bool = False
    delayed: bool = False
    # progress
    pushes: set[int] = field(default_factory=set)
    failure: str | None = None
    outcome: Outcome = Outcome.LANDED
    notify_state: str = ""  # "", "sent", "done"
    ids_deadline: float | None = None


class ProducerBook:
    """The prefill worker's transfers, keyed by transfer id; see the package docstring.

    A transfer's blocks are released (its request reported in ``take_finished_sending``) only when
    the request finished in vLLM, no push of it is in flight and the decode was told the outcome (or
    cannot be). Block ids that never come are given up ``ids_timeout_s`` after the request finished;
    ids for a request not seen yet wait ``transfer_timeout_s``.
    """

    def __init__(self, block_size: int, num_layers: int, config: ConnectorConfig, clock: Clock,
                 effects: ProducerEffects) -> None:
        self.block_size = block_size
        self.num_layers = num_layers
        self.config = config
        self.clock = clock
        self.effects = effects
        self._transfers: dict[str, _Outgoing] = {}
        self._push_owner: dict[int, _Outgoing] = {}
        self._step: list[tuple[_Outgoing, int | None]] = []  # this step's transfers and their pipelined push
        self._step_layers: dict[int, set[int]] = {}
        self._next_push = 1
        self._finished_sending: set[str] = set()
        self._ended: OrderedDict[str, str] = OrderedDict()  # transfer id -> how it ended
        #: pushes_pipelined / pushes_after_forward / blocks_pushed / landed / failed / released
        self.stats: Counter[str] = Counter()

    # -- introspection -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._transfers)

    def state_of(self, transfer_id: str) -> ProducerState | None:
        t = self._transfers.get(transfer_id)
        if t is None:
            return None
        if t.pushes:
            return ProducerState.PUSHING if t.failure is None else ProducerState.DRAINING
        if t.notify_state == "sent":
            return ProducerState.NOTIFYING
        if t.failure is None and t.dst_blocks is None:
            return ProducerState.WAITING_IDS
        if t.failure is None and t.notify_state != "done":
            return ProducerState.PUSHING  # between the steps of a chunked prefill
        return ProducerState.RELEASABLE

    def ended(self, transfer_id: str) -> str | None:
        """How a released transfer ended ("landed" or the reason), while remembered."""
        return self._ended.get(transfer_id)

    # -- vLLM step hooks ---------------------------------------------------------------------------
    def begin_step(self, sends: Sequence[SendStep], finished: Sequence[FinishedSend] = ()) -> None:
        """Before the forward pass: start a pipelined push for every request whose decode blocks are
        known and whose blocks this step touches; then take note of finished requests."""
        for item in finished:
            self._finish(item)
        for send in sends:
            t = self._transfers.get(send.transfer_id)
            if t is None:
                t = self._transfers[send.transfer_id] = _Outgoing(send.transfer_id, self.clock())
                gone = self._ended.get(send.transfer_id)
                if gone is not None:  # its decode already gave up (and was answered): only keep the blocks
                    t.failure, t.outcome = f"ended before its request ran: {gone}", Outcome.UNKNOWN
                    t.notify_state = "done"
            if t.req_id is None:
                t.ids_deadline = None  # the request is here; its ids are awaited from when it finishes
            t.req_id = send.req_id
            t.blocks = list(send.blocks)
            if send.resumed:
                log.info("transfer %s: request %s was preempted; its blocks are pushed again", t.transfer_id,
                         send.req_id)
                t.pushed_upto = t.first_block
            if t.num_prompt_tokens is None:
                t.num_prompt_tokens = send.num_prompt_tokens
                self._check_tokens(t)
            t.computed_upto = send.computed_before
            t.step_after = send.computed_after
            push_id = None
            if t.failure is None and t.dst_blocks is not None:
                end = min(blocks_for(send.computed_after, self.block_size), self._end_block(t))
                push_id = self._start(t, t.pushed_upto, end, pipelined=True)
                t.pushed_upto = max(t.pushed_upto, self._end_block(t) if send.computed_after >= t.num_tokens
                                    else send.computed_after // self.block_size)
            self._step.append((t, push_id))

    def layer_saved(self, layer: int) -> None:
        """Layer ``layer``'s KV of this step is in memory: push it for every pipelined push."""
        for _, push_id in self._step:
            if push_id is not None and push_id in self._step_layers:
                self._step_layers[push_id].add(layer)
                self.effects.push_layer(push_id, layer)

    def end_step(self) -> None:
        """After the forward pass: every pipelined push gets its missing layers (a model whose layers
        did not all reach ``save_kv_layer``) and is finished; late block ids are served."""
        step, self._step = self._step, []
        for t, push_id in step:
            t.computed_upto = max(t.computed_upto, t.step_after)
            if push_id is not None and push_id in self._step_layers:
                for layer in range(self.num_layers):
                    if layer not in self._step_layers[push_id]:
                        self.effects.push_layer(push_id, layer)
                del self._step_layers[push_id]
                self.effects.finish_push(push_id)
        for t, _ in step:
            if t.transfer_id in self._transfers:
                self._settle(t)

    # -- engine events -----------------------------------------------------------------------------
    def on_message(self, peer: int, message: Message) -> None:
        if isinstance(message, BlockIds):
            self._on_ids(peer, message)
        elif isinstance(message, Abort):
            t = self._transfers.get(message.transfer_id)
            if t is None or t.peer not in (None, peer):
                log.debug("abort for transfer %s from cluster %d: nothing to abort", message.transfer_id, peer)
                if t is None:
                    self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.UNKNOWN, 0, "no such transfer")))
                return
            t.peer = peer
            self._fail(t, f"aborted by the decode ({message.reason or 'no reason given'})", Outcome.ABORTED)
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

    def on_notified(self, transfer_id: str, error: str | None) -> None:
        t = self._transfers.get(transfer_id)
        if t is None:
            return
        if error is not None:
            log.warning("transfer %s: could not tell the decode (cluster %s) the outcome: %s; it will time out",
                        transfer_id, t.peer, error)
        t.notify_state = "done"
        self._settle(t)

    def on_link_lost(self, peer: int, reason: str = "link closed") -> None:
        for t in [t for t in self._transfers.values() if t.peer == peer]:
            t.notify_state = t.notify_state or "done"  # nobody to tell
            self._fail(t, f"link to the decode (cluster {peer}) lost: {reason}", Outcome.FAILED)

    def poll(self) -> None:
        """Give up transfers whose request or block ids did not come in time."""
        now = self.clock()
        for t in [t for t in self._transfers.values() if t.ids_deadline is not None and now >= t.ids_deadline]:
            t.ids_deadline = None
            if t.failure is not None:
                continue
            if t.req_id is None:
                waited = self.config.transfer_timeout_s
                self._fail(t, f"its request did not reach this prefill within {waited:g} s", Outcome.UNKNOWN)
            elif t.dst_blocks is None:
                self._fail(t, f"no block ids from a decode within {self.config.ids_timeout_s:g} s", Outcome.FAILED)

    def take_finished_sending(self) -> set[str]:
        done, self._finished_sending = self._finished_sending, set()
        return done

    # -- internals ---------------------------------------------------------------------------------
    def _end_block(self, t: _Outgoing) -> int:
        """One past the last prefill block the decode wants."""
        return t.first_block + len(t.dst_blocks or ())

    def _start(self, t: _Outgoing, start: int, end: int, pipelined: bool) -> int | None:
        start = max(start, t.first_block)
        end = min(end, self._end_block(t), len(t.blocks))
        if start >= end or t.peer is None or t.dst_blocks is None:
            return None
        push_id = self._next_push
        self._next_push += 1
        src = t.blocks[start:end]
        dst = t.dst_blocks[start - t.first_block:end - t.first_block]
        t.pushes.add(push_id)
        self._push_owner[push_id] = t
        if pipelined:
            self._step_layers[push_id] = set()
        self.stats["pushes_pipelined" if pipelined else "pushes_after_forward"] += 1
        self.stats["blocks_pushed"] += len(src)
        self.effects.start_push(push_id, t.peer, src, dst, pipelined)
        return push_id

    def _finish(self, item: FinishedSend) -> None:
        t = self._transfers.get(item.transfer_id)
        if t is None:
            if item.delayed:  # never leak blocks, even for a request this book somehow lost
                self._finished_sending.add(item.req_id)
            return
        t.req_id = item.req_id
        t.finished = True
        t.delayed = item.delayed
        if not item.ok:
            self._fail(t, "the prefill request was aborted", Outcome.FAILED)
        elif not item.delayed:
            self._fail(t, "the prefill request ended before it was scheduled", Outcome.FAILED)
        elif t.dst_blocks is None and t.failure is None:
            t.ids_deadline = self.clock() + self.config.ids_timeout_s
        self._settle(t)

    def _on_ids(self, peer: int, message: BlockIds) -> None:
        t = self._transfers.get(message.transfer_id)
        if t is None:
            gone = self._ended.get(message.transfer_id)
            if gone is not None:
                self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.UNKNOWN, 0,
                                                     f"already ended: {gone}")))
                return
            if len(self._transfers) >= self.config.max_transfers:
                self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.FAILED, 0,
                                                     f"prefill tracks {len(self._transfers)} transfers already")))
                return
            t = self._transfers[message.transfer_id] = _Outgoing(message.transfer_id, self.clock())
            t.ids_deadline = t.created + self.config.transfer_timeout_s
        if t.peer is not None and t.peer != peer:
            self.effects.reply(peer, encode(Done(message.transfer_id, Outcome.FAILED, 0,
                                                 f"transfer already belongs to cluster {t.peer}")))
            return
        t.peer = peer
        if t.failure is not None:
            self._settle(t)  # answers with the failure (once its pushes drained)
            return
        if t.dst_blocks is not None:
            self._fail(t, "block ids sent twice", Outcome.MISMATCH)
            return
        if message.block_size != self.block_size:
            self._fail(t, f"decode block size {message.block_size}, prefill {self.block_size}", Outcome.MISMATCH)
            return
        if message.offset != len(t.parts) or (t.parts and message.total != t.parts_total):
            self._fail(t, f"block id part at {message.offset} of {message.total} out of order", Outcome.MISMATCH)
            return
        t.parts.extend(message.blocks)
        t.parts_total = message.total
        if len(t.parts) < message.total:
            return
        if message.total != blocks_for(message.num_tokens, self.block_size) - message.first_block:
            self._fail(t, f"{message.total} blocks from block {message.first_block} do not cover "
                          f"{message.num_tokens} tokens", Outcome.MISMATCH)
            return
        t.dst_blocks, t.parts = t.parts, []
        t.first_block = message.first_block
        t.num_tokens = message.num_tokens
        t.pushed_upto = max(t.pushed_upto, t.first_block)
        if t.req_id is not None:
            t.ids_deadline = None
        if not self._check_tokens(t):
            return
        self._settle(t)

    def _check_tokens(self, t: _Outgoing) -> bool:
        if t.dst_blocks is not None and t.num_prompt_tokens is not None and t.num_tokens != t.num_prompt_tokens:
            self._fail(t, f"decode expects {t.num_tokens} prompt tokens, prefill has {t.num_prompt_tokens}",
                       Outcome.MISMATCH)
            return False
        return True

    def _fail(self, t: _Outgoing, reason: str, outcome: Outcome) -> None:
        if t.failure is None:
            t.failure, t.outcome = reason, outcome
            log.warning("transfer %s (request %s): %s", t.transfer_id, t.req_id, reason)
            for push_id in sorted(t.pushes):
                self.effects.cancel_push(push_id)
        self._settle(t)

    def _in_step(self, t: _Outgoing) -> bool:
        return any(item is t for item, _ in self._step)

    def _settle(self, t: _Outgoing) -> None:
        """Move ``t`` on as far as it can go now: catch-up pushes, the Done notification, release.
        Does nothing for a transfer already released (a caller may settle what a nested call released)."""
        if t.pushes or self._transfers.get(t.transfer_id) is not t:
            return
        if t.failure is None:
            if t.dst_blocks is None:
                return
            if t.finished and t.computed_upto < t.num_tokens:
                self._fail(t, f"request finished with {t.computed_upto} of {t.num_tokens} prompt tokens computed",
                           Outcome.FAILED)
                return
            if not self._in_step(t):
                # Blocks every layer of which is in memory and that no later step writes: all of them
                # once the request finished, else the whole blocks below the computed tokens.
                limit = self._end_block(t) if t.finished else t.computed_upto // self.block_size
                if t.pushed_upto < limit:
                    start, t.pushed_upto = t.pushed_upto, limit
                    if self._start(t, start, limit, pipelined=False) is not None:
                        return
            if not t.finished or t.pushed_upto < self._end_block(t):
                return
        if t.peer is not None and not t.notify_state:
            t.notify_state = "sent"
            if t.failure is None:
                done = Done(t.transfer_id, Outcome.LANDED, len(t.dst_blocks or ()))
            else:
                done = Done(t.transfer_id, t.outcome, 0, t.failure)
            self.effects.notify(t.peer, encode(done), t.transfer_id)
            return
        if t.notify_state == "sent":
            return
        if t.req_id is not None and not t.finished:
            return  # the request still computes into (and owns) its blocks
        self._release(t)

    def _release(self, t: _Outgoing) -> None:
        del self._transfers[t.transfer_id]
        self.stats["released"] += 1
        self.stats["landed" if t.failure is None else "failed"] += 1
        if t.finished and t.delayed and t.req_id is not None:
            self._finished_sending.add(t.req_id)
        self._ended[t.transfer_id] = "landed" if t.failure is None else t.failure
        while len(self._ended) > TOMBSTONES:
            self._ended.popitem(last=False)
        log.debug("transfer %s (request %s) released: %s", t.transfer_id, t.req_id, self._ended[t.transfer_id])
