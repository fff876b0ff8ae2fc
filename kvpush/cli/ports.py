"""Loopback ports for the servers a command starts (``kvpush demo --vllm``; the vLLM tests use it too)."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections and to ``bind(0)`` (Linux's default: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(span: int = 1) -> int:
    """A loopback port ``p`` with ``p`` .. ``p + span - 1`` all free: a connector's ``kv_port`` needs as many as
    its instances listen on (a decode on ``kv_port + 1``, the rank-r worker of a TP instance on ``+ 2r``).
    Chosen below the kernel's ephemeral range, so that nothing else is handed it between this probe and the
    server's bind, seconds later (an outgoing connection, or another server's ``bind(0)``: a demo's prefill once
    found its ``kv_port`` in use)."""
    rng = random.Random()
    high = _ephemeral_low() - span
    for _ in range(200):
        port = rng.randrange(20000, high)
        with contextlib.ExitStack() as probes:
            try:
                for offset in range(span):
                    probes.enter_context(socket.socket()).bind(("127.0.0.1", port + offset))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no {span} free consecutive loopback ports below {high + span}")
