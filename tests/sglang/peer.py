"""One side of the two-process backend test, run in the SGLang test venv: SGLang's real disaggregation classes
(``get_kv_class`` through kvpush's plugin, SGLang's bootstrap server, its ``Common*`` senders/receivers) over
CPU tensors laid out as SGLang's MHA pool lays them out (``MHATokenToKVPool``: per layer a K and a V buffer of
``[tokens + page_size, kv_heads, head_dim]``, K layers then V layers in ``KVArgs``; page ``p`` holds tokens
``p * page_size ..``), and aux buffers as ``MetadataBuffers`` hands them (one row per request slot).

With ``KVPUSH_TEST_STATE`` a model's state pool sits beside that pool, laid out as SGLang lays it out and named in
``KVArgs.state_*`` as SGLang's ``setup_state_kv_args`` names it: ``swa``, a sliding-window model's window layers'
own MHA sub-pool (``SWAKVPool.swa_kv_pool``: ``SWA_LAYERS`` K buffers then as many V buffers of
``[SWA_TOKENS + page_size, kv_heads, head_dim]``, an item a page); ``mamba``, a hybrid model's recurrent state
(``MambaPool`` through ``HybridLinearKVPool``: per Mamba layer a conv state ``[slots + 1, conv_dim, kernel - 1]`` and
an SSM state ``[slots + 1, heads, head_dim, d_state]``, an item a slot); ``dsa``, a DSA indexer pool kvpush does not
move.

``python peer.py prefill|decode PORT TP_RANK TP_SIZE``: prints one JSON line when ready, then answers JSON
commands on stdin, one per line (see ``Peer.handle``). Nothing of SGLang is stubbed: only what a scheduler
process would have set (its runtime context and parallel ranks) is set here, as SGLang's own tests do.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

import torch  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402

LAYERS, TOTAL_HEADS, HEAD_DIM, PAGE, TOKENS = 3, 4, 16, 4, 256
AUX_ITEMS = (16 * 4, 8 * 4)  # two aux buffers: bytes per row
AUX_SLOTS = 8
SWA_LAYERS, SWA_TOKENS = 2, 128  # a window sub-pool's layers and tokens (SGLang sizes it below the full pool)
MAMBA_LAYERS, SLOTS = 2, 8  # Mamba layers; state slots (one per running request)
MAMBA_SHAPES = ((24, 3), (2, 8, 16))  # conv: conv_dim x (kernel - 1); SSM: heads x head_dim x d_state


def prefill_kv(layer: int, head: int) -> torch.Tensor:
    """The prefill's content of one buffer's global head: deterministic, different everywhere."""
    generator = torch.Generator().manual_seed(1000 * layer + head)
    return torch.randn(TOKENS + PAGE, HEAD_DIM, generator=generator).to(torch.bfloat16)


def prefill_state(entry: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The prefill's content of one Mamba state entry (every slot of it)."""
    generator = torch.Generator().manual_seed(50_000 + entry)
    return torch.randn(SLOTS + 1, *shape, generator=generator)


class Peer:
    def __init__(self, role: str, port: int, tp_rank: int, tp_size: int) -> None:
        self.role, self.tp_rank, self.tp_size = role, tp_rank, tp_size
        get_context().override_server_args(disaggregation_bootstrap_port=port, host="127.0.0.1",
                                           disaggregation_mode=role, tp_size=tp_size).install()
        get_parallel().override_permanently(attn_tp_rank=tp_rank, attn_cp_rank=0, attn_dp_rank=0, tp_rank=tp_rank,
                                            attn_tp_size=tp_size, attn_dcp_rank=0, pp_group=None)
        backend = TransferBackend("kvpush")
        self.server = None
        if role == "prefill" and tp_rank == 0:
            self.server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
        local = max(1, TOTAL_HEADS // tp_size)
        first = (tp_rank // max(1, tp_size // TOTAL_HEADS)) * local
        self.heads = range(first, first + local)
        self.k = [self._buffer(layer, 0) for layer in range(LAYERS)]
        self.v = [self._buffer(layer, 1) for layer in range(LAYERS)]
        buffers = self.k + self.v
        self.aux = [torch.zeros(AUX_SLOTS, size, dtype=torch.uint8) for size in AUX_ITEMS]
        args = KVArgs()
        args.engine_rank = tp_rank
        args.pp_rank = 0
        args.system_dp_rank = 0
        args.rust_http_port = None
        args.kv_cache_dtype_str = "bfloat16"
        args.kv_layout = None
        args.prefill_start_layer = 0
        args.prefill_end_layer = LAYERS
        args.kv_data_ptrs = [b.data_ptr() for b in buffers]
        args.kv_data_lens = [b.nbytes for b in buffers]
        args.kv_item_lens = [b[0].nbytes * PAGE for b in buffers]
        args.num_draft_entries = 0
        args.kv_layer_ids = list(range(LAYERS)) * 2
        args.kv_head_num = local
        args.total_kv_head_num = TOTAL_HEADS
        args.page_size = PAGE
        args.aux_data_ptrs = [a.data_ptr() for a in self.aux]
        args.aux_data_lens = [a.nbytes for a in self.aux]
        args.aux_item_lens = [a[0].nbytes for a in self.aux]
        args.ib_device = None
        args.gpu_id = 0
        for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "state_layer_ids",
                     "state_dim_per_tensor", "state_slice_outer_counts", "state_conv_shard_groups"):
            setattr(args, name, [])
        args.is_hybrid_mla_backend = False
        args.swa_kv_cache_layout = None
        self.state = os.environ.get("KVPUSH_TEST_STATE", "")
        self.state_buffers = self._state_pool(args)
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        self.manager = get_kv_class(backend, KVClassType.MANAGER)(args, mode, get_context().server_args, False)
        self.backend = backend
        self.rooms: dict[int, Any] = {}

    def _state_pool(self, args: KVArgs) -> list[torch.Tensor]:
        """The ``KVPUSH_TEST_STATE`` pool's buffers, named in ``args`` as SGLang's ``append_state_component`` does."""
        from sglang.srt.disaggregation.base.conn import StateType

        if not self.state:
            return []
        if self.state == "swa":
            buffers = [self._buffer(100 + layer, kv, SWA_TOKENS) for kv in (0, 1) for layer in range(SWA_LAYERS)]
            kind, items = StateType.SWA, [b[0].nbytes * PAGE for b in buffers]
            args.swa_kv_cache_layout = "nhd"
        elif self.state == "mamba":
            buffers = []
            for _ in range(MAMBA_LAYERS):
                for shape in MAMBA_SHAPES:
                    entry = len(buffers)
                    buffers.append(prefill_state(entry, shape) if self.role == "prefill"
                                   else torch.zeros(SLOTS + 1, *shape))
            kind, items = StateType.MAMBA, [b[0].nbytes for b in buffers]
        else:
            buffers = [torch.zeros(TOKENS + PAGE, 64, dtype=torch.uint8)]
            kind, items = StateType(self.state), [64 * PAGE]
        args.state_types = [kind]
        args.state_data_ptrs = [[b.data_ptr() for b in buffers]]
        args.state_data_lens = [[b.nbytes for b in buffers]]
        args.state_item_lens = [items]
        args.state_layer_ids = [[]]
        args.state_dim_per_tensor = [[0] * len(buffers)]
        args.state_slice_outer_counts = [[1] * len(buffers)]
        args.state_conv_shard_groups = [[]]
        return buffers

    def _buffer(self, layer: int, kv: int, tokens: int = TOKENS) -> torch.Tensor:
        if self.role == "decode":
            return torch.zeros(tokens + PAGE, len(self.heads), HEAD_DIM, dtype=torch.bfloat16)
        return torch.stack([prefill_kv(2 * layer + kv, head)[:tokens + PAGE] for head in self.heads],
                           dim=1).contiguous()

    # -- commands ------------------------------------------------------------------------------------
    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        return getattr(self, f"op_{op}")(**{k: v for k, v in command.items() if k != "op"})

    def op_receive(self, room: int, pages: list[int], aux: int, bootstrap: str,  # noqa: PLR0913
                   metadata: bool = True, state: list[list[int] | None] | None = None) -> dict[str, Any]:
        """Decode: a receiver for ``room`` (SGLang's order: parallel info, init, metadata; without ``metadata``,
        as SGLang's prealloc queue holds it before it has pages: ``op_send_metadata`` sends them)."""
        deadline = time.monotonic() + 10
        while not self.manager.try_ensure_parallel_info(bootstrap):
            if time.monotonic() > deadline:
                return {"error": "no parallel info"}
            time.sleep(0.05)
        receiver = get_kv_class(self.backend, KVClassType.RECEIVER)(mgr=self.manager, bootstrap_addr=bootstrap,
                                                                     bootstrap_room=room)
        self.before = [b.clone() for b in self.k + self.v]  # what "written elsewhere" compares with
        self.state_before = [b.clone() for b in self.state_buffers]
        self.rooms[room] = (receiver, pages, aux)
        self.room_state = {**getattr(self, "room_state", {}), room: state}
        receiver.init(0)
        if metadata:
            self.op_send_metadata(room)
        return {"status": int(receiver.poll())}

    def op_send_metadata(self, room: int) -> dict[str, Any]:
        receiver, pages, aux = self.rooms[room]
        state = self.room_state.get(room)
        receiver.send_metadata(np.asarray(pages, dtype=np.int32), aux,
                               None if state is None else [None if s is None else np.asarray(s) for s in state])
        return {"status": int(receiver.poll())}

    def op_open(self, room: int, pages: list[int], aux: int, bootstrap: str) -> dict[str, Any]:
        """Prefill: a sender for ``room``, as SGLang's bootstrap queue makes it, without waiting for the decode."""
        sender = get_kv_class(self.backend, KVClassType.SENDER)(mgr=self.manager, bootstrap_addr=bootstrap,
                                                                 bootstrap_room=room)
        sender.init(len(pages), aux)
        self.rooms[room] = (sender, pages, aux)
        return {"status": int(sender.poll())}

    def op_send(self, room: int, pages: list[int], aux: int, bootstrap: str, chunks: int = 1,  # noqa: PLR0913
                fill_aux: int = 7, hold: int = 0, abort: bool = False, stall: float = 0,
                state: list[list[int] | None] | None = None) -> dict[str, Any]:
        """Prefill: a sender for ``room``; once the decode's metadata is in, send ``pages`` in ``chunks``, all
        but the last ``hold`` of them (``op_send_rest`` sends those); with ``abort``, abort the room right after.
        ``stall``: kvpush's loop thread does not run for that long first (as on a loaded host), so what the
        scheduler hands it meanwhile runs in one go: pushes queued and cancelled before they started."""
        sender = get_kv_class(self.backend, KVClassType.SENDER)(mgr=self.manager, bootstrap_addr=bootstrap,
                                                                 bootstrap_room=room)
        sender.init(len(pages), aux)
        self.rooms[room] = (sender, pages, aux)
        deadline = time.monotonic() + 10
        while sender.poll() == KVPoll.Bootstrapping:
            if time.monotonic() > deadline:
                return {"error": "decode never sent its metadata", "status": int(sender.poll())}
            time.sleep(0.01)
        for i, buffer in enumerate(self.aux):
            buffer[aux] = torch.arange(buffer.shape[1], dtype=torch.uint8) + fill_aux + i
        parts = np.array_split(np.asarray(pages, dtype=np.int32), chunks)
        if stall:
            self.manager.portal.call_soon(time.sleep, stall)
        state_indices = None if state is None else [None if s is None else np.asarray(s) for s in state]
        for index, part in enumerate(parts[:chunks - hold]):
            sender.send(part, state_indices if index == chunks - 1 else None)
        if abort:
            sender.abort()
        self.held = parts[chunks - hold:]
        return {"status": int(sender.poll())}

    def op_stall(self, seconds: float) -> dict[str, Any]:
        """kvpush's loop thread does not run for ``seconds`` (as on a loaded host): what SGLang's threads hand it
        meanwhile waits, and runs in one go after."""
        self.manager.portal.call_soon(time.sleep, seconds)
        return {}

    def op_send_rest(self, room: int) -> dict[str, Any]:
        sender = self.rooms[room][0]
        for part in self.held:
            sender.send(part)
        return {"status": int(sender.poll())}

    def op_wait(self, room: int, timeout: float) -> dict[str, Any]:
        endpoint = self.rooms[room][0]
        started = time.monotonic()
        status = endpoint.poll()
        while status not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() - started < timeout:
            time.sleep(0.01)
            status = endpoint.poll()
        reply: dict[str, Any] = {"status": int(status), "seconds": time.monotonic() - started}
        if status == KVPoll.Failed:
            try:
                endpoint.failure_exception()
            except Exception as error:  # noqa: BLE001 - the reason is the answer
                reply["reason"] = str(error)
        return reply

    def op_check(self, room: int, src_pages: list[int], src_tp_size: int, fill_aux: int = 7) -> dict[str, Any]:
        """Decode: do the room's pages hold the prefill's KV of ``src_pages`` (every head this rank holds),
        and its aux slot the prefill's row?"""
        _, pages, aux = self.rooms[room]
        mismatches = 0
        offsets = np.arange(PAGE)
        dst_tokens = (np.asarray(pages)[:, None] * PAGE + offsets).ravel()
        src_tokens = (np.asarray(src_pages)[:, None] * PAGE + offsets).ravel()
        for index, buffer in enumerate(self.k + self.v):
            layer, kv = index % LAYERS, index // LAYERS
            for local, head in enumerate(self.heads):
                expected = prefill_kv(2 * layer + kv, head)[src_tokens]
                mismatches += int((buffer[dst_tokens, local] != expected).any())
        aux_ok = all(bool((a[aux] == torch.arange(a.shape[1], dtype=torch.uint8) + fill_aux + i).all())
                     for i, a in enumerate(self.aux))
        pages_of = [b.view(-1, PAGE, *b.shape[1:]) for b in self.k + self.v]
        before = [b.view(-1, PAGE, *b.shape[1:]) for b in self.before]
        others = [p for p in range(TOKENS // PAGE) if p not in pages]
        return {"mismatched_buffers": mismatches, "aux_ok": aux_ok,
                "written_elsewhere": sum(int(not torch.equal(a[others], b[others])) for a, b in zip(pages_of, before)),
                "room_untouched": all(torch.equal(a[pages], b[pages]) for a, b in zip(pages_of, before))}

    def op_check_state(self, room: int, src: list[int]) -> dict[str, Any]:
        """Decode: does the room's state hold the prefill's state ``src`` (the prefill's SWA pages, paired from the
        end with this side's, every head this rank holds; or its Mamba slot), and is every other page or slot of
        the state pool as it was?"""
        dst = np.asarray((self.room_state.get(room) or [None])[0])
        src_ids = np.asarray(src)
        mismatched, elsewhere = 0, 0
        if self.state == "swa":
            count = min(len(src_ids), len(dst))
            src_ids, dst = src_ids[len(src_ids) - count:], dst[len(dst) - count:]
            offsets = np.arange(PAGE)
            dst_tokens = (dst[:, None] * PAGE + offsets).ravel()
            src_tokens = (src_ids[:, None] * PAGE + offsets).ravel()
            for index, buffer in enumerate(self.state_buffers):
                layer, kv = 100 + index % SWA_LAYERS, index // SWA_LAYERS
                for local, head in enumerate(self.heads):
                    expected = prefill_kv(2 * layer + kv, head)[src_tokens]
                    mismatched += int((buffer[dst_tokens, local] != expected).any())
            written = dst_tokens
        else:
            for entry, buffer in enumerate(self.state_buffers):
                expected = prefill_state(entry, tuple(buffer.shape[1:]))[int(src_ids[0])]
                mismatched += int(not torch.equal(buffer[int(dst[0])], expected))
            written = dst
        for buffer, before in zip(self.state_buffers, self.state_before):
            keep = torch.ones(buffer.shape[0], dtype=torch.bool)
            keep[torch.as_tensor(written)] = False
            elsewhere += int(not torch.equal(buffer[keep], before[keep]))
        return {"mismatched": mismatched, "written_elsewhere": elsewhere}

    def op_abort(self, room: int) -> dict[str, Any]:
        endpoint = self.rooms[room][0]
        endpoint.abort()
        return {"status": int(endpoint.poll())}

    def op_released(self, room: int, prefill_ranks: int = 1, timeout: float = 10) -> dict[str, Any]:
        """Decode: whether every prefill rank acknowledged the aborted room drained (SGLang's deferred KV
        release: only then may the decode reuse its pages), and how long it took."""
        started = time.monotonic()
        while not self.manager.is_abort_release_safe(room, prefill_ranks):
            if time.monotonic() - started > timeout:
                return {"released": False, "seconds": timeout}
            time.sleep(0.01)
        self.manager.clear_deferred_abort_state(room)
        return {"released": True, "seconds": time.monotonic() - started}

    def op_clear(self, room: int) -> dict[str, Any]:
        endpoint = self.rooms.pop(room)[0]
        endpoint.clear()
        return {}

    def op_links(self, at_least: int = 1, timeout: float = 10) -> dict[str, Any]:
        """The kvpush links this peer holds, once there are ``at_least`` (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        manager = self.manager

        async def count() -> int:
            return len(manager.dd.links)
        while (links := manager.portal.run(count(), timeout=5)) < at_least and time.monotonic() < deadline:
            time.sleep(0.02)
        return {"links": links}

    def op_close_links(self) -> dict[str, Any]:
        """Reset this peer's kvpush links; the process lives on (a dropped connection)."""
        manager = self.manager

        async def close_links() -> int:
            links = list(manager.dd.links.values())
            for link in links:
                link.close("dropped by the test", abort=True)
            return len(links)
        return {"closed": manager.portal.run(close_links(), timeout=5)}

    def op_exit_links_first(self, linger: float) -> dict[str, Any]:
        """Exit as a dying process can be seen to: its kvpush links close (reset) first, its control (ZMQ) socket
        only ``linger`` seconds later, with the process (``os._exit``: nothing is finalized or said)."""
        closed = self.op_close_links()
        threading.Timer(linger, os._exit, (0,)).start()
        return closed

    def op_loop_policy(self) -> dict[str, Any]:
        """The scheduling policy of kvpush's loop thread (``KVPUSH_LOOP_YIELDS``)."""
        async def policy() -> int:
            return os.sched_getscheduler(0)
        return {"policy": self.manager.portal.run(policy(), timeout=5)}

    def op_stats(self) -> dict[str, Any]:
        """What the manager still holds: rooms, grants, pushes (a leak shows here)."""
        manager = self.manager

        async def count() -> dict[str, int]:
            return {"grants": sum(len(g) for g in manager._grants.values()), "pushes": len(manager._pushes),
                    "room_prefills": len(manager._room_prefills), "outstanding": len(manager._staging_outstanding),
                    "transfer_infos": len(getattr(manager, "transfer_infos", {})),
                    "watches": len(manager._prefill_watches) + len(manager._decode_watches)}
        counts = manager.portal.run(count(), timeout=5)
        return {"request_status": len(manager.request_status), **counts}


def main() -> None:
    role, port, tp_rank, tp_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    peer = Peer(role, port, tp_rank, tp_size)
    print(json.dumps({"ready": True, "cluster_id": peer.manager.cluster_id}), flush=True)
    for line in sys.stdin:
        try:
            reply = peer.handle(json.loads(line))
        except Exception as error:  # noqa: BLE001 - reported to the test, which fails on it
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)
    peer.manager.teardown()
    if peer.server is not None:
        peer.server.close()


if __name__ == "__main__":
    main()
