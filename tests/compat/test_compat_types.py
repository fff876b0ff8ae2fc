"""kvpush.compat.llm_datadist's value types as LLM-DataDist defines them (``v2/llm_types.py``,
``configs.py``, ``status.py``): constructors, defaults, checks and error classes."""

from __future__ import annotations

import pickle

import pytest

import kvpush
from kvpush.compat import llm_datadist as compat
from kvpush.compat.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMClusterInfo,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    Status,
)

U64_MAX = (1 << 64) - 1


def test_every_name_llm_datadist_exports_is_here() -> None:
    real = {"LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig", "DataType",
            "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache", "BlocksCacheKey",
            "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer", "TransferConfig", "CacheTask",
            "TransferWithCacheKeyConfig", "Memtype", "MemInfo"}
    assert real <= set(compat.__all__)
    for name in compat.__all__:
        assert getattr(compat, name) is not None


def test_blocks_cache_key_needs_a_cluster_id_as_in_llm_datadist() -> None:
    for make in (lambda: BlocksCacheKey(), lambda: BlocksCacheKey(model_id=1)):
        with pytest.raises(LLMException, match="cluster_id is required") as caught:
            make()
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException, match="over limit"):
        BlocksCacheKey(1, 2, 3)
    with pytest.raises(LLMException, match="Unsupported"):
        BlocksCacheKey(cluster_id=1, model=2)
    with pytest.raises(TypeError, match="only support"):
        BlocksCacheKey("aa")
    key = BlocksCacheKey(prompt_cluster_id=1, model_id=1)
    assert (key.cluster_id, key.prompt_cluster_id, key.model_id) == (1, 1, 1)
    assert BlocksCacheKey(cluster_id=5).model_id == 0
    assert isinstance(key, kvpush.BlocksCacheKey)  # the engine takes it as its own
    assert kvpush.BlocksCacheKey().cluster_id == 0  # kvpush's own key keeps its default


def test_cache_key_as_in_llm_datadist() -> None:
    with pytest.raises(LLMException, match="cluster_id is required"):
        CacheKey(req_id=1, model_id=1, prefix_id=1)
    with pytest.raises(LLMException, match="req_id is required"):
        CacheKey(cluster_id=1, model_id=1, prefix_id=1)
    with pytest.raises(LLMException, match="Unsupported"):
        CacheKey(cluster_id=1, req_id=1, prefix_id1=1)
    key = CacheKey(1, 2, 3, 4)
    assert (key.cluster_id, key.req_id, key.model_id, key.prefix_id) == (1, 2, 3, 4)
    key = CacheKey(prompt_cluster_id=1, req_id=2)
    assert (key.prompt_cluster_id, key.model_id, key.prefix_id) == (1, 0, U64_MAX)
    with pytest.raises(ValueError):
        CacheKey(cluster_id=-1, req_id=1)
    assert CacheKey(1, 2) == CacheKey(cluster_id=1, req_id=2) and len({CacheKey(1, 2), CacheKey(1, 2)}) == 1
    CacheKey(1, 2).check_one_id()
    for neither_or_both in (CacheKey(1, U64_MAX), CacheKey(1, 2, 0, 3)):
        with pytest.raises(LLMException, match="req id and prefix id"):
            neither_or_both.check_one_id()


def test_cache_desc_defaults_to_device_and_has_llm_datadists_fields() -> None:
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT16)
    assert desc.placement == Placement.DEVICE and isinstance(desc, kvpush.CacheDesc)
    assert (desc.batch_dim_index, desc.batch_dim, desc.batch_size, desc.seq_len_dim_index, desc.kv_tensor_format) \
        == (0, 0, 4, -1, None)
    assert kvpush.CacheDesc(2, [4, 8], DataType.DT_FLOAT16).placement == Placement.HOST  # kvpush's own default
    shaped = CacheDesc(1, [3, 16, 8], DataType.DT_INT8, Placement.HOST, 1, 1, "BSH")
    assert (shaped.batch_size, shaped.seq_len_dim_index, shaped.kv_tensor_format) == (16, 1, "BSH")
    shaped.update_dim(1, 32)
    assert list(shaped.shape) == [3, 32, 8] and shaped.batch_size == 32 and shaped.size == 3 * 32 * 8
    with pytest.raises(ValueError):
        CacheDesc(-1, [2, 4], DataType.DT_INT8)
    with pytest.raises(LLMException, match="batch_dim_index"):
        CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE, 2)
    with pytest.raises(LLMException, match="seq_len_dim_index"):
        CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE, 0, 5)
    with pytest.raises(TypeError):
        CacheDesc(1, [2, 4], 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CacheDesc(1, [2, 4], DataType.DT_INT8, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CacheDesc(1, [2, 4], DataType.DT_INT8, kv_tensor_format=3)  # type: ignore[arg-type]


def test_cpu_caches() -> None:
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT, Placement.HOST)
    cache = Cache.create_cpu_cache(desc, [4096, 8192])
    assert (cache.cache_id, cache.tensor_addrs, cache.is_blocks_cache) == (-1, [4096, 8192], True)
    with pytest.raises(ValueError, match="HOST"):
        Cache.create_cpu_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT), [1, 2])
    with pytest.raises(ValueError, match="num_tensors"):
        Cache.create_cpu_cache(desc, [1])
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(desc, (1, 2))  # type: ignore[arg-type]
    kv = KvCache.create_cpu_cache(desc, [1, 2])
    assert (kv.cache_id, kv.per_device_tensor_addrs) == (-1, [[1, 2]])
    assert KvCache.create_cpu_cache(desc, [[1, 2], [3, 4]]).per_device_tensor_addrs == [[1, 2], [3, 4]]
    with pytest.raises(LLMException, match="consistent"):
        KvCache.create_cpu_cache(desc, [[1, 2], 3])  # type: ignore[list-item]


def test_llm_exception_both_ways_of_making_one() -> None:
    theirs = LLMException("pull failed", status_code=LLMStatusCode.LLM_TIMEOUT)
    assert str(theirs) == "pull failed" and theirs.status_code == LLMStatusCode.LLM_TIMEOUT
    assert LLMException("no code").status_code == LLMStatusCode.LLM_SUCCESS  # LLM-DataDist's default
    ours = LLMException(LLMStatusCode.LLM_TIMEOUT, "push_blocks: slow", [0, 1])
    assert str(ours) == "[LLM_TIMEOUT] push_blocks: slow" and ours.completed_layers == [0, 1]
    assert LLMException(LLMStatusCode.LLM_PARAM_INVALID).status_code == LLMStatusCode.LLM_PARAM_INVALID
    by_keyword = LLMException(status_code=LLMStatusCode.LLM_TIMEOUT, message="slow", completed_layers=[3])
    assert (str(by_keyword), by_keyword.completed_layers) == ("[LLM_TIMEOUT] slow", [3])
    assert str(LLMException(LLMStatusCode.LLM_TIMEOUT, message="slow")) == "[LLM_TIMEOUT] slow"
    for error in (theirs, ours):
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), str(copy), copy.status_code, copy.completed_layers) == (
            LLMException, str(error), error.status_code, error.completed_layers)


def test_enums_print_as_llm_datadist_prints_them() -> None:
    assert str(LLMRole.PROMPT) == "LLMRole.PROMPT" and f"{LLMRole.DECODER}" == "LLMRole.DECODER"
    assert str(Placement.DEVICE) == "Placement.DEVICE"
    assert str(LLMStatusCode.LLM_SUCCESS) == "LLMStatusCode.LLM_SUCCESS"
    assert int(LLMStatusCode.LLM_TIMEOUT) == 0x5010B01A
    assert LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT == LLMStatusCode.LLM_WAIT_PROC_TIMEOUT
    assert LLMStatusCode.LLM_SEQ_LENOVERLIMIT == LLMStatusCode.LLM_SEQ_LEN_OVER_LIMIT
    assert (LLMStatusCode.LLM_DEVICE_MEM_ERROR, LLMStatusCode.LLM_SUSPECT_REMOTE_ERROR) == (507053, 507057)
    assert [status.value for status in RegisterMemStatus] == [0, 1, 2]
    assert [kind.value for kind in Memtype] == [0, 1]


def test_cluster_info_has_llm_datadists_properties() -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = 7
    info.remote_role_type = LLMRole.PROMPT
    info.append_local_ip_info("127.0.0.1", 26001)
    info.append_remote_ip_info("::1", 26000)
    assert info.remote_role_type == LLMRole.PROMPT
    assert info.local_ip_info_list == [("127.0.0.1", 26001)] and info.remote_ip_info_list == [("::1", 26000)]
    with pytest.raises(TypeError):
        info.remote_role_type = "prompt"  # type: ignore[assignment]


def test_status_and_mem_info() -> None:
    assert Status(LLMStatusCode.LLM_SUCCESS).is_ok() and not Status(LLMStatusCode.LLM_TIMEOUT).is_ok()
    assert Status(LLMStatusCode.LLM_TIMEOUT).status_code == LLMStatusCode.LLM_TIMEOUT
    info = MemInfo(Memtype.MEM_TYPE_DEVICE, 1234, 1)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_DEVICE, 1234, 1)
    with pytest.raises(TypeError):
        MemInfo(0, 1, 1)  # type: ignore[arg-type]
