"""Run a sample port's roles as separate processes and give them what ``torch.distributed`` gives the
samples: a barrier and a few shared integers. A role fails by raising; the run then releases the
others from the barrier and reports every role's exit code."""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvpush.compat.llm_datadist import Placement

BARRIER_TIMEOUT_S = 60.0
HOST_IP = "127.0.0.1"


@dataclass
class Ctx:
    """What one role process gets: ``wait()`` is the samples' ``dist.barrier()``."""

    barrier: Any  # multiprocessing Barrier
    values: Any  # multiprocessing Array of int64
    placement: Placement
    variant: str  # "as-sample" or "host-memory"

    def wait(self) -> None:
        self.barrier.wait(BARRIER_TIMEOUT_S)

    def put(self, index: int, value: int) -> None:
        self.values[index] = value

    def get(self, index: int) -> int:
        return int(self.values[index])

    @property
    def as_sample(self) -> bool:
        return self.variant == "as-sample"


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST_IP, 0))
        port: int = probe.getsockname()[1]
        return port


_TORCH_CTYPES = {torch.float32: ctypes.c_float, torch.float16: ctypes.c_uint16, torch.int32: ctypes.c_int32}


def tensors_at(shape: list[int], dtype: torch.dtype, addrs: list[int]) -> list[torch.Tensor]:
    """The CPU stand-in for ``torchair.llm_datadist.create_npu_tensors``: torch tensors over memory
    kvpush allocated (``cache.tensor_addrs``)."""
    count = 1
    for dim in shape:
        count *= dim
    return [torch.frombuffer((_TORCH_CTYPES[dtype] * count).from_address(addr), dtype=dtype).view(*shape)
            for addr in addrs]


def _role_main(module: str, role: str, ctx: Ctx) -> None:
    logging.basicConfig(format=f"%(asctime)s [{role}] %(name)s %(message)s", level=logging.INFO)
    logging.getLogger("kvpush").setLevel(logging.WARNING)
    getattr(importlib.import_module(module), role)(ctx)


def run(module: str, roles: list[str], placement: Placement, variant: str, values: dict[int, int],
        timeout: float = 120.0) -> dict[str, int | None]:
    """Start one process per role of ``module`` (``module.<role>(ctx)``), wait for all; exit codes."""
    context = multiprocessing.get_context("spawn")
    shared = context.Array("q", 16)
    for index, value in values.items():
        shared[index] = value
    ctx = Ctx(context.Barrier(len(roles)), shared, placement, variant)
    processes = [context.Process(target=_role_main, args=(module, role, ctx), name=role) for role in roles]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    try:
        while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
            for process in processes:
                process.join(0.05)
            if any(process.exitcode not in (None, 0) for process in processes):
                ctx.barrier.abort()  # a role failed: the others stop waiting for it
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
    return {process.name: process.exitcode for process in processes}
