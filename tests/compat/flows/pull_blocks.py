"""pull_blocks_sample.py: a rank-table link; the decoder pulls the prompt's blocks [0, 1] of a 1-tensor
blocks cache (default tensor_num_per_layer, no layer ranges) into its own, then swaps both blocks out
to a CPU cache (``Cache.create_cpu_cache``) and back in; both ``unlink(comm_id)``."""

from __future__ import annotations

import torch

from flows.harness import Ctx, check
from flows.rank_table_link import init_llm_datadist, link
from kvpush.compat.llm_datadist import BlocksCacheKey, Cache, CacheDesc, DataType, LLMRole, Placement

BLOCK = 256 * 1024  # floats per block (the sample: 1024 * 1024)


def values() -> torch.Tensor:
    return torch.arange(2 * BLOCK, dtype=torch.float).view(2, BLOCK) + 7


def _allocate_cpu_cache(block_size: int, num_block: int, num_tensors: int) -> tuple[Cache, list[torch.Tensor]]:
    cpu_tensors = [torch.rand(size=(num_block, block_size), dtype=torch.float32, device="cpu")
                   for _ in range(num_tensors)]
    cpu_cache_desc = CacheDesc(num_tensors=num_tensors, shape=[num_block, block_size], data_type=DataType.DT_FLOAT,
                               placement=Placement.HOST)
    return Cache.create_cpu_cache(cpu_cache_desc, [t.data_ptr() for t in cpu_tensors]), cpu_tensors


def decoder(ctx: Ctx) -> None:
    datadist = init_llm_datadist(LLMRole.DECODER, 2)
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=1, shape=[2, BLOCK], data_type=DataType.DT_FLOAT, placement=ctx.placement)
    tensor = torch.ones(2, BLOCK, dtype=torch.float)
    cache = cache_manager.register_blocks_cache(cache_desc, [int(tensor.data_ptr())])
    comm_id = link(ctx, datadist)
    ctx.wait()  # the prompt registered (the sample sleeps 5 s)
    cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])
    check(torch.equal(tensor, values()), "pulled blocks differ from the prompt's")
    if ctx.as_sample:  # swap_blocks moves between DEVICE and HOST caches (LLM-DataDist refuses HOST to HOST)
        cpu_cache, cpu_tensors = _allocate_cpu_cache(BLOCK, 2, 1)
        cache_manager.swap_blocks(cache, cpu_cache, {0: 0, 1: 1})  # swap out
        check(torch.equal(cpu_tensors[0], values()), "swap out did not copy the blocks")
        cpu_tensors[0][1] = -1.0
        tensor.zero_()
        cache_manager.swap_blocks(cpu_cache, cache, {0: 0, 1: 1})  # swap in
        check(torch.equal(tensor[0], values()[0]) and bool((tensor[1] == -1).all()), "swap in did not copy back")
    ctx.wait()  # decoder done
    datadist.unlink(comm_id)
    datadist.finalize()


def prompt(ctx: Ctx) -> None:
    datadist = init_llm_datadist(LLMRole.PROMPT, 1)
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=1, shape=[2, BLOCK], data_type=DataType.DT_FLOAT, placement=ctx.placement)
    tensor = values()
    cache_manager.register_blocks_cache(cache_desc, [int(tensor.data_ptr())], BlocksCacheKey(1, 0))
    comm_id = link(ctx, datadist)
    ctx.wait()  # registered
    ctx.wait()  # decoder done (the sample sleeps 30 s)
    datadist.unlink(comm_id)
    datadist.finalize()
