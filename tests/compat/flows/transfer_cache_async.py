"""transfer_cache_async_sample.py: both listen; the prompt links to the decoder and pushes its blocks
cache, layer 0 into layer 0 (``TransferWithCacheKeyConfig(BlocksCacheKey(decoder, 0), range(0, 1),
range(0, 1))``), layer-synchronised by a ``LayerSynchronizer``; the decoder checks it holds the
prompt's ones everywhere. Both unlink (force)."""

from __future__ import annotations

import threading

import torch

from flows.harness import HOST_IP, Ctx, check
from kvpush.compat.llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    TransferWithCacheKeyConfig,
)

NUM_TENSORS = 2
BLOCKS_NUM = 3
KV_SHAPE = 10
PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
PROMPT_PORT, DECODER_PORT = 0, 1  # Ctx slots (the sample: 26001 and 26000)


class LayerSynchronizerImpl(LayerSynchronizer):
    def __init__(self, ret: bool = True) -> None:
        self._ret = ret
        self.calls: list[tuple[int, int | None, str]] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append((layer_index, timeout_in_millis, threading.current_thread().name))
        return self._ret


def init_llm_datadist(ctx: Ctx, role: LLMRole, cluster_id: int) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    port = ctx.get(DECODER_PORT if role == LLMRole.DECODER else PROMPT_PORT)
    llm_config.listen_ip_info = f"{HOST_IP}:{port}"
    llm_config.enable_cache_manager = True
    llm_config.enable_remote_cache_accessible = True
    datadist.init(llm_config.generate_options())
    return datadist


def desc(ctx: Ctx) -> CacheDesc:
    return CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=ctx.placement)


def _unlink(datadist: LLMDataDist, remote: int) -> None:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret}")


def prompt(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    cache_manager = datadist.cache_manager
    tensors = [torch.ones(BLOCKS_NUM, KV_SHAPE, dtype=torch.float) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(desc(ctx), [int(t.data_ptr()) for t in tensors],
                                                BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    ctx.wait()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_local_ip_info(HOST_IP, ctx.get(PROMPT_PORT))
    cluster.append_remote_ip_info(HOST_IP, ctx.get(DECODER_PORT))
    ret, _ = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {ret}")
    transfer_config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_CLUSTER_ID, 0), range(0, 1), range(0, 1))
    synchronizer = LayerSynchronizerImpl(True)
    cache_task = cache_manager.transfer_cache_async(cache, synchronizer, [transfer_config])
    results = cache_task.get_results()
    check(results == [LLMStatusCode.LLM_SUCCESS], f"get_results: {results}")
    check(cache_task.synchronize() == LLMStatusCode.LLM_SUCCESS, "synchronize did not report success")
    check([(layer, timeout) for layer, timeout, _ in synchronizer.calls] == [(0, None)],
          f"synchronize_layer calls: {synchronizer.calls}")
    check(synchronizer.calls[0][2] != threading.current_thread().name, "synchronize_layer ran on the caller")
    ctx.wait()  # transfer cache end
    _unlink(datadist, DECODER_CLUSTER_ID)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def decoder(ctx: Ctx) -> None:
    datadist = init_llm_datadist(ctx, LLMRole.DECODER, DECODER_CLUSTER_ID)
    cache_manager = datadist.cache_manager
    tensors = [torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(desc(ctx), [int(t.data_ptr()) for t in tensors],
                                                BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    ctx.wait()  # register end
    ctx.wait()  # prompt transfer cache end
    for tensor in tensors:
        check(bool((tensor == 1).all()), f"after prompt transfer cache: {tensor}")
    _unlink(datadist, PROMPT_CLUSTER_ID)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
