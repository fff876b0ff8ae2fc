"""Two "hosts": network namespaces joined by a veth pair, created (and always removed) by the test.
Decode runs in one, prefill in the other; a push crosses the veth over TCP, and ``transport="auto"``
must not pick the same-host path, because these are different hosts as far as the network goes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from peer import Peer, pattern

from transports import ucx

TRANSPORTS = ["auto", "tcp"] + (["ucx"] if ucx.available() is None else [])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_between_two_namespaces(two_hosts: Any, tmp_path: Any, transport: str) -> None:
    (ns_a, addr_a, veth_a), (ns_b, _, veth_b) = two_hosts
    options = {"llm.listenIpInfo": f"{addr_a}:0", "kvpush.transport": transport}
    with Peer(2, options=options, wrapper=["ip", "netns", "exec", ns_a], env={"UCX_NET_DEVICES": veth_a}) as decode, \
            Peer(1, options={"kvpush.transport": transport}, role=1, wrapper=["ip", "netns", "exec", ns_b],
                 env={"UCX_NET_DEVICES": veth_b}) as prefill:
        decode.call("allocate", name="kv", num_tensors=4, shape=[64, 2048], model_id=0)
        prefill.call("allocate", name="kv", num_tensors=4, shape=[32, 2048], model_id=0, seed=41)
        linked = prefill.call("link", cluster_id=2, host=addr_a, port=decode.port)
        assert linked["codes"] == [0]
        links = prefill.call("link_info")["links"]
        # never the same-host path between two network namespaces
        assert links["2"]["transport"] == ("ucx" if transport == "ucx" else "tcp")
        if transport == "auto":
            assert "another host" in links["2"]["fallback_reason"]
        src_blocks, dst_blocks = [0, 1, 2, 9, 31], [60, 61, 62, 3, 0]
        prefill.call("push", name="kv", cluster_id=2, src_blocks=src_blocks, dst_blocks=dst_blocks)
        got = decode.snapshot("kv", tmp_path).reshape(4, 64, -1)
        for tensor in range(4):
            source = pattern(41, tensor, 32 * 4096).reshape(32, -1)
            assert np.array_equal(got[tensor][dst_blocks], source[src_blocks])
        untouched = sorted(set(range(64)) - set(dst_blocks))
        assert not got[:, untouched].any()
        # across hosts the sender's copy overlaps the wire: nothing tells a layer pusher's caller to hold back
        held = prefill.call("hold_pusher", name="kv", cluster_id=2, src_blocks=[0], dst_blocks=[1])
        assert held["copies_here"] is False


def test_explicit_same_host_transport_across_namespaces_is_refused(two_hosts: Any) -> None:
    (ns_a, addr_a, _), (ns_b, _, _) = two_hosts
    with Peer(2, options={"llm.listenIpInfo": f"{addr_a}:0"}, wrapper=["ip", "netns", "exec", ns_a]) as decode, \
            Peer(1, options={"kvpush.transport": "cma"}, role=1, wrapper=["ip", "netns", "exec", ns_b]) as prefill:
        linked = prefill.call("link", cluster_id=2, host=addr_a, port=decode.port)
        assert linked["codes"] == [0x5010B019]  # LLM_FEATURE_NOT_ENABLED
