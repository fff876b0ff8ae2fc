"""pull_blocks_xpyd_sample.py: one decoder, two prompts; cluster ids are ``ip:port`` packed into 48 bits;
every cache is one tensor (default tensor_num_per_layer, no layer ranges). The decoder links to both
prompts in one call and pulls blocks [0, 1] of each into its blocks [0, 2], checking after each pull."""

from __future__ import annotations

import socket
import struct

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

NUM_TENSORS = 1
BLOCKS_NUM = 3
KV_SHAPE = 10
DECODER_PORT, PROMPT1_PORT, PROMPT2_PORT = 0, 1, 2  # Ctx slots: the roles' --local_ip_port


def ip_port_to_int(ip_port: str) -> int:
    ip, port_str = ip_port.split(":")
    return (struct.unpack("!I", socket.inet_aton(ip))[0] << 16) | int(port_str)


def local_ip_port(ctx: Ctx, slot: int) -> str:
    return f"{HOST_IP}:{ctx.get(slot)}"


def init_llm_datadist(ctx: Ctx, role: LLMRole, slot: int) -> LLMDataDist:
    datadist = LLMDataDist(role, ip_port_to_int(local_ip_port(ctx, slot)))
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.local_comm_res = ""
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = local_ip_port(ctx, slot)
    datadist.init(llm_config.generate_options())
    return datadist


def desc(ctx: Ctx) -> CacheDesc:
    return CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=ctx.placement)


def _prompt(ctx: Ctx, slot: int) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.PROMPT, slot)
    cache_manager = datadist.cache_manager
    cluster_id = ip_port_to_int(local_ip_port(ctx, slot))
    tensor = torch.full((BLOCKS_NUM, KV_SHAPE), cluster_id, dtype=torch.float)
    cache = cache_manager.register_blocks_cache(desc(ctx), [int(tensor.data_ptr())], BlocksCacheKey(cluster_id, 0))
    ctx.wait()  # registered (the decoder sleeps 5 s in the sample)
    ctx.wait()  # the decoder pulled and unlinked (the prompts sleep 30 s in the sample)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def prompt1(ctx: Ctx) -> None:
    _prompt(ctx, PROMPT1_PORT)


def prompt2(ctx: Ctx) -> None:
    _prompt(ctx, PROMPT2_PORT)


def decoder(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.DECODER, DECODER_PORT)
    cache_manager = datadist.cache_manager
    remote_list = [local_ip_port(ctx, PROMPT1_PORT), local_ip_port(ctx, PROMPT2_PORT)]
    tensor = torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float)
    cache = cache_manager.register_blocks_cache(desc(ctx), [int(tensor.data_ptr())],
                                                BlocksCacheKey(ip_port_to_int(local_ip_port(ctx, DECODER_PORT)), 0))
    ctx.wait()  # register end
    cluster_list = []
    for remote in remote_list:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = ip_port_to_int(remote)
        cluster.append_local_ip_info(HOST_IP, 0)
        cluster.append_remote_ip_info(remote.split(":")[0], int(remote.split(":")[1]))
        cluster_list.append(cluster)
    ret, _ = datadist.link_clusters(cluster_list, 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {ret}")
    for remote in remote_list:
        cache_manager.pull_blocks(BlocksCacheKey(ip_port_to_int(remote), 0), cache, src_blocks=[0, 1],
                                  dst_blocks=[0, 2])
        want = float(torch.tensor(ip_port_to_int(remote), dtype=torch.float))
        check(bool((tensor[[0, 2]] == want).all()) and bool((tensor[1] == 0).all()),
              f"after the pull from {remote}: {tensor}")
    ret, _ = datadist.unlink_clusters(cluster_list, 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret}")
    ctx.wait()  # pulled and unlinked
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
