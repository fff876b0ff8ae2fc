#!/usr/bin/env python3
"""What opening and closing a request's blocks costs a decode (``CacheManager.allow`` / ``BlockAccess.revoke``:
``kvpush.access.BlockGrants``), against the size of the cache it opens them in.

    python bench/grants.py

A serving engine's pool is one cache of millions of blocks (SGLang: a block per token and KV head), and every
request opens a few thousand of them before its KV comes and closes them after; the SGLang backend does it on
SGLang's scheduler thread's path. For caches of 16 Ki, 1 Mi and 8 Mi blocks and requests of 256 and 4096 blocks
(scattered over the cache, as a pool's free list hands them out), one JSON line each: the p50 of a grant and its
revocation together, of a check of a frame's runs against them (``check_us``: one run per block, as scattered
blocks give; ``check_runs_of_16_us``: the same number of blocks granted in one stretch and checked as runs of 16
blocks), and, as the limit, numpy touching the same blocks once (``counts[blocks] += 1``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvpush.access import BlockGrants  # noqa: E402

BLOCK_BYTES, REPS = 64, 200


def p50_us(action: Callable[[], object]) -> float:
    times = []
    for _ in range(REPS):
        started = time.perf_counter_ns()
        action()
        times.append(time.perf_counter_ns() - started)
    return round(statistics.median(times) / 1000, 2)


def case(cache_blocks: int, request_blocks: int, rng: np.random.Generator) -> dict[str, object]:
    grants = BlockGrants(cache_blocks)
    blocks = rng.choice(cache_blocks, request_blocks, replace=False).astype(np.int64)
    offsets = (np.sort(blocks) * BLOCK_BYTES).astype(np.uint64)
    lengths = np.full(request_blocks, BLOCK_BYTES, np.uint64)
    limit = np.zeros(cache_blocks, np.uint32)

    def grant_and_revoke() -> None:
        grants.add(7, blocks, True)
        grants.remove(7, blocks, True)

    def touch() -> None:
        limit[blocks] += 1

    grants.add(7, blocks, True)
    assert grants.covers(7, True, BLOCK_BYTES, None, offsets, lengths)
    check = p50_us(lambda: grants.covers(7, True, BLOCK_BYTES, None, offsets, lengths))
    grants.remove(7, blocks, True)
    stretch = np.arange(request_blocks, dtype=np.int64) + cache_blocks // 2
    grants.add(7, stretch, True)
    long_offsets = (stretch[::16] * BLOCK_BYTES).astype(np.uint64)
    long_lengths = np.full(len(long_offsets), 16 * BLOCK_BYTES, np.uint64)
    assert grants.covers(7, True, BLOCK_BYTES, None, long_offsets, long_lengths)
    long_check = p50_us(lambda: grants.covers(7, True, BLOCK_BYTES, None, long_offsets, long_lengths))
    grants.remove(7, stretch, True)
    return {"bench": "grants", "cache_blocks": cache_blocks, "request_blocks": request_blocks,
            "grant_and_revoke_us": p50_us(grant_and_revoke), "check_us": check, "check_runs_of_16_us": long_check,
            "numpy_touch_us": p50_us(touch)}


def main() -> None:
    rng = np.random.default_rng(7)
    for cache_blocks in (16 * 1024, 1024 * 1024, 8 * 1024 * 1024):
        for request_blocks in (256, 4096):
            print(json.dumps(case(cache_blocks, request_blocks, rng)), flush=True)


if __name__ == "__main__":
    main()
