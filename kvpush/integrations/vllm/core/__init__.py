"""The vLLM-free core of kvpush's vLLM KV connector: what is sent, when, and what a request waits for.

How a request moves (decode first, prefill pushes layer by layer):

1. A proxy gives one request two sets of ``kv_transfer_params`` sharing a ``transfer_id``: the decode
   instance's (``do_remote_prefill``, the prefill's kvpush address) and the prefill instance's
   (``do_remote_decode``). Either may be scheduled first.
2. Decode scheduler: ``SchedulerBook.matched_tokens`` claims the prompt as loaded asynchronously;
   after vLLM allocated the blocks, ``after_alloc`` turns them into a ``RecvSpec`` for the worker.
3. Decode worker: ``ConsumerBook`` sends the destination block ids to the prefill worker as
   ``BlockIds`` messages and waits for a ``Done`` notification, which the prefill sends after every
   byte landed. Only then is the request reported finished (``take_finished``); a failure, timeout,
   lost link or a prefill's refusal reports its blocks as load errors instead.
4. Prefill worker: ``ProducerBook`` pushes, in every step that computes part of the prompt, the
   blocks that step touches, one layer at a time as ``save_kv_layer`` sees it (``SendStep``). So that
   the ids are there before the first of those steps, the prefill scheduler holds a request whose
   decode sends them (``SchedulerBook.matched_tokens`` answers None) until the workers report them in
   (``ProducerBook.take_ids_in``, carried back in vLLM's worker metadata) or ``ids_wait_ms`` passed.
   Block ids that arrive after the forward pass started are served by a push after it; the prefill
   scheduler delays freeing the blocks (``request_finished`` returns True) until the worker reports
   the transfer settled (``take_finished_sending``).

Everything here is pure: the clock and every effect (pushes, messages) are injected, events come
in as method calls, and every wait has a deadline from ``ConnectorConfig``. The books are not
thread-safe; the adapter calls them from one thread. Message formats are versioned
(``PROTOCOL_VERSION``) and bounded (``MAX_MESSAGE_BYTES``; long block lists are split).

The modules, each importing only those listed after it: ``scheduler`` (``SchedulerBook``),
``producer`` (``ProducerBook``), ``consumer`` (``ConsumerBook``); ``effects`` (what the worker books
ask of the engine, and the clock); ``steps`` (what the scheduler tells the workers each step);
``config`` (``ConnectorConfig``, addresses, cluster ids, ``kv_transfer_params``); ``messages`` (the
wire messages and their codec); ``topology`` (tensor parallelism: heads per rank, legs,
compatibility). Every name is re-exported here; import from the package.
"""

from kvpush import MAX_MESSAGE_BYTES

from ...config import (
    BOOTSTRAP_PORT_ENV,
    IDS_WAIT_MS,
    MAX_TRANSFER_ID_BYTES,
    ROLES,
    Bootstrap,
    ConnectorConfig,
    ConsumerParams,
    ParamsError,
    PeerAddress,
    ProducerParams,
    bootstrap_address,
    bootstrap_answer,
    bootstrap_url,
    decode_request_params,
    derive_cluster_id,
    listen_port,
    new_transfer_id,
    parse_params,
    prefill_request_params,
)
from ...topology import (
    Geometry,
    Leg,
    LegInfo,
    Sharding,
    Target,
    TopologyError,
    dst_ids,
    incompatibility,
    plan_legs,
    targets,
)
from .consumer import ConsumerBook, ConsumerState, Received
from .effects import Clock, ConsumerEffects, ProducerEffects
from .messages import (
    MAX_BLOCKS_PER_TRANSFER,
    MAX_REASON_BYTES,
    PROTOCOL_VERSION,
    Abort,
    BlockIds,
    Done,
    Hello,
    Kind,
    Message,
    MessageError,
    Outcome,
    Welcome,
    block_id_messages,
    decode,
    encode,
)
from .producer import TOMBSTONES, ProducerBook, ProducerState
from .scheduler import IDS_IN_REMEMBERED, IdsHold, Resolve, Scheduled, SchedulerBook
from .steps import FinishedSend, RecvSpec, SendStep, StepMeta, blocks_for, per_group

__all__ = [
    "BOOTSTRAP_PORT_ENV", "Bootstrap", "Resolve", "bootstrap_address", "bootstrap_answer", "bootstrap_url",
    "IDS_IN_REMEMBERED", "IDS_WAIT_MS", "Abort", "BlockIds", "Clock", "ConnectorConfig", "ConsumerBook",
    "ConsumerEffects", "ConsumerParams", "ConsumerState", "Done", "FinishedSend", "Geometry", "Hello", "IdsHold",
    "Kind", "Leg", "LegInfo", "MAX_BLOCKS_PER_TRANSFER", "MAX_MESSAGE_BYTES", "MAX_REASON_BYTES",
    "MAX_TRANSFER_ID_BYTES", "Message", "MessageError", "Outcome", "PROTOCOL_VERSION", "ParamsError", "PeerAddress",
    "ProducerBook", "ProducerEffects", "ProducerParams", "ProducerState", "ROLES", "Received", "RecvSpec",
    "Scheduled", "SchedulerBook", "SendStep", "Sharding", "StepMeta", "TOMBSTONES", "Target", "TopologyError",
    "Welcome", "block_id_messages", "blocks_for", "decode", "decode_request_params", "derive_cluster_id", "dst_ids",
    "encode", "incompatibility", "listen_port", "new_transfer_id", "parse_params", "per_group", "plan_legs",
    "prefill_request_params", "targets",
]
