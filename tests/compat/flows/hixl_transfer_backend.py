"""hixl_transfer_backend_sample.py: both listen (``transfer_backend="hixl"``) and, right after the
register barrier, each links to the other at once. The prompt pulls the decoder's block 2 into its
block 2 while the decoder pushes its blocks [0, 1] into the prompt's [0, 1]; the prompt then holds
only the decoder's zeros. Both unlink (non-force)."""

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
PROMPT_PORT, DECODER_PORT = 0, 1  # Ctx slots (the sample: 26000 and 26001)


def init_llm_datadist(ctx: Ctx, role: LLMRole, cluster_id: int) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.local_comm_res = ""
    llm_config.transfer_backend = "hixl"
    port = ctx.get(PROMPT_PORT if role == LLMRole.PROMPT else DECODER_PORT)
    llm_config.listen_ip_info = f"{HOST_IP}:{port}"
    datadist.init(llm_config.generate_options())
    return datadist


def _link(ctx: Ctx, datadist: LLMDataDist, remote: int, local_port: int, remote_port: int) -> None:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote
    cluster.append_local_ip_info(HOST_IP, ctx.get(local_port))
    cluster.append_remote_ip_info(HOST_IP, ctx.get(remote_port))
    ret, _ = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {ret}")


def _unlink(datadist: LLMDataDist, remote: int) -> None:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret}")


def desc(ctx: Ctx) -> CacheDesc:
    return CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=ctx.placement)


def prompt(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    cache_manager = datadist.cache_manager
    tensors = [torch.ones(BLOCKS_NUM, KV_SHAPE, dtype=torch.float) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(desc(ctx), [int(t.data_ptr()) for t in tensors],
                                                BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    ctx.wait()  # register end
    _link(ctx, datadist, DECODER_CLUSTER_ID, PROMPT_PORT, DECODER_PORT)
    cache_manager.pull_blocks(BlocksCacheKey(DECODER_CLUSTER_ID, 0), cache, src_blocks=[2], dst_blocks=[2])
    ctx.wait()  # the decoder's push ended
    expect = torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float)
    for tensor in tensors:
        check(torch.equal(expect, tensor), f"check tensor val failed, tensor={tensor}")
    _unlink(datadist, DECODER_CLUSTER_ID)
    ctx.wait()  # wait peer unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def decoder(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.DECODER, DECODER_CLUSTER_ID)
    cache_manager = datadist.cache_manager
    tensors = [torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(desc(ctx), [int(t.data_ptr()) for t in tensors],
                                                BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    ctx.wait()  # register end
    _link(ctx, datadist, PROMPT_CLUSTER_ID, DECODER_PORT, PROMPT_PORT)
    cache_manager.push_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])
    ctx.wait()  # push_blocks end
    _unlink(datadist, PROMPT_CLUSTER_ID)
    ctx.wait()  # wait peer unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
