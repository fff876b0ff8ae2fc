"""pull_cache_sample.py: a rank-table link; the prompt allocates a 4-tensor contiguous cache whose two
batch slots are named by CacheKey(1, req 0) and CacheKey(1, req 1) and fills tensor 0 with ones; the
decoder allocates its own and pulls both slots (then, as-sample, checks that a pull consumed its key); the
prompt removes the keys and deallocates. The host-memory variant addresses the slots by
CacheKeyByIdAndIndex."""

from __future__ import annotations

import torch

from flows.harness import Ctx, check, tensors_at
from flows.rank_table_link import init_llm_datadist, link
from kvpush.compat.llm_datadist import (
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

SHAPE = [2, 64 * 1024]  # the sample: [2, 1024 * 1024]
PROMPT_CACHE_ID = 1  # Ctx slot


def desc(ctx: Ctx) -> CacheDesc:
    return CacheDesc(num_tensors=4, shape=SHAPE, data_type=DataType.DT_FLOAT16, placement=ctx.placement)


def decoder(ctx: Ctx) -> None:
    datadist = init_llm_datadist(LLMRole.DECODER, 2)
    comm_id = link(ctx, datadist)
    cache_manager = datadist.cache_manager
    cache = cache_manager.allocate_cache(desc(ctx))
    ctx.wait()  # the prompt filled its cache (the sample sleeps 5 s)
    if ctx.as_sample:
        cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), cache, batch_index=0)
        cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=1, model_id=0), cache, batch_index=1)
        try:  # a successful pull released the key on the prompt, as in LLM-DataDist
            cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), cache, batch_index=0)
        except LLMException as error:
            check(error.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"pulled again: {error}")
        else:
            check(False, "a pulled cache key could be pulled again")
    else:
        cache_id = ctx.get(PROMPT_CACHE_ID)
        cache_manager.pull_cache(CacheKeyByIdAndIndex(1, cache_id, 0), cache, batch_index=0)
        cache_manager.pull_cache(CacheKeyByIdAndIndex(1, cache_id, 1), cache, batch_index=1)
    tensors = tensors_at(list(cache.cache_desc.shape), torch.float16, cache.tensor_addrs)
    check(bool((tensors[0] == 1).all()), "tensor 0 is not the prompt's ones")
    check(all(bool((t == 2).all()) for t in tensors[1:]), "tensors 1..3 are not the prompt's twos")
    cache_manager.deallocate_cache(cache)
    ctx.wait()  # pulled
    datadist.unlink(comm_id)
    datadist.finalize()


def prompt(ctx: Ctx) -> None:
    datadist = init_llm_datadist(LLMRole.PROMPT, 1)
    comm_id = link(ctx, datadist)
    cache_manager = datadist.cache_manager
    cache_key_0 = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache_key_1 = CacheKey(prompt_cluster_id=1, req_id=1, model_id=0)
    cache = cache_manager.allocate_cache(desc(ctx), [cache_key_0, cache_key_1])
    tensors = tensors_at(list(cache.cache_desc.shape), torch.float16, cache.tensor_addrs)
    tensors[0].fill_(1)
    for tensor in tensors[1:]:  # the sample leaves them as allocated; here every byte is checked
        tensor.fill_(2)
    ctx.put(PROMPT_CACHE_ID, cache.cache_id)
    ctx.wait()  # filled
    ctx.wait()  # the decoder pulled (the sample sleeps 30 s)
    cache_manager.remove_cache_key(cache_key_0)
    cache_manager.remove_cache_key(cache_key_1)
    cache_manager.deallocate_cache(cache)
    datadist.unlink(comm_id)
    datadist.finalize()
