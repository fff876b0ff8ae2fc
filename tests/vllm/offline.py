"""Run vLLM's offline engine (CPU build) on a local model with greedy decoding, single process.

    taskset -c 1 python tests/vllm/offline.py /tmp/tiny-llama [--kv-role kv_both] [--json]

The settings are the ones measured to work on this kind of host (../shared/VLLM_NOTES.md): float32,
eager, block size 32 (the CPU attention backend needs a multiple of 32), in-process engine core and
``uni`` executor (~7 s start-up instead of ~30 s). ``engine_env()`` sets the environment vLLM reads
at import time, so call it (or run this file) before importing vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

PROMPTS = (
    "The cache",
    "Every layer of the model is pushed to the decode engine while the prefill computes",
    "A river in the north; a garden in the south: morning light, evening light, quiet, loud, open, close. "
    "The first request was slow, the next one fast, and every block of every layer went over the link.",
)


def engine_env(kv_cache_gib: int = 1, omp_core: str = "1") -> None:
    """Environment for one small CPU engine pinned to ``omp_core``; existing values win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_core)


def engine_kwargs(model: str, kv_transfer_config: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=1024,
        max_num_seqs=8,
        distributed_executor_backend="uni",
        seed=0,
    )
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    kwargs.update(overrides)
    return kwargs


def greedy(max_tokens: int = 16) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kv-role", default=None, help="load kvpush's connector with this kv_role")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    engine_env()
    started = time.monotonic()
    from vllm import LLM

    imported = time.monotonic()
    kv_config = None
    if args.kv_role:
        kv_config = {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.integrations.vllm",
                     "kv_role": args.kv_role}
    llm = LLM(**engine_kwargs(args.model, kv_config))
    ready = time.monotonic()
    outputs = llm.generate(list(PROMPTS), greedy(args.max_tokens))
    done = time.monotonic()
    rows = [{"prompt_tokens": len(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
             "text": o.outputs[0].text, "num_cached_tokens": o.num_cached_tokens} for o in outputs]
    summary = {"import_s": round(imported - started, 2), "startup_s": round(ready - imported, 2),
               "generate_s": round(done - ready, 2), "outputs": rows}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"import {summary['import_s']} s, engine start-up {summary['startup_s']} s, "
              f"generate {summary['generate_s']} s")
        for row in rows:
            print(f"  {row['prompt_tokens']:4d} prompt tokens -> {row['tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
