"""kvpush.onesided: the writer's standing-grant (lease) states and the per-request grant flow, over a
mover that copies with numpy (no peer process, no socket)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from kvpush.onesided import LeaseState, OneSidedSender
from kvpush.protocol import HEADER_SIZE, Kind, decode_header, decode_json, decode_status, encode_status
from kvpush.requests import RequestTable
from kvpush.status import LLMException, LLMStatusCode
from transports.base import Capabilities


class MemcpyMover:
    """Copies local -> remote iovec entries in this process (what a same-host mover does)."""

    capabilities = Capabilities("memcpy", one_sided=True, same_host_only=True, standing_grants=True)
    lease_proof = "proof"

    def start(self, is_read: bool, local: Any, remote: Any, cache_id: int, first_tensor: int, rkeys: Any,
              runs_per_tensor: int) -> asyncio.Future[Any]:
        import ctypes
        for (src, length), (dst, _) in zip(local.tolist(), remote.tolist()):
            ctypes.memmove(src if is_read else dst, dst if is_read else src, length)
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def close(self) -> None:
        pass


def sender() -> tuple[OneSidedSender, RequestTable, list[tuple[Kind, Any]], list[str]]:
    loop = asyncio.get_running_loop()
    sent: list[tuple[Kind, Any]] = []
    closed: list[str] = []
    requests = RequestTable(loop, lambda error: None)

    def send(head: bytes) -> Any:
        header = decode_header(head[:HEADER_SIZE])
        meta = head[HEADER_SIZE:]
        sent.append((header.kind, decode_json(header.kind, meta) if header.kind == Kind.LEASE
                     else decode_status(header, meta) if header.kind == Kind.LANDED else None))
        return None
    return OneSidedSender(MemcpyMover(), send, requests, closed.append, loop), requests, sent, closed


def iov(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.array([[array.ctypes.data, array.nbytes]], np.uint64)


async def test_lease_states_request_grant_revoke_done() -> None:
    one, _, sent, _ = sender()
    assert not one.lease_active(5)  # asks the first time
    assert one.leases[5] == LeaseState.REQUESTED == "requested"
    assert sent == [(Kind.LEASE, {"op": "request", "cache": 5, "proof": "proof"})]
    one.on_lease({"op": "grant", "cache": 5})
    assert one.lease_active(5) and one.leases[5] == LeaseState.ACTIVE
    one.on_lease({"op": "revoke", "cache": 5})  # nothing in flight: confirmed at once
    assert one.leases[5] == LeaseState.DONE and sent[-1] == (Kind.LEASE, {"op": "revoked", "cache": 5})
    assert not one.lease_active(5)  # no new request for a cache whose lease ended


async def test_a_refused_lease_falls_back_to_per_request_grants() -> None:
    one, _, _, _ = sender()
    one.lease_active(3)
    one.on_lease({"op": "refuse", "cache": 3})
    assert one.leases[3] == LeaseState.REVOKED and not one.lease_active(3)
    assert not one.reader_copies()  # an old receiver's refusal says nothing of reading


async def test_a_receiver_that_reads_says_so_even_when_it_refuses_the_lease() -> None:
    """A cache open per request (GRANTED, as vLLM's decode registers it) is never leased; its writes are
    still offered for the receiver to copy, each checked there against the grants."""
    one, _, _, _ = sender()
    one.lease_active(3)
    one.on_lease({"op": "refuse", "cache": 3, "reads": True})
    assert one.leases[3] == LeaseState.REVOKED and one.reader_copies()
    one.close_leases()  # unlinking: nothing new is offered
    assert not one.reader_copies()


async def test_a_leased_write_copies_then_notifies_and_unlinking_stops_new_ones() -> None:
    one, requests, sent, _ = sender()
    one.lease_active(1)
    one.on_lease({"op": "grant", "cache": 1})
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    op = requests.new(Kind.WRITE_INTENT)
    op.local_iov, op.remote_iov, op.move_args, op.notice = iov(src), iov(dst), (1, 0, None, 1), b"notice"
    sent_before = len(sent)
    one._send = lambda head: sent.append((Kind.WRITE_NOTICE, head))  # noqa: SLF001 - record the raw notice
    one.begin_leased(op)
    await op.future
    assert np.array_equal(src, dst)
    assert not one.leases_idle()  # the notice leaves right after the caller resumes
    await asyncio.sleep(0)
    assert one.leases_idle() and sent[sent_before:] == [(Kind.WRITE_NOTICE, b"notice")]
    one.close_leases()
    assert one.leases[1] == LeaseState.DONE
    late = requests.new(Kind.WRITE_INTENT)
    late.local_iov, late.remote_iov, late.move_args, late.notice = iov(src), iov(dst), (1, 0, None, 1), b"n"
    one.begin_leased(late)
    try:
        await late.future
    except LLMException as error:
        assert error.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    else:
        raise AssertionError("a leased copy started while unlinking")
    assert await one.drain_leases(0.1)


async def test_notices_of_finished_leased_writes_go_out_in_order_when_flushed() -> None:
    """The caller of a leased write resumes before its notice leaves; a message the link sends
    meanwhile (a push's notification) first flushes the notices, in order, each exactly once, in one write."""
    one, requests, sent, _ = sender()
    one.lease_active(1)
    one.on_lease({"op": "grant", "cache": 1})
    one._send = lambda head: sent.append((Kind.WRITE_NOTICE, head))  # noqa: SLF001 - record the raw notice
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    before = len(sent)
    for name in (b"first", b"second"):
        op = requests.new(Kind.WRITE_INTENT)
        op.local_iov, op.remote_iov, op.move_args, op.notice = iov(src), iov(dst), (1, 0, None, 1), name
        one.begin_leased(op)
        assert op.future.done() and op.future.exception() is None
    assert sent[before:] == [] and not one.leases_idle()  # nothing sent yet: the callers go first
    one.flush_notices()  # what Link.send_message does before a message
    assert sent[before:] == [(Kind.WRITE_NOTICE, b"firstsecond")]  # frames back to back, one write
    assert one.leases_idle()
    await asyncio.sleep(0)  # the scheduled flush finds nothing left: no notice twice
    assert len(sent) == before + 1


async def test_a_grant_moves_the_bytes_and_landed_follows_an_abandoned_grant_is_answered() -> None:
    one, requests, sent, _ = sender()
    src, dst = np.full(32, 7, np.uint8), np.zeros(32, np.uint8)
    op = requests.new(Kind.WRITE_INTENT)
    op.local_iov, op.remote_iov, op.move_args = iov(src), iov(dst), (1, 0, None, 1)
    grant = encode_status(Kind.GRANT, op.request_id, 0)
    one.on_grant(decode_header(grant[:HEADER_SIZE]), grant[HEADER_SIZE:])
    await op.future
    assert np.array_equal(src, dst) and sent[-1] == (Kind.LANDED, (0, ""))
    stale = encode_status(Kind.GRANT, 99, 0)  # a grant for a request that was abandoned
    one.on_grant(decode_header(stale[:HEADER_SIZE]), stale[HEADER_SIZE:])
    assert sent[-1] == (Kind.LANDED, (1, ""))  # let the peer unpin


async def test_no_lease_is_asked_for_until_the_mover_has_its_proof() -> None:
    """A UCX mover reads the peer's secret one-sided after the link is up: until it has landed, writes
    go per request (no LEASE request, no state); the first write after it asks."""
    one, _, sent, _ = sender()
    mover = one.mover
    assert isinstance(mover, MemcpyMover)
    mover.lease_proof = ""
    assert not one.lease_active(5)
    assert not one.lease_active(5)
    assert sent == [] and 5 not in one.leases
    mover.lease_proof = "late"
    assert not one.lease_active(5)
    assert sent == [(Kind.LEASE, {"op": "request", "cache": 5, "proof": "late"})]


class Source:
    """A cache entry stand-in: counts pins."""

    def __init__(self) -> None:
        self.pins = 0

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1


def offered(one: OneSidedSender, requests: RequestTable) -> tuple[Any, Source]:
    source = Source()
    op = requests.new(Kind.READ_OFFER)
    source.pin()
    op.hold(source.unpin)
    one.lend(op, source)  # type: ignore[arg-type]
    return op, source


async def test_a_read_offer_keeps_its_source_until_the_readers_done_even_when_abandoned() -> None:
    one, requests, _, _ = sender()
    assert not one.reader_copies()
    one.lease_active(1)
    one.on_lease({"op": "grant", "cache": 1, "reads": True})
    assert one.reader_copies()
    op, source = offered(one, requests)
    assert not one.leases_idle()  # an unlink waits for the reader
    requests.abandon(op)  # the caller gave up (timeout, cancel): the reader may still be copying
    assert source.pins == 1
    assert not one.on_taken(op.request_id + 1, 0, "")  # not a READ_OFFER's answer
    assert one.on_taken(op.request_id, 0, "")
    assert source.pins == 0 and op.copy is not None and op.copy.done() and one.leases_idle()
    second, _ = offered(one, requests)
    assert one.on_taken(second.request_id, int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST), "gone")
    assert second.error is not None and second.error.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


async def test_a_withdrawn_offer_frees_its_source_and_a_closing_link_hands_the_lent_ones_over() -> None:
    one, requests, _, _ = sender()
    withdrawn, first = offered(one, requests)
    one.withdraw(withdrawn)  # dropped before any of it left: no one reads it
    assert first.pins == 0 and not withdrawn.ended  # ended by whoever abandons it, not here
    outstanding, second = offered(one, requests)
    assert one.close() == [second]  # still pinned: the caller releases it once the reader is gone
    assert second.pins == 1 and outstanding.ended and outstanding.error is not None
    assert one.leases_idle()
