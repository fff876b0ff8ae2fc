"""KvpushConnector with timestamps, for bench/vllm_bench.py: the same connector, and a trace of when each
step's forward pass ran and when a transfer was reported landed. And ``TracingConnector``: a connector that moves
nothing, for the single instance, with the same clock points (see its docstring).

    KVTransferConfig(kv_connector="TimedKvpushConnector", kv_connector_module_path="bench.vllm_timed_connector",
                     ...)   # with the repository root on PYTHONPATH

Environment (read once, in the worker):
- ``KVPUSH_BENCH_TRACE``: a file this worker appends JSON lines to (nothing is traced without it).
- ``KVPUSH_BENCH_CONTROL``: a file whose content, read at every step that sends KV, is ``pipelined``
  (default) or ``serial``. ``serial`` keeps ``save_kv_layer`` from pushing, so ``wait_for_save`` pushes
  every layer after the forward pass (the connector's own path for a model whose layers never reach
  ``save_kv_layer``): the same transfer, with no overlap, on the same servers.

Trace lines (``time.monotonic()``, which is one clock for every process of a Linux host):
- prefill, one per step that computes prompt tokens of a request being sent:
  ``{"ev": "step", "t_bind": .., "t_first_layer": .., "t_last_layer": .., "t_forward_end": ..,
  "mode": "pipelined"|"serial", "sends": n, "pushes_pipelined": d, "pushes_after_forward": d, "pushes_deferred": d}``
  (``t_bind``: metadata bound, just before the forward; ``t_forward_end``: ``wait_for_save`` entered,
  every layer computed; the push counters are this step's increments of the connector's stats).
- prefill, scheduler side, one per request it held for its decode's block ids, when it lets it run:
  ``{"ev": "held", "t": .., "held_ms": .., "ids_in": true|false}`` (``ids_in``: released by the ids,
  else by the hold's bound).
- prefill, whenever the bytes its pushes were asked to move grew: ``{"ev": "bytes", "t": .., "total": ..}`` (the
  connector's ``producer.bytes_pushed``, cumulative: what every layer of every block pushed so far takes; the
  benchmark's servers run with ``--disable-log-stats``, so vLLM's ``/metrics`` do not carry it).
- scheduler side, both roles: ``{"ev": "seen", "t": .., "side": "prefill"|"decode"}`` when its scheduler first asks
  about a request that sends (prefill) or expects (decode) a prefill's KV: it came through vLLM's front end;
- decode: ``{"ev": "ids", "t": ..}`` when a step hands the worker requests to receive (their block ids go to the
  prefill from there), and
  ``{"ev": "landed", "t": .., "reqs": [..]}`` at the first hook call that reports them in
  ``finished_recving`` (the decode engine steps continuously while a request waits, so this is within
  one empty step of the landing notification).

kvpush's own time: every hook vLLM calls is timed around ``KvpushConnector``'s own code into a clock per process
(``hooks_ms``: the time spent in hooks so far; vLLM runs the scheduler and the worker in processes of their own, so
each side has its clock). The prefill's scheduler writes it on ``seen``, on ``{"ev": "built", "t": ..}`` (the step
that sends a request was built) and on ``{"ev": "finished", "t": ..}`` (``request_finished``: it let the request
go); its worker on ``step``, twice: ``hooks_ms_bind`` (before the forward) and ``hooks_ms`` (at its end), with
``save_ms`` and ``save_cpu_ms`` (``wait_for_save``'s time, and its thread's CPU time in it: the rest is waiting for
the core or the GIL), and on
``{"ev": "reported", "t": .., "by_hook_ms": {..}}`` (the step's last hook, ``build_connector_worker_meta``,
returned: the step's ``wait_for_save`` and reports are done; ``by_hook_ms``: the time in each hook since the
forward's end). The difference between two lines of one side is kvpush's own time between them.

The bookkeeping costs one ``time.monotonic()`` per layer, two ``time.perf_counter()`` per hook call and one
buffered line per sending step.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from kvpush.integrations.vllm import KvpushConnector, KvpushMetadata

# every hook vLLM calls on a connector, scheduler side then worker side
HOOKS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "has_pending_push_work",
         "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
         "get_transfer_results", "get_finished", "build_connector_worker_meta", "get_kv_connector_stats")
_BY_HOOK: dict[str, float] = dict.fromkeys(HOOKS, 0.0)  # seconds this process spent in each hook


def _clocked(name: str) -> Any:
    """``KvpushConnector.<name>``, its time added to ``_BY_HOOK``."""
    hook = getattr(KvpushConnector, name)

    def clocked(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            _BY_HOOK[name] += time.perf_counter() - start

    clocked.__name__ = clocked.__qualname__ = name
    return clocked


def hooks_ms() -> float:
    """The time this process spent in the connector's hooks so far (ms)."""
    return round(sum(_BY_HOOK.values()) * 1e3, 3)


class _ClockedConnector(KvpushConnector):
    """``KvpushConnector`` with every hook of ``HOOKS`` timed into ``_SPENT``."""


for _name in HOOKS:
    setattr(_ClockedConnector, _name, _clocked(_name))


class TimedKvpushConnector(_ClockedConnector):
    """``KvpushConnector`` plus the trace described in the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        trace = os.environ.get("KVPUSH_BENCH_TRACE")
        self._trace: IO[str] | None = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115
        self._control = os.environ.get("KVPUSH_BENCH_CONTROL")
        self._step: dict[str, Any] | None = None
        self._serial = False
        self._before: dict[str, int] = {}
        self._held: dict[str, float] = {}  # scheduler: request id -> when it was first held
        self._seen: set[str] = set()  # decode scheduler: requests whose "seen" line was written
        self._bytes_written = 0  # prefill worker: the bytes_pushed of its last "bytes" line
        self._reporting = False  # prefill worker: a sending step's forward ended, its reports are due
        self._at_forward_end: dict[str, float] = {}  # _BY_HOOK when it did

    def _write(self, record: dict[str, Any]) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps(record) + "\n")

    def _mode(self) -> str:
        if not self._control:
            return "pipelined"
        try:
            with open(self._control) as control:
                return "serial" if control.read().strip() == "serial" else "pipelined"
        except OSError:
            return "pipelined"

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        released = self._scheduler.stats["held_ids_in"] if self._scheduler is not None else 0
        params = getattr(request, "kv_transfer_params", None) or {}
        side = "decode" if params.get("do_remote_prefill") else "prefill" if params.get("do_remote_decode") else None
        if side is not None and request.request_id not in self._seen:
            self._seen.add(request.request_id)
            self._write({"ev": "seen", "t": time.monotonic(), "side": side, "hooks_ms": hooks_ms()})
            if len(self._seen) > 4096:
                self._seen.clear()
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        now = time.monotonic()
        if answer[0] is None:
            self._held.setdefault(request.request_id, now)
        elif request.request_id in self._held and self._scheduler is not None:
            ids_in = self._scheduler.stats["held_ids_in"] > released
            self._write({"ev": "held", "t": now, "held_ms": round((now - self._held.pop(request.request_id)) * 1e3, 2),
                         "ids_in": ids_in})
        return answer

    def build_connector_meta(self, scheduler_output: Any) -> KvpushMetadata:
        meta = super().build_connector_meta(scheduler_output)
        if meta.step is not None and meta.step.send:
            self._write({"ev": "built", "t": time.monotonic(), "hooks_ms": hooks_ms()})
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        answer = super().request_finished(request, block_ids)
        if (getattr(request, "kv_transfer_params", None) or {}).get("do_remote_decode"):
            self._write({"ev": "finished", "t": time.monotonic(), "hooks_ms": hooks_ms()})
        return answer

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        now = time.monotonic()
        step = connector_metadata.step if isinstance(connector_metadata, KvpushMetadata) else None
        if step is not None and step.send:
            mode = self._mode()
            self._serial = mode == "serial"
            self._before = self.stats()
            self._step = {"ev": "step", "t_bind": now, "t_first_layer": None, "t_last_layer": None,
                          "mode": mode, "sends": len(step.send), "hooks_ms_bind": hooks_ms()}
        if step is not None and step.recv:
            self._write({"ev": "ids", "t": now, "n": len(step.recv)})
        super().bind_connector_metadata(connector_metadata)

    def build_connector_worker_meta(self) -> Any:
        meta = super().build_connector_worker_meta()
        if self._reporting:  # the last hook of a step that sent: its reports are out
            self._reporting = False
            by_hook = {name: round((_BY_HOOK[name] - self._at_forward_end[name]) * 1e3, 3) for name in HOOKS
                       if _BY_HOOK[name] > self._at_forward_end[name]}
            self._write({"ev": "reported", "t": time.monotonic(), "hooks_ms": hooks_ms(), "by_hook_ms": by_hook})
        return meta

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self._step is not None:
            now = time.monotonic()
            if self._step["t_first_layer"] is None:
                self._step["t_first_layer"] = now
            self._step["t_last_layer"] = now
            if self._serial:
                return  # wait_for_save pushes every layer after the forward
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step["t_forward_end"] = time.monotonic()
            step["hooks_ms"] = hooks_ms()
            self._at_forward_end = dict(_BY_HOOK)
        cpu = time.thread_time()
        super().wait_for_save()
        if step is not None:  # what the hook took, and how much of it was this thread's CPU (the rest: waiting)
            step["save_ms"] = round((_BY_HOOK["wait_for_save"] - self._at_forward_end["wait_for_save"]) * 1e3, 3)
            step["save_cpu_ms"] = round((time.thread_time() - cpu) * 1e3, 3)
            after = self.stats()
            for key in ("pushes_pipelined", "pushes_after_forward", "pushes_deferred"):
                name = f"producer.{key}"
                step[key] = after.get(name, 0) - self._before.get(name, 0)
            self._write(step)
            self._reporting = True

    def _landed(self, recving: set[str] | None) -> None:
        if recving:
            self._write({"ev": "landed", "t": time.monotonic(), "reqs": sorted(recving)})
        pushed = self.stats().get("producer.bytes_pushed", 0)
        if pushed != self._bytes_written:
            self._bytes_written = pushed
            self._write({"ev": "bytes", "t": time.monotonic(), "total": pushed})

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        self._landed(results.finished_recving)
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        self._landed(recving)
        return sending, recving

    def shutdown(self) -> None:
        super().shutdown()
        if self._trace is not None:
            self._trace.close()
            self._trace = None


class _TraceMeta(KVConnectorMetadata):
    """The scheduler's word to the worker: this step computes a new request's prompt."""

    def __init__(self, prompt: bool) -> None:
        self.prompt = prompt


class TracingConnector(KVConnectorBase_V1):
    """A connector that moves nothing and only writes the single instance's side of the trace, with the same
    clock points as ``TimedKvpushConnector``'s prefill: ``{"ev": "seen", "t": .., "side": "single"}`` when its
    scheduler first asks about a request, and ``{"ev": "step", "t_bind": .., "t_forward_end": .., "hooks_ms": ..}``
    for a step that computes a new request's prompt (``t_bind``: metadata bound, just before the forward;
    ``t_forward_end``: ``wait_for_save`` entered; ``hooks_ms``: this worker's time in this class's hooks so far).
    So bench/vllm_bench.py can split a single instance's time to first token into the same phases as a prefill's.

        KVTransferConfig(kv_connector="TracingConnector", kv_connector_module_path="bench.vllm_timed_connector",
                         kv_role="kv_both")

    Its scheduler answers that nothing is cached outside, so vLLM computes every request as it would without it;
    and it hands nothing off (``requires_kv_delivery`` False), so a preempted request is treated as without it. A
    connector still makes vLLM hash every request's blocks and carry its metadata through each step: what that
    costs is ``bench/vllm_bench.py --cases single-plain``. A prompt computed in several chunks (a longer prompt
    than the step's token budget) has its first chunk's step stamped only.
    """

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        trace = os.environ.get("KVPUSH_BENCH_TRACE")
        self._trace: IO[str] | None = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115
        self._seen: set[str] = set()
        self._step: dict[str, Any] | None = None
        self._spent = 0.0  # seconds in this class's worker hooks

    def _write(self, record: dict[str, Any]) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps(record) + "\n")

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id not in self._seen:
            self._seen.add(request.request_id)
            self._write({"ev": "seen", "t": time.monotonic(), "side": "single"})
            if len(self._seen) > 4096:
                self._seen.clear()
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _TraceMeta(bool(scheduler_output.scheduled_new_reqs))

    # worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        now = time.monotonic()
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, _TraceMeta) and connector_metadata.prompt:
            self._step = {"ev": "step", "t_bind": now}
        self._spent += time.monotonic() - now

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        now = time.monotonic()
        step, self._step = self._step, None
        if step is not None:
            step["t_forward_end"] = now
            self._spent += time.monotonic() - now
            step["hooks_ms"] = round(self._spent * 1e3, 3)
            self._write(step)

    def shutdown(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None
