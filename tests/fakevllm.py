"""A stand-in for a vLLM OpenAI server (aiohttp, loopback): records what it received and answers as its
``behaviour`` says (default: a JSON completion, or a short event stream when asked to stream). For tests of
the proxy's own behaviour; real vLLM servers are tested in tests/vllm."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

Behaviour = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]
USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
         "prompt_tokens_details": {"cached_tokens": 32}}


class FakeVllm:
    """An upstream that records what it received and answers as ``behaviour`` says (default: JSON)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.behaviour: Behaviour = self.answer
        self.health_status = 200
        self.runner: web.AppRunner | None = None
        self.url = ""
        #: what GET /kv_event_sources answers (vLLM: its KVEventsConfig per data parallel rank); None: 404
        self.event_sources: dict[str, Any] | None = None
        self.tokenized: list[dict[str, Any]] = []  # POST /tokenize bodies (answered: one token per character)
        self.raw: list[bytes] = []  # the completions' bodies as they came
        self.model_root: str | None = None  # the "root" /v1/models names (vLLM: the model's directory or name)
        #: a transformers tokenizer: /tokenize then renders a chat with its chat template and tokenizes it as vLLM
        #: does (else one token per character of the messages' JSON)
        self.tokenizer: Any = None
        self.chat_template: str | None = None  # the one it was started with (--chat-template), else the tokenizer's

    async def start(self, port: int = 0) -> FakeVllm:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)
        app.router.add_post("/tokenize", self.tokenize)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def completion(self, request: web.Request) -> web.StreamResponse:
        self.raw.append(await request.read())
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.started.set()
        try:
            return await self.behaviour(request, body)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        answer = {"id": f"cmpl-{self.name}", "object": "text_completion",
                  "choices": [{"index": 0, "text": f"from {self.name}"}], "usage": USAGE}
        if not body.get("stream"):
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps(answer).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        model: dict[str, Any] = {"id": "tiny", "owned_by": self.name}
        if self.model_root is not None:
            model["root"] = self.model_root
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        if self.event_sources is None:
            return web.Response(status=404)
        return web.json_response(self.event_sources)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        if "messages" in body and self.tokenizer is not None:
            text = self.tokenizer.apply_chat_template(
                body["messages"], tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False), chat_template=self.chat_template,
                **(body.get("chat_template_kwargs") or {}))
            ids = self.tokenizer(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"]
            return web.json_response({"tokens": ids, "count": len(ids)})
        text = body.get("prompt") if "prompt" in body else json.dumps(body.get("messages"))
        return web.json_response({"tokens": [ord(c) % 2000 for c in str(text)], "count": len(str(text))})
