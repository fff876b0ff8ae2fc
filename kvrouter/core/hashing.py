"""A prompt's prefix-cache block hashes, computed as vLLM computes them, so the router can tell how many
leading blocks of a request each instance already holds (``block_hashes``).

vLLM (0.32, ``vllm/v1/core/kv_cache_utils.py``) hashes every *full* block of ``block_size`` tokens as
``H((parent, tuple(tokens), extra_keys))``: ``H`` is sha256 over pickle protocol 5 (``--prefix-caching-hash-algo
sha256``, the default) or over canonical CBOR (``sha256_cbor``); ``parent`` is the previous block's 32-byte
digest, for the first block ``H(seed)`` of the string ``"vllm-none-hash"`` (or the engine's ``PYTHONHASHSEED``);
``extra_keys`` is None but for a request's ``cache_salt`` (``(("cache_salt", salt),)`` on the first block only)
and LoRA or multimodal inputs, which the router does not route by. The KV events carry each hash as the
digest's last 8 bytes, an unsigned big-endian int: what ``block_hashes`` returns.

Pure: hashlib and pickle (cbor2 for ``sha256_cbor``).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor")
_UINT64 = (1 << 64) - 1


class HashConfigError(ValueError):
    """A hash algorithm the router cannot compute."""


def _pickle_sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=5)).digest()


def _cbor_sha256(value: Any) -> bytes:
    import cbor2  # only for sha256_cbor engines

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class BlockHasher:
    """The block hashes of one fleet's engines: their block size, algorithm and seed (``PYTHONHASHSEED``
    of their engine processes, else vLLM's default)."""

    def __init__(self, block_size: int, algorithm: str = "sha256", seed: str | None = None) -> None:
        if block_size < 1:
            raise HashConfigError(f"block size {block_size} must be >= 1")
        if algorithm not in ALGORITHMS:
            raise HashConfigError(f"prefix-caching hash algorithm {algorithm!r}: the router computes "
                                  f"{', '.join(ALGORITHMS)} (xxhash needs a seed shared with every engine)")
        self.block_size = block_size
        self.algorithm = algorithm
        self._hash: Callable[[Any], bytes] = _pickle_sha256 if algorithm == "sha256" else _cbor_sha256
        self.none_hash = self._hash(seed if seed is not None else DEFAULT_SEED)

    def digests(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The 32-byte digest of every full block of ``tokens``."""
        size, out, parent = self.block_size, [], self.none_hash
        extra: tuple[Any, ...] | None = (("cache_salt", cache_salt),) if cache_salt else None
        for start in range(0, len(tokens) - size + 1, size):
            parent = self._hash((parent, tuple(tokens[start:start + size]), extra))
            out.append(parent)
            extra = None
        return out

    def block_hashes(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """What vLLM's KV events call these blocks: each digest's last 8 bytes, unsigned big-endian."""
        return [int.from_bytes(digest, "big") & _UINT64 for digest in self.digests(tokens, cache_salt)]
