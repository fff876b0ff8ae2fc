"""Run an example's roles as separate processes on this host and supervise them.

Not an example itself. It stands in for what the LLM-DataDist samples get from torch.distributed
(``dist.barrier()`` between the two roles, and a way to tell one role the other's port), and makes
every example self-checking: the run succeeds only if every role exits with status 0, a role that
fails releases the others from the barrier, and no process outlives the run.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BARRIER_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 90.0


@dataclass
class Shared:
    """What the roles share: a barrier and a few integers (ports, cache ids)."""

    barrier: Any  # multiprocessing Barrier
    values: Any  # multiprocessing Array of int64

    def wait(self) -> None:
        """``dist.barrier()`` of the original samples; raises BrokenBarrierError if another role failed."""
        self.barrier.wait(BARRIER_TIMEOUT_S)

    def put(self, index: int, value: int) -> None:
        self.values[index] = value

    def get(self, index: int) -> int:
        return int(self.values[index])


def _role_main(function: Callable[[Shared], None], shared: Shared) -> None:
    logging.basicConfig(format="%(asctime)s [%(processName)s] %(message)s", level=logging.INFO)
    logging.getLogger("kvpush").setLevel(logging.WARNING)  # the example's own lines tell the story
    function(shared)


def run(title: str, roles: dict[str, Callable[[Shared], None]], timeout: float = RUN_TIMEOUT_S) -> int:
    """Start one process per role, wait for all of them, print one verdict line; 0 if every role exited 0."""
    context = multiprocessing.get_context("spawn")
    shared = Shared(context.Barrier(len(roles)), context.Array("q", 8))
    processes = [context.Process(target=_role_main, args=(function, shared), name=name)
                 for name, function in roles.items()]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    try:
        while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
            for process in processes:
                process.join(0.05)
            if any(process.exitcode not in (None, 0) for process in processes):
                shared.barrier.abort()  # a role failed: the others stop waiting for it
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
    codes = {process.name: process.exitcode for process in processes}
    passed = all(code == 0 for code in codes.values())
    summary = ", ".join(f"{name} exit {code}" for name, code in codes.items())
    print(f"{title}: {'OK' if passed else 'FAILED'} ({summary})", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit("examples/_launch.py is a helper; run one of the examples next to it")
