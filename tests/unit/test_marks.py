"""Ready marks (kvpush.marks): what the receiver reads at a mark's address, and that a layer is either let go
or withdrawn, never both, whichever thread gets there first."""

from __future__ import annotations

import ctypes
import threading

from kvpush.marks import LayerMarks

MASK = (1 << 64) - 1


def word_at(marks: LayerMarks, slot: int) -> int:
    return int(ctypes.c_uint64.from_address(marks.address(slot)).value)


def test_a_mark_reads_zero_then_the_token_once_opened_and_its_time_is_the_first_opening() -> None:
    marks = LayerMarks(3)
    assert marks.token not in (0, MASK) and [word_at(marks, slot) for slot in range(3)] == [0, 0, 0]
    assert marks.open(1) and word_at(marks, 1) == marks.token and marks.is_open(1)
    first = float(marks.marked_at[1])
    assert first > 0 and marks.open(1) and float(marks.marked_at[1]) == first  # idempotent
    assert word_at(marks, 0) == 0 and word_at(marks, 2) == 0 and not marks.is_open(0)
    assert LayerMarks(1).token != marks.token  # random per request: a stale word never reads open


def test_a_withdrawn_layer_is_never_opened_and_an_opened_one_never_withdrawn() -> None:
    marks = LayerMarks(2)
    assert marks.withdraw(0) and word_at(marks, 0) == marks.token ^ MASK
    assert not marks.open(0) and word_at(marks, 0) == marks.token ^ MASK and not marks.marked_at[0]
    assert marks.open(1) and not marks.withdraw(1) and word_at(marks, 1) == marks.token
    assert marks.open_slots() == [1]  # the withdrawn one is not open


def test_the_open_slots_are_read_in_one_pass_in_order() -> None:
    marks = LayerMarks(80)
    assert marks.open_slots() == []
    for slot in (79, 3, 40, 0):
        marks.open(slot)
    marks.withdraw(5)
    assert marks.open_slots() == [0, 3, 40, 79]
    assert marks.open_slots() == [slot for slot in range(80) if marks.is_open(slot)]


def test_opening_and_withdrawing_from_two_threads_agree_on_one_outcome_per_layer() -> None:
    """The computation's thread marks layers while the event loop's withdraws them (``wait()`` began): for
    every layer exactly one of the two succeeds, and the word says which."""
    layers = 2000
    marks = LayerMarks(layers)
    opened = [False] * layers
    withdrawn = [False] * layers
    start = threading.Barrier(2)

    def opener() -> None:
        start.wait()
        for slot in range(layers):
            opened[slot] = marks.open(slot)

    def withdrawer() -> None:
        start.wait()
        for slot in reversed(range(layers)):
            withdrawn[slot] = marks.withdraw(slot)

    threads = [threading.Thread(target=opener), threading.Thread(target=withdrawer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    for slot in range(layers):
        assert opened[slot] != withdrawn[slot]
        assert word_at(marks, slot) == (marks.token if opened[slot] else marks.token ^ MASK)
