"""switch_role_sample.py: the decoder links to the listening prompt and pulls its blocks [0, 1] into
[0, 2], unlinks (non-force); both switch roles (the old prompt stops listening, the old decoder
listens); the old prompt links to it and the old decoder pushes all 3 blocks with
``tensor_num_per_layer=1`` and layer ranges ``range(0, 2)``."""

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
PROMPT_PORT, DECODER_PORT = 0, 1  # Ctx slots (the sample listens on 26000 on both hosts)


def init_llm_datadist(ctx: Ctx, role: LLMRole, cluster_id: int) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.local_comm_res = ""
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = f"{HOST_IP}:{ctx.get(PROMPT_PORT)}"
    datadist.init(llm_config.generate_options())
    return datadist


def register(ctx: Ctx, datadist: LLMDataDist, tensors: list[torch.Tensor], cluster_id: int) -> object:
    desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=ctx.placement)
    return datadist.cache_manager.register_blocks_cache(desc, [int(t.data_ptr()) for t in tensors],
                                                        BlocksCacheKey(cluster_id, 0))


def cluster(remote_cluster_id: int, port: int | None = None) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    info.append_local_ip_info(HOST_IP, 0)
    if port is not None:
        info.append_remote_ip_info(HOST_IP, port)
    return info


def prompt(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    tensors = [torch.ones(BLOCKS_NUM, KV_SHAPE, dtype=torch.float) for _ in range(NUM_TENSORS)]
    cache = register(ctx, datadist, tensors, PROMPT_CLUSTER_ID)
    ctx.wait()  # register end
    ctx.wait()  # decoder unlink
    datadist.switch_role(LLMRole.DECODER)
    check(datadist.listen_address is None and datadist.role == LLMRole.DECODER, "switch to DECODER did not stop "
                                                                                  "listening")
    ctx.wait()  # prompt switch role end, close listen
    ctx.wait()  # decoder switch role end, listen
    ret, _ = datadist.link_clusters([cluster(DECODER_CLUSTER_ID, ctx.get(DECODER_PORT))], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {ret}")
    ctx.wait()  # prompt link end
    ctx.wait()  # decoder push blocks end
    for tensor in tensors:
        check(bool((tensor == 10).all()), f"not every block was pushed: {tensor}")
    ret, _ = datadist.unlink_clusters([cluster(DECODER_CLUSTER_ID)], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret}")
    datadist.cache_manager.unregister_cache(cache.cache_id)  # type: ignore[attr-defined]
    datadist.finalize()


def decoder(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.DECODER, DECODER_CLUSTER_ID)
    tensors = [torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float) for _ in range(NUM_TENSORS)]
    cache = register(ctx, datadist, tensors, DECODER_CLUSTER_ID)
    ctx.wait()  # register end
    prompt_cluster = cluster(PROMPT_CLUSTER_ID, ctx.get(PROMPT_PORT))
    ret, _ = datadist.link_clusters([prompt_cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {ret}")
    datadist.cache_manager.pull_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1],
                                       dst_blocks=[0, 2])
    for tensor in tensors:
        check(bool((tensor[[0, 2]] == 1).all()) and bool((tensor[1] == 0).all()), f"pull_blocks: {tensor}")
    ret, _ = datadist.unlink_clusters([prompt_cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret}")
    ctx.wait()  # decoder unlink
    ctx.wait()  # prompt switch role end, close listen
    llm_config = LLMConfig()
    llm_config.listen_ip_info = f"{HOST_IP}:{ctx.get(DECODER_PORT)}"
    datadist.switch_role(LLMRole.PROMPT, llm_config.generate_options())
    ctx.wait()  # decoder switch role end, listen
    ctx.wait()  # prompt link end
    for tensor in tensors:
        tensor.fill_(10)
    datadist.cache_manager.push_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1, 2],
                                       dst_blocks=[0, 1, 2], src_layer_range=range(0, 2), dst_layer_range=range(0, 2),
                                       tensor_num_per_layer=1)
    ctx.wait()  # decoder push blocks end
    ret, _ = datadist.unlink_clusters([cluster(PROMPT_CLUSTER_ID)], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret}")
    datadist.cache_manager.unregister_cache(cache.cache_id)  # type: ignore[attr-defined]
    datadist.finalize()
