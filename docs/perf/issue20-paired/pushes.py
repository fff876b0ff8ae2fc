"""One run of issue 20's paired check: PUSHES pushes of WORKLOAD over TRANSPORT from the current directory's
tree (its kvpush and bench/), the driver on core 0 and the target on core 1; prints sender CPU, p50 and p99
per push in microseconds. Usage: python pushes.py TRANSPORT PUSHES WORKLOAD"""

import asyncio
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())
from bench import push_bench as pb  # noqa: E402
from bench.workload import WORKLOADS  # noqa: E402
from kvpush import BlocksCacheKey  # noqa: E402

transport, count, work = sys.argv[1], int(sys.argv[2]), WORKLOADS[sys.argv[3]]


def pin(pid: int, cpus: set[int]) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)


async def main(target: pb.Target) -> None:
    engine, cache = await pb.linked_prefill(work, transport, target)
    pin(target.proc.pid, {1})  # every thread either side started meanwhile
    pin(os.getpid(), {0})
    src, dst = (b.tolist() for b in work.block_lists())
    key = BlocksCacheKey(2, 0)
    for _ in range(min(500, count)):  # warm-up
        await engine.cache_manager.push_blocks(key, cache, src, dst, tensor_num_per_layer=work.kv)
    took = []
    cpu = time.process_time()
    for _ in range(count):
        start = time.perf_counter()
        await engine.cache_manager.push_blocks(key, cache, src, dst, tensor_num_per_layer=work.kv)
        took.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    us = np.array(took) * 1e6
    print(os.path.basename(os.getcwd()), transport,
          f"cpu {cpu / count * 1e6:.1f} p50 {np.percentile(us, 50):.1f} p99 {np.percentile(us, 99):.1f}")
    await engine.finalize()


target = pb.start_target(work, transport)
try:
    asyncio.run(main(target))
finally:
    target.close()
