#!/usr/bin/env python3
"""The proxies of bench/vllm_load.py's setups that ``kvpush proxy`` does not serve (aiohttp, loopback).

    python bench/load_proxy.py rr   --port P --upstream URL --upstream URL   # round robin over instances
    python bench/load_proxy.py nixl --port P --prefill URL --decode URL      # vLLM's NixlConnector P/D

``rr``: each request goes whole to the next instance in turn (two independent instances, no KV moves).
``nixl``: the flow of vLLM's own toy P/D proxy: the prefill gets the request with ``do_remote_decode`` and
``max_tokens=1``, its answer's ``kv_transfer_params`` go to the decode with the client's request, whose
answer is streamed back. Both relay the answer chunk by chunk. Prints ``serving http://...`` when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from typing import Any

import aiohttp
from aiohttp import web


class Relay:
    def __init__(self, mode: str, upstreams: list[str], prefill: str | None, decode: str | None) -> None:
        self.mode = mode
        self.turn = itertools.cycle(upstreams) if upstreams else None
        self.prefill, self.decode = prefill, decode
        self.session: aiohttp.ClientSession | None = None

    async def completion(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body: dict[str, Any] = await request.json()
        if self.mode == "rr":
            assert self.turn is not None
            target, sent = next(self.turn), body
        else:
            assert self.prefill is not None and self.decode is not None
            first = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}}
            first.pop("stream_options", None)
            async with self.session.post(self.prefill + request.path, json=first) as reply:
                answer = await reply.json()
                if reply.status != 200:
                    return web.json_response(answer, status=reply.status)
            params = dict(answer.get("kv_transfer_params") or {})
            params.pop("remote_prefill_cached_tokens", None)  # the decode reports its own cached tokens
            target, sent = self.decode, {**body, "kv_transfer_params": params}
        async with self.session.post(target + request.path, json=sent) as reply:
            response = web.StreamResponse(status=reply.status,
                                          headers={"Content-Type": reply.headers.get("Content-Type", "")})
            await response.prepare(request)
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def client(self, app: web.Application) -> Any:
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as self.session:
            yield


async def serve(relay: Relay, port: int) -> None:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", relay.completion)
    app.router.add_post("/v1/chat/completions", relay.completion)
    app.cleanup_ctx.append(relay.client)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"serving http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("rr", "nixl"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", action="append", default=[])
    parser.add_argument("--prefill")
    parser.add_argument("--decode")
    args = parser.parse_args()
    asyncio.run(serve(Relay(args.mode, args.upstream, args.prefill, args.decode), args.port))


if __name__ == "__main__":
    main()
