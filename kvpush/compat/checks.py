"""Argument checks and layer models of the facade's ``CacheManager``, as LLM-DataDist makes them.

LLM-DataDist's layer model differs from kvpush's in two places, translated here into kvpush arguments
that move exactly the same bytes:

- a push without layer ranges moves layers ``0 .. num_tensors // N - 1`` (``N = tensor_num_per_layer``):
  nothing for a 1-tensor cache with the default N=2, and only the first ``(num_tensors // N) * N``
  tensors when N does not divide the cache (kvpush then uses one tensor per layer);
- a pull without layer ranges moves every tensor, whatever N.
"""

from __future__ import annotations

import logging
import math

from kvpush import CacheDesc

from .transfer_async import check_layer_range
from .types import check_uint, require

log = logging.getLogger(__name__)


def check_desc(api: str, desc: object) -> None:
    """LLM-DataDist's type check (the engine refuses a ``batch_dim_index`` other than 0)."""
    if not isinstance(desc, CacheDesc):
        raise TypeError(f"cache_desc only support ['CacheDesc'], but got {type(desc)}.")


def check_n(api: str, n: object) -> int:
    value = check_uint("tensor_num_per_layer", n, 32)
    require(value > 0, f"[{api}] param check failed, tensor_num_per_layer ({value}) is invalid")
    return value


def push_layers(api: str, num_tensors: int, src: range | None, dst: range | None,
                n: int) -> tuple[range | None, range | None, int] | None:
    """LLM-DataDist's push layer model as kvpush arguments; None when it moves no layer."""
    check_layer_range("src_layer_range", src)
    check_layer_range("dst_layer_range", dst)
    whole = src is None and dst is None
    src = range(0, num_tensors // n) if src is None else src
    dst = range(0, num_tensors // n) if dst is None else dst
    require(len(src) == len(dst), "src_layer_range size should be equal to size of dst_layer_range size.")
    if len(src) == 0:
        log.warning("%s: %d tensor(s) with tensor_num_per_layer=%d make no layer: nothing moves (as in "
                    "LLM-DataDist)", api, num_tensors, n)
        return None
    if num_tensors % n == 0:
        return (None, None, n) if whole else (src, dst, n)
    # N does not divide the cache: LLM-DataDist moves tensors layer*N .. layer*N+N-1; kvpush then needs
    # one tensor per layer to say the same
    return range(src.start * n, src.stop * n), range(dst.start * n, dst.stop * n), 1


def pull_layers(num_tensors: int, src: range | None, dst: range | None,
                n: int) -> tuple[range | None, range | None, int]:
    """LLM-DataDist's pull layer model: no ranges means every tensor, whatever N."""
    check_layer_range("src_layer_range", src)
    check_layer_range("dst_layer_range", dst)
    if src is None and dst is None:
        return None, None, math.gcd(n, num_tensors) or 1
    if num_tensors % n == 0:
        return src, dst, n
    return (None if src is None else range(src.start * n, src.stop * n),
            None if dst is None else range(dst.start * n, dst.stop * n), 1)


def block_list(name: str, blocks: object) -> list[int]:
    if not isinstance(blocks, (list, tuple)):
        raise TypeError(f"{name} only support ['list', 'tuple'], but got {type(blocks)}.")
    for block in blocks:
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"{name} inner type only support [<class 'int'>], but got {type(block)}.")
    return list(blocks)


def note_remote_accessible(api: str, remote_accessible: object) -> None:
    if remote_accessible is None:
        return
    if not isinstance(remote_accessible, bool):
        raise TypeError(f"{api}: remote_accessible must be a bool or None, got {type(remote_accessible).__name__}")
    if remote_accessible:
        log.debug("%s: remote_accessible=True is kvpush's behaviour for every cache", api)
    else:
        log.warning("%s: remote_accessible=False is not enforced per cache in kvpush: linked peers can address "
                    "this cache; set llm.EnableRemoteCacheAccessible=0 to refuse all peer access", api)
