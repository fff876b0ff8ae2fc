"""kvpush.links without sockets: which link carries this side's transfers to a cluster when links cross,
repeat or come from a restarted peer, and what a closed link leaves behind."""

from __future__ import annotations

from kvpush.links import Adopted, LinkTable


class FakeLink:
    def __init__(self, cluster: int, instance: str = "a", dialer: bool = True) -> None:
        self.peer_cluster_id: int | None = cluster
        self.peer_instance = instance
        self.dialer = dialer
        self.closed = ""

    @property
    def ready(self) -> bool:
        return not self.closed

    def close(self, reason: str, abort: bool = False) -> None:
        self.closed = reason


def test_links_that_cross_are_both_kept_and_the_crossing_one_takes_over() -> None:
    table: LinkTable[FakeLink] = LinkTable()
    ours, theirs = FakeLink(2, dialer=True), FakeLink(2, dialer=False)
    assert table.adopt(ours) is Adopted.PRIMARY
    assert table.adopt(theirs) is Adopted.CROSSED
    assert table.primary(2) is ours and table.links_to(2) == [theirs, ours] and not ours.closed
    ours.close("peer went")
    assert table.closed(ours) is False  # not lost: the crossing link carries this side's transfers now
    assert table.primary(2) is theirs and table.links_to(2) == [theirs] and table.losses(2) == 0
    theirs.close("peer went")
    assert table.closed(theirs) is True and table.primary(2) is None and table.losses(2) == 1


def test_a_restarted_peer_replaces_every_older_link_and_a_repeat_replaces_its_own_direction() -> None:
    table: LinkTable[FakeLink] = LinkTable()
    first, crossing = FakeLink(2, "old", dialer=True), FakeLink(2, "old", dialer=False)
    table.adopt(first)
    table.adopt(crossing)
    restarted = FakeLink(2, "new", dialer=True)
    assert table.adopt(restarted) is Adopted.PRIMARY
    assert first.closed and crossing.closed and table.primary(2) is restarted
    again = FakeLink(2, "new", dialer=True)  # the same direction again: the peer lost the one it had
    assert table.adopt(again) is Adopted.PRIMARY and restarted.closed and table.primary(2) is again


def test_a_link_closed_before_it_was_adopted_or_after_it_was_replaced_leaves_the_table_as_it_is() -> None:
    table: LinkTable[FakeLink] = LinkTable()
    live, stray = FakeLink(3), FakeLink(3)
    table.adopt(live)
    assert table.closed(stray) is False and table.primary(3) is live and table.losses(3) == 0
    unnamed = FakeLink(3)
    unnamed.peer_cluster_id = None  # closed during its handshake
    assert table.closed(unnamed) is False
    assert table.all() == [live]
    table.clear()
    assert len(table) == 0 and table.primary(3) is None
