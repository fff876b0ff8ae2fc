"""push_cache_sample.py: both register a 2-tensor contiguous cache (3 batch slots); the decoder links to
the prompt and pushes its slot 0 (ones) into the prompt's cache id 1 slot 0 with the default layers,
then unlinks (non-force); the prompt checks slot 0 changed and slots 1, 2 did not."""

from __future__ import annotations

import torch

from flows.harness import Ctx, check
from flows.push_blocks import DECODER_CLUSTER_ID, PROMPT_CLUSTER_ID, PROMPT_PORT, init_llm_datadist
from kvpush.compat.llm_datadist import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMRole,
    LLMStatusCode,
)

NUM_TENSORS = 2
BLOCKS_NUM = 3
KV_SHAPE = 10
HOST_IP = "127.0.0.1"


def cache_desc(ctx: Ctx) -> CacheDesc:
    return CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=ctx.placement)


def prompt(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    cache_manager = datadist.cache_manager
    tensors = [torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_cache(cache_desc(ctx), [int(t.data_ptr()) for t in tensors])
    check(cache.cache_id == 1, f"the sample pushes to cache id 1; got {cache.cache_id}")
    ctx.wait()  # register end
    ctx.wait()  # decoder push cache end
    for tensor in tensors:
        check(bool((tensor[0] == 1).all()) and bool((tensor[1:] == 0).all()), f"unexpected contents {tensor}")
    ctx.wait()  # wait unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def decoder(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.DECODER, DECODER_CLUSTER_ID)
    cache_manager = datadist.cache_manager
    tensors = [torch.full((BLOCKS_NUM, KV_SHAPE), 1, dtype=torch.float) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_cache(cache_desc(ctx), [int(t.data_ptr()) for t in tensors])
    ctx.wait()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(HOST_IP, 0)
    cluster.append_remote_ip_info(HOST_IP, ctx.get(PROMPT_PORT))
    ret, _ = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {ret}")
    cache_manager.push_cache(CacheKeyByIdAndIndex(cluster_id=PROMPT_CLUSTER_ID, cache_id=1, batch_index=0), cache,
                             src_batch_index=0)
    ctx.wait()  # push cache end
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret}")
    ctx.wait()  # unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
