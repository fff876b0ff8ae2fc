#!/usr/bin/env python3
"""The C++ ``PushKvBlocks`` flow of LLM-DataDist, on kvpush, on one host.

Follows ``cplusplus/.../11_llm_data_dist/prompt_push_cache_and_blocks.cpp`` (and its decoder half)
with kvpush's status-returning ``push_kv_blocks``: like ``PushKvBlocks`` it returns an
``LLMStatusCode`` instead of raising.

- The decoder (cluster 1) listens and registers 4 int32 tensors of shape [8, 16] (8 blocks of 16
  values), all zeros, from raw int addresses.
- The prompt (cluster 0) registers its own 4 tensors filled with iota values (tensor i holds
  ``1000 * i + 0, 1, 2, ...``, so a tensor sent to the wrong place shows), links, and pushes blocks
  5, 6, 7 into the decoder's blocks 5, 6, 7 one tensor at a time:
  ``push_kv_blocks(cache, CacheKeyByIdAndIndex(1, cache_id), [5, 6, 7], [5, 6, 7],
  KvCacheExtParam((i, i), (i, i), 1))`` for i in 0..3 — each call moves layer i of one tensor.
- The decoder checks that blocks 5..7 of every tensor hold the prompt's values and blocks 0..4 are
  still zero.

    python examples/push_kv_blocks.py   # exit status 0 when the check passed
"""

from __future__ import annotations

import logging
import sys

import numpy as np
from _launch import Shared, run

from kvpush.compat.llm_datadist import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)

PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
NUM_TENSORS = 4
TENSOR_SHAPE = [8, 16]
PROMPT_BLOCKS = [5, 6, 7]
DECODER_BLOCKS = [5, 6, 7]
HOST_IP = "127.0.0.1"
DECODER_PORT, DECODER_CACHE_ID = 0, 1  # slots in Shared

log = logging.getLogger("push_kv_blocks")


def prompt_values(index: int) -> np.ndarray:
    """What the prompt's tensor ``index`` holds: iota, offset per tensor."""
    return (np.arange(8 * 16, dtype=np.int32) + 1000 * index).reshape(TENSOR_SHAPE)


def cache_desc() -> CacheDesc:
    # LLM-DataDist's CacheDesc defaults to Placement.DEVICE; this memory is numpy's, so say HOST
    return CacheDesc(NUM_TENSORS, TENSOR_SHAPE, DataType.DT_INT32, Placement.HOST)


def run_prompt_sample(shared: Shared) -> None:
    # 1. initialise (no listen address: this side dials)
    datadist = LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    datadist.init({"ge.exec.deviceId": "0"})  # OPTION_DEVICE_ID: accepted, no effect on a CPU host
    # 2. register memory (aclrtMalloc + iota in the C++ sample)
    buffers = [prompt_values(i) for i in range(NUM_TENSORS)]
    tensor_addrs = [int(buffer.ctypes.data) for buffer in buffers]
    cache = datadist.cache_manager.register_blocks_cache(cache_desc(), tensor_addrs)
    log.info("RegisterKvCache success, cache_id=%d, tensor addrs=%s", cache.cache_id,
             [hex(a) for a in cache.tensor_addrs])
    shared.wait()  # both registered; the decoder listens

    # 3. link to the decoder
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_remote_ip_info(HOST_IP, shared.get(DECODER_PORT))
    ret, rets = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise SystemExit(f"LinkLlmClusters failed, ret={ret.name} {[r.name for r in rets]}")
    log.info("LinkLlmClusters success")

    # 4. push blocks 5..7, one tensor (= one layer of tensor_num_per_layer=1) per call
    cache_index = CacheKeyByIdAndIndex(DECODER_CLUSTER_ID, shared.get(DECODER_CACHE_ID))
    for i in range(NUM_TENSORS):
        param = KvCacheExtParam((i, i), (i, i), 1)
        ret = datadist.cache_manager.push_kv_blocks(cache, cache_index, PROMPT_BLOCKS, DECODER_BLOCKS, param)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise SystemExit(f"PushKvBlocks failed for tensor {i}, ret={ret.name}")
    log.info("PushKvBlocks success")
    shared.wait()  # pushed

    # 5. unlink, unregister, finalize
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    shared.wait()  # unlinked: the decoder finalizes only now (a peer finalizing during a non-force unlink
    # closes the link before it can acknowledge, and the unlink then reports LLM_UNLINK_FAILED)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise SystemExit(f"UnlinkLlmClusters failed, ret={ret.name}")
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    log.info("Prompt sample end")


def run_decoder_sample(shared: Shared) -> None:
    datadist = LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER_ID)
    datadist.init({"llm.listenIpInfo": f"{HOST_IP}:0", "ge.exec.deviceId": "1"})
    assert datadist.listen_address is not None
    buffers = [np.zeros(TENSOR_SHAPE, dtype=np.int32) for _ in range(NUM_TENSORS)]
    cache = datadist.cache_manager.register_blocks_cache(cache_desc(), [int(b.ctypes.data) for b in buffers])
    shared.put(DECODER_PORT, datadist.listen_address[1])
    shared.put(DECODER_CACHE_ID, cache.cache_id)  # the C++ sample hard-codes CacheIndex{1, 1}
    log.info("RegisterKvCache success, cache_id=%d; listening on port %d", cache.cache_id,
             datadist.listen_address[1])
    shared.wait()  # both registered
    shared.wait()  # the prompt pushed

    failures = []
    for i, buffer in enumerate(buffers):
        if not np.array_equal(buffer[DECODER_BLOCKS], prompt_values(i)[PROMPT_BLOCKS]):
            failures.append(f"tensor {i}: blocks {DECODER_BLOCKS} hold {buffer[DECODER_BLOCKS].tolist()}")
        if buffer[:5].any():
            failures.append(f"tensor {i}: blocks 0..4 were written")
    shared.wait()  # the prompt unlinked
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    if failures:
        raise SystemExit("check FAILED: " + "; ".join(failures))
    log.info("check passed: blocks %s of all %d tensors hold the prompt's values, blocks 0..4 are still zero",
             DECODER_BLOCKS, NUM_TENSORS)


if __name__ == "__main__":
    sys.exit(run("push_kv_blocks example", {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
