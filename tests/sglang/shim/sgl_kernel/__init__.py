"""Test infrastructure, not part of kvpush: the two ``sgl_kernel`` functions SGLang 0.5.23 calls on a CPU
without AMX (its CPU kernel package is source-only on PyPI), in numpy. ``tests/sglang/sglang_venv.py`` copies this
package into the SGLang test venv. Any other name imports, and raises NotImplementedError when called, so a
code path that needs a real kernel fails loudly instead of computing something else.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


def _as_numpy(tensor: Any) -> np.ndarray[Any, Any]:
    return np.asarray(tensor.detach().cpu().numpy() if hasattr(tensor, "detach") else tensor, dtype=np.int64)


def copy_all_layer_kv_cache_cpu(data_ptrs: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    """For every per-layer buffer (a raw address and a row stride in bytes), copy row ``src_loc[i]`` to row
    ``tgt_loc[i]``, reading every source row before writing any."""
    targets, sources = _as_numpy(tgt_loc), _as_numpy(src_loc)
    if not len(targets):
        return
    for address, stride in zip(_as_numpy(data_ptrs).tolist(), _as_numpy(strides).tolist()):
        rows = int(max(targets.max(), sources.max())) + 1
        buffer = np.ctypeslib.as_array((ctypes.c_uint8 * (rows * int(stride))).from_address(int(address)))
        view = buffer.reshape(rows, int(stride))
        view[targets] = view[sources].copy()


def assign_req_to_token_pool_cpu(req_pool_indices: Any, req_to_token: Any, start_offset: Any, end_offset: Any,
                                 out_cache_loc: Any, pool_len: int) -> None:
    """For each request ``i``: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` = the next
    ``end[i] - start[i]`` entries of ``out_cache_loc``."""
    rows, starts, ends = (_as_numpy(t).tolist() for t in (req_pool_indices, start_offset, end_offset))
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + count].to(req_to_token.dtype)
        taken += count


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name}: not in kvpush's CPU test shim (tests/sglang/shim)")
    missing.__name__ = name
    return missing
