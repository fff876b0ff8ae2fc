"""The SGLang-free core of kvpush's SGLang transfer backend: how SGLang's KV pool is registered as kvpush
blocks, which blocks a prefill rank writes to a decode rank, the backend's two wire messages and its
settings. Pure (no SGLang, torch, sockets or threads); it shares with vLLM's connector the tensor-parallel
maths of ``..topology`` (``Sharding``, ``Leg``) and the cluster ids and engine options of ``..config`` rather
than copying them.

SGLang's MHA pool keeps one buffer per layer for K and one for V (``KVArgs.kv_data_ptrs``: K layers, then V
layers), each ``[tokens, local_heads, head_dim]``, addressed by page (``page_size`` tokens). One head of one
token is the smallest contiguous piece a rank of another tensor-parallel size may need, so every buffer is
registered as ``tokens * local_heads`` kvpush blocks of one head each (token ``t``, local head ``h`` -> block
``t * local_heads + h``); a prefill rank writes a decode rank the heads they share (``overlap``) of every
token of the pages it was sent, computed with numpy; kvpush merges touching blocks into runs, so with equal
TP sizes a page moves as one run per buffer. MLA pools have one latent "head" every rank holds whole.

A model may keep state beside that pool (``KVArgs.state_types``; ``StatePool``), and two kinds of it move with
the KV, after the room's last chunk:

- ``SWA``: a sliding-window model's window layers keep their own sub-pool, with pages of their own; it is
  registered as the KV pool is (``PoolLayout``), and the pages both sides name for the window (SGLang computes
  them on each side: the page-aligned window before the prompt's end) are paired from the end
  (``families.pair_tail``);
- ``MAMBA``: a hybrid model's recurrent state (Mamba, GDN, ...): one entry per state tensor and layer, each a
  buffer of slots (one per request); entries of one slot size are one registered cache, and a room moves one
  slot (the prefill's request's) into one slot (the decode's). Equal tensor-parallel sizes only.

Any other state (DSA indexers, QSA, block scales, DeepSeek-V4's rings) is refused at start-up, named.
"""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpush import AUTH_TOKEN_ENV, MAX_MESSAGE_BYTES, is_loopback

from ..config import ConnectorConfig, ParamsError, derive_cluster_id
from ..families import pair_tail
from ..topology import Leg, Sharding, TopologyError

__all__ = [
    "AbortedRooms", "BACKEND_NAME", "BackendSettings", "Done", "LayoutError", "MODEL_ID", "PoolLayout",
    "PrefillRank", "REGISTER_ROOM", "Registration", "SlotGroup", "StatePool", "cluster_id_of", "decode_done",
    "decode_state_indices", "encode_done", "encode_state_indices", "incompatibility", "overlap", "prefill_ranks",
    "slab_ids", "state_model_ids", "state_pools", "state_pushes",
]

BACKEND_NAME = "kvpush"  # the value of --disaggregation-transfer-backend
MODEL_ID = 0  # the KV pool's blocks cache: BlocksCacheKey(cluster_id, MODEL_ID); state pools' follow it (1, 2, ..)
REGISTER_ROOM = b"None"  # SGLang's first frame of a decode rank's registration (its other messages carry a room)
_DONE_MAGIC = b"KSD1"  # kvpush-SGLang done, version 1
_DONE_HEADER = struct.Struct("<4sQII")  # magic, room, prefill rank, number of aux buffers


class LayoutError(ValueError):
    """A KV pool kvpush cannot register or two pools it cannot move KV between; says which value."""


@dataclass(frozen=True)
class PoolLayout:
    """One rank's KV pool as kvpush registers it: ``buffers`` buffers of ``pages`` pages of ``page_size``
    tokens, each token ``local_heads`` slabs of ``slab_bytes``; the rank is ``tp_rank`` of ``tp_size``
    sharding ``total_heads`` heads (MLA: ``mla``, one latent head every rank holds)."""

    buffers: int
    pages: int
    page_size: int
    local_heads: int
    slab_bytes: int
    total_heads: int
    tp_size: int
    tp_rank: int
    mla: bool = False

    @classmethod
    def of(cls, kv_args: Any, tp_size: int, tp_rank: int, mla: bool, data_lens: Any = None,
           item_lens: Any = None) -> PoolLayout:
        """From SGLang's ``KVArgs`` (its buffers' and pages' byte counts, page size, KV heads); refuses pools
        whose buffers differ (a draft model's pool beside the target's) or whose pages do not cut into head
        slabs. ``data_lens``/``item_lens``: another pool's buffers of the same heads (an SWA sub-pool's)."""
        data_lens = list(kv_args.kv_data_lens if data_lens is None else data_lens)
        item_lens = list(kv_args.kv_item_lens if item_lens is None else item_lens)
        page_size = int(kv_args.page_size)
        local_heads = int(getattr(kv_args, "kv_head_num", 1) or 1)
        total_heads = int(getattr(kv_args, "total_kv_head_num", 1) or 1)
        if not data_lens or len(data_lens) != len(item_lens):
            raise LayoutError(f"{len(data_lens)} KV buffers with {len(item_lens)} page sizes")
        if len(set(data_lens)) != 1 or len(set(item_lens)) != 1:
            raise LayoutError(f"KV buffers of different sizes ({sorted(set(data_lens))} bytes, pages of "
                              f"{sorted(set(item_lens))} bytes): kvpush registers one page size per pool (a "
                              f"speculative draft model's KV beside the target's is not supported yet)")
        if mla:
            local_heads, total_heads = 1, 1
        data_len, item_len = int(data_lens[0]), int(item_lens[0])
        slabs = page_size * local_heads
        if page_size < 1 or local_heads < 1 or item_len < 1 or item_len % slabs or data_len % item_len:
            raise LayoutError(f"pages of {item_len} bytes in buffers of {data_len} bytes do not cut into "
                              f"{page_size} tokens x {local_heads} heads")
        layout = cls(len(data_lens), data_len // item_len, page_size, local_heads, item_len // slabs, total_heads,
                     tp_size, tp_rank, mla)
        try:
            if layout.sharding().local != local_heads:
                raise LayoutError(f"{local_heads} KV heads on this rank; {total_heads} over {tp_size} ranks "
                                  f"would be {layout.sharding().local}")
        except TopologyError as error:
            raise LayoutError(str(error)) from None
        return layout

    @property
    def blocks(self) -> int:
        """kvpush blocks per buffer: one per head of every token."""
        return self.pages * self.page_size * self.local_heads

    def sharding(self) -> Sharding:
        return Sharding(self.total_heads, 1 if self.mla else self.tp_size)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, body: Any) -> PoolLayout:
        if not isinstance(body, Mapping):
            raise LayoutError(f"a pool layout is an object, got {type(body).__name__}")
        try:
            numbers = {key: int(body[key]) for key in ("buffers", "pages", "page_size", "local_heads", "slab_bytes",
                                                        "total_heads", "tp_size", "tp_rank")}
            layout = cls(**numbers, mla=bool(body["mla"]))
        except (KeyError, TypeError, ValueError) as error:
            raise LayoutError(f"bad pool layout {body!r}: {error}") from None
        if min(layout.buffers, layout.pages, layout.page_size, layout.local_heads, layout.slab_bytes,
               layout.total_heads, layout.tp_size) < 1 or not 0 <= layout.tp_rank < layout.tp_size:
            raise LayoutError(f"bad pool layout {body!r}")
        return layout


@dataclass(frozen=True)
class SlotGroup:
    """Mamba state entries of one slot size, registered as one cache: ``entries`` buffers (the KVArgs entries
    ``members``) of ``slots`` slots of ``slot_bytes``."""

    members: tuple[int, ...]
    slots: int
    slot_bytes: int


@dataclass(frozen=True)
class StatePool:
    """One of a model's state components (``KVArgs.state_types[i]``) as kvpush registers it: ``kind`` ``SWA``
    (``window``: its sub-pool's layout) or ``MAMBA`` (``groups``: its entries by slot size)."""

    kind: str
    window: PoolLayout | None = None
    groups: tuple[SlotGroup, ...] = ()

    @property
    def caches(self) -> int:
        """Registered caches: one for a window sub-pool, one per slot size of a state."""
        return 1 if self.kind == "SWA" else len(self.groups)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "window": self.window.to_wire() if self.window else None,
                "groups": [[list(g.members), g.slots, g.slot_bytes] for g in self.groups]}

    @classmethod
    def from_wire(cls, body: Any) -> StatePool:
        try:
            kind = str(body["kind"])
            window = PoolLayout.from_wire(body["window"]) if body.get("window") is not None else None
            groups = tuple(SlotGroup(tuple(int(m) for m in members), int(slots), int(size))
                           for members, slots, size in body["groups"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise LayoutError(f"bad state pool {body!r}: {error}") from None
        if kind not in ("SWA", "MAMBA") or (kind == "SWA") != (window is not None) or (kind == "MAMBA" and not groups):
            raise LayoutError(f"bad state pool {body!r}")
        return cls(kind, window, groups)

    def describe(self) -> str:
        if self.window is not None:
            return f"SWA ({self.window.buffers} buffers of {self.window.pages} pages)"
        return "MAMBA (" + ", ".join(f"{len(g.members)} x {g.slots} slots of {g.slot_bytes} bytes"
                                     for g in self.groups) + ")"


def _kind(state_type: Any) -> str:
    return str(getattr(state_type, "name", state_type)).rsplit(".", 1)[-1].upper()


def state_pools(kv_args: Any, tp_size: int, tp_rank: int) -> tuple[StatePool, ...]:
    """The state components of SGLang's ``KVArgs`` as kvpush registers them; raises LayoutError naming a component
    that does not move (yet) or whose buffers do not cut into its pages or slots."""
    pools = []
    types = list(getattr(kv_args, "state_types", None) or [])
    for index, state_type in enumerate(types):
        kind = _kind(state_type)
        data_lens = [int(n) for n in kv_args.state_data_lens[index]]
        item_lens = [int(n) for n in kv_args.state_item_lens[index]]
        if kind == "SWA":
            window = PoolLayout.of(kv_args, tp_size, tp_rank, False, data_lens, item_lens)
            pools.append(StatePool("SWA", window))
        elif kind == "MAMBA":
            if not data_lens or len(data_lens) != len(item_lens) or any(
                    size < 1 or total % size for total, size in zip(data_lens, item_lens)):
                raise LayoutError(f"state pool {index} (MAMBA): buffers of {sorted(set(data_lens))} bytes do not cut "
                                  f"into slots of {sorted(set(item_lens))} bytes")
            by_shape: dict[tuple[int, int], list[int]] = {}
            for entry, (total, size) in enumerate(zip(data_lens, item_lens)):
                by_shape.setdefault((total // size, size), []).append(entry)
            pools.append(StatePool("MAMBA", None, tuple(SlotGroup(tuple(members), slots, size)
                                                        for (slots, size), members in by_shape.items())))
        else:
            raise LayoutError(f"this model keeps a {kind} state pool beside its KV (state component {index} of "
                              f"{[_kind(t) for t in types]}); kvpush moves SWA and MAMBA state pools only, so far")
    return tuple(pools)


def encode_state_indices(indices: list[Any]) -> bytes:
    """A side's state indices (one list per state pool, None where it has none) for a message."""
    return json.dumps([None if part is None else np.asarray(part, np.int64).ravel().tolist()
                       for part in indices]).encode()


def decode_state_indices(data: bytes) -> list[np.ndarray[Any, Any] | None]:
    """Raises LayoutError for anything but ``encode_state_indices``' output."""
    try:
        parts = json.loads(data)
        if not isinstance(parts, list):
            raise TypeError("not a list")
        return [None if part is None else np.asarray(part, np.int64) for part in parts]
    except (ValueError, TypeError) as error:
        raise LayoutError(f"bad state indices: {error}") from None


def state_model_ids(states: tuple[StatePool, ...]) -> list[list[int]]:
    """The blocks-cache model ids of each state pool's caches (the KV pool's is ``MODEL_ID``; theirs follow it, in
    order), as both sides derive them: a prefill pushes into a decode's cache by that id."""
    ids, next_id = [], MODEL_ID + 1
    for pool in states:
        ids.append(list(range(next_id, next_id + pool.caches)))
        next_id += pool.caches
    return ids


def state_pushes(prefill: StatePool, decode: StatePool, src: Any, dst: Any,
                 leg: Leg | None) -> list[tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """What one state component of a room moves: (cache within the component, src block ids, dst block ids) for
    the prefill's indices ``src`` and the decode's ``dst`` (SGLang's state indices of each side): a window's pages
    paired from the end, this rank's heads of every token of them (``leg``: the window sub-pools' ``overlap``); a
    state's one slot in every slot size. Raises LayoutError for indices that do not fit."""
    src, dst = np.asarray(src, np.int64).ravel(), np.asarray(dst, np.int64).ravel()
    if prefill.kind == "SWA":
        assert prefill.window is not None and decode.window is not None
        src, dst = pair_tail(src, dst)
        if leg is None or not len(src):
            return []
        return [(0, *slab_ids(leg, src, dst, prefill.window, decode.window))]
    if len(src) != 1 or len(dst) != 1:
        raise LayoutError(f"a MAMBA state moves one slot per side; the prefill names {len(src)}, the decode "
                          f"{len(dst)}")
    for side, slot, pool in (("prefill", int(src[0]), prefill), ("decode", int(dst[0]), decode)):
        if any(not 0 <= slot < group.slots for group in pool.groups):
            raise LayoutError(f"the {side}'s MAMBA slot {slot} is outside its {pool.describe()}")
    return [(index, src, dst) for index in range(len(prefill.groups))]


def incompatibility(prefill: PoolLayout, decode: PoolLayout, prefill_states: tuple[StatePool, ...] = (),
                     decode_states: tuple[StatePool, ...] = ()) -> str | None:
    """Why the decode's pool cannot take the prefill's KV (each differing value named on both sides), or
    None. Different tensor-parallel sizes are bridged head by head (a window sub-pool's too); a recurrent state
    moves between equal ones only; nothing else is bridged."""
    problems = _differences(prefill, decode, "KV")
    kinds = [pool.kind for pool in prefill_states], [pool.kind for pool in decode_states]
    if kinds[0] != kinds[1]:
        problems.append(f"state pools: prefill {kinds[0]}, decode {kinds[1]}")
    else:
        for index, (mine, theirs) in enumerate(zip(prefill_states, decode_states)):
            if mine.window is not None and theirs.window is not None:
                problems += _differences(mine.window, theirs.window, f"SWA state pool {index}")
            elif mine.groups != theirs.groups:
                problems.append(f"MAMBA state pool {index}: prefill {mine.describe()}, decode {theirs.describe()}")
            elif mine.kind == "MAMBA" and prefill.tp_size != decode.tp_size:
                problems.append(f"MAMBA state pool {index}: prefill TP {prefill.tp_size}, decode TP {decode.tp_size} "
                                f"(a recurrent state moves between equal TP sizes only)")
    return "; ".join(problems) or None


def _differences(prefill: PoolLayout, decode: PoolLayout, pool: str) -> list[str]:
    what = {"buffers": "KV buffers (layers x K/V)", "page_size": "page size",
            "slab_bytes": "bytes per head per token (head size x dtype)", "total_heads": "KV heads", "mla": "MLA"}
    if pool != "KV":
        what = {key: f"{pool}: {text.removeprefix('KV ')}" for key, text in what.items()}
    return [f"{text}: prefill {getattr(prefill, key)}, decode {getattr(decode, key)}" for key, text in what.items()
            if getattr(prefill, key) != getattr(decode, key)]


def overlap(prefill: PoolLayout, decode: PoolLayout) -> Leg | None:
    """The heads prefill rank ``prefill.tp_rank`` writes to decode rank ``decode.tp_rank``: those both
    hold (None: none). SGLang's own rank mapping decides which prefill ranks a decode rank hears from;
    when heads are replicated, two prefill ranks may write the same head with the same bytes."""
    if prefill.mla:
        return Leg(prefill.tp_rank, decode.tp_rank, 0, 0, 1)
    src, dst = prefill.sharding(), decode.sharding()
    mine, theirs = src.heads(prefill.tp_rank), dst.heads(decode.tp_rank)
    first, last = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
    if first >= last:
        return None
    return Leg(prefill.tp_rank, decode.tp_rank, first - mine.start, first - theirs.start, last - first)


def _tokens(pages: Any, page_size: int) -> np.ndarray[Any, Any]:
    return (np.asarray(pages, np.int64)[:, None] * page_size + np.arange(page_size, dtype=np.int64)).ravel()


def slab_ids(leg: Leg, src_pages: Any, dst_pages: Any, prefill: PoolLayout,
             decode: PoolLayout) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The kvpush block ids ``leg`` moves for pages ``src_pages`` (prefill) into ``dst_pages`` (decode),
    pairwise: every token of every page, the leg's heads of each (``topology.Leg.block_ids`` over tokens)."""
    return leg.block_ids(_tokens(src_pages, prefill.page_size), _tokens(dst_pages, decode.page_size),
                         prefill.local_heads, decode.local_heads)


def cluster_id_of(host: str, zmq_port: int) -> int:
    """A backend engine's kvpush cluster id: derived from its SGLang rank's control (ZMQ) address, which
    both sides know from SGLang's bootstrap, so a decode can grant a prefill before it links."""
    return derive_cluster_id(host, zmq_port)


@dataclass(frozen=True)
class PrefillRank:
    """A prefill rank as a decode rank knows it from SGLang's bootstrap: its bootstrap server, its control
    (ZMQ) address, where a live rank accepts connections, and the rank number its acknowledgements carry
    (SGLang's ``_prefill_unique_rank``)."""

    bootstrap_addr: str
    host: str
    port: int
    rank: int


def prefill_ranks(bootstrap_addr: str, infos: list[dict[str, Any]]) -> dict[int, PrefillRank]:
    """The prefill ranks of SGLang's bootstrap infos (dummy ranks included: they acknowledge aborts too) by
    kvpush cluster id."""
    ranks = {}
    for info in infos:
        host, port = str(info["rank_ip"]), int(info["rank_port"])
        tp_rank = int(info.get("attn_tp_rank", info.get("tp_rank", 0)) or 0)
        pp_size, pp_rank = int(info.get("pp_size") or 1), int(info.get("pp_rank") or 0)
        cp_size, cp_rank = int(info.get("attn_cp_size") or 1), int(info.get("attn_cp_rank") or 0)
        rank = (tp_rank * pp_size + pp_rank) * cp_size + cp_rank
        ranks[cluster_id_of(host, port)] = PrefillRank(bootstrap_addr, host, port, rank)
    return ranks


@dataclass(frozen=True)
class Registration:
    """What a decode rank tells a prefill rank once, beside SGLang's own registration fields: where its
    kvpush engine listens, its cluster id, its pool and its aux (metadata) buffers' item sizes."""

    host: str
    port: int
    cluster_id: int
    layout: PoolLayout
    aux_item_lens: tuple[int, ...]
    states: tuple[StatePool, ...] = ()

    def encode(self) -> bytes:
        return json.dumps({"v": 1, "host": self.host, "port": self.port, "cluster_id": self.cluster_id,
                           "layout": self.layout.to_wire(), "aux_item_lens": list(self.aux_item_lens),
                           "states": [pool.to_wire() for pool in self.states]}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Registration:
        """Raises LayoutError for anything but a complete registration of version 1."""
        try:
            body = json.loads(data)
            if body.get("v") != 1:
                raise LayoutError(f"registration version {body.get('v')!r}; this side speaks 1")
            return cls(str(body["host"]), int(body["port"]), int(body["cluster_id"]),
                       PoolLayout.from_wire(body["layout"]), tuple(int(n) for n in body["aux_item_lens"]),
                       tuple(StatePool.from_wire(pool) for pool in body.get("states", [])))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise LayoutError(f"bad kvpush registration: {error}") from None


@dataclass(frozen=True)
class Done:
    """Prefill -> decode, delivered by kvpush after the last byte of a room's KV landed: the room, the
    prefill rank, and the request's aux (metadata) row, one bytes per aux buffer."""

    room: int
    prefill_rank: int
    aux: tuple[bytes, ...]


def encode_done(done: Done) -> bytes:
    data = _DONE_HEADER.pack(_DONE_MAGIC, done.room, done.prefill_rank, len(done.aux))
    data += b"".join(struct.pack("<I", len(row)) for row in done.aux) + b"".join(done.aux)
    if len(data) > MAX_MESSAGE_BYTES:
        raise LayoutError(f"the aux (metadata) row of room {done.room} is {len(data)} bytes; a kvpush "
                          f"notification carries {MAX_MESSAGE_BYTES}")
    return data


def decode_done(data: bytes) -> Done:
    """Raises LayoutError for anything but a well-formed ``Done``."""
    try:
        magic, room, rank, count = _DONE_HEADER.unpack_from(data)
        if magic != _DONE_MAGIC:
            raise LayoutError(f"not a kvpush-SGLang done message ({magic!r})")
        offset = _DONE_HEADER.size
        sizes = struct.unpack_from(f"<{count}I", data, offset)
        offset += 4 * count
        if offset + sum(sizes) != len(data):
            raise LayoutError(f"done message of {len(data)} bytes, its rows say {offset + sum(sizes)}")
        rows = []
        for size in sizes:
            rows.append(bytes(data[offset:offset + size]))
            offset += size
        return Done(room, rank, tuple(rows))
    except struct.error as error:
        raise LayoutError(f"bad done message: {error}") from None


@dataclass(frozen=True)
class BackendSettings:
    """The backend's settings, from the environment (SGLang has no per-backend options): ``KVPUSH_TRANSPORT``
    (kvpush's transport: ``auto``, ``cma``, ``tcp``, ``ucx``), ``KVPUSH_AUTH_TOKEN`` (the shared secret every
    link proves; required for a listener another host can reach unless ``KVPUSH_INSECURE=1``),
    ``KVPUSH_SYNC_KV_TIMEOUT_MS`` (kvpush's per-layer deadline), ``KVPUSH_LINK_TIMEOUT_MS``, ``KVPUSH_LOOP_YIELDS``
    (the vLLM connector's ``loop_yields``: kvpush's loop thread runs under ``SCHED_BATCH``; ``1``/``0``)."""

    transport: str = "auto"
    auth_token: str | None = None
    insecure: bool = False
    sync_kv_timeout_ms: int = 5000
    link_timeout_ms: int = 3000
    loop_yields: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BackendSettings:
        env = os.environ if environ is None else environ
        try:
            return cls(env.get("KVPUSH_TRANSPORT", "auto"), env.get(AUTH_TOKEN_ENV) or None,
                       env.get("KVPUSH_INSECURE", "") in ("1", "true", "yes"),
                       int(env.get("KVPUSH_SYNC_KV_TIMEOUT_MS", "5000")),
                       int(env.get("KVPUSH_LINK_TIMEOUT_MS", "3000")),
                       _env_flag(env, "KVPUSH_LOOP_YIELDS"))
        except ValueError as error:
            raise ParamsError(f"kvpush SGLang backend: {error}") from None

    def check_listener(self, host: str) -> None:
        """The vLLM connector's rule: no unauthenticated listener another host can reach, unless asked."""
        if not self.auth_token and not is_loopback(host) and not self.insecure:
            raise ParamsError(
                f"kvpush SGLang backend: the decode's kvpush engine would listen on {host}, which other hosts may "
                f"reach, with no auth token: any of them could link to it and write the KV it grants. Give every "
                f"prefill and decode the same secret in {AUTH_TOKEN_ENV}, or set KVPUSH_INSECURE=1 on a private "
                f"network")

    def engine_options(self, listen: tuple[str, int] | None) -> dict[str, str]:
        config = ConnectorConfig(transport=self.transport, auth_token=self.auth_token,
                                 sync_kv_timeout_ms=self.sync_kv_timeout_ms, link_timeout_ms=self.link_timeout_ms)
        return config.engine_options_for(listen)


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    """An on/off environment variable: ``1``, ``true``, ``yes`` or ``0``, ``false``, ``no``, empty; ValueError
    naming it otherwise."""
    value = env.get(name, "").strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("", "0", "false", "no"):
        return False
    raise ValueError(f"{name}={env[name]!r} is none of 1, true, yes, 0, false, no")


class AbortedRooms:
    """Rooms one side aborted before the other side's part of them arrived, so that what arrives later ends at
    once instead of waiting for SGLang's bootstrap or waiting timeout (300 s): a prefill remembers a room it
    aborted before the decode's destination came, and one the decode aborted before the prefill's request came.
    Bounded: the oldest of more than ``limit`` rooms is forgotten (that room falls back to SGLang's timeouts).
    Not thread-safe: the backend serializes its threads' calls with a lock of its own."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._rooms: OrderedDict[int, str] = OrderedDict()

    def add(self, room: int, reason: str) -> None:
        self._rooms[room] = reason
        self._rooms.move_to_end(room)
        while len(self._rooms) > self.limit:
            self._rooms.popitem(last=False)

    def reason(self, room: int) -> str | None:
        """Why ``room`` was aborted, or None if it was not (or was forgotten)."""
        return self._rooms.get(room)

    def __len__(self) -> int:
        return len(self._rooms)
