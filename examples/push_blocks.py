#!/usr/bin/env python3
"""LLM-DataDist's push_blocks walkthrough, on kvpush, on one host.

The original sample (llm_datadist ``examples/python/push_blocks_sample.py``) runs its two roles on
two Ascend servers. Here they are two processes on this host talking over loopback, and the result
is checked instead of logged. An llm_datadist program needs one change, its import:

    from llm_datadist import ...   ->   from kvpush.compat.llm_datadist import ...

Both clusters register a blocks cache of 2 tensors x 3 blocks, passing raw int addresses as the
sample passes ``tensor.data_ptr()``: the prompt side holds all ones, the decoder side all zeros. The
decoder links to the prompt and pushes its blocks [0, 1] into the prompt's blocks [0, 2]; the prompt
then checks that blocks 0 and 2 changed (now zeros) and block 1 did not (still ones).

    python examples/push_blocks.py      # exit status 0 when the check passed
"""

from __future__ import annotations

import logging
import sys

import numpy as np
from _launch import Shared, run

from kvpush.compat.llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
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
PROMPT_PORT = 0  # slot in Shared: the sample listens on 26000; here the kernel picks a free port

log = logging.getLogger("push_blocks")


def init_llm_datadist(role: LLMRole, cluster_id: int) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0  # accepted for compatibility; no effect on a CPU host
    llm_config.local_comm_res = ""  # likewise
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = f"{HOST_IP}:0"
    datadist.init(llm_config.generate_options())
    log.info("init %s success, cluster_id=%d", role.name, cluster_id)
    return datadist


def cache_desc() -> CacheDesc:
    # As in the sample: Placement.DEVICE. On a host without an accelerator, memory registered as DEVICE is
    # host memory (kvpush checks it is mapped), here numpy's.
    return CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)


def run_prompt_sample(shared: Shared) -> None:
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    assert datadist.listen_address is not None
    shared.put(PROMPT_PORT, datadist.listen_address[1])
    # 1. register memory: torch.ones(...).npu() and int(tensor.data_ptr()) in the sample
    cache_manager = datadist.cache_manager
    tensor = np.ones((BLOCKS_NUM, KV_SHAPE), dtype=np.float32)
    tensor2 = np.ones((BLOCKS_NUM, KV_SHAPE), dtype=np.float32)
    addr = int(tensor.ctypes.data)
    addr2 = int(tensor2.ctypes.data)
    cache = cache_manager.register_blocks_cache(cache_desc(), [addr, addr2], BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    log.info("register_blocks_cache success")
    shared.wait()  # register end

    # 2. wait for the decoder to push blocks
    shared.wait()  # decoder push blocks end
    log.info("after decoder push, tensor=\n%s", tensor)
    changed = [bool((t[0] == 0).all() and (t[2] == 0).all()) for t in (tensor, tensor2)]
    unchanged = [bool((t[1] == 1).all()) for t in (tensor, tensor2)]

    # 3. unlink
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink failed: {ret.name}")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    log.info("[finalize] success")
    if not (all(changed) and all(unchanged)):
        sys.exit(f"check FAILED: blocks 0 and 2 became zeros: {changed}; block 1 still ones: {unchanged}")
    log.info("check passed: blocks 0 and 2 were overwritten by the decoder's zeros, block 1 is untouched")


def run_decoder_sample(shared: Shared) -> None:
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID)
    # 1. register memory
    cache_manager = datadist.cache_manager
    tensor = np.zeros((BLOCKS_NUM, KV_SHAPE), dtype=np.float32)
    tensor2 = np.zeros((BLOCKS_NUM, KV_SHAPE), dtype=np.float32)
    addr = int(tensor.ctypes.data)
    addr2 = int(tensor2.ctypes.data)
    cache = cache_manager.register_blocks_cache(cache_desc(), [addr, addr2], BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    log.info("register_blocks_cache success")
    shared.wait()  # register end

    # 2. link to the prompt
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(HOST_IP, 0)  # kept from the sample; kvpush dials from any local port
    cluster.append_remote_ip_info(HOST_IP, shared.get(PROMPT_PORT))
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link failed: {ret.name}")

    # 3. push blocks [0, 1] into the prompt's blocks [0, 2]; returns when they are in its memory
    cache_manager.push_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
    log.info("push_blocks success")
    shared.wait()  # push_blocks end

    # 4. unlink
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink failed: {ret.name}")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


if __name__ == "__main__":
    sys.exit(run("push_blocks example", {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
