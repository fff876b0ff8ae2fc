"""kvpush/layout.py: run merging and scatter vectors."""

from __future__ import annotations

import numpy as np

from kvpush.layout import Blocks, block_runs, merge_block_runs, pack_runs, runs_in_bounds, scatter_vector, unpack_runs


def test_consecutive_pairs_merge_into_runs() -> None:
    src_start, dst_start, counts = merge_block_runs(np.array([0, 1, 2, 5, 6, 9]), np.array([10, 11, 12, 3, 4, 0]))
    assert src_start.tolist() == [0, 5, 9]
    assert dst_start.tolist() == [10, 3, 0]
    assert counts.tolist() == [3, 2, 1]


def test_runs_break_when_either_side_jumps() -> None:
    _, _, counts = merge_block_runs(np.array([0, 1, 2]), np.array([5, 7, 8]))
    assert counts.tolist() == [1, 2]


def test_unordered_pairs_are_sorted_by_source_then_merged() -> None:
    src_start, dst_start, counts = merge_block_runs(np.array([3, 1, 2, 0]), np.array([13, 11, 12, 10]))
    assert (src_start.tolist(), dst_start.tolist(), counts.tolist()) == ([0], [10], [4])


def test_merged_runs_cover_exactly_the_pairs() -> None:
    rng = np.random.default_rng(5)
    src = rng.permutation(300)[:200]
    dst = rng.permutation(400)[:200]
    runs = block_runs(Blocks.of(src), Blocks.of(dst), 64)
    covered_src = np.concatenate([np.arange(s, s + n) for s, n in zip(runs.src_offset // 64, runs.length // 64)])
    covered_dst = np.concatenate([np.arange(d, d + n) for d, n in zip(runs.dst_offset // 64, runs.length // 64)])
    assert sorted(zip(covered_src.tolist(), covered_dst.tolist())) == sorted(zip(src.tolist(), dst.tolist()))
    assert runs.bytes_per_tensor == 200 * 64


def test_wire_round_trip() -> None:
    offsets, lengths = np.array([0, 4096], np.uint64), np.array([4096, 8192], np.uint64)
    got_offsets, got_lengths = unpack_runs(pack_runs(offsets, lengths))
    assert got_offsets.tolist() == [0, 4096] and got_lengths.tolist() == [4096, 8192]


def test_scatter_vector_is_tensor_major() -> None:
    iov = scatter_vector([1000, 5000], np.array([0, 100], np.uint64), np.array([10, 20], np.uint64))
    assert iov.tolist() == [[1000, 10], [1100, 20], [5000, 10], [5100, 20]]
    assert iov.dtype == np.uint64 and iov.flags.c_contiguous


def test_runs_in_bounds_rejects_overflow_and_past_end() -> None:
    assert runs_in_bounds(np.array([0, 100]), np.array([100, 28]), 128)
    assert not runs_in_bounds(np.array([0, 100]), np.array([100, 29]), 128)
    assert not runs_in_bounds(np.array([2**64 - 8], np.uint64), np.array([16], np.uint64), 2**63)
    assert not runs_in_bounds(np.array([0]), np.array([0]), 128)


def test_scatter_vector_keeps_exact_64_bit_addresses_for_any_integer_input() -> None:
    high = 0x7FFF_FFFF_F000_1234
    iov = scatter_vector([high], np.array([3], np.int64), np.array([5], np.int64))
    assert iov.dtype == np.uint64 and iov.tolist() == [[high + 3, 5]]
