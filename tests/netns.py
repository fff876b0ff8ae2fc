"""Two "hosts" for tests: network namespaces joined by a veth pair, created by the test and always
removed, with addresses (10.213.x.0/24) that exist only inside them."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest

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
