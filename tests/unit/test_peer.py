"""kvpush/peer.py: the peer's cache table - lookups by model id, cache id and cache key, and the checks
on what a peer's TABLE may say."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.memory import CacheRegistry, allocate_regions
from kvpush.peer import PeerTable
from kvpush.protocol import ProtocolError
from kvpush.types import CacheDesc, CacheKey, DataType


def entry(cache_id: int = 1, blocks: bool = False, keys: Any = None, slots: int = 4) -> dict[str, Any]:
    item: dict[str, Any] = {"id": cache_id, "model": None, "blocks": blocks, "n": 2, "shape": [slots, 8],
                            "dtype": int(DataType.DT_UINT8)}
    if keys is not None:
        item["keys"] = keys
    return item


def test_a_table_made_by_a_registry_is_read_back_with_its_keys() -> None:
    registry = CacheRegistry()
    desc = CacheDesc(2, (4, 8), DataType.DT_UINT8)
    mapping, regions = allocate_regions(desc)
    cache = registry.add(desc, regions, False, None, mapping, cache_keys=[CacheKey(5, 10), CacheKey(5, prefix_id=2)])
    table = PeerTable()
    table.apply({"caches": registry.table()})
    found = table.by_key((0, 10, 0))
    assert found is not None and found[0].cache_id == cache.cache_id and found[1].slot == 0
    assert found[1].released_on_pull  # a request key of allocated memory
    prefix = table.by_key((1, 2, 0))
    assert prefix is not None and prefix[1].slot == 1 and not prefix[1].released_on_pull
    assert table.key_at(cache.cache_id, 1) == prefix[1] and table.key_at(cache.cache_id, 2) is None
    assert table.by_key((0, 2, 0)) is None  # a request id is not a prefix id
    table.forget_key((0, 10, 0))  # consumed here: a lookup misses until the next table
    assert table.by_key((0, 10, 0)) is None and table.key_at(cache.cache_id, 0) is None
    table.apply({"caches": registry.table()})
    assert table.by_key((0, 10, 0)) is not None


@pytest.mark.parametrize("item", [
    entry(keys={"req": 1}),                      # not a list
    entry(keys=[[0, 10, 0, 0]]),                 # four fields
    entry(keys=[[0, 10, 0, 4, 1]]),              # slot 4 of 4
    entry(keys=[[3, 10, 0, 0, 1]]),              # neither a request nor a prefix
    entry(keys=[[0, (1 << 64) - 1, 0, 0, 1]]),   # "no id"
    entry(keys=[[0, 10, 0, 0, 2]]),              # released_on_pull is 0 or 1
    entry(keys=[[0, 10, 0, 0, True]]),           # bool is not an int here
    entry(keys=[[0, 10, 0, 0, 1], [0, 10, 0, 1, 1]]),  # one key for two slots
    entry(keys=[[0, 10, 0, 0, 1], [0, 11, 0, 0, 1]]),  # two keys for one slot
    entry(blocks=True, keys=[[0, 10, 0, 0, 1]]),  # a blocks cache is named by its model id
])
def test_bad_cache_keys_in_a_table_are_protocol_errors(item: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        PeerTable().apply({"caches": [item]})


def test_one_key_in_two_caches_is_a_protocol_error_and_the_old_table_stays() -> None:
    table = PeerTable()
    table.apply({"caches": [entry(1, keys=[[0, 10, 0, 0, 1]])]})
    with pytest.raises(ProtocolError, match="two caches"):
        table.apply({"caches": [entry(1, keys=[[0, 10, 0, 0, 1]]), entry(2, keys=[[0, 10, 0, 1, 1]])]})
    assert table.by_key((0, 10, 0)) is not None and table.updates == 1
    table.apply({"caches": [entry(1)]})  # a table without keys (an engine that predates them) drops them
    assert table.by_key((0, 10, 0)) is None and table.by_id(1) is not None
