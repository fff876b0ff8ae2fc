"""The runs behind issue 31: P/D stacks whose instances share this host's two cores, each in its own session
(or all in this one, ``--same-session``), and N requests one at a time through ``kvpush proxy``.

    python docs/perf/issue31-sessions/pd_sessions.py fleet MODEL_DIR WORKDIR [-n 20]      # 2 prefills + 1 decode
    python docs/perf/issue31-sessions/pd_sessions.py tp MODEL_DIR WORKDIR --ptp 2 --dtp 1  # one TP prefill, decode

MODEL_DIR: ``python -m kvpush.cli.tiny_model MODEL_DIR``. Prints, per request: status, seconds, prompt tokens,
the tokens the decode reports cached (the prompt's length when its KV came from the prefill), and a summary.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "vllm"))

import serving  # noqa: E402
from serving import KV_CONNECTOR, MODEL_NAME, Server, free_port, post, start_proxy, start_vllm, wait_healthy  # noqa: E402


def _same_session() -> None:
    """Start every server in this script's session (one scheduler group), as the tests once did."""
    def spawn(name: str, command: Any, env: Any, log: Path, url: str) -> Server:
        handle = open(log, "ab")
        process = subprocess.Popen(list(command), env=dict(env), stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, process_group=0)
        return Server(name, url, process, log, handle)
    serving._spawn = spawn  # type: ignore[attr-defined]


def _config(role: str, port: int) -> dict[str, Any]:
    config: dict[str, Any] = {**KV_CONNECTOR, "kv_role": role, "kv_port": port}
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = "recompute"
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=("fleet", "tp"))
    parser.add_argument("model", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("-n", type=int, default=20)
    parser.add_argument("--ptp", type=int, default=2)
    parser.add_argument("--dtp", type=int, default=1)
    parser.add_argument("--same-session", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.same_session:
        _same_session()
    servers: list[Server] = []
    try:
        if args.shape == "fleet":
            kv = [free_port(2), free_port(2)]
            servers += [start_vllm("prefill1", args.model, "0", _config("kv_producer", kv[0]), args.work),
                        start_vllm("prefill2", args.model, "1", _config("kv_producer", kv[1]), args.work),
                        start_vllm("decode", args.model, "1", _config("kv_consumer", free_port(2)), args.work)]
            prefills = [f"{servers[i].url}#kv=127.0.0.1:{kv[i]}" for i in (0, 1)]
        else:
            kv = [free_port(4)]
            servers += [start_vllm("prefill", args.model, "0|1" if args.ptp == 2 else "0",
                                   _config("kv_producer", kv[0]), args.work, tp=args.ptp),
                        start_vllm("decode", args.model, "0|1" if args.dtp == 2 else "1",
                                   _config("kv_consumer", free_port(4)), args.work, tp=args.dtp)]
            prefills = [f"{servers[0].url}#kv=127.0.0.1:{kv[0]}"]
        print(f"healthy in {wait_healthy(servers, 400):.0f} s", flush=True)
        proxy = start_proxy("proxy", prefills, [servers[-1].url], args.work)
        servers.append(proxy)
        rng = random.Random(5)
        loaded = 0
        for i in range(args.n):
            prompt = [rng.randrange(50, 1900) for _ in range(rng.randrange(40, 300))]
            started = time.monotonic()
            status, body = post(f"{proxy.url}/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8,
                                                                "temperature": 0}, timeout=120)
            cached = ((body.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            loaded += status == 200 and cached == len(prompt)
            print(i, status, f"{time.monotonic() - started:.2f}s", len(prompt), cached, flush=True)
        print(f"{loaded} of {args.n} with the prompt's KV loaded", flush=True)
    finally:
        for server in servers:
            server.stop(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
