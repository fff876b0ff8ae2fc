"""A single-instance reference (one offline vLLM engine, no connector) for token-id prompts and chats.

    taskset -c 1 python tests/vllm/single_reference.py MODEL --requests in.json --out out.json

``in.json``: ``{"prompts": [[ids...], ...], "chats": [[{"role": ..., "content": ...}, ...], ...],
"chat_template": "...", "max_tokens": 12, "max_num_batched_tokens": 64}`` (every key but ``prompts``
optional). Writes ``{"prompts": [{"prompt_ids", "tokens", "finish"}...], "chats": [...]}``: greedy
tokens (``ignore_eos``) with the engine settings of tests/vllm/offline.py. Chats are rendered by vLLM's
own chat path (``LLM.chat`` with the template), as ``vllm serve`` renders /v1/chat/completions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from offline import engine_env, engine_kwargs  # noqa: E402


def _rows(outputs: Any) -> list[dict[str, Any]]:
    return [{"prompt_ids": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
             "finish": o.outputs[0].finish_reason} for o in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--requests", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--core", default="1")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.requests).read_text())
    engine_env(omp_core=args.core)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(args.model, None, enable_prefix_caching=True,
                              max_num_batched_tokens=spec.get("max_num_batched_tokens", 128)))
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 12), ignore_eos=True)
    result: dict[str, Any] = {"prompts": _rows(llm.generate([TokensPrompt(prompt_token_ids=p)
                                                              for p in spec["prompts"]], params))}
    if spec.get("chats"):
        result["chats"] = _rows(llm.chat(spec["chats"], params, chat_template=spec.get("chat_template")))
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
