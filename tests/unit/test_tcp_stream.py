"""transports.tcp.TcpFrameStream's receive path over a real socket pair: frames of every shape (no meta,
small metas, metas bigger than the staging buffer, payloads spread over several iovec entries,
payloads discarded) written in chunks cut at random places - one byte at a time, across header, meta
and payload boundaries, many frames in one write - arrive whole, in order, and their payloads land
byte for byte exactly where the sink said."""

from __future__ import annotations

import asyncio
import ctypes
import random
import socket
from typing import Any

import numpy as np
import pytest

from kvpush.layout import IoVec
from kvpush.protocol import FrameHeader, Kind, encode_header
from transports import iovec, tcp
from transports.base import PayloadSink
from transports.tcp import STAGING_BYTES, TRUSTED_STAGING_BYTES, TcpFrameStream


class Recorder:
    """A StreamHandler: records every frame; a payload goes into its own array, cut into entries."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.frames: list[tuple[Kind, int, bytes]] = []
        self.payloads: dict[int, np.ndarray[Any, Any]] = {}
        self.landed: list[int] = []
        self.discard: set[int] = set()
        self.closed: list[str] = []
        self.in_hand: list[int] = []  # frames whose payload was all staged when they were handed over

    def on_frame(self, header: FrameHeader, meta: bytes, in_hand: bool = False) -> PayloadSink | None:
        # the contract of ``in_hand``: the previous such frame's payload landed before this call
        assert not self.in_hand or self.in_hand[-1] in self.landed or self.in_hand[-1] in self.discard
        if in_hand:
            assert header.payload_len > 0
            self.in_hand.append(header.request_id)
        self.frames.append((header.kind, header.request_id, meta))
        if header.payload_len == 0 or header.request_id in self.discard:
            return None
        target = np.zeros(header.payload_len, np.uint8)
        self.payloads[header.request_id] = target
        cuts = sorted(self.rng.sample(range(1, header.payload_len), min(5, header.payload_len - 1)))
        bounds = [0, *cuts, header.payload_len]
        base = target.ctypes.data
        entries = [(base + a, b - a) for a, b in zip(bounds, bounds[1:])]
        request_id = header.request_id
        if self.rng.random() < 0.5:  # a few entries as flat ints (the stream's FlatCursor), else an IoVec
            return PayloadSink(tuple(v for entry in entries for v in entry), lambda: self.landed.append(request_id),
                               header.payload_len)
        return PayloadSink(np.array(entries, np.uint64), lambda: self.landed.append(request_id), header.payload_len)

    def on_close(self, reason: str) -> None:
        self.closed.append(reason)


def frames(rng: random.Random, count: int, big: bool) -> list[tuple[Kind, int, bytes, bytes]]:
    """(kind, request id, meta, payload): status-like, JSON with big metas, writes with payloads
    (larger than socket buffers when ``big``)."""
    out = []
    for request_id in range(1, count + 1):
        shape = rng.randrange(4)
        if shape == 0:
            out.append((Kind.DONE, request_id, rng.randbytes(rng.choice([4, 10])), b""))
        elif shape == 1:  # a meta too big for the staging buffer, now and then
            size = rng.choice([0, 1, 100, STAGING_BYTES - 24, STAGING_BYTES, 3 * STAGING_BYTES + 7])
            out.append((Kind.TABLE, request_id, rng.randbytes(size), b""))
        else:
            sizes = [1, 17, 1000, STAGING_BYTES, 5000] + (
                [40_000, TRUSTED_STAGING_BYTES - 100, TRUSTED_STAGING_BYTES + 3, 300_000] if big else [])
            payload = rng.randbytes(rng.choice(sizes))
            out.append((Kind.WRITE, request_id, rng.randbytes(rng.choice([24, 40, 200])), payload))
    return out


async def run_stream(seed: int, count: int, max_chunk: int, discard_every: int = 0, trust: bool = False) -> None:
    """``trust``: the peer becomes trusted (the staging buffer grows) at a random point of the stream."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    recorder = Recorder(rng)
    sent = frames(rng, count, big=max_chunk >= 1000)
    if discard_every:
        recorder.discard = {rid for _, rid, _, payload in sent if payload and rid % discard_every == 0}
    stream = TcpFrameStream(ours, recorder, loop)
    try:
        wire = b"".join(encode_header(kind, rid, len(meta), len(payload)) + meta + payload
                        for kind, rid, meta, payload in sent)
        theirs.setblocking(False)
        offset = 0
        trust_at = rng.randrange(len(wire)) if trust else len(wire) + 1
        while offset < len(wire):  # bounded: every pass sends at least one byte or waits for the reader
            if offset >= trust_at:
                stream.trusted()
                trust_at = len(wire) + 1
            chunk = wire[offset:offset + rng.randint(1, max_chunk)]
            try:
                offset += theirs.send(chunk)
            except BlockingIOError:
                pass
            await asyncio.sleep(0)
        for _ in range(2000):
            if len(recorder.frames) == len(sent) and len(recorder.landed) == len(recorder.payloads):
                break
            await asyncio.sleep(0.001)
        assert not recorder.closed, recorder.closed
        assert [(k, r, m) for k, r, m in recorder.frames] == [(k, r, m) for k, r, m, _ in sent]
        expected = {rid: payload for _, rid, _, payload in sent if payload and rid not in recorder.discard}
        assert sorted(recorder.landed) == sorted(expected)
        for rid, payload in expected.items():
            assert recorder.payloads[rid].tobytes() == payload, f"payload of request {rid}"
        assert stream.bytes_in == len(wire)
        if max_chunk >= 1000:  # payloads staged whole behind their heads were handed over in hand
            assert recorder.in_hand
        if trust:  # the buffer grows at the next read that starts a frame (no cursor points into it then)
            theirs.send(encode_header(Kind.DONE, count + 1, 0, 0))
            for _ in range(2000):
                if len(recorder.frames) > len(sent):
                    break
                await asyncio.sleep(0.001)
            assert recorder.frames[-1][:2] == (Kind.DONE, count + 1)
        assert stream.staging_bytes == (TRUSTED_STAGING_BYTES if trust else STAGING_BYTES)
    finally:
        stream.close("test over")
        theirs.close()


async def test_frames_cut_anywhere_arrive_whole_and_in_order() -> None:
    for seed in range(6):
        await run_stream(seed, count=40, max_chunk=rng_chunk(seed))


async def test_the_staging_buffer_grows_at_any_point_of_the_stream_without_losing_a_byte() -> None:
    for seed in range(8):  # trusted mid-header, mid-meta, mid-payload, between frames
        await run_stream(400 + seed, count=40, max_chunk=rng_chunk(seed), discard_every=3 if seed % 2 else 0,
                         trust=True)


async def test_one_byte_at_a_time() -> None:
    await run_stream(100, count=12, max_chunk=1)


async def test_many_frames_in_one_write() -> None:
    await run_stream(200, count=60, max_chunk=1 << 20)


async def test_discarded_payloads_leave_the_stream_in_step() -> None:
    await run_stream(300, count=40, max_chunk=5000, discard_every=2)


def rng_chunk(seed: int) -> int:
    return [3, 25, 700, 2100, 9000, 70_000][seed % 6]


def test_the_address_of_a_frame_head_is_where_its_bytes_are() -> None:
    """The send path hands ``writev`` the address of each frame head (a bytes object): found by a fixed
    offset from the object when CPython lays bytes out that way (checked at import), else by a cast."""
    for size in (0, 1, 7, 64, 4096, 1 << 20):
        head = bytes(random.Random(size).randbytes(size))
        assert ctypes.string_at(iovec.address_of(head), size) == head
        assert iovec.address_of(head) == iovec.address_by_cast(head)
    assert iovec.BYTES_OFFSET is not None  # CPython: the fast way is the one in use


async def arrived(recorder: Recorder, expected: list[tuple[Kind, int, bytes, bytes]]) -> None:
    """Wait (bounded) until ``recorder`` has every frame of ``expected`` and every payload landed; then check
    that they came in order, byte for byte, and the stream stayed open."""
    for _ in range(5000):
        if len(recorder.frames) == len(expected) and len(recorder.landed) == len(recorder.payloads):
            break
        await asyncio.sleep(0.001)
    assert not recorder.closed, recorder.closed
    assert recorder.frames == [(kind, rid, meta) for kind, rid, meta, _ in expected]
    for kind, rid, _, payload in expected:
        if kind == Kind.WRITE:
            assert recorder.payloads[rid].tobytes() == payload, f"payload of request {rid}"


async def test_frames_sent_through_the_stream_arrive_whole_and_in_order() -> None:
    """The send path: control frames, and payloads of one to 40 iovec entries (short ones go out through
    the stream's scratch vector, long ones through their own; short ones as an IoVec or flat ints), small
    and larger than the socket buffers (written in parts, the rest from the loop), interleaved - all
    arrive in order, byte for byte."""
    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    recorder = Recorder(rng)
    receiver = TcpFrameStream(theirs, recorder, loop)
    sender = TcpFrameStream(ours, Recorder(rng), loop)
    sources: list[np.ndarray[Any, Any]] = []
    expected: list[tuple[Kind, int, bytes, bytes]] = []
    try:
        for request_id in range(1, 61):
            if rng.random() < 0.3:
                meta = rng.randbytes(rng.choice([4, 30]))
                sender.send(encode_header(Kind.DONE, request_id, len(meta), 0) + meta)
                expected.append((Kind.DONE, request_id, meta, b""))
                continue
            size = rng.choice([40, 3000, 40_000, 300_000, 2_000_000])
            entries = min(size, rng.choice([1, 2, 5, 31, 32, 40]))
            data = np.frombuffer(rng.randbytes(size), np.uint8).copy()
            sources.append(data)  # alive until sent
            cuts = sorted(rng.sample(range(1, size), entries - 1)) if entries > 1 else []
            bounds = [0, *cuts, size]
            entries_ = [(data.ctypes.data + a, b - a) for a, b in zip(bounds, bounds[1:])]
            flat = len(entries_) <= 16 and rng.random() < 0.5  # a short vector may come as flat ints
            iov: Any = tuple(v for e in entries_ for v in e) if flat else np.array(entries_, np.uint64)
            meta = rng.randbytes(24)
            head = encode_header(Kind.WRITE, request_id, len(meta), size) + meta
            sender.enqueue(sender.prepare(head, iov, size if rng.random() < 0.5 else None))
            expected.append((Kind.WRITE, request_id, meta, data.tobytes()))
        await arrived(recorder, expected)
        assert sender.bytes_out == receiver.bytes_in
    finally:
        sender.close("test over")
        receiver.close("test over")


def test_a_cursor_tracks_a_few_entries_as_ints_as_it_tracks_many_with_numpy() -> None:
    """The cursor's two ways of tracking progress - a few entries as ints in the stream's scratch vector,
    any number with numpy in a vector of its own - against each other over the same entries and the same
    random progress: the same entry pointers, the same remaining vector, the same bytes where ``fill``
    copied them."""
    rng = random.Random(11)
    for _ in range(300):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(1, 16))]
        total = sum(sizes)
        flat_target, np_target = np.zeros(total, np.uint8), np.zeros(total, np.uint8)
        source = np.frombuffer(rng.randbytes(total), np.uint8).copy()
        bounds = np.cumsum([0, *sizes])
        flat = tuple(v for a, n in zip(bounds, sizes) for v in (flat_target.ctypes.data + int(a), n))
        vec = np.array([(np_target.ctypes.data + int(a), n) for a, n in zip(bounds, sizes)], np.uint64)
        spill = (12345, 2048)
        scratch = iovec.Scratch()
        ours = iovec.Cursor(IoVec.of(flat), spill=spill, scratch=scratch)
        theirs = iovec.Cursor(IoVec.of(vec), spill=spill)
        done = 0
        while done < total:
            step = min(total - done, rng.choice([1, 2, rng.randint(1, 60)]))
            if rng.random() < 0.5:
                ours.fill(source.ctypes.data + done, step)
                theirs.fill(source.ctypes.data + done, step)
            else:
                ours.advance(step)
                theirs.advance(step)
            done += step
            assert ours.index == theirs.index and ours.done == theirs.done
            if done < total:
                left = theirs.vec.shape[0] - theirs.index
                assert ours.pointer()[1] == theirs.pointer()[1] == left
                mine = scratch.table[ours.index:ours.index + left - 1].astype(np.int64)  # entries into another array
                other = theirs.vec[theirs.index:-1].astype(np.int64)
                assert (mine[:, 1] == other[:, 1]).all()
                assert (mine[:, 0] - flat_target.ctypes.data == other[:, 0] - np_target.ctypes.data).all()
                assert tuple(scratch.table[ours.index + left - 1]) == spill
        assert (flat_target == np_target).all()


async def test_small_frames_sent_on_an_idle_stream_into_a_filling_socket_arrive_whole_and_in_order() -> None:
    """``send`` writes a small frame on an idle stream itself: one that left whole is answered by a frame that
    has left; one the kernel took only part of (the peer reads nothing yet, the socket fills) is finished
    from the queue before any later frame, and one it took none of waits in the queue. Then the peer reads:
    every frame arrives whole, in order, byte for byte."""
    rng = random.Random(11)
    loop = asyncio.get_running_loop()
    with socket.create_server(("127.0.0.1", 0)) as server:  # TCP: its kernel takes part of a write that does not fit
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    sender = TcpFrameStream(ours, Recorder(rng), loop)
    expected: list[tuple[Kind, int, bytes, bytes]] = []
    sources: list[np.ndarray[Any, Any]] = []
    returned: list[Any] = []
    receiver = None
    try:
        for request_id in range(1, 400):
            meta = rng.randbytes(rng.choice([4, 24, 100]))
            if rng.random() < 0.3:
                returned.append(sender.send(encode_header(Kind.DONE, request_id, len(meta), 0) + meta))
                expected.append((Kind.DONE, request_id, meta, b""))
                continue
            size = rng.choice([17, 1000, 3000, 9000, 30000])
            data = np.frombuffer(rng.randbytes(size), np.uint8).copy()
            sources.append(data)
            half = size // 2
            vector = IoVec.of_ints((data.ctypes.data, half, data.ctypes.data + half, size - half))
            returned.append(sender.send(encode_header(Kind.WRITE, request_id, len(meta), size) + meta, vector))
            expected.append((Kind.WRITE, request_id, meta, data.tobytes()))
        sizes = [len(encode_header(kind, rid, len(meta), len(payload))) + len(meta) + len(payload)
                 for kind, rid, meta, payload in expected]
        whole = sum(size for size, frame in zip(sizes, returned) if frame.left)
        # frames that left whole, then more bytes than they hold: the start of a frame the kernel took part of
        # (nothing has read yet, so no later write added any)
        assert 0 < whole < sender.bytes_out < sum(sizes), (whole, sender.bytes_out)
        recorder = Recorder(rng)
        receiver = TcpFrameStream(theirs, recorder, loop)
        await arrived(recorder, expected)
        assert all(frame.left for frame in returned) and sender.bytes_out == receiver.bytes_in
    finally:
        sender.close("test over")
        if receiver is not None:
            receiver.close("test over")
        else:
            theirs.close()


async def test_a_frame_bigger_than_the_socket_buffer_leaves_in_writes_that_never_fail(monkeypatch: Any) -> None:
    """A payload larger than the socket's buffer, of many entries (its own vector) or a few (the stream's
    scratch vector): each ``writev`` takes what the buffer has room for and the rest waits for the socket
    to be writable, so no call is made that can only fail with EAGAIN (one per buffer fill before); the
    bytes arrive exact."""
    from transports import tcp_send

    calls: list[int] = []
    real = tcp_send.writev

    def counting(fd: int, address: int, count: int) -> int:
        written = int(real(fd, address, count))
        calls.append(written if written >= 0 else -ctypes.get_errno())
        return written

    monkeypatch.setattr(tcp_send, "writev", counting)
    rng = random.Random(5)
    loop = asyncio.get_running_loop()
    for entries in (600, 3):
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        recorder = Recorder(rng)
        receiver = TcpFrameStream(theirs, recorder, loop)
        sender = TcpFrameStream(ours, Recorder(rng), loop)
        calls.clear()
        try:
            size = 4 << 20
            data = np.frombuffer(rng.randbytes(size), np.uint8).copy()
            bounds = [0, *sorted(rng.sample(range(1, size), entries - 1)), size]
            vector = np.array([(data.ctypes.data + a, b - a) for a, b in zip(bounds, bounds[1:])], np.uint64)
            meta = rng.randbytes(24)
            sender.send(encode_header(Kind.WRITE, 1, len(meta), size) + meta, vector)
            for _ in range(10_000):
                if recorder.landed:
                    break
                await asyncio.sleep(0.001)
            assert not recorder.closed, recorder.closed
            assert recorder.payloads[1].tobytes() == data.tobytes()
            assert len(calls) > 2 and all(written > 0 for written in calls), calls  # written in parts, none failed
        finally:
            sender.close("test over")
            receiver.close("test over")


class Replier(Recorder):
    """Answers every PING with a PONG, from inside the frame handler (as a link does)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.stream: TcpFrameStream | None = None
        self.replies: list[asyncio.Future[None]] = []

    def on_frame(self, header: FrameHeader, meta: bytes, in_hand: bool = False) -> PayloadSink | None:
        if header.kind == Kind.PING and self.stream is not None:
            self.replies.append(self.stream.send(encode_header(Kind.PONG, header.request_id, 0, 0)).sent)
        return super().on_frame(header, meta, in_hand)


async def test_what_a_resetting_peer_sent_before_the_reset_is_delivered() -> None:
    """The peer sends a PING and then its last word (a BYE) and resets the connection; the PONG this side
    answers with fails (the reset is already here), and the BYE behind the PING must still be handed
    over before the stream closes - over TCP, as a link's control stream runs."""
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(listener.getsockname())
    ours, _ = listener.accept()
    listener.close()
    replier = Replier(random.Random(3))
    stream = TcpFrameStream(ours, replier, loop)
    replier.stream = stream
    try:
        peer.send(encode_header(Kind.PING, 1, 0, 0))  # unread by the peer: its close below is a reset
        for _ in range(500):
            if replier.replies:
                break
            await asyncio.sleep(0.002)
        await replier.replies[0]  # the first PONG goes out: the peer has it, unread
        bye = b'{"ack": true}'
        peer.send(encode_header(Kind.PING, 2, 0, 0) + encode_header(Kind.BYE, 0, len(bye), 0) + bye)
        peer.close()  # with the PONG unread: a reset, which lands before this side reads the PING
        for _ in range(500):
            if replier.closed:
                break
            await asyncio.sleep(0.002)
        assert [kind for kind, _, _ in replier.frames] == [Kind.PING, Kind.PING, Kind.BYE]
        assert replier.frames[-1][2] == bye
        with pytest.raises(ConnectionError):
            await replier.replies[1]  # the answer to the second PING could not be sent
        assert len(replier.closed) == 1 and stream.closed
    finally:
        stream.close("test over")
        peer.close()


def test_a_stream_knows_whether_its_peer_is_on_this_host() -> None:
    """Loopback, a Unix socket, or a connection from one of this host's addresses to itself: the bytes are
    copied by this host's CPUs at both ends (``FrameStream.local``)."""
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            server = socket.socket(family)
            server.bind((address, 0))
        except OSError:  # no IPv6 here
            continue
        with server, socket.socket(family) as client:
            server.listen(1)
            client.connect(server.getsockname()[:2])
            accepted, _ = server.accept()
            with accepted:
                assert tcp.is_local(client) and tcp.is_local(accepted)
    left, right = socket.socketpair()
    with left, right:
        assert tcp.is_local(left)
    with socket.socket() as unconnected:
        assert not tcp.is_local(unconnected)  # no peer: nothing to say it is here
