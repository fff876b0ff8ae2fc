"""transports/cma.py against a real second process: identity checks, dead and replaced targets."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpush.layout import IoVec
from transports import cma

pytestmark = pytest.mark.skipif(not cma.AVAILABLE, reason="cross-memory attach needs Linux with pidfd_open")

CHILD = """
import json, sys, ctypes
from transports.cma import Probe
probe = Probe()
target = ctypes.create_string_buffer(4096)
print(json.dumps({**probe.describe(), "target": ctypes.addressof(target)}), flush=True)
sys.stdin.read()
print(target.raw[:16].hex(), flush=True)
"""


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    description = json.loads(proc.stdout.readline())
    yield proc, description
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def one(address: int, length: int) -> IoVec:
    return IoVec.of_ints((address, length))


def test_write_lands_in_the_peer(child: tuple[subprocess.Popen[str], dict[str, Any]]) -> None:
    proc, description = child
    peer = cma.CmaPeer(description)
    data = np.arange(16, dtype=np.uint8)
    assert peer.write(one(data.ctypes.data, 16), one(description["target"], 16)) == 16
    out, _ = proc.communicate("", timeout=10)
    assert out.strip() == data.tobytes().hex()
    peer.close()


def test_dead_peer_is_an_error_not_a_write(child: tuple[subprocess.Popen[str], dict[str, Any]]) -> None:
    proc, description = child
    peer = cma.CmaPeer(description)
    proc.kill()
    proc.wait(10)
    data = np.zeros(16, np.uint8)
    with pytest.raises(cma.CmaError) as caught:
        peer.write(one(data.ctypes.data, 16), one(description["target"], 16))
    assert caught.value.errno == errno.ESRCH
    peer.close()


@pytest.mark.parametrize("change", [{"start": 1}, {"token": "00" * 32}, {"pid": 1}, {"probe_addr": 4096}])
def test_wrong_identity_is_refused(child: tuple[subprocess.Popen[str], dict[str, Any]],
                                   change: dict[str, Any]) -> None:
    _, description = child
    with pytest.raises(cma.CmaError):
        cma.CmaPeer({**description, **change})


def test_unmapped_range_is_efault(child: tuple[subprocess.Popen[str], dict[str, Any]]) -> None:
    _, description = child
    peer = cma.CmaPeer(description)
    data = np.zeros(16, np.uint8)
    with pytest.raises(cma.CmaError) as caught:
        peer.write(one(data.ctypes.data, 16), one(8, 16))
    assert caught.value.errno == errno.EFAULT
    peer.close()


def test_host_identity_includes_namespaces() -> None:
    identity = cma.host_identity()
    assert "net:[" in identity and "pid:[" in identity
