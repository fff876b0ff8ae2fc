"""transports/ucp.py: kvpush's own UCP binding, built against the installed UCX headers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from transports import ucp, ucx

pytestmark = pytest.mark.skipif(ucx.available() is not None, reason=f"UCX unavailable: {ucx.available()}")


async def test_put_and_get_between_two_workers_in_one_loop() -> None:
    loop = asyncio.get_running_loop()
    left, right = ucp.Worker(loop), ucp.Worker(loop)
    try:
        target = np.zeros(1 << 20, np.uint8)
        memh, packed = right.map(target.ctypes.data, target.nbytes)
        errors: list[str] = []
        endpoint = left.connect(right.address, errors.append)
        back = right.connect(left.address, errors.append)
        rkey = endpoint.unpack_rkey(packed)
        source = np.random.default_rng(3).integers(0, 256, 64 * 1024, dtype=np.uint8)
        sizes = np.full(16, 4096, np.uint64)
        local = np.stack([source.ctypes.data + np.arange(16, dtype=np.uint64) * 4096, sizes], 1)
        slots = np.array([5, 200, 3, 17, 99, 100, 101, 0, 250, 7, 8, 9, 60, 61, 62, 63], np.uint64)
        remote = np.stack([target.ctypes.data + slots * 4096, sizes], 1)
        await asyncio.wait_for(endpoint.rma(False, local, remote, np.zeros(16, np.uint32), [rkey]), 10)
        for i, slot in enumerate(slots.tolist()):
            assert np.array_equal(target[slot * 4096:(slot + 1) * 4096], source[i * 4096:(i + 1) * 4096])
        pulled = np.zeros(64 * 1024, np.uint8)
        local_back = np.stack([pulled.ctypes.data + np.arange(16, dtype=np.uint64) * 4096, sizes], 1)
        await asyncio.wait_for(endpoint.rma(True, local_back, remote, np.zeros(16, np.uint32), [rkey]), 10)
        assert np.array_equal(pulled, source) and errors == []
        endpoint.close()
        back.close()
        right.unmap(memh)
    finally:
        left.close()
        right.close()


async def test_an_idle_worker_costs_no_cpu() -> None:
    worker = ucp.Worker(asyncio.get_running_loop())
    try:
        start = time.process_time()
        await asyncio.sleep(0.5)
        assert time.process_time() - start < 0.25  # busy polling would burn the whole half second
    finally:
        worker.close()


def test_without_the_extra_the_transport_says_what_is_missing() -> None:
    script = """
import asyncio, sys
sys.modules["libucx"] = None  # as if the 'ucx' extra were not installed
from kvpush import LLMDataDist, LLMException, LLMRole
async def main():
    try:
        await LLMDataDist(LLMRole.PROMPT, 1).init({"kvpush.transport": "ucx"})
    except LLMException as error:
        print(hex(error.status_code), error)
        return
    print("no error")
asyncio.run(main())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith("0x5010b019"), result.stdout + result.stderr
    assert "libucx-cu12" in result.stdout and "kvpush[ucx]" in result.stdout


async def test_the_ucx_transport_choice_leaves_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    service = ucx.UcxService(asyncio.get_running_loop())
    try:
        assert "UCX_TLS" not in os.environ  # child processes (and other libraries) keep UCX's defaults
    finally:
        service.close()
