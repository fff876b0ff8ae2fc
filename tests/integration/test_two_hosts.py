"""Two "hosts": network namespaces joined by a veth pair, created (and always removed) by the test.
Decode runs in one, prefill in the other; a push crosses the veth over TCP, and ``transport="auto"``
must not pick the same-host path, because these are different hosts as far as the network goes."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from peer import Peer, pattern

from transports import ucx

SUBNET = "10.213.{}.{}"  # exists only inside the test's namespaces


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def two_hosts() -> Iterator[tuple[tuple[str, str, str], tuple[str, str, str]]]:
    """((ns_a, addr_a, veth_a), (ns_b, addr_b, veth_b)); skipped, with the reason, where namespaces
    cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"kvp-{tag}-a", f"kvp-{tag}-b"
    veth_a, veth_b = f"kv{tag}a", f"kv{tag}b"
    octet = int(tag[:2], 16)
    addr_a, addr_b = SUBNET.format(octet, 1), SUBNET.format(octet, 2)
    created: list[str] = []
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", ns_a)
        _ip("link", "set", veth_b, "netns", ns_b)
        for ns, veth, addr in ((ns_a, veth_a, addr_a), (ns_b, veth_b, addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        stderr = getattr(error, "stderr", b"") or b""
        pytest.skip(f"cannot create network namespaces here: {stderr.decode(errors='replace').strip() or error}")
    try:
        yield (ns_a, addr_a, veth_a), (ns_b, addr_b, veth_b)
    finally:
        for ns in created:  # deleting a namespace also deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


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


def test_explicit_same_host_transport_across_namespaces_is_refused(two_hosts: Any) -> None:
    (ns_a, addr_a, _), (ns_b, _, _) = two_hosts
    with Peer(2, options={"llm.listenIpInfo": f"{addr_a}:0"}, wrapper=["ip", "netns", "exec", ns_a]) as decode, \
            Peer(1, options={"kvpush.transport": "cma"}, role=1, wrapper=["ip", "netns", "exec", ns_b]) as prefill:
        linked = prefill.call("link", cluster_id=2, host=addr_a, port=decode.port)
        assert linked["codes"] == [0x5010B019]  # LLM_FEATURE_NOT_ENABLED
