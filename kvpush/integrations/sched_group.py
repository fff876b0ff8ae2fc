"""A vLLM worker in a scheduling group of its own, on its own cores (``confine``).

Linux schedules each session as a group (autogroup: every terminal, ``setsid`` or daemon), group against
group on each core. vLLM's CPU worker binds every thread to its cores (``VLLM_CPU_OMP_THREADS_BIND``) while
its instance's API server and engine core run anywhere, so the instance's group spans every core, and on
the worker's core its weight changes each time one of its threads wakes: the worker's 13 gloo loops poll
every 10 ms (1,300 wake-ups a second) and its main thread spins between engine steps. Kernels carrying
commit 6d71a9c61604 without its revert 101f3498b4bd (6.18.44 here; reverted in 6.18.45) re-place a running
group's entity at each of those weight changes and keep it ahead of every other group on that core: an
instance sharing the core got no CPU for seconds at a time (docs/perf/notes.md, "instances in their own
sessions"). In a session of its own the worker's group lives on its cores alone: its weight there never
changes, and the kernel has nothing to re-place.

``confine`` does that only where it helps and cannot surprise: on Linux with autogroup on, in a worker that
``multiprocessing`` started (not a user's own program, whose terminal's Ctrl-C must still reach it), bound to
some of the cores, not leading a process group already, and whose engine core (its parent) may run beyond
them. An instance confined as a whole (``taskset``, a container's cpuset) has no group spanning every core to
escape; there a group of its own would only part the worker from its engine core, which waits for each step's
answer spinning on ``sched_yield`` for up to a second (vLLM's ``SpinCondition``): a yield reaches only its own
group, so the two groups' entities split the core and the worker lost half of it (TPOT 105 ms against 45 ms
for the same instance without kvpush, bench/vllm_load.py's setups, before this check). The worker still ends
with its engine: vLLM's death pipe ends a worker whose parent is gone, and its shutdown signals it by pid.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from dataclasses import dataclass
from pathlib import Path

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


@dataclass(frozen=True)
class Process:
    """What ``decide`` reads of this process and its host."""

    linux: bool
    autogroup: bool
    started_by_multiprocessing: bool
    cores: frozenset[int]  # where its threads may run
    host_cores: int
    group_leader: bool
    parent_cores: frozenset[int] = frozenset()  # where its parent (vLLM's engine core) may run; empty: unknown


def decide(process: Process) -> str | None:
    """Why this process stays in its session's group (None: it takes a session of its own)."""
    if not process.linux:
        return "not Linux"
    if not process.autogroup:
        return "the kernel does not group sessions (sched_autogroup_enabled is 0)"
    if not process.started_by_multiprocessing:
        return "not a worker process of vLLM's (its own program's session is left alone)"
    if not process.cores or len(process.cores) >= process.host_cores:
        return "its threads are not bound to some of the cores: a group of its own would span them all anyway"
    if process.group_leader:
        return "it leads a process group already"
    if process.parent_cores and process.parent_cores <= process.cores:
        return "its engine core runs on its cores only: apart, the engine core's spin-wait for each step would " \
               "take half of them"
    return None


def this_process() -> Process:
    try:
        autogroup = AUTOGROUP.read_text().strip() == "1"
    except OSError:
        autogroup = False
    linux = sys.platform.startswith("linux")
    cores = frozenset(os.sched_getaffinity(0)) if linux else frozenset()
    try:
        parent_cores = frozenset(os.sched_getaffinity(os.getppid())) if linux else frozenset()
    except OSError:
        parent_cores = frozenset()
    return Process(linux, autogroup, multiprocessing.parent_process() is not None, cores, os.cpu_count() or 1,
                   os.getpgid(0) == os.getpid(), parent_cores)


def confine() -> str:
    """Give this process a session, so a scheduling group, of its own when ``decide`` says so; what was done
    (for the log)."""
    process = this_process()
    why_not = decide(process)
    if why_not is not None:
        return f"stays in its session's scheduling group: {why_not}"
    try:
        os.setsid()
    except OSError as error:
        return f"stays in its session's scheduling group: setsid: {error.strerror or error}"
    return f"in a scheduling group of its own on cores {sorted(process.cores)} (a session of its own)"
