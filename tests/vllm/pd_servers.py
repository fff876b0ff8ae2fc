"""Drive a prefill and a decode ``vllm serve`` (OpenAI API) with KvpushConnector, like a proxy would.

    python tests/vllm/pd_servers.py --prefill http://127.0.0.1:18100 --decode http://127.0.0.1:18200 \
        --bootstrap http://127.0.0.1:8998 [--reference single.json] [--concurrent]

Each request goes to both servers at once with a shared transfer id, in the Mooncake contract's shape: to the
prefill with ``do_remote_decode`` and ``max_tokens=1``, to the decode with ``do_remote_prefill``,
``remote_bootstrap_addr`` (the prefill's bootstrap server, ``VLLM_MOONCAKE_BOOTSTRAP_PORT``) and
``remote_engine_id`` (from its ``GET /query``, asked once). Prints per
prompt the decode's tokens against a single-instance reference (pd_offline.py's prompts and
``single.json``) and the prompt tokens the decode reports as cached (``--enable-prompt-tokens-details``).
Standard library only (urllib), so it runs from any Python.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pd_offline import prompts  # noqa: E402


def post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def engine_id(bootstrap: str) -> str:
    """The prefill's engine id, as routers learn it: its bootstrap server's ``GET /query``."""
    with urllib.request.urlopen(f"{bootstrap}/query", timeout=10) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return str(answer["0"]["engine_id"])


def one(prefill: str, decode: str, model: str, prompt: list[int], max_tokens: int,  # noqa: PLR0913
        bootstrap: str, engine: str) -> dict[str, Any]:
    tid = f"xfer-{uuid.uuid4()}"
    common = {"model": model, "prompt": prompt, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        to_decode = pool.submit(post, f"{decode}/v1/completions", {
            **common, "max_tokens": max_tokens,
            "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": tid, "remote_bootstrap_addr": bootstrap,
                                   "remote_engine_id": engine}})
        to_prefill = pool.submit(post, f"{prefill}/v1/completions", {
            **common, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}})
        decoded, prefilled = to_decode.result(), to_prefill.result()
    choice = decoded["choices"][0]
    details = (decoded.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"prompt": len(prompt), "tokens": choice.get("token_ids"), "finish": choice.get("finish_reason"),
            "cached": details.get("cached_tokens"), "latency_s": round(time.monotonic() - started, 3),
            "prefill_params": prefilled.get("kv_transfer_params")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--bootstrap", required=True, help="the prefill's bootstrap server, http://HOST:PORT")
    parser.add_argument("--model", default=None, help="served model name (default: the decode's first model)")
    parser.add_argument("--reference", default=None)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--concurrent", action="store_true", help="all prompts at once")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        with urllib.request.urlopen(f"{args.decode}/v1/models", timeout=10) as response:
            model = json.loads(response.read())["data"][0]["id"]
    items = prompts()
    engine = engine_id(args.bootstrap)

    def run(prompt: list[int]) -> dict[str, Any]:
        return one(args.prefill, args.decode, model, prompt, args.max_tokens, args.bootstrap, engine)

    if args.concurrent:
        with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
            rows = list(pool.map(run, items))
    else:
        rows = [run(p) for p in items]
    reference = json.loads(Path(args.reference).read_text())["outputs"] if args.reference else None
    good = True
    print("| prompt tokens | tokens equal | cached tokens | finish | latency s |")
    print("|---|---|---|---|---|")
    for i, row in enumerate(rows):
        equal = reference is not None and reference[i]["tokens"] == row["tokens"]
        good = good and (equal or reference is None) and row["finish"] == "length"
        print(f"| {row['prompt']} | {'yes' if equal else 'NO' if reference else '?'} | {row['cached']} | "
              f"{row['finish']} | {row['latency_s']} |")
    print("prefill's kv_transfer_params (first request):", json.dumps(rows[0]["prefill_params"]))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
