"""What the command prints: sizes and addresses for people, the one-line failure, logging set-up,
a progress bar, and serve's event lines.

Results go to stdout (text, or JSON with ``--json``); failures, progress and logs go to stderr, so a
piped ``--json`` run prints nothing but JSON.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def size(nbytes: float) -> str:
    """A byte count for people: B, KiB, MiB or GiB."""
    if nbytes < 2**10:
        return f"{int(nbytes)} B"
    if nbytes < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def fail(command: str, message: str) -> int:
    """The one line a failed run prints (stderr); returns the exit status."""
    print(f"kvpush {command}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return 1


def configure_logging(verbose: int, quiet_level: int) -> None:
    """Log at ``quiet_level`` by default, INFO with ``-v``, DEBUG with ``-vv`` (stderr)."""
    level = [quiet_level, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream: TextIO = sys.stderr if stream is None else stream
        self.enabled = enabled and total > 1 and self.stream.isatty()
        self._draw()

    def _draw(self) -> None:
        if self.enabled:
            filled = 30 * self.done // self.total
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            self.stream.flush()

    def step(self) -> None:
        self.done += 1
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


class Reporter:
    """Prints events as text lines or JSON lines (stdout, flushed at once, so a reader sees each
    event when it happens)."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def event(self, name: str, text: str, **fields: Any) -> None:
        if self.as_json:
            print(json.dumps({"event": name, "time": round(time.time(), 3), **fields}), flush=True)
        else:
            print(text, flush=True)
