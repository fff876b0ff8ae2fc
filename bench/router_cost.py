#!/usr/bin/env python3
"""What placing one request costs the router (kvrouter), step by step, beside what any proxy pays anyway.

    python bench/router_cost.py                       # hashing, index matches, placement; JSON lines
    python bench/router_cost.py --tokenizer DIR       # and tokenizing text with the model's tokenizer

Per prompt length (128, 512, 2048, 8192 tokens; 32-token blocks, vLLM's default sha256): the request body's
JSON decode and encode (``json``: every proxy pays it twice), the block hashes (``hash``), matching them
against the index of each of N instances holding 100 000 blocks (``match``), the placement decision over N
candidates (``place``), and - with ``--tokenizer`` - the text's tokenization (``tokenize``). One JSON line per
(step, length, instances): median and p99 microseconds over the repetitions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvrouter.core.hashing import BlockHasher  # noqa: E402
from kvrouter.core.index import PrefixIndex  # noqa: E402
from kvrouter.core.placement import Candidate, Policy, Prompt, place  # noqa: E402

LENGTHS = (128, 512, 2048, 8192)
INSTANCES = (2, 8, 32)
BLOCK = 32


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e6)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def emit(step: str, length: int, instances: int, cost: tuple[float, float]) -> None:
    print(json.dumps({"workload": "ROUTER-COST", "case": step, "prompt_tokens": length, "instances": instances,
                      "p50_us": round(cost[0], 1), "p99_us": round(cost[1], 1)}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--tokenizer", default=None, help="a model directory with tokenizer files")
    args = parser.parse_args()
    rng = random.Random(1)
    hasher = BlockHasher(BLOCK)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    for length in LENGTHS:
        ids = [rng.randrange(3, 32000) for _ in range(length)]
        body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 16, "stream": True})
        emit("json", length, 0, timed(lambda body=body: json.dumps(json.loads(body)), args.reps))
        emit("hash", length, 0, timed(lambda ids=ids: hasher.block_hashes(ids), args.reps))
        hashes = hasher.block_hashes(ids)
        if tokenizer is not None:
            text = tokenizer.decode(ids[: min(length, 2048)] if tokenizer.vocab_size > 32000 else
                                    [i % tokenizer.vocab_size for i in ids])
            emit("tokenize", length, 0, timed(lambda text=text: tokenizer(text, add_special_tokens=True),
                                              max(20, args.reps // 10)))
        for count in INSTANCES:
            indexes = []
            for i in range(count):
                index = PrefixIndex(200_000)
                index.store(rng.randrange(1 << 64) for _ in range(100_000))
                if i == 0:
                    index.store(hashes[: len(hashes) // 2])
                indexes.append(index)
            def match_all(hashes: list[int] = hashes, indexes: list[PrefixIndex] = indexes) -> list[int]:
                return [index.match(hashes) for index in indexes]
            emit("match", length, count, timed(match_all, args.reps))
            candidates = [Candidate(f"http://10.0.0.{i}:8000", True, True, indexes[i].match(hashes), i % 3, 0)
                          for i in range(count)]
            emit("place", length, count, timed(lambda length=length, candidates=candidates: place(
                Prompt(length, BLOCK), candidates, Policy()), args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
