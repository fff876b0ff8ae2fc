"""Watch vLLM drive KvpushConnector in one process (no peer): which hooks it calls, with what.

    taskset -c 1 python tests/vllm/probe.py /tmp/tiny-llama [--role kv_both] [--json]

Loads the connector by name (a subclass that records every hook call, from this file's module path),
generates greedy tokens for plain prompts (which must equal a run without the connector) and for
one prompt marked ``do_remote_decode`` that no decode ever asks for, so the prefill side holds its
blocks until ``ids_timeout_s`` and then frees them. Prints what was seen.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline import PROMPTS, engine_env, engine_kwargs, greedy  # noqa: E402

from kvpush.integrations.vllm import KvpushConnector  # noqa: E402
from kvpush.integrations.vllm import core as vllm_core  # noqa: E402

CALLS: collections.Counter[str] = collections.Counter()
SEEN: list[dict[str, Any]] = []


def _note(name: str, **details: Any) -> None:
    CALLS[name] += 1
    if details:
        SEEN.append({"hook": name, **details})


class ProbeConnector(KvpushConnector):
    """KvpushConnector that records its hook calls (module-level state: one engine per process)."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        names = list(kv_caches)
        base = kv_caches[names[0]].data_ptr()
        _note("register_kv_caches", layers=[
            {"name": n, "shape": list(t.shape), "dtype": str(t.dtype), "device": str(t.device),
             "contiguous": t.is_contiguous(), "offset": t.data_ptr() - base,
             "storage_offset_bytes": t.storage_offset() * t.element_size(),
             "storage_bytes": t.untyped_storage().nbytes()} for n, t in kv_caches.items()])
        self._first_ptrs = {n: t.data_ptr() for n, t in kv_caches.items()}
        super().register_kv_caches(kv_caches)

    def on_new_request(self, request: Any) -> None:
        _note("on_new_request", req=request.request_id, params=request.kv_transfer_params,
              prompt=request.num_prompt_tokens)
        super().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        _note("get_num_new_matched_tokens", req=request.request_id, num_computed=num_computed_tokens,
              result=list(result))
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        _note("update_state_after_alloc", req=request.request_id, blocks=blocks.get_block_ids()[0],
              external=num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        CALLS["build_connector_meta"] += 1
        if meta.step.send or meta.step.send_finished or meta.step.recv:
            _note("meta", send=[(s.req_id, s.computed_before, s.computed_after, list(s.blocks))
                                for s in meta.step.send],
                  send_finished=[(f.req_id, f.ok, f.delayed) for f in meta.step.send_finished])
        return meta

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        CALLS["bind_connector_metadata"] += 1
        super().bind_connector_metadata(connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        CALLS["save_kv_layer"] += 1
        if kv_layer.data_ptr() != self._first_ptrs.get(layer_name):
            _note("save_kv_layer: tensor differs from the registered one", layer=layer_name)
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        CALLS["wait_for_save"] += 1
        super().wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        CALLS["get_transfer_results"] += 1
        if results.finished_sending or results.finished_recving or results.failed_recving:
            _note("transfer_results", sending=sorted(results.finished_sending),
                  recving=sorted(results.finished_recving), failed=sorted(results.failed_recving),
                  t=round(time.monotonic() - START, 2))
        return results

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        result = super().request_finished(request, block_ids)
        _note("request_finished", req=request.request_id, status=str(request.status), blocks=block_ids,
              result=[result[0], result[1]], t=round(time.monotonic() - START, 2))
        return result

    def update_connector_output(self, connector_output: Any) -> None:
        CALLS["update_connector_output"] += 1
        super().update_connector_output(connector_output)


START = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--role", default="kv_both", choices=vllm_core.ROLES)
    parser.add_argument("--ids-timeout", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    engine_env()
    import probe  # vLLM loads the connector from the module "probe", not from __main__: share its records
    from vllm import LLM, SamplingParams

    kv_config = {"kv_connector": "ProbeConnector", "kv_connector_module_path": "probe", "kv_role": args.role,
                 "kv_connector_extra_config": {"ids_timeout_s": args.ids_timeout}}
    llm = LLM(**engine_kwargs(args.model, kv_config))
    plain = llm.generate(list(PROMPTS), greedy(16))
    report: dict[str, Any] = {"plain": [list(o.outputs[0].token_ids) for o in plain]}
    if args.role != "kv_consumer":
        marked = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": vllm_core.prefill_request_params("probe-t1")})
        started = time.monotonic()
        (out,) = llm.generate([PROMPTS[2]], marked)
        report["marked"] = {"tokens": list(out.outputs[0].token_ids), "kv_transfer_params": out.kv_transfer_params}
        engine = llm.llm_engine
        while time.monotonic() - started < args.ids_timeout + 3 and not any(
                s["hook"] == "transfer_results" and s["sending"] for s in probe.SEEN):
            engine.step()  # the offline engine steps only inside generate(): keep it stepping
        report["freed_after_s"] = round(time.monotonic() - started, 2)
    report["calls"] = dict(probe.CALLS)
    report["seen"] = probe.SEEN
    print(json.dumps(report, indent=None if args.json else 1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
