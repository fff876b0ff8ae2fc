"""Prefill/decode disaggregation with two offline vLLM engines (two processes) over KvpushConnector.

    python tests/vllm/pd_offline.py /tmp/tiny-llama [--order decode-first|prefill-first] [--transport tcp]

Runs a single-instance reference, then a prefill process (``kv_producer``, pinned to core 0) and a
decode process (``kv_consumer``, core 1) on the same prompts with shared transfer ids, and prints per
prompt whether the decode's greedy tokens equal the reference and how many prompt tokens vLLM reports
as cached (the prompt length when the decode used the pushed KV). ``--order`` decides whether the
decode's block ids reach the prefill before its forward pass (pipelined pushes from save_kv_layer)
or after it (one push after the forward). Exit status 0 when every prompt matched and was cached.

Internally ``python pd_offline.py --role prefill|decode ...`` is one engine; the offline engine only
steps inside ``generate()``, so the prefill keeps stepping afterwards until its blocks are released.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from offline import engine_env, engine_kwargs  # noqa: E402

WORDS = "the cache block layer prefill decode push token model engine request memory page tensor head".split()


def prompts() -> list[list[int]]:
    """Token-id prompts of lengths around the 32-token block and one that needs chunked prefill."""
    lengths = [1, 5, 31, 32, 33, 64, 100, 300, 700]
    return [[(7 * n + 13 * i) % 1900 + 50 for i in range(n)] for n in lengths]


ENGINE = dict(max_num_batched_tokens=128, max_num_seqs=8, enable_prefix_caching=True)


def kv_config(role: str, kv_port: int, transport: str, failure_policy: str = "fail") -> dict[str, Any]:
    return {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.integrations.vllm",
            "kv_role": role, "kv_port": kv_port, "kv_load_failure_policy": failure_policy,
            "kv_connector_extra_config": {"transport": transport, "transfer_timeout_s": 30, "ids_timeout_s": 30}}


def run_engine(args: argparse.Namespace) -> int:
    engine_env(omp_core=args.core)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("kvpush").addHandler(handler)
    logging.getLogger("kvpush").setLevel(logging.INFO)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvpush.integrations.vllm import core as vllm_core

    role = {"prefill": "kv_producer", "decode": "kv_consumer", "single": None}[args.role]
    config = kv_config(role, args.kv_port, args.transport, args.failure_policy) if role else None
    started = time.monotonic()
    llm = LLM(**engine_kwargs(args.model, config, **ENGINE))
    ready = time.monotonic() - started
    Path(args.ready).write_text("ready") if args.ready else None
    if args.wait_for:
        while not Path(args.wait_for).exists():
            time.sleep(0.05)
        time.sleep(args.delay)
    items = prompts()
    params = []
    for i, _ in enumerate(items):
        tid = f"pd-{args.run}-{i}"
        if args.role == "prefill":
            extra = vllm_core.prefill_request_params(tid)
            params.append(SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                         extra_args={"kv_transfer_params": extra}))
        else:
            extra = vllm_core.decode_request_params(tid, "127.0.0.1", args.kv_port) if args.role == "decode" else None
            params.append(SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                         extra_args={"kv_transfer_params": extra} if extra else None))
    t0 = time.monotonic()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in items], params)
    generate_s = time.monotonic() - t0
    if args.generated:
        Path(args.generated).write_text("generated")
    if args.role == "prefill":  # keep stepping until the decode took every request's KV
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        deadline = time.monotonic() + 60
        while scheduler.has_requests() and time.monotonic() < deadline:
            llm.llm_engine.step()
    stats = {}
    if role:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        stats = get_kv_transfer_group().stats()
    result = {"role": args.role, "startup_s": round(ready, 2), "generate_s": round(generate_s, 3), "stats": stats,
              "released_s": round(time.monotonic() - t0, 3),
              "outputs": [{"prompt": len(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
                           "cached": o.num_cached_tokens, "finish": o.outputs[0].finish_reason} for o in outputs]}
    Path(args.out).write_text(json.dumps(result))
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def orchestrate(args: argparse.Namespace) -> int:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1")
    options = ["--max-tokens", str(args.max_tokens), "--transport", args.transport, "--run", str(os.getpid()),
               "--failure-policy", args.failure_policy]
    port = free_port()

    def engine(role: str, core: str, *extra: str) -> subprocess.Popen[bytes]:
        log = open(work / f"{role}.log", "wb")
        model = args.prefill_model if role == "prefill" and args.prefill_model else args.model
        command = ["taskset", "-c", core, sys.executable, str(Path(__file__).resolve()), model, *options,
                   "--role", role, "--core", core, "--kv-port", str(port),
                   "--out", str(work / f"{role}.json"), *extra]
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def prefill_up(*extra: str) -> subprocess.Popen[bytes] | None:
        """The prefill, once it is ready; None if it exited first. The port ``free_port`` chose can be taken
        (an outgoing connection's ephemeral port) before the prefill listens on it: then, three times at
        most, another port."""
        nonlocal port
        for _ in range(3):
            prefill = engine("prefill", "0", "--ready", str(work / "prefill.ready"), *extra)
            while not (work / "prefill.ready").exists() and prefill.poll() is None:
                time.sleep(0.1)
            if prefill.poll() is None or (work / "prefill.ready").exists():
                return prefill
            if b"Address already in use" not in (work / "prefill.log").read_bytes():
                break
            port = free_port()
        print(f"the prefill exited before it was ready; see {work / 'prefill.log'}")
        return None

    for name in ("single", "prefill", "decode"):
        for suffix in (".json", ".ready", ".generated"):
            (work / f"{name}{suffix}").unlink(missing_ok=True)
    reference_file = work / "single.json"
    if args.reference and Path(args.reference).exists():
        reference_file = Path(args.reference)
    else:
        if engine("single", "1").wait() != 0:
            print(f"single-instance run failed; see {work / 'single.log'}")
            return 1
    started = time.monotonic()
    if args.order == "decode-first":
        # the decode's ids reach the prefill before its forward pass: pushes from save_kv_layer
        prefill = prefill_up("--wait-for", str(work / "decode.ready"), "--delay", "1.0")
        if prefill is None:
            return 1
        decode = engine("decode", "1", "--ready", str(work / "decode.ready"))
        if args.kill_prefill_after is not None:  # the decode's ids went out; the prefill dies before pushing
            while not (work / "decode.ready").exists() and decode.poll() is None:
                time.sleep(0.05)
            time.sleep(args.kill_prefill_after)
            prefill.kill()
            print(f"killed the prefill {args.kill_prefill_after} s after the decode started generating")
    else:
        # the prefill computes first; the decode's ids arrive after its forward pass (both engines are up
        # first, so process start-up does not count against the prefill's ids_timeout_s)
        prefill = prefill_up("--generated", str(work / "prefill.generated"), "--wait-for", str(work / "decode.ready"))
        if prefill is None:
            return 1
        decode = engine("decode", "1", "--ready", str(work / "decode.ready"), "--wait-for",
                        str(work / "prefill.generated"))
    codes = [decode.wait(timeout=300), prefill.wait(timeout=120)]
    wall = time.monotonic() - started
    if args.kill_prefill_after is not None:
        codes[1] = 0
        (work / "prefill.json").write_text(json.dumps({"startup_s": None, "released_s": None, "stats": "killed"}))
    if any(codes):
        print(f"engines exited with {codes}; see {work}/prefill.log and decode.log")
        return 1
    reference = json.loads(reference_file.read_text())["outputs"]
    decoded = json.loads((work / "decode.json").read_text())
    prefilled = json.loads((work / "prefill.json").read_text())
    print(f"decode generate() took {decoded['generate_s']} s (failure policy {args.failure_policy})")
    print(f"order {args.order}, transport {args.transport}: decode start-up {decoded['startup_s']} s, "
          f"prefill start-up {prefilled['startup_s']} s, wall {wall:.1f} s, prefill released its blocks "
          f"{prefilled['released_s']} s after its generate() began")
    print(f"prefill {prefilled['stats']}\ndecode {decoded['stats']}")
    print("| prompt tokens | tokens equal | cached tokens | decode finish |")
    print("|---|---|---|---|")
    good = True
    rows = []
    for ref, out in zip(reference, decoded["outputs"]):
        equal = ref["tokens"] == out["tokens"]
        # vLLM recomputes a prompt's last token itself; a one-token prompt is all recomputed (0 cached)
        cached_all = out["cached"] >= out["prompt"] - (1 if out["prompt"] == 1 else 0)
        good = good and equal and cached_all
        rows.append({"prompt": out["prompt"], "equal": equal, "cached": out["cached"], "finish": out["finish"]})
        print(f"| {out['prompt']} | {'yes' if equal else 'NO'} | {out['cached']} | {out['finish']} |")
    if args.summary:
        Path(args.summary).write_text(json.dumps({"rows": rows, "good": good, "wall_s": round(wall, 2),
                                                  "decode": decoded, "prefill": prefilled}))
    return 0 if good else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--role", choices=["single", "prefill", "decode"])
    parser.add_argument("--order", choices=["decode-first", "prefill-first"], default="decode-first")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--workdir", default="/tmp/kvpush-pd")
    parser.add_argument("--reference", default=None, help="a single.json from an earlier run")
    parser.add_argument("--prefill-model", default=None, help="negative control: a prefill with other weights")
    parser.add_argument("--kv-port", type=int, default=14579)
    parser.add_argument("--core", default="1")
    parser.add_argument("--out", default=None)
    parser.add_argument("--ready", default=None)
    parser.add_argument("--wait-for", default=None)
    parser.add_argument("--generated", default=None)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--summary", default=None, help="write the comparison as JSON here")
    parser.add_argument("--failure-policy", choices=["fail", "recompute"], default="fail",
                        help="the decode's kv_load_failure_policy")
    parser.add_argument("--kill-prefill-after", type=float, default=None,
                        help="decode-first only: kill the prefill this many seconds after the decode is ready")
    parser.add_argument("--run", default="0")
    args = parser.parse_args(argv)
    return run_engine(args) if args.role else orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
