"""Many prefill processes pushing many requests at once into one decode process."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from peer import Peer, pattern

PREFILLS, REQUESTS = 4, 100
BLOCKS = PREFILLS * REQUESTS  # every request owns its own destination block
ROW = 512                     # 1 KiB blocks, 2 tensors (one layer of K, V)


def test_four_prefills_times_a_hundred_concurrent_pushes(tmp_path: Any) -> None:
    with Peer(2) as decode:
        decode.call("allocate", name="kv", num_tensors=2, shape=[BLOCKS, ROW], model_id=0)
        prefills = [Peer(10 + p, options={}, role=1) for p in range(PREFILLS)]
        try:
            for index, prefill in enumerate(prefills):
                prefill.call("allocate", name="kv", num_tensors=2, shape=[REQUESTS, ROW], model_id=0, seed=100 + index)
                assert prefill.call("link", cluster_id=2, port=decode.port)["codes"] == [0]
            # all four start at once; each runs its hundred pushes concurrently
            for index, prefill in enumerate(prefills):
                requests = [([i], [index * REQUESTS + i]) for i in range(REQUESTS)]
                assert prefill.proc.stdin is not None
                command = {"op": "push_many", "name": "kv", "cluster_id": 2, "requests": requests}
                prefill.proc.stdin.write(json.dumps(command) + "\n")
                prefill.proc.stdin.flush()
            for prefill in prefills:
                result = prefill._read()
                assert result["ok"] and result["errors"] == [], result
            got = decode.snapshot("kv", tmp_path).reshape(2, BLOCKS, -1)
            for index in range(PREFILLS):
                for tensor in range(2):
                    source = pattern(100 + index, tensor, REQUESTS * ROW * 2).reshape(REQUESTS, -1)
                    assert np.array_equal(got[tensor][index * REQUESTS:(index + 1) * REQUESTS], source)
            stats = decode.call("stats")["stats"]
            assert sorted(stats) == [str(10 + p) for p in range(PREFILLS)]
        finally:
            for prefill in prefills:
                prefill.close()
