"""kvpush in SGLang: ``--disaggregation-transfer-backend kvpush``.

- ``plugin``: the entry point SGLang runs (``sglang.srt.plugins``: ``kvpush.integrations.sglang:register``), which
  makes ``kvpush`` a backend without patching SGLang;
- ``backend``: the backend's classes, SGLang's ``Common*`` with kvpush moving the pages (``prefill``, ``decode``:
  each side's state);
- ``core``: its SGLang-free core (the pools as kvpush blocks, heads between TP sizes, its messages and settings).

The model families' layouts (``..families``), tensor parallelism (``..topology``) and the settings both engines take
(``..config``) are shared with vLLM's connector (``..vllm``).
"""

from .plugin import register

__all__ = ["register"]
