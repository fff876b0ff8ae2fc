"""What the router serves and how it decides (``ProxyConfig``), checked once. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpush.fleet import parse_discovery

from .core.hashing import BlockHasher
from .core.index import DEFAULT_CAPACITY
from .core.kv_events import Source
from .core.placement import Policy
from .core.pools import Prefill, SpecError

DEFAULT_TIMEOUT_S = 600.0
ACCEPT_TIMEOUT_S = 5.0  # a healthy vLLM answers a streamed request's head within milliseconds
RETRY_FOR_S = 30.0
PREFILL_GRACE_S = 2.0  # after the decode answered, how long a prefill's answer may still come (then cancelled)
MAX_BODY_BYTES = 32 << 20  # far above a 128k-token prompt as JSON (~1 MB); images inline may need more
# A prefill whose kvpush engine does not answer within KV_PROBE_TIMEOUT_S gets no request until it does: a
# decode sent to it would wait for a link it cannot make (its own link timeout is 3 s)
KV_PROBE_S = 1.0
KV_PROBE_TIMEOUT_S = 1.5
GUESS_BLOCK_SIZE = 16  # the guessed indexes' block size while no instance said its own


@dataclass(frozen=True)
class ProxyConfig:
    """What ``kvpush proxy`` serves. ``prefills`` compute prompts for the ``decodes``; ``both`` (vLLM
    instances with ``kv_role`` ``kv_both``) may do either, request by request. ``timeout_s`` bounds a client's
    request from its arrival to the last byte of the answer; ``accept_timeout_s`` how long a prefill may take
    to accept its copy; ``retry_for_s`` how long a request waits for a decode to accept it;
    ``prefill_grace_s`` how long a prefill may still run after the decode answered. ``policy`` places each
    request (``kvrouter.core.placement``); ``block_size``, ``hash_algorithm`` and ``hash_seed`` are the
    instances' prefix-cache settings (``block_size`` None: learnt from their KV events); ``sources`` says where
    an instance publishes its KV events (by URL; the others are asked); ``follow_events`` False: every
    index is guessed from the requests sent; ``tokenizer``: where to load the model's tokenizer ("auto": the one
    the instances serve, if its files are on this host; None: the instances tokenize; ``kvrouter.tokens``);
    ``chat_template``: the chat template the instances were given (``--chat-template``: its text), else the
    tokenizer's own renders chats here."""

    prefills: Sequence[Prefill]
    decodes: Sequence[str]  # base URLs
    both: Sequence[Prefill] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    prefill_grace_s: float = PREFILL_GRACE_S
    accept_timeout_s: float = ACCEPT_TIMEOUT_S
    retry_for_s: float = RETRY_FOR_S
    api_key: str | None = None  # clients must send it (Authorization: Bearer)
    upstream_api_key: str | None = None  # what the upstreams get instead of the client's Authorization
    max_body_bytes: int = MAX_BODY_BYTES
    discovery: str | None = None  # etcd://HOST:PORT[,...]: the fleet's registry
    kv_probe_s: float = KV_PROBE_S  # how often each prefill's kvpush side is probed (0: never)
    kv_probe_timeout_s: float = KV_PROBE_TIMEOUT_S  # a probe unanswered this long holds the prefill out
    policy: Policy = field(default_factory=Policy)
    block_size: int | None = None
    hash_algorithm: str = "sha256"
    hash_seed: str | None = None
    sources: Mapping[str, Source] = field(default_factory=dict)
    follow_events: bool = True
    index_capacity: int = DEFAULT_CAPACITY
    tokenizer: str | None = "auto"
    chat_template: str | None = None
    warm_links: bool = False  # each prefill-decode pair carries a warm-up request first (``kvrouter.warm``)

    def __post_init__(self) -> None:
        if self.discovery is not None:
            parse_discovery(self.discovery)  # FleetError (a ValueError) naming what is wrong
        elif not (self.prefills or self.both) or not (self.decodes or self.both):
            raise SpecError("a proxy needs prefills and decodes (or instances that do both), or a fleet to "
                            "discover them in")
        if not (self.timeout_s > 0 and self.accept_timeout_s > 0 and self.prefill_grace_s >= 0
                and self.retry_for_s >= 0):
            raise SpecError(f"timeout {self.timeout_s} and accept timeout {self.accept_timeout_s} must be > 0, "
                            f"prefill grace {self.prefill_grace_s} and retry window {self.retry_for_s} >= 0")
        if not (self.kv_probe_s >= 0 and self.kv_probe_timeout_s > 0):
            raise SpecError(f"kv probe interval {self.kv_probe_s} must be >= 0 and its timeout "
                            f"{self.kv_probe_timeout_s} > 0")
        if self.max_body_bytes < 1:
            raise SpecError(f"max body size {self.max_body_bytes} must be >= 1 byte")
        if self.index_capacity < 1 or self.policy.pd_min_tokens < 0 or self.policy.prefill_queue < 1 \
                or self.policy.waste < 1 or self.policy.request_tokens < 0:
            raise SpecError(f"index capacity {self.index_capacity} and the policy {self.policy} are out of range")
        BlockHasher(self.block_size or GUESS_BLOCK_SIZE, self.hash_algorithm, self.hash_seed)  # HashConfigError
