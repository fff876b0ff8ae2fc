"""Test-only shim: SGLang's own ``mooncake_tcp`` backend on a host without CUDA (bench/sglang_bench.py puts this
directory on the servers' ``PYTHONPATH`` for that case only).

SGLang 0.5.23's prefill asks its KV sender's class attribute ``supports_host_tensor_indices``; Mooncake's sender
says True, so the prefill copies each chunk's page indices into pinned host memory and records a
``torch.cuda.Event`` for the transfer thread to wait on: CUDA calls, which a CPU build of torch refuses. With the
attribute False the prefill computes the page indices on the CPU (``kv_to_page_indices``), as it does for every
other backend. Nothing else of SGLang or Mooncake changes: the transfer is Mooncake's own TCP transport, its
handshake and bootstrap SGLang's own.

Python imports ``sitecustomize`` at start-up in every process that inherits the path (SGLang's scheduler and
detokenizer subprocesses too). The attribute is set when SGLang imports the module, not before: importing SGLang
here would slow every process and could change its import order.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

TARGET = "sglang.srt.disaggregation.mooncake.conn"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``TARGET`` is imported, it lets the other finders find it and patches the module
    once its loader has run it; then it leaves ``sys.meta_path``. A lookup that imports nothing (a bare
    ``find_spec``, or an import that fails) leaves it in place for the next one."""

    def __init__(self) -> None:
        self._looking = False

    def find_spec(self, name: str, path: object = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET or self._looking:
            return None
        self._looking = True  # (the other finders' lookup below comes back here)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._looking = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module.MooncakeKVSender.supports_host_tensor_indices = False
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterImport())
