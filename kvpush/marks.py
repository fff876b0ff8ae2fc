"""Ready marks: how a layer pusher lets a layer go without its event loop (the sender's side of a gated
READ_OFFER).

A layer pusher whose peer copies the layers itself (same host, ``OneSidedSender.reader_copies``) sends every
layer's READ_OFFER when it is made, each naming one 8-byte word of a ``LayerMarks`` in this process's memory
and a random token. The receiver checks and pins each offer at once and then reads the words (one system
call for all of them, ``kvpush.gates``): a word holding the token means the layer's bytes are final and it
copies them; the token's complement means the sender withdrew the offer, and it answers without copying.
Marking a layer is two stores into numpy arrays under an uncontended lock: any thread may do it (the
computation's own, between two layers), and this process's event loop does not wake for it. The lock makes
opening and withdrawing one word exclusive: a withdrawn layer is never opened afterwards (the receiver may
already have answered it, and the blocks it would write may belong to another request by then), and a
layer opened is never withdrawn (the receiver may be copying it).

Memory ordering: the computation's stores to the layer's bytes are made before the mark's (program order,
one thread), and x86-64 keeps stores in order, so a receiver that reads the mark reads the bytes after
them. Memory a device writes (a GPU) is final only once its stream is synchronized: mark after that.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

_MASK = (1 << 64) - 1


class LayerMarks:
    """One word per layer of one request, and when each was marked (``time.monotonic()``, 0: not yet)."""

    def __init__(self, count: int) -> None:
        self.words = np.zeros(count, np.uint64)
        self.marked_at = np.zeros(count, np.float64)
        token = 0
        while token in (0, _MASK):  # neither the zeroed word nor its complement
            token = int.from_bytes(os.urandom(8), "little")
        self.token = token
        self._lock = threading.Lock()

    def address(self, slot: int) -> int:
        """Where slot ``slot``'s word is in this process's memory."""
        return int(self.words.ctypes.data) + 8 * slot

    def open(self, slot: int) -> bool:
        """The layer's bytes are final: the peer may copy them. Any thread; idempotent. False (nothing
        changed) if the layer was withdrawn."""
        with self._lock:
            if int(self.words[slot]) == self.token ^ _MASK:
                return False
            if not self.marked_at[slot]:
                self.marked_at[slot] = time.monotonic()
            self.words[slot] = self.token
            return True

    def withdraw(self, slot: int) -> bool:
        """The layer will not be let go: the peer answers its offer without copying. False (nothing
        changed) if it was opened already: the peer copies it."""
        with self._lock:
            if int(self.words[slot]) == self.token:
                return False
            self.words[slot] = self.token ^ _MASK
            return True

    def is_open(self, slot: int) -> bool:
        return int(self.words[slot]) == self.token

    def open_slots(self) -> list[int]:
        """Every slot opened so far, in order (one pass over the words: a model's every layer at once)."""
        slots: list[int] = np.flatnonzero(self.words == np.uint64(self.token)).tolist()
        return slots
