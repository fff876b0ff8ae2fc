"""kvrouter.core.hashing against block hashes vLLM 0.32 computed itself (vllm.v1.core.kv_cache_utils, run once
on this machine: the request block hasher, hash_block_tokens and maybe_convert_block_hash agreed)."""

from __future__ import annotations

import random

import pytest

from kvrouter.core.hashing import BlockHasher, HashConfigError


def tokens() -> list[int]:
    """100 token ids covering every pickle int opcode, as the reference run drew them."""
    random.seed(0)
    return [random.choice([random.randrange(256), random.randrange(65536), random.randrange(65536, 152000)])
            for _ in range(100)]


def test_the_default_algorithm_gives_vllms_hashes() -> None:
    assert BlockHasher(32).block_hashes(tokens()) == [9925681334941026257, 7981685298255503449, 7397216992424453241]
    assert BlockHasher(32).none_hash.hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"


def test_a_seed_and_cbor_give_vllms_hashes_too() -> None:
    assert BlockHasher(32, seed="42").block_hashes(tokens()) == [3784790005597894035, 7911203359183823772,
                                                                8144282457542311994]
    assert BlockHasher(32, "sha256_cbor").block_hashes(tokens()) == [11494117185494400025, 8524500346307236888,
                                                                      14944426633951940330]


def test_only_full_blocks_are_hashed_and_a_prefix_shares_its_hashes() -> None:
    hasher, ids = BlockHasher(32), tokens()
    assert hasher.block_hashes(ids[:31]) == []
    assert hasher.block_hashes(ids[:64]) == hasher.block_hashes(ids)[:2]
    assert hasher.block_hashes(ids, cache_salt="s")[0] != hasher.block_hashes(ids)[0]  # a salt changes the chain
    assert hasher.block_hashes([1] * 32 + ids[32:64])[1] != hasher.block_hashes(ids)[1]  # so does the parent


def test_what_the_router_cannot_compute_is_refused() -> None:
    for args in ((0,), (32, "xxhash"), (16, "md5")):
        with pytest.raises(HashConfigError):
            BlockHasher(*args)  # type: ignore[arg-type]
