"""kvrouter: one OpenAI endpoint in front of vLLM instances that move KV with kvpush - placement that knows
what each instance caches (``kvpush proxy``, ``python -m kvrouter``).

The decisions are a pure core (``kvrouter.core``: block hashes, cache indexes, KV event decoding, placement,
pools); aiohttp (``server``, ``relay``), ZMQ (``events``, ``caches``) and the tokenizer (``tokens``) are shells
around it. Importing ``kvrouter`` imports none of them: its public names load on first use, so ``kvpush``'s
command line works without the proxy extra.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {"ProxyConfig": "config", "Policy": "core.placement", "DEFAULT_KV_PORT": "core.pools",
           "Prefill": "core.pools", "SpecError": "core.pools", "base_url": "core.pools", "parse_decode": "core.pools",
           "parse_prefill": "core.pools", "bound_port": "server", "start": "server"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kvrouter' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
