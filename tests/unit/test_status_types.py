"""kvpush/status.py, kvpush/types.py, kvpush/options.py: names, numbers, argument checks."""

from __future__ import annotations

import pytest

from kvpush import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LLMConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from kvpush.options import parse_options


def test_status_codes_have_llm_datadist_values() -> None:
    assert LLMStatusCode.LLM_SUCCESS == 0
    assert LLMStatusCode.LLM_FAILED == 0xFFFFFFFF
    assert LLMStatusCode.LLM_KV_CACHE_NOT_EXIST == 0x5010B002
    assert LLMStatusCode.LLM_PARAM_INVALID == 0x5010B005
    assert LLMStatusCode.LLM_NOT_YET_LINK == 0x5010B007
    assert LLMStatusCode.LLM_ALREADY_LINK == 0x5010B008
    assert LLMStatusCode.LLM_LINK_FAILED == 0x5010B009
    assert LLMStatusCode.LLM_UNLINK_FAILED == 0x5010B00A
    assert LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT == 0x5010B00C
    assert LLMStatusCode.LLM_PROCESSING_LINK == 0x5010B00D
    assert LLMStatusCode.LLM_EXIST_LINK == 0x5010B018
    assert LLMStatusCode.LLM_FEATURE_NOT_ENABLED == 0x5010B019
    assert LLMStatusCode.LLM_TIMEOUT == 0x5010B01A
    assert LLMStatusCode.LLM_LINK_BUSY == 0x5010B01B
    assert LLMStatusCode.LLM_OUT_OF_MEMORY == 0x5010B01C
    assert LLMStatusCode.LLM_UNKNOWN_ERROR == -1
    assert LLMStatusCode.from_wire(0x5010B01A) is LLMStatusCode.LLM_TIMEOUT
    assert LLMStatusCode.from_wire(12345) is LLMStatusCode.LLM_FAILED


def test_exception_carries_code_layers_and_is_runtime_error() -> None:
    error = LLMException(LLMStatusCode.LLM_TIMEOUT, "push_blocks: slow", [0, 1])
    assert isinstance(error, RuntimeError)
    assert error.status_code is LLMStatusCode.LLM_TIMEOUT
    assert error.completed_layers == [0, 1]
    assert "LLM_TIMEOUT" in str(error) and "push_blocks" in str(error)


def test_enums_values() -> None:
    assert (LLMRole.PROMPT, LLMRole.DECODER, LLMRole.MIX) == (1, 2, 3)
    assert (Placement.HOST, Placement.DEVICE) == (0, 1)
    expected = {"DT_FLOAT": (0, 4), "DT_FLOAT16": (1, 2), "DT_INT8": (2, 1), "DT_INT32": (3, 4),
                "DT_UINT8": (4, 1), "DT_INT16": (6, 2), "DT_UINT16": (7, 2), "DT_UINT32": (8, 4),
                "DT_INT64": (9, 8), "DT_UINT64": (10, 8), "DT_DOUBLE": (11, 8), "DT_BOOL": (12, 1),
                "DT_BF16": (27, 2)}
    for name, (value, itemsize) in expected.items():
        assert DataType[name] == value and DataType[name].itemsize == itemsize


def test_cache_desc_sizes_and_checks() -> None:
    desc = CacheDesc(4, (16, 8, 128), DataType.DT_FLOAT16)
    assert desc.size == 16 * 8 * 128 * 2 and desc.block_bytes == 8 * 128 * 2 and desc.num_blocks == 16
    assert desc == CacheDesc(4, [16, 8, 128], DataType.DT_FLOAT16)
    with pytest.raises(TypeError):
        CacheDesc("4", (16,), DataType.DT_FLOAT16)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CacheDesc(4, 16, DataType.DT_FLOAT16)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CacheDesc(4, (-1, 8), DataType.DT_FLOAT16)


def test_keys() -> None:
    assert BlocksCacheKey(3, 1).cluster_id == 3
    assert BlocksCacheKey(prompt_cluster_id=7).cluster_id == 7
    with pytest.raises(ValueError):
        BlocksCacheKey(1 << 64)
    with pytest.raises(ValueError):
        BlocksCacheKey(-1)
    with pytest.raises(TypeError):
        BlocksCacheKey("1")  # type: ignore[arg-type]
    key = CacheKeyByIdAndIndex(2, 5, 1)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (2, 5, 1)


def test_cache_keys_name_a_request_or_a_prefix() -> None:
    none = (1 << 64) - 1
    key = CacheKey(2, 7, model_id=1)
    assert (key.cluster_id, key.prompt_cluster_id, key.req_id, key.model_id, key.prefix_id) == (2, 2, 7, 1, none)
    assert key.name() == (0, 7, 1) and key.has_one_id and not key.is_placeholder
    prefix = CacheKey(prompt_cluster_id=2, prefix_id=9)
    assert prefix.name() == (1, 9, 0) and prefix.has_one_id  # a prefix: its own name space
    assert CacheKey(2).is_placeholder and not CacheKey(2).has_one_id  # neither id: names no slot
    assert not CacheKey(2, 7, 0, 9).has_one_id and CacheKey(2, 7, 0, 9).name() == (1, 9, 0)
    assert CacheKey(2, 7) == CacheKey(prompt_cluster_id=2, req_id=7) and len({CacheKey(2, 7), CacheKey(2, 7)}) == 1
    assert CacheKey(2, 7) != CacheKey(3, 7) and CacheKey(2, 7) != CacheKey(2, 7, 1)
    assert "req_id=7" in repr(key)
    with pytest.raises(ValueError):
        CacheKey(1, -1)
    with pytest.raises(ValueError):
        CacheKey(1, 1 << 64)
    with pytest.raises(TypeError):
        CacheKey(1, "7")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CacheKey(1, 2, cluster_id=3)  # type: ignore[misc]
    with pytest.raises(TypeError):
        CacheKey(1, prompt_cluster_id=1)


def test_cluster_info_ipv4_ipv6_and_checks() -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = 9
    info.append_remote_ip_info("127.0.0.1", 26000)
    info.append_remote_ip_info("::1", 26001)
    info.append_remote_ip_info(0x7F000001, 26002)
    assert info.remote_ip_info == [("127.0.0.1", 26000), ("::1", 26001), ("127.0.0.1", 26002)]
    with pytest.raises(ValueError):
        info.append_remote_ip_info("127.0.0.1", 70000)
    with pytest.raises(TypeError):
        info.append_remote_ip_info(None, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        info.remote_cluster_id = -3


def test_ext_param_checks() -> None:
    assert KvCacheExtParam().src_layer_range == (-1, -1)
    with pytest.raises(TypeError):
        KvCacheExtParam(src_layer_range=3)  # type: ignore[arg-type]


def test_llm_config_generates_llm_datadist_keys() -> None:
    config = LLMConfig()
    config.listen_ip_info = "127.0.0.1:26000"
    config.sync_kv_timeout = 500
    config.enable_remote_cache_accessible = True
    config.device_id = 0
    config.transport = "tcp"
    options = config.generate_options()
    assert options["llm.listenIpInfo"] == "127.0.0.1:26000"
    assert options["llm.SyncKvCacheWaitTime"] == "500"
    assert options["ge.exec.deviceId"] == "0"
    assert options["kvpush.transport"] == "tcp"
    parsed = parse_options(options)
    assert parsed.listen == ("127.0.0.1", 26000) and parsed.sync_kv_timeout_ms == 500
    with pytest.raises(AttributeError):
        config.sync_kv_timout = 3  # type: ignore[attr-defined]


@pytest.mark.parametrize("options, fragment", [
    ({"llm.NoSuchKey": "1"}, "llm.NoSuchKey"),
    ({"llm.SyncKvCacheWaitTime": "0"}, "llm.SyncKvCacheWaitTime"),
    ({"llm.SyncKvCacheWaitTime": "soon"}, "llm.SyncKvCacheWaitTime"),
    ({"llm.listenIpInfo": "127.0.0.1"}, "llm.listenIpInfo"),
    ({"kvpush.transport": "carrier-pigeon"}, "kvpush.transport"),
])
def test_bad_options_name_the_key(options: dict[str, str], fragment: str) -> None:
    with pytest.raises(LLMException) as caught:
        parse_options(options)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert fragment in str(caught.value)


def test_listen_ip_info_ipv6() -> None:
    assert parse_options({"llm.listenIpInfo": "[::1]:0"}).listen == ("::1", 0)
