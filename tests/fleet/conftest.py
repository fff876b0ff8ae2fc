"""Tests of the fleet's membership with a real etcd (started by each test that needs one). Without etcd
they are skipped, saying why; in CI (``CI`` set) a missing etcd fails them instead."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from etcd import Etcd, missing  # noqa: E402


@pytest.fixture
def etcd() -> Iterator[Etcd]:
    problem = missing()
    if problem is not None:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(problem)
        pytest.skip(problem)
    server = Etcd().start()
    try:
        yield server
    finally:
        server.stop()
