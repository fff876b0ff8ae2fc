"""pull_from_cache_to_blocks.py: a rank-table link; the prompt allocates a contiguous cache whose batch
slot 0 is CacheKey(1, req 0); the decoder registers a blocks cache of the same shape and pulls that
slot into its block 0 (``pull_blocks`` with ``src_blocks=[]``); both unlink. The host-memory variant
addresses the slot by CacheKeyByIdAndIndex."""

from __future__ import annotations

import torch

from flows.harness import Ctx, check, tensors_at
from flows.rank_table_link import init_llm_datadist, link
from kvpush.compat.llm_datadist import CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMRole

CACHE_NUM_TENSORS = 4
CACHE_SHAPE = [2, 16 * 1024]
PROMPT_CACHE_ID = 1  # Ctx slot


def desc(ctx: Ctx) -> CacheDesc:
    return CacheDesc(num_tensors=CACHE_NUM_TENSORS, shape=CACHE_SHAPE, data_type=DataType.DT_FLOAT16,
                     placement=ctx.placement)


def slot_values(tensor: int) -> torch.Tensor:
    return (torch.arange(CACHE_SHAPE[1]) % 1000 + 10 * tensor).to(torch.float16)


def decoder(ctx: Ctx) -> None:
    datadist = init_llm_datadist(LLMRole.DECODER, 2)
    cache_manager = datadist.cache_manager
    tensors = [torch.ones(*CACHE_SHAPE, dtype=torch.float16) for _ in range(CACHE_NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(desc(ctx), [t.data_ptr() for t in tensors])
    comm_id = link(ctx, datadist)
    ctx.wait()  # cache ready
    if ctx.as_sample:
        source = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    else:
        source = CacheKeyByIdAndIndex(1, ctx.get(PROMPT_CACHE_ID), 0)
    cache_manager.pull_blocks(source, cache, src_blocks=[], dst_blocks=[0])
    for index, tensor in enumerate(tensors):
        check(torch.equal(tensor[0], slot_values(index)), f"block 0 of tensor {index} is not the prompt's slot 0")
        check(bool((tensor[1] == 1).all()), f"block 1 of tensor {index} changed")
    ctx.wait()  # pull_blocks end
    datadist.unlink(comm_id)
    ctx.wait()  # wait peer unlink end
    datadist.finalize()


def prompt(ctx: Ctx) -> None:
    datadist = init_llm_datadist(LLMRole.PROMPT, 1)
    comm_id = link(ctx, datadist)
    cache_manager = datadist.cache_manager
    cache_key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache = cache_manager.allocate_cache(desc(ctx), [cache_key])
    for index, tensor in enumerate(tensors_at(CACHE_SHAPE, torch.float16, cache.tensor_addrs)):
        tensor[0] = slot_values(index)
        tensor[1] = -1
    ctx.put(PROMPT_CACHE_ID, cache.cache_id)
    ctx.wait()  # cache ready
    ctx.wait()  # decoder pull_blocks end
    datadist.unlink(comm_id)
    ctx.wait()  # wait peer unlink end
    cache_manager.remove_cache_key(cache_key)
    cache_manager.deallocate_cache(cache)
    datadist.finalize()
