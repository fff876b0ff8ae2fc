"""push_blocks_sample.py: the decoder links to the prompt and pushes its blocks [0, 1] into the prompt's
blocks [0, 2]; the prompt checks blocks 0 and 2 now hold the decoder's zeros and block 1 its own ones."""

from __future__ import annotations

import torch

from flows.harness import HOST_IP, Ctx, check
from kvpush.compat.llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)

NUM_TENSORS = 2
BLOCKS_NUM = 3
KV_SHAPE = 10
PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
PROMPT_PORT, DECODER_PORT = 0, 1  # Ctx slots: ports the roles listen on


def init_llm_datadist(ctx: Ctx, role: LLMRole, cluster_id: int) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.local_comm_res = ""
    port = ctx.get(PROMPT_PORT if role == LLMRole.PROMPT else DECODER_PORT)
    llm_config.listen_ip_info = f"{HOST_IP}:{port}"
    datadist.init(llm_config.generate_options())
    return datadist


def cache_desc(ctx: Ctx) -> CacheDesc:
    return CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=ctx.placement)


def prompt(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    cache_manager = datadist.cache_manager
    tensor = torch.ones(BLOCKS_NUM, KV_SHAPE, dtype=torch.float)
    tensor2 = torch.ones(BLOCKS_NUM, KV_SHAPE, dtype=torch.float)
    cache = cache_manager.register_blocks_cache(cache_desc(ctx), [int(tensor.data_ptr()), int(tensor2.data_ptr())],
                                                BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    ctx.wait()  # register end
    ctx.wait()  # decoder push blocks end
    for t in (tensor, tensor2):
        check(bool((t[[0, 2]] == 0).all()), f"blocks 0 and 2 were not overwritten: {t}")
        check(bool((t[1] == 1).all()), f"block 1 changed: {t}")
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret}")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def decoder(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.DECODER, DECODER_CLUSTER_ID)
    cache_manager = datadist.cache_manager
    tensor = torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float)
    tensor2 = torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float)
    cache = cache_manager.register_blocks_cache(cache_desc(ctx), [int(tensor.data_ptr()), int(tensor2.data_ptr())],
                                                BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    ctx.wait()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(HOST_IP, ctx.get(DECODER_PORT))
    cluster.append_remote_ip_info(HOST_IP, ctx.get(PROMPT_PORT))
    ret, _ = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {ret}")
    cache_manager.push_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
    ctx.wait()  # push_blocks end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret}")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
