"""kvpush.access: block grants against a plain model of sets, for any grants and any byte runs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.access import BlockAccess, BlockGrants

BLOCKS, BLOCK_BYTES = 24, 64


def _model_covers(granted: set[int], runs: list[tuple[int, int]]) -> bool:
    for offset, length in runs:
        if length <= 0:
            return False
        touched = range(offset // BLOCK_BYTES, (offset + length - 1) // BLOCK_BYTES + 1)
        if not set(touched) <= granted:
            return False
    return True


run = st.tuples(st.integers(0, BLOCKS * BLOCK_BYTES - 1), st.integers(1, 4 * BLOCK_BYTES))
grant = st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=10)


@settings(max_examples=300, deadline=None)
@given(grants=st.lists(st.tuples(st.integers(1, 3), grant, st.booleans()), max_size=6),
       revoked=st.sets(st.integers(0, 5)), peer=st.integers(1, 3), write=st.booleans(),
       runs=st.lists(run, min_size=1, max_size=20))
def test_covers_is_the_set_model_for_any_grants_revocations_and_runs(
        grants: list[tuple[int, list[int], bool]], revoked: set[int], peer: int, write: bool,
        runs: list[tuple[int, int]]) -> None:
    grants_ = BlockGrants(BLOCKS)
    for who, blocks, direction in grants:
        grants_.add(who, np.array(blocks), direction)
    kept = [g for i, g in enumerate(grants) if i not in revoked]
    for i in sorted(revoked):
        if i < len(grants):
            who, blocks, direction = grants[i]
            grants_.remove(who, np.array(blocks), direction)
    granted = {b for who, blocks, direction in kept if who == peer and direction == write for b in blocks}
    in_bounds = [r for r in runs if r[0] + r[1] <= BLOCKS * BLOCK_BYTES]
    expected = bool(in_bounds) and len(in_bounds) == len(runs) and _model_covers(granted, runs)
    assert grants_.covers(peer, write, BLOCK_BYTES, runs) == expected  # a few runs, as Python pairs
    offsets = np.array([r[0] for r in runs], np.uint64)
    lengths = np.array([r[1] for r in runs], np.uint64)
    assert grants_.covers(peer, write, BLOCK_BYTES, None, offsets, lengths) == expected  # many, as arrays
    assert grants_.granted(peer, write) == len(granted)


def test_grants_nest_and_are_per_peer_and_direction() -> None:
    grants = BlockGrants(8)
    grants.add(7, np.array([2, 3]), write=True)
    grants.add(7, np.array([3]), write=True)
    assert grants.covers(7, True, 10, [(20, 20)])
    assert not grants.covers(7, False, 10, [(20, 20)])  # reading was not granted
    assert not grants.covers(8, True, 10, [(20, 20)])  # another peer
    assert not grants.covers(7, True, 10, [(20, 21)])  # one byte into block 4
    grants.remove(7, np.array([2, 3]), write=True)
    assert grants.covers(7, True, 10, [(30, 10)]) and not grants.covers(7, True, 10, [(20, 10)])
    grants.remove(7, np.array([3]), write=True)
    assert not grants and not grants.covers(7, True, 10, [(30, 10)])


def test_runs_outside_the_cache_or_wrapping_are_never_covered() -> None:
    grants = BlockGrants(8)
    grants.add(7, np.arange(8), write=True)
    assert not grants.covers(7, True, 10, [(-10, 10)])  # before the cache (the last block is granted)
    assert not grants.covers(7, True, 10, [(70, 20)])  # past it
    wrapped = np.array([2**64 - 5], np.uint64)  # a length (or offset) past 2^63 turns negative as an int64
    assert not grants.covers(7, True, 10, None, np.array([0], np.uint64), wrapped)
    assert not grants.covers(7, True, 10, None, wrapped, np.array([10], np.uint64))
    whole = np.full(1000, 80, np.uint64)  # many runs over the whole cache: the union, read once
    assert grants.covers(7, True, 10, None, np.zeros(1000, np.uint64), whole)
    grants.add(8, np.array([3]), write=True)  # another peer holds one block: the union is not all its
    assert not grants.covers(8, True, 10, None, np.zeros(1000, np.uint64), whole)


def test_a_dropped_peer_starts_afresh_and_its_old_revocations_do_not_reach_the_new_grants() -> None:
    grants = BlockGrants(8)
    old = BlockAccess(grants, 1, 7, np.array([2, 3]), (True, False), lambda: False)
    grants.drop(7)  # the link to peer 7 closed
    assert not grants and not old.active and not grants.covers(7, True, 10, [(20, 20)])
    new = BlockAccess(grants, 1, 7, np.array([2, 3]), (True, False), lambda: False)
    old.revoke()  # made before the drop: nothing of the new grant goes
    assert new.active and grants.covers(7, True, 10, [(20, 20)])
    new.revoke()
    assert not grants and not grants.covers(7, True, 10, [(20, 20)])
