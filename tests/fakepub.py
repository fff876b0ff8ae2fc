"""A KV event publisher as vLLM 0.32's ``ZmqEventPublisher`` behaves on the wire (for tests of the router's
follower; real vLLM instances publish in tests/vllm): a PUB socket sending ``[topic, seq (8 bytes, big-endian),
msgpack [ts, events, rank]]``, events as maps tagged by ``"type"``, and a ROUTER answering a replay request
``[b"", start (8 bytes)]`` with every buffered batch from ``start`` on, then the end marker."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

END = b"\xff" * 8


def stored(hashes: list[int], block_size: int = 32) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": list(range(block_size * len(hashes))), "block_size": block_size, "lora_id": None,
            "medium": "GPU", "lora_name": None, "group_idx": 0}


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


CLEARED = {"type": "AllBlocksCleared"}


class FakePublisher:
    def __init__(self, topic: bytes = b"kv", buffer_steps: int = 100) -> None:
        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.router = self.context.socket(zmq.ROUTER)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        replay = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint, self.replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._serving = asyncio.get_running_loop().create_task(self._serve_replays())

    async def publish(self, events: list[Any], seq: int | None = None, send: bool = True) -> int:
        """One batch (numbered in turn, or ``seq``); ``send`` False: buffered for replays, never sent live (a
        batch the subscriber missed)."""
        number = self.seq if seq is None else seq
        payload = msgpack.packb([time.time(), events, 0])
        self.buffer.append((number, payload))
        if send:
            await self.pub.send_multipart([self.topic, number.to_bytes(8, "big"), payload])
        self.seq = number + 1
        return number

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replays(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([identity, b"", b"", END, b""])

    def restart(self) -> None:
        """As an engine started again: numbers from 0, an empty buffer."""
        self.seq = 0
        self.buffer.clear()

    async def close(self) -> None:
        self._serving.cancel()
        await asyncio.gather(self._serving, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.context.term()
