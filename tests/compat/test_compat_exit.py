"""A program that exits without ``finalize()`` while linked and mid-use (issue 12.6): its instance is
finalized at interpreter exit, cleanly (no asyncio noise), and the peer sees its link go."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
from peer import Peer

from transports import cma

TRANSPORTS = ["tcp"] + (["cma"] if cma.AVAILABLE else [])

_FORGETS_TO_FINALIZE = textwrap.dedent("""
    import logging, sys
    import numpy as np
    from kvpush.compat.llm_datadist import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMDataDist,
                                            LLMRole, Placement)
    logging.basicConfig(level=logging.WARNING)  # anything kvpush or asyncio warns about at exit shows up
    port, transport = int(sys.argv[1]), sys.argv[2]
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    engine.init({"kvpush.transport": transport})
    tensors = [np.ones((16, 256), np.int32) for _ in range(4)]
    cache = engine.cache_manager.register_blocks_cache(CacheDesc(4, [16, 256], DataType.DT_INT32, Placement.HOST),
                                                       [int(t.ctypes.data) for t in tensors], BlocksCacheKey(1, 0))
    info = LLMClusterInfo()
    info.remote_cluster_id = 2
    info.append_remote_ip_info("127.0.0.1", port)
    assert engine.link_clusters([info], 5000)[0] == 0
    engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, [0, 1, 2, 3], [4, 5, 6, 7])
    engine.cache_manager.push_blocks(BlocksCacheKey(2, 0), cache, [8], [9])  # a standing grant on the same host
    print("pushed", flush=True)
    # no unlink, no unregister, no finalize
""")


@pytest.fixture(params=TRANSPORTS)
def decode_peer(request: pytest.FixtureRequest) -> Iterator[tuple[Peer, str]]:
    transport = str(request.param)
    with Peer(2, options={"llm.listenIpInfo": "127.0.0.1:0", "kvpush.transport": transport}) as peer:
        peer.call("allocate", name="kv", num_tensors=4, shape=[16, 256], dtype=3, model_id=0)
        yield peer, transport


def test_exit_without_finalize_is_clean_and_releases_the_link(decode_peer: tuple[Peer, str],
                                                              tmp_path: object) -> None:
    peer, transport = decode_peer
    result = subprocess.run([sys.executable, "-c", _FORGETS_TO_FINALIZE, str(peer.port), transport],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "pushed"
    assert result.stderr == "", result.stderr  # no asyncio error, no "cannot schedule new futures ...", no warning
    snapshot = peer.snapshot("kv", tmp_path)
    assert (snapshot[:, [4, 5, 6, 7, 9]].view("int32") == 1).all()  # what it pushed had landed
    deadline = time.monotonic() + 5
    while peer.call("link_info")["links"]:  # the peer saw the link go (closed, not timed out)
        assert time.monotonic() < deadline, "the peer still has a link to the process that exited"
        time.sleep(0.05)
