"""Synthetic cache contents: the same seed gives the same bytes in any process, so the side that
receives blocks can rebuild what was sent and compare byte for byte without being sent a copy."""

from __future__ import annotations

from typing import Any

import numpy as np


def fill(tensors: list[np.ndarray[Any, Any]], seed: int) -> None:
    """Overwrite each tensor with random 64-bit words from ``(seed, tensor index)``; the tail of a
    tensor whose size is not a multiple of 8 bytes is left as it was."""
    for index, tensor in enumerate(tensors):
        raw = tensor.reshape(-1).view(np.uint8)
        words = raw[: raw.nbytes // 8 * 8].view(np.uint64)
        words[:] = np.random.default_rng([seed, index]).integers(0, 2**63, words.shape[0], dtype=np.uint64)
