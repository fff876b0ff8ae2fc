"""The scheduler side of the connector: ``SchedulerBook`` notes which requests load or send their KV,
tracks their block lists, builds each step's ``StepMeta`` from the ``Scheduled`` requests the adapter
reads off vLLM's SchedulerOutput, and says which finished requests keep their blocks until the worker
reports them settled. Pure; the adapter calls it from vLLM's scheduler thread.

A prefill request whose decode sends block ids (a proxy named its transfer) is *held* before its first
forward (``matched_tokens`` answers None, vLLM's "ask again next step") until every worker rank reported
the decode's ids in (``ids_in``), or ``ids_wait_s`` after it was first asked: so its forward pushes every
layer as it computes it. A request whose ids do not come in time runs as it would have, and its blocks
are pushed after the forward once they come: the hold never waits on anything but a clock.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ...config import (
    MAX_TRANSFER_ID_BYTES,
    Bootstrap,
    ConsumerParams,
    ParamsError,
    PeerAddress,
    ProducerParams,
    decode_request_params,
    parse_params,
)
from ...families import PLAIN, Groups, LayoutError
from .effects import Clock
from .steps import FinishedSend, RecvSpec, SendStep, StepMeta, blocks_for, per_group

log = logging.getLogger(__name__)

IDS_IN_REMEMBERED = 4096  # transfers whose block ids came before their request (decode first), remembered

#: a decode's lookup of the prefill a Mooncake-shaped request names (``Bootstrap``): its address, None while the
#: lookup runs (vLLM asks again next step), ParamsError when it cannot be found. It never blocks.
Resolve = Callable[[Bootstrap], PeerAddress | None]


@dataclass(frozen=True)
class Scheduled:
    """One scheduled request of a step, as the adapter reads it from vLLM's SchedulerOutput:
    ``new_blocks`` are all its blocks for a new or ``resumed`` request, else the ones added this
    step (None: none), one tuple per KV cache group (``per_group``); ``num_computed_tokens`` before this step."""

    req_id: str
    new_blocks: tuple[tuple[int, ...], ...] | None
    resumed: bool
    num_computed_tokens: int
    num_scheduled_tokens: int

    def __post_init__(self) -> None:
        if self.new_blocks is not None:
            object.__setattr__(self, "new_blocks", per_group(self.new_blocks))


@dataclass(frozen=True)
class IdsHold:
    """How a prefill holds a request for its decode's block ids: until ``ranks`` worker ranks (its
    tensor-parallel size) reported them in, at most ``wait_s`` on ``clock`` after it was first asked."""

    wait_s: float
    clock: Clock
    ranks: int = 1


@dataclass
class _SchedRequest:
    req_id: str
    num_prompt_tokens: int
    consumer: ConsumerParams | None = None
    transfer_id: str = ""
    issued: bool = False  # consumer: a RecvSpec went to the worker
    blocks: list[list[int]] = field(default_factory=list)  # producer: one list per KV cache group
    handed: bool = False  # producer: a SendStep went to the worker
    ids_coming: bool = False  # producer: a decode sends block ids (the proxy named the transfer)
    held_until: float | None = None  # producer: held for those ids until then (None: not held yet)
    refused: str | None = None  # consumer: why its KV cannot come (its blocks become load errors)


class SchedulerBook:
    """The scheduler side: which requests load or send, their block lists, and what to delay.

    ``produce``/``consume`` follow the instance's kv_role. ``local`` is this instance's own kvpush
    address (returned to the proxy by a prefill in ``request_finished``, with ``bootstrap``: its Mooncake
    bootstrap server's URL and engine id, when it serves one). ``resolve`` finds the prefill a decode request
    names by its bootstrap server (``Resolve``; None: such requests are refused). A decode request that names
    no prefill is refused (its blocks are load errors): nothing guesses one. ``hold``: how a prefill request is
    held for its decode's block ids (None: never). ``groups``: the model's KV cache groups (``families.Groups``); with a
    recurrent state a transfer covers the prompt but its last token (``Groups.backoff``), which the decode
    computes, and the adapter shortens the prefill's prompt by as much.
    """

    def __init__(self, block_size: int, produce: bool, consume: bool, local: PeerAddress | None = None,  # noqa: PLR0913
                 resolve: Resolve | None = None, name: str = "kvpush",
                 hold: IdsHold | None = None, groups: Groups = PLAIN,
                 bootstrap: Bootstrap | None = None) -> None:
        if block_size < 1:
            raise ParamsError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.produce = produce
        self.consume = consume
        self.local = local
        self.resolve = resolve
        self.bootstrap = bootstrap
        self.name = name
        self.groups = groups
        self._requests: dict[str, _SchedRequest] = {}
        self._meta = StepMeta()
        self._pending_send: set[str] = set()  # producer requests whose blocks wait for finished_sending
        self._received: set[str] = set()  # consumer requests reported finished_recving
        self.hold = hold if hold is not None and hold.wait_s > 0 else None
        #: transfer id -> worker ranks that reported its block ids in (oldest first, bounded)
        self._ids_in: OrderedDict[str, int] = OrderedDict()
        #: held (prefill requests held for block ids), held_ids_in (released by their ids), held_expired
        self.stats: Counter[str] = Counter()

    # -- per request ---------------------------------------------------------------------------------
    def on_new_request(self, req_id: str, params: Mapping[str, Any] | None, num_prompt_tokens: int) -> None:
        """Note a request; a decode request with unusable params is refused (its blocks are load errors: vLLM
        fails or recomputes it, as its kv_load_failure_policy says), any other served locally (logged); none
        is left waiting."""
        try:
            parsed = parse_params(params)
        except ParamsError as error:
            if self.consume and params and params.get("do_remote_prefill"):
                transfer_id = _local_transfer_id(self.name, req_id)
                self._requests[req_id] = _SchedRequest(req_id, num_prompt_tokens, ConsumerParams(transfer_id, None),
                                                       transfer_id, refused=str(error))
                log.warning("%s: request %s: %s; its KV cannot be loaded", self.name, req_id, error)
                return
            log.warning("%s: request %s: %s; computing it locally", self.name, req_id, error)
            return
        if isinstance(parsed, ConsumerParams):
            if not self.consume:
                log.warning("%s: request %s asks to load remote KV but this instance is not a consumer", self.name,
                            req_id)
                return
            self._requests[req_id] = _SchedRequest(req_id, num_prompt_tokens, consumer=parsed,
                                                   transfer_id=parsed.transfer_id)
        elif isinstance(parsed, ProducerParams):
            if not self.produce:
                log.warning("%s: request %s asks to send its KV but this instance is not a producer", self.name,
                            req_id)
                return
            transfer_id = parsed.transfer_id or _local_transfer_id(self.name, req_id)
            self._requests[req_id] = _SchedRequest(req_id, num_prompt_tokens, transfer_id=transfer_id,
                                                   ids_coming=parsed.transfer_id is not None)

    def transfer_id(self, req_id: str) -> str | None:
        request = self._requests.get(req_id)
        return request.transfer_id if request is not None else None

    def matched_tokens(self, req_id: str, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens to load, asynchronously?) for vLLM's get_num_new_matched_tokens. A decode request
        claims every prompt token it does not hold, once; a prefill request whose block ids are coming
        answers None (held: vLLM asks again next step) until they came or its hold expired."""
        request = self._requests.get(req_id)
        if request is None:
            return 0, False
        if request.consumer is None:
            return (None, False) if self._held(request) else (0, False)
        if request.issued:
            return 0, False
        if self._resolving(request):
            return None, False
        count = self._tokens(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _resolving(self, request: _SchedRequest) -> bool:
        """Whether a decode request named by its prefill's bootstrap server still waits for the address (a
        lookup that fails refuses the request)."""
        consumer = request.consumer
        if consumer is None or consumer.remote is not None or request.refused is not None:
            return False
        if consumer.bootstrap is None or self.resolve is None:
            request.refused = "this decode looks up no bootstrap server"
            return False
        try:
            remote = self.resolve(consumer.bootstrap)
        except ParamsError as error:
            request.refused = str(error)
            log.warning("%s: request %s: %s; its KV cannot be loaded", self.name, request.req_id, error)
            return False
        if remote is None:
            return True
        request.consumer = replace(consumer, remote=remote)
        return False

    def _tokens(self, request: _SchedRequest) -> int:
        """The prompt tokens a decode request loads: all of them, but the last one with a recurrent state."""
        return request.num_prompt_tokens - (self.groups.backoff if request.num_prompt_tokens > 1 else 0)

    def _held(self, request: _SchedRequest) -> bool:
        """Whether the prefill request still waits for its decode's block ids (starting its hold when
        first asked); once released it is never held again (a preempted request resumes at once)."""
        hold = self.hold
        if not request.ids_coming or request.handed or hold is None:
            return False
        if self._ids_in.get(request.transfer_id, 0) >= hold.ranks:
            if request.held_until is not None:
                self.stats["held_ids_in"] += 1
            request.ids_coming = False
            return False
        now = hold.clock()
        if request.held_until is None:
            request.held_until = now + hold.wait_s
            self.stats["held"] += 1
        if now < request.held_until:
            return True
        request.ids_coming = False
        self.stats["held_expired"] += 1
        log.debug("%s: request %s: no block ids within %.0f ms; it runs, pushed after its forward", self.name,
                  request.req_id, hold.wait_s * 1e3)
        return False

    def ids_in(self, transfer_ids: Mapping[str, int]) -> None:
        """Worker ranks reported the decode's block ids of these transfers in (transfer id -> ranks)."""
        for transfer_id, ranks in transfer_ids.items():
            self._ids_in[transfer_id] = self._ids_in.pop(transfer_id, 0) + ranks
        while len(self._ids_in) > IDS_IN_REMEMBERED:
            self._ids_in.popitem(last=False)

    def after_alloc(self, req_id: str, block_ids: Sequence[Sequence[int]] | Sequence[int],
                    num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks, one list per KV cache group, ``per_group``)
        with ``num_external_tokens`` to load: queue the decode worker's RecvSpec for the next step."""
        request = self._requests.get(req_id)
        if request is None or request.consumer is None or request.issued or num_external_tokens <= 0:
            return
        request.issued = True
        tokens = self._tokens(request)
        local_tokens = tokens - num_external_tokens
        first_block = local_tokens // self.block_size
        end_block = blocks_for(tokens, self.block_size)
        error = request.refused
        blocks: tuple[int, ...] = ()
        if local_tokens < 0 or local_tokens % self.block_size:
            error = error or f"{local_tokens} locally computed tokens are not whole blocks of {self.block_size}"
            first_block = max(local_tokens, 0) // self.block_size
        lists = per_group(block_ids)
        try:
            entries = self.groups.entries(end_block, min(first_block, end_block))
            blocks = tuple(self.groups.select(lists, *entries).tolist())
        except LayoutError as problem:
            error = error or f"{problem} for {tokens} tokens"
            blocks = tuple(b for group in lists for b in group[first_block:end_block] if b)
        self._meta.recv.append(RecvSpec(req_id, request.transfer_id, request.consumer.remote, first_block, blocks,
                                        tokens, error))

    def build_step(self, scheduled: Iterable[Scheduled], computes: bool = True) -> StepMeta:
        """This step's metadata: queued RecvSpecs and aborts, and a SendStep for every producer request
        computing prompt tokens in this step (``computes``: any request computes tokens in it). Resets the
        queue."""
        meta = self._meta
        meta.computes = computes
        meta.holding = any(r.ids_coming and r.held_until is not None and not r.handed for r in self._requests.values())
        for item in scheduled:
            request = self._requests.get(item.req_id)
            if request is None or request.consumer is not None:
                continue
            if item.resumed or not request.handed:
                request.blocks = [list(group) for group in item.new_blocks or ()]
            elif item.new_blocks:
                if not request.blocks:
                    request.blocks = [[] for _ in item.new_blocks]
                for mine, new in zip(request.blocks, item.new_blocks):
                    mine.extend(new)
            before = item.num_computed_tokens
            if before >= request.num_prompt_tokens:
                continue  # decoding on the prefill instance: only prompt KV is sent
            after = min(before + item.num_scheduled_tokens, request.num_prompt_tokens)
            blocks = tuple(map(tuple, request.blocks))
            meta.send.append(SendStep(item.req_id, request.transfer_id, blocks, before, after,
                                      request.num_prompt_tokens, item.resumed and request.handed))
            request.handed = True
        self._meta = StepMeta()
        return meta

    def request_finished(self, req_id: str, ok: bool) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks?, kv_transfer_params for the output). A producer request the
        worker has seen keeps its blocks until the worker reports it settled; its params tell a
        proxy that sends the decode request afterwards where to get the KV."""
        request = self._requests.pop(req_id, None)
        if request is None:
            return False, None
        self._ids_in.pop(request.transfer_id, None)
        if request.consumer is not None:
            if request.issued and req_id not in self._received:
                self._meta.recv_aborted.append(req_id)  # vLLM keeps the blocks until finished_recving
            self._received.discard(req_id)
            return False, None
        delay = request.handed
        self._meta.send_finished.append(FinishedSend(req_id, request.transfer_id, ok, delay))
        if delay:
            self._pending_send.add(req_id)
        params = None
        if ok and self.local is not None:
            params = decode_request_params(request.transfer_id, self.local.host, self.local.port,
                                           self.local.cluster_id)
            if self.bootstrap is not None:  # the Mooncake shape too, for a prefill-first router that relays it
                params["remote_bootstrap_addr"] = self.bootstrap.url
                params["remote_engine_id"] = self.bootstrap.engine_id
        return delay, params

    def connector_output(self, finished_sending: Iterable[str] = (), finished_recving: Iterable[str] = ()) -> None:
        self._pending_send.difference_update(finished_sending)
        for req_id in finished_recving:
            if req_id in self._requests:
                self._received.add(req_id)

    def has_pending_push_work(self) -> bool:
        return bool(self._pending_send)


def _local_transfer_id(name: str, req_id: str) -> str:
    candidate = f"{name}-{req_id}"
    if len(candidate.encode("utf-8")) <= MAX_TRANSFER_ID_BYTES:
        return candidate
    return f"{name[:32]}-{hashlib.blake2b(req_id.encode('utf-8'), digest_size=16).hexdigest()}"
