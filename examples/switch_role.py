#!/usr/bin/env python3
"""LLM-DataDist's switch-role walkthrough, on kvpush, on one host.

Follows llm_datadist's ``examples/python/switch_role_sample.py`` with its two roles as two processes
on this host (loopback) and checks every step:

1. The prompt listens and registers a blocks cache of 2 tensors x 3 blocks (tensor t filled with t+1);
   the decoder registers zeros, links to the prompt and *pulls* the prompt's blocks [0, 1] into its
   blocks [0, 2], then checks them.
2. The decoder unlinks (non-force: both ends go). Both switch roles: the prompt becomes a DECODER
   (its listener stops), the decoder becomes a PROMPT listening on a new port.
3. The old prompt links the other way, to the new listener; the old decoder scales its blocks by 10
   (new KV) and *pushes* all 3 blocks with ``tensor_num_per_layer=1`` and layer ranges
   ``range(0, 2)`` (each tensor is one layer); the old prompt checks it holds exactly those bytes.

    python examples/switch_role.py      # exit status 0 when every check passed
"""

from __future__ import annotations

import logging
import sys

import numpy as np
from _launch import Shared, run

from kvpush.compat.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

NUM_TENSORS = 2
BLOCKS_NUM = 3
KV_SHAPE = 10
PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
HOST_IP = "127.0.0.1"
PROMPT_PORT, DECODER_PORT = 0, 1  # slots in Shared (the sample uses port 26000 on both hosts)

log = logging.getLogger("switch_role")


def init_llm_datadist(role: LLMRole, cluster_id: int) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0  # accepted for compatibility; no effect on a CPU host
    llm_config.local_comm_res = ""
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = f"{HOST_IP}:0"
    datadist.init(llm_config.generate_options())
    log.info("init %s success, cluster_id=%d", role.name, cluster_id)
    return datadist


def register(datadist: LLMDataDist, tensors: list[np.ndarray], cluster_id: int) -> Cache:
    # Placement.DEVICE as in the sample: on a host without an accelerator that is host memory (numpy's here)
    desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    addrs = [int(tensor.ctypes.data) for tensor in tensors]  # int(tensor.data_ptr()) with torch
    cache = datadist.cache_manager.register_blocks_cache(desc, addrs, BlocksCacheKey(cluster_id, 0))
    log.info("register_blocks_cache success, cache_id=%d", cache.cache_id)
    return cache


def cluster_info(remote_cluster_id: int, port: int | None = None) -> LLMClusterInfo:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote_cluster_id
    if port is not None:
        cluster.append_remote_ip_info(HOST_IP, port)
    return cluster


def expect(label: str, got: np.ndarray, want: np.ndarray) -> None:
    if not np.array_equal(got, want):
        raise SystemExit(f"check FAILED: {label}:\n got {got.tolist()}\nwant {want.tolist()}")
    log.info("check passed: %s", label)


def run_prompt_sample(shared: Shared) -> None:
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    assert datadist.listen_address is not None
    shared.put(PROMPT_PORT, datadist.listen_address[1])
    tensors = [np.full((BLOCKS_NUM, KV_SHAPE), t + 1, dtype=np.float32) for t in range(NUM_TENSORS)]
    cache = register(datadist, tensors, PROMPT_CLUSTER_ID)

    shared.wait()  # register end
    log.info("wait for the decoder to link and pull...")
    shared.wait()  # decoder unlinked

    # switch role: without llm.listenIpInfo the listener stops
    try:
        datadist.switch_role(LLMRole.DECODER)
    except LLMException as error:
        raise SystemExit(f"switch_role failed: {error}") from None
    if datadist.listen_address is not None:
        raise SystemExit(f"check FAILED: still listening on {datadist.listen_address} after switching to DECODER")
    log.info("switch_role PROMPT -> DECODER success; listener stopped")
    shared.wait()  # prompt switched role
    shared.wait()  # decoder switched role and listens

    # link the other way, to the new listener
    ret, _ = datadist.link_clusters([cluster_info(DECODER_CLUSTER_ID, shared.get(DECODER_PORT))], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link failed: {ret.name}")
    log.info("link success, wait for the decoder to push...")
    shared.wait()  # prompt link end
    shared.wait()  # decoder push blocks end

    want = [np.array([[10 * (t + 1)] * KV_SHAPE, [0] * KV_SHAPE, [10 * (t + 1)] * KV_SHAPE], np.float32)
            for t in range(NUM_TENSORS)]
    for t in range(NUM_TENSORS):
        expect(f"tensor {t} after the decoder's push with layer ranges", tensors[t], want[t])

    ret, _ = datadist.unlink_clusters([cluster_info(DECODER_CLUSTER_ID)], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink failed: {ret.name}")
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    log.info("[finalize] success")


def run_decoder_sample(shared: Shared) -> None:
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID)
    tensors = [np.zeros((BLOCKS_NUM, KV_SHAPE), dtype=np.float32) for _ in range(NUM_TENSORS)]
    cache = register(datadist, tensors, DECODER_CLUSTER_ID)
    shared.wait()  # register end

    # link to the prompt and pull its blocks [0, 1] into ours [0, 2]
    prompt = cluster_info(PROMPT_CLUSTER_ID, shared.get(PROMPT_PORT))
    ret, _ = datadist.link_clusters([prompt], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link failed: {ret.name}")
    datadist.cache_manager.pull_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache,
                                       src_blocks=[0, 1], dst_blocks=[0, 2])
    for t in range(NUM_TENSORS):
        want = np.array([[t + 1] * KV_SHAPE, [0] * KV_SHAPE, [t + 1] * KV_SHAPE], np.float32)
        expect(f"tensor {t} after pull_blocks", tensors[t], want)

    # unlink (non-force: the prompt's end goes too), then switch role and listen
    ret, _ = datadist.unlink_clusters([prompt], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink failed: {ret.name}")
    shared.wait()  # decoder unlinked
    shared.wait()  # prompt switched role
    llm_config = LLMConfig()
    llm_config.listen_ip_info = f"{HOST_IP}:0"
    datadist.switch_role(LLMRole.PROMPT, llm_config.generate_options())
    assert datadist.listen_address is not None
    shared.put(DECODER_PORT, datadist.listen_address[1])
    log.info("switch_role DECODER -> PROMPT success; listening on port %d", datadist.listen_address[1])
    shared.wait()  # decoder switched role and listens
    shared.wait()  # prompt link end

    # new KV, pushed layer by layer: one tensor per layer, layers 0..1 to layers 0..1
    for tensor in tensors:
        tensor *= 10
    datadist.cache_manager.push_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache,
                                       src_blocks=[0, 1, 2], dst_blocks=[0, 1, 2], src_layer_range=range(0, 2),
                                       dst_layer_range=range(0, 2), tensor_num_per_layer=1)
    log.info("push_blocks with layer ranges success")
    shared.wait()  # decoder push blocks end

    ret, _ = datadist.unlink_clusters([cluster_info(PROMPT_CLUSTER_ID)], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink failed: {ret.name}")
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


if __name__ == "__main__":
    sys.exit(run("switch_role example", {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
