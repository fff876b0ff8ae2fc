"""kvpush/options.py: LLMConfig as LLM-DataDist's LlmConfig (fields, checks, generated keys and value
formats) and parse_options (what takes effect, what is accepted and noted, what is refused)."""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

import pytest

from kvpush import LLMConfig, LLMException, LLMStatusCode
from kvpush.options import TRANSPORTS, EngineOptions, parse_options
from transports.registry import canonical_transport, transport_names


def config(**fields: Any) -> LLMConfig:
    made = LLMConfig()
    for name, value in fields.items():
        setattr(made, name, value)
    return made


# -- generate_options: LLM-DataDist's keys and value formats -------------------------------------------
def test_a_fresh_config_emits_only_memory_utilization_as_llm_datadist_does() -> None:
    assert LLMConfig().generate_options() == {"llm.MemoryUtilization": "0.95"}


@pytest.mark.parametrize("fields, expected", [
    ({"device_id": 3}, {"ge.exec.deviceId": "3", "ge.session_device_id": "3"}),
    ({"device_id": [4, 5, 6]}, {"ge.exec.deviceId": "4;5;6", "ge.session_device_id": "4"}),
    ({"device_id": (7,)}, {"ge.exec.deviceId": "7", "ge.session_device_id": "7"}),
    ({"sync_kv_timeout": 1500}, {"llm.SyncKvCacheWaitTime": "1500"}),
    ({"sync_kv_timeout": "2500"}, {"llm.SyncKvCacheWaitTime": "2500"}),
    ({"deploy_res_path": "/opt/res"}, {"llm.deployResPath": "/opt/res"}),
    ({"deploy_res_path": ""}, {}),
    ({"listen_ip_info": "10.0.0.1:26000"}, {"llm.listenIpInfo": "10.0.0.1:26000"}),
    ({"listen_ip_info": ""}, {}),
    ({"enable_switch_role": True}, {"llm.EnableSwitchRole": "1"}),
    ({"enable_switch_role": False}, {}),
    ({"enable_cache_manager": True}, {"llm.EnableCacheManager": "1"}),
    ({"enable_cache_manager": False}, {"llm.EnableCacheManager": "0"}),
    ({"enable_remote_cache_accessible": False}, {"llm.EnableRemoteCacheAccessible": "0"}),
    ({"link_total_time": 0}, {"llm.LinkTotalTime": "0"}),
    ({"link_retry_count": 7}, {"llm.LinkRetryCount": "7"}),
    ({"rdma_traffic_class": 132, "rdma_service_level": 4}, {"llm.RdmaTrafficClass": "132",
                                                           "llm.RdmaServiceLevel": "4"}),
    ({"local_comm_res": ""}, {"llm.LocalCommRes": ""}),
    ({"transfer_backend": "hixl"}, {"llm.TransferBackend": "hixl"}),
    ({"global_resource_config": '{"a": 1}'}, {"llm.GlobalResourceConfig": '{"a": 1}'}),
    ({"buf_pool_cfg": "x", "mem_pool_cfg": '{"memory_size": 1}', "host_mem_pool_cfg": '{"memory_size": 2}'},
     {"llm.BufPoolCfg": "x", "llm.MemPoolConfig": '{"memory_size": 1}', "llm.HostMemPoolConfig": '{"memory_size": 2}'}),
    ({"mem_pool_cfg": ""}, {}),
    ({"output_max_size": 1024}, {"llm.OutputMaxSize": "1024"}),
    ({"mem_utilization": 0.5}, {"llm.MemoryUtilization": "0.5"}),
    ({"transport": "tcp", "auth_token": "s3cret"}, {"kvpush.transport": "tcp", "kvpush.auth_token": "s3cret"}),
    ({"keepalive_interval_ms": 100, "keepalive_timeout_ms": 900}, {"kvpush.keepalive_interval_ms": "100",
                                                                   "kvpush.keepalive_timeout_ms": "900"}),
    ({"layer_merge_bytes": 0}, {"kvpush.layer_merge_bytes": "0"}),
])
def test_each_field_emits_llm_datadists_key_and_value_format(fields: dict[str, Any],
                                                             expected: dict[str, str]) -> None:
    options = config(**fields).generate_options()
    expected = {"llm.MemoryUtilization": "0.95", **expected}
    assert options == expected


def test_ge_options_come_first_and_fields_override_them() -> None:
    made = config(device_id=1)
    made.ge_options["ge.exec.deviceId"] = "9"  # vllm-ascend adds raw options this way
    made.ge_options["ge.flowGraphMemMaxSize"] = "1024"
    options = made.generate_options()
    assert list(options)[0] == "ge.exec.deviceId" and options["ge.exec.deviceId"] == "1"
    assert options["ge.flowGraphMemMaxSize"] == "1024"
    made.ge_options = {"ge.other": "x"}
    assert made.generate_options()["ge.other"] == "x"


def test_cluster_info_ips_become_llm_datadists_little_endian_integers() -> None:
    made = config(cluster_info=json.dumps({"cluster_id": 1, "listen_ip_info": [{"ip": "127.0.0.1", "port": 26000}]}))
    stored = json.loads(made.generate_options()["llm.ClusterInfo"])
    assert stored["listen_ip_info"][0] == {"ip": int.from_bytes(socket.inet_aton("127.0.0.1"), "little"), "port": 26000}
    assert stored["cluster_id"] == 1


def test_getters_read_as_llm_datadists_while_unset() -> None:
    made = LLMConfig()
    assert (made.link_retry_count, made.link_total_time, made.local_comm_res, made.transfer_backend,
            made.global_resource_config) == (1, 0, "", "", "")
    assert (made.enable_cache_manager, made.enable_remote_cache_accessible, made.enable_switch_role) == (False,) * 3
    assert (made.listen_ip_info, made.mem_utilization, made.device_id, made.sync_kv_timeout) == ("", 0.95, None, None)
    assert made.gen_options() == made.generate_options() == made.options


# -- setters: LLM-DataDist's checks and error classes --------------------------------------------------
@pytest.mark.parametrize("name, value, error", [
    ("device_id", "0", TypeError),
    ("device_id", [0, "1"], TypeError),
    ("device_id", -1, LLMException),
    ("device_id", [0, -2], LLMException),
    ("device_id", 1 << 31, ValueError),
    ("sync_kv_timeout", 1.5, TypeError),
    ("sync_kv_timeout", 0, LLMException),
    ("sync_kv_timeout", "soon", LLMException),
    ("sync_kv_timeout", 1 << 31, ValueError),
    ("listen_ip_info", 26000, TypeError),
    ("link_total_time", -1, LLMException),
    ("link_total_time", 1 << 32, LLMException),
    ("link_retry_count", 0, LLMException),
    ("link_retry_count", 101, LLMException),
    ("link_retry_count", "2", TypeError),
    ("mem_utilization", 1, TypeError),
    ("mem_utilization", 1.5, LLMException),
    ("enable_cache_manager", 1, TypeError),
    ("enable_switch_role", "yes", TypeError),
    ("rdma_traffic_class", -1, ValueError),
    ("rdma_service_level", 1 << 32, ValueError),
    ("local_comm_res", None, TypeError),
    ("transfer_backend", 1, TypeError),
    ("cluster_info", "{not json", ValueError),
    ("ge_options", {"k": 1}, TypeError),
    ("ge_options", ["k"], TypeError),
    ("output_max_size", "1", TypeError),
    ("keepalive_interval_ms", 0, LLMException),
])
def test_setters_check_as_llm_datadist_does(name: str, value: Any, error: type[Exception]) -> None:
    made = LLMConfig()
    before = made.generate_options()
    with pytest.raises(error) as caught:
        setattr(made, name, value)
    if error is LLMException:
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # type: ignore[attr-defined]
    assert made.generate_options() == before  # a refused value leaves the config as it was


def test_an_unknown_attribute_is_an_error_not_silently_dropped() -> None:
    with pytest.raises(AttributeError):
        LLMConfig().sync_kv_timout = 100  # type: ignore[attr-defined]


# -- parse_options ---------------------------------------------------------------------------------
def full_config() -> LLMConfig:
    return config(device_id=[0, 1], sync_kv_timeout=2000, deploy_res_path="/res", listen_ip_info="127.0.0.1:0",
                  enable_switch_role=True, link_total_time=5000, link_retry_count=3,
                  cluster_info='{"listen_ip_info": [{"ip": "127.0.0.1", "port": 1}]}', output_max_size=64,
                  mem_utilization=0.9, buf_pool_cfg="b", mem_pool_cfg='{"memory_size": 1}',
                  host_mem_pool_cfg='{"memory_size": 1}', enable_cache_manager=True,
                  enable_remote_cache_accessible=False, rdma_traffic_class=1, rdma_service_level=2,
                  local_comm_res="", transfer_backend="hixl", global_resource_config="{}", transport="tcp")


def test_every_key_llm_datadist_emits_is_accepted_and_the_meaningful_ones_take_effect(
        caplog: pytest.LogCaptureFixture) -> None:
    options = full_config().generate_options()
    with caplog.at_level(logging.DEBUG, logger="kvpush.options"):
        parsed = parse_options(options)
    assert parsed == EngineOptions(listen=("127.0.0.1", 0), sync_kv_timeout_ms=2000, transport="tcp",
                                   link_retry_count=3, link_total_time_ms=5000, enable_remote_cache_accessible=False)
    effective = {"llm.listenIpInfo", "llm.SyncKvCacheWaitTime", "llm.LinkRetryCount", "llm.LinkTotalTime",
                 "llm.EnableRemoteCacheAccessible", "kvpush.transport"}
    for key in set(options) - effective:  # the hardware-only ones: each noted in the debug log
        assert f"option {key}=" in caplog.text, key
    assert parse_options(full_config()) == parsed  # the LLMConfig itself is accepted too


@pytest.mark.parametrize("key, value", [
    ("ge.exec.deviceId", "0;1"), ("ge.session_device_id", "0"), ("ge.flowGraphMemMaxSize", "1024"),
    ("llm.DeviceId", "0"), ("llm.MemUtilization", "0.9"), ("llm.RefInputShapes", "1,2;1,2"),
    ("llm.RefInputDtypes", "1;1"), ("llm.RefInputSeqLenDimIndex", "1"), ("llm.kvTensorFormat", "BSH"),
    ("llm.ListenIpInfo", "127.0.0.1:26000"), ("kvpush.auth_token", ""),
])
def test_other_keys_llm_datadist_defines_are_accepted(key: str, value: str) -> None:
    parse_options({key: value})


@pytest.mark.parametrize("options, fragment", [
    ({"llm.NoSuchKey": "1"}, "llm.NoSuchKey"),
    ({"llm.Role": "Prompt"}, "llm.Role"),  # LLM-DataDist sets it itself; a caller does not
    ({"kvpush.transprt": "tcp"}, "kvpush.transprt"),
    ({"LLM.listenIpInfo": "127.0.0.1:1"}, "LLM.listenIpInfo"),
    ({"llm.MemoryUtilization": "1.5"}, "llm.MemoryUtilization"),
    ({"llm.MemoryUtilization": "most"}, "llm.MemoryUtilization"),
    ({"llm.EnableSwitchRole": "maybe"}, "llm.EnableSwitchRole"),
    ({"llm.EnableCacheManager": "2"}, "llm.EnableCacheManager"),
    ({"llm.ClusterInfo": "{"}, "llm.ClusterInfo"),
    ({"llm.RdmaTrafficClass": "-1"}, "llm.RdmaTrafficClass"),
    ({"llm.OutputMaxSize": "lots"}, "llm.OutputMaxSize"),
    ({"llm.LinkTotalTime": "-1"}, "llm.LinkTotalTime"),
    ({"llm.LinkRetryCount": "0"}, "llm.LinkRetryCount"),
    ({"llm.SyncKvCacheWaitTime": "0"}, "llm.SyncKvCacheWaitTime"),
    ({"kvpush.keepalive_interval_ms": "500", "kvpush.keepalive_timeout_ms": "400"}, "keepalive_timeout_ms"),
    ({"kvpush.layer_merge_bytes": "-1"}, "kvpush.layer_merge_bytes"),
    ({"kvpush.layer_merge_bytes": "2M"}, "kvpush.layer_merge_bytes"),
])
def test_unknown_keys_and_bad_values_are_param_invalid_naming_the_key(options: dict[str, str],
                                                                       fragment: str) -> None:
    with pytest.raises(LLMException) as caught:
        parse_options(options)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert fragment in str(caught.value)


def test_layer_merge_bytes_defaults_to_2_mib_and_takes_0() -> None:
    assert EngineOptions().layer_merge_bytes == 2 << 20
    assert parse_options({"kvpush.layer_merge_bytes": "0"}).layer_merge_bytes == 0
    assert parse_options(config(layer_merge_bytes=1 << 30)).layer_merge_bytes == 1 << 30
    with pytest.raises(LLMException):
        config(layer_merge_bytes=-1)


def test_options_must_be_a_dict_of_str_keys() -> None:
    with pytest.raises(TypeError):
        parse_options([("llm.listenIpInfo", "127.0.0.1:0")])
    with pytest.raises(TypeError):
        parse_options({1: "x"})
    assert parse_options(None) == EngineOptions()


# -- transport names come from the transport registry -------------------------------------------------
def test_transport_names_are_the_registrys() -> None:
    assert TRANSPORTS == transport_names() and TRANSPORTS[0] == "auto"
    for name in transport_names():
        assert parse_options({"kvpush.transport": name}).transport == name


@pytest.mark.parametrize("alias", ["shm", "same-host"])
def test_transport_aliases_resolve_as_the_registry_says(alias: str) -> None:
    assert parse_options({"kvpush.transport": alias}).transport == canonical_transport(alias) == "cma"


def test_an_unknown_transport_lists_the_names() -> None:
    with pytest.raises(LLMException) as caught:
        parse_options({"kvpush.transport": "carrier-pigeon"})
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert all(name in str(caught.value) for name in transport_names())
