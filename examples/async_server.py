#!/usr/bin/env python3
"""An asyncio prefill server that serves many concurrent requests with ``await push_blocks``.

Two processes on this host, using kvpush's async API (``kvpush.LLMDataDist``):

- **decode** owns the KV block pool (a blocks cache listening for links). For each of
  ``REQUESTS`` requests it picks scattered free blocks of its pool and asks the prefill server, all
  requests at once, to compute the request's KV and put it there. When a request's reply arrives its
  blocks are checked right away; at the end, spare blocks must still be zero.
- **prefill** links to decode and runs an asyncio TCP server (JSON lines). Each connection is one
  request: take a free slot of prefill's own KV memory (at most ``SLOTS`` requests are computed at
  once; the rest wait for a slot), "compute" the KV layer by layer, ``await push_blocks`` it into the
  blocks decode named, give the slot back and reply. Many pushes are in flight on the one link at
  the same time; each returns when its bytes are in decode's memory, so the reply means "ready".

    python examples/async_server.py     # exit status 0 when every request's blocks checked out
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

import numpy as np
from _launch import Shared, run

from kvpush import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

PREFILL_CLUSTER_ID = 1
DECODE_CLUSTER_ID = 2
LAYERS = 4
NUM_TENSORS = 2 * LAYERS  # K and V per layer
BLOCK_ELEMS = 2048  # float16 values per block per tensor: 4 KiB blocks
REQUESTS = 48
BLOCKS_PER_REQUEST = 6
SPARE_BLOCKS = 16
POOL_BLOCKS = REQUESTS * BLOCKS_PER_REQUEST + SPARE_BLOCKS
SLOTS = 8  # requests prefill computes at once
HOST_IP = "127.0.0.1"
DECODE_PORT, SERVER_PORT = 0, 1  # slots in Shared

log = logging.getLogger("async_server")


def kv_desc(blocks: int) -> CacheDesc:
    return CacheDesc(NUM_TENSORS, (blocks, BLOCK_ELEMS), DataType.DT_FLOAT16)


def request_kv(request_id: int, tensor: int) -> np.ndarray:
    """The bytes (as uint16) a request's KV holds in one tensor: distinct per request, tensor, block."""
    values = np.arange(BLOCKS_PER_REQUEST * BLOCK_ELEMS, dtype=np.uint32) + request_id * 7919 + tensor * 104729
    return (values % 65521).astype(np.uint16).reshape(BLOCKS_PER_REQUEST, BLOCK_ELEMS)


# -- prefill: the server -------------------------------------------------------------------------
async def prefill_main(shared: Shared) -> None:
    options = {"llm.SyncKvCacheWaitTime": "5000"}
    async with LLMDataDist(LLMRole.PROMPT, PREFILL_CLUSTER_ID, options) as datadist:
        cache_manager = datadist.cache_manager
        kv = cache_manager.allocate_blocks_cache(kv_desc(SLOTS * BLOCKS_PER_REQUEST),
                                                 BlocksCacheKey(PREFILL_CLUSTER_ID, 0))
        free_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(SLOTS):
            free_slots.put_nowait(slot)
        await asyncio.to_thread(shared.wait)  # decode listens

        decode = LLMClusterInfo()
        decode.remote_cluster_id = DECODE_CLUSTER_ID
        decode.append_remote_ip_info(HOST_IP, shared.get(DECODE_PORT))
        status, codes = await datadist.link_clusters([decode], timeout=5000)
        if status != LLMStatusCode.LLM_SUCCESS:
            raise SystemExit(f"link to decode failed: {codes[0].name}")

        stop = asyncio.Event()
        pushes = {"in_flight": 0, "peak": 0, "done": 0}

        async def compute(request_id: int, blocks: list[int]) -> None:
            """Stands in for the model's prefill: writes the request's KV, yielding between layers."""
            for layer in range(LAYERS):
                for tensor in (2 * layer, 2 * layer + 1):
                    kv.tensors[tensor].view(np.uint16)[blocks] = request_kv(request_id, tensor)
                await asyncio.sleep(0)

        async def serve_one(request: dict[str, Any]) -> dict[str, Any]:
            slot = await free_slots.get()
            try:
                src_blocks = list(range(slot * BLOCKS_PER_REQUEST, (slot + 1) * BLOCKS_PER_REQUEST))
                await compute(request["id"], src_blocks)
                pushes["in_flight"] += 1
                pushes["peak"] = max(pushes["peak"], pushes["in_flight"])
                start = time.perf_counter()
                try:
                    await cache_manager.push_blocks(BlocksCacheKey(DECODE_CLUSTER_ID, 0), kv, src_blocks,
                                                    request["dst_blocks"])
                finally:
                    pushes["in_flight"] -= 1
                pushes["done"] += 1
                return {"ok": True, "id": request["id"], "push_ms": round((time.perf_counter() - start) * 1e3, 3)}
            except LLMException as error:
                return {"ok": False, "id": request["id"], "error": str(error)}
            finally:
                free_slots.put_nowait(slot)  # the push returned: the slot's bytes left, it may be reused

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                request = json.loads(await reader.readline())
                if request.get("op") == "shutdown":
                    stop.set()
                    reply: dict[str, Any] = {"ok": True}
                else:
                    reply = await serve_one(request)
                writer.write((json.dumps(reply) + "\n").encode())
                await writer.drain()
            finally:
                writer.close()
                await writer.wait_closed()

        server = await asyncio.start_server(handle, HOST_IP, 0)
        shared.put(SERVER_PORT, server.sockets[0].getsockname()[1])
        await asyncio.to_thread(shared.wait)  # serving
        async with server:
            await stop.wait()
        log.info("served %d requests; up to %d pushes were in flight at once", pushes["done"], pushes["peak"])


# -- decode: the client that owns the block pool ----------------------------------------------------
async def ask_prefill(port: int, request_id: int, dst_blocks: list[int], pool: Cache) -> str | None:
    """One request; None when its blocks hold exactly its KV, else what is wrong."""
    reader, writer = await asyncio.open_connection(HOST_IP, port)
    try:
        writer.write((json.dumps({"id": request_id, "dst_blocks": dst_blocks}) + "\n").encode())
        await writer.drain()
        reply = json.loads(await reader.readline())
    finally:
        writer.close()
        await writer.wait_closed()
    if not reply.get("ok"):
        return f"request {request_id}: {reply.get('error')}"
    for tensor_index, tensor in enumerate(pool.tensors):
        if not np.array_equal(tensor.view(np.uint16)[dst_blocks], request_kv(request_id, tensor_index)):
            return f"request {request_id}: tensor {tensor_index} of blocks {dst_blocks} differs"
    return None


async def decode_main(shared: Shared) -> None:
    options = {"llm.listenIpInfo": f"{HOST_IP}:0", "llm.SyncKvCacheWaitTime": "5000"}
    async with LLMDataDist(LLMRole.DECODER, DECODE_CLUSTER_ID, options) as datadist:
        pool = datadist.cache_manager.allocate_blocks_cache(kv_desc(POOL_BLOCKS), BlocksCacheKey(DECODE_CLUSTER_ID, 0))
        assert datadist.listen_address is not None
        shared.put(DECODE_PORT, datadist.listen_address[1])
        await asyncio.to_thread(shared.wait)  # decode listens
        await asyncio.to_thread(shared.wait)  # prefill linked and serving
        port = shared.get(SERVER_PORT)

        order = np.random.default_rng(7).permutation(POOL_BLOCKS)
        assigned = order[:REQUESTS * BLOCKS_PER_REQUEST].reshape(REQUESTS, BLOCKS_PER_REQUEST)
        start = time.perf_counter()
        problems = await asyncio.gather(*(ask_prefill(port, request_id, assigned[request_id].tolist(), pool)
                                          for request_id in range(REQUESTS)))
        elapsed = time.perf_counter() - start
        reader, writer = await asyncio.open_connection(HOST_IP, port)
        writer.write(b'{"op": "shutdown"}\n')
        await reader.readline()
        writer.close()
        await writer.wait_closed()

        failures = [problem for problem in problems if problem is not None]
        spare = order[REQUESTS * BLOCKS_PER_REQUEST:]
        if any(tensor.view(np.uint16)[spare].any() for tensor in pool.tensors):
            failures.append(f"spare blocks {sorted(spare.tolist())} were written")
        if failures:
            raise SystemExit("check FAILED: " + "; ".join(failures))
        moved = REQUESTS * BLOCKS_PER_REQUEST * NUM_TENSORS * BLOCK_ELEMS * 2
        log.info("check passed: %d concurrent requests, every block verified, spare blocks untouched "
                 "(%.1f MiB in %.0f ms)", REQUESTS, moved / 2**20, elapsed * 1e3)


def run_prefill(shared: Shared) -> None:
    asyncio.run(prefill_main(shared))


def run_decode(shared: Shared) -> None:
    asyncio.run(decode_main(shared))


if __name__ == "__main__":
    sys.exit(run("async_server example", {"decode": run_decode, "prefill": run_prefill}))
