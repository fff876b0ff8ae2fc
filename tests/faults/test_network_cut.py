"""Cutting the network between two hosts (network namespaces): a transfer in flight still ends
within its deadline, the dead link is noticed by keepalive with no transfer running, and linking
again works once the network is back."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest
from peer import Peer

from transports import ucx

TRANSPORTS = ["tcp"] + (["ucx"] if ucx.available() is None else [])


def _veth(ns: str, veth: str, state: str) -> None:
    subprocess.run(["ip", "-n", ns, "link", "set", veth, state], check=True, capture_output=True, timeout=20)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cut_network_ends_transfers_and_links_heal(two_hosts: Any, transport: str) -> None:
    (ns_a, addr_a, veth_a), (ns_b, _, veth_b) = two_hosts
    common = {"kvpush.transport": transport, "llm.SyncKvCacheWaitTime": "500"}
    with Peer(2, options={"llm.listenIpInfo": f"{addr_a}:0", **common}, wrapper=["ip", "netns", "exec", ns_a],
              env={"UCX_NET_DEVICES": veth_a}) as decode, \
            Peer(1, options=common, role=1, wrapper=["ip", "netns", "exec", ns_b],
                 env={"UCX_NET_DEVICES": veth_b}) as prefill:
        decode.call("allocate", name="kv", num_tensors=4, shape=[64, 8192], model_id=0)
        prefill.call("allocate", name="kv", num_tensors=4, shape=[64, 8192], model_id=0, seed=3)
        assert prefill.call("link", cluster_id=2, host=addr_a, port=decode.port)["codes"] == [0]
        assert prefill.call("try_push", name="kv", cluster_id=2, src_blocks=[0], dst_blocks=[1])["status"] == 0
        _veth(ns_b, veth_b, "down")
        try:
            ended = prefill.call("try_push", name="kv", cluster_id=2, src_blocks=list(range(64)),
                                 dst_blocks=list(range(64)))
            # a terminal state, within the deadline of the layers (plus their clean-up grace)
            assert ended["status"] in (0x5010B01A, 0x5010B007), ended  # LLM_TIMEOUT / LLM_NOT_YET_LINK
            assert ended["seconds"] < 5
            deadline = time.monotonic() + 5  # keepalive: 1 s of silence by default
            while prefill.call("links")["links"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert prefill.call("links")["links"] == []
            assert prefill.call("try_push", name="kv", cluster_id=2, src_blocks=[0], dst_blocks=[1])["status"] == \
                0x5010B007  # LLM_NOT_YET_LINK
        finally:
            _veth(ns_b, veth_b, "up")
        deadline = time.monotonic() + 10
        while decode.call("links")["links"] and time.monotonic() < deadline:  # the other end noticed too
            time.sleep(0.05)
        codes = prefill.call("link", cluster_id=2, host=addr_a, port=decode.port, timeout=5000)["codes"]
        assert codes == [0]
        assert prefill.call("try_push", name="kv", cluster_id=2, src_blocks=[5], dst_blocks=[6])["status"] == 0
