"""A request's prompt as the token ids vLLM will compute (``Tokens``), so the router can hash its blocks.

- ``/v1/completions`` with token ids: those, as they are (free).
- a text prompt: the model's tokenizer, loaded by the router (``tokenizer``: a model directory or name with
  tokenizer files, read with ``transformers.AutoTokenizer``), as vLLM tokenizes it (``add_special_tokens``
  as the request says, default true); without one, the instance's own ``POST /tokenize``.
- ``/v1/chat/completions``: the instance's ``POST /tokenize`` with the messages (vLLM renders its chat template
  as it would for the request; a template the router rendered itself could differ from vLLM's choice).

A prompt that cannot be tokenized (a batch of prompts, an instance that does not answer within
``TOKENIZE_TIMEOUT_S``) is placed by load alone. Tokenizing runs off the event loop (a thread).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 2.0
_CHAT_KEYS = ("messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
              "tools", "add_special_tokens", "mm_processor_kwargs")


class Tokens:
    """Token ids of requests: ``ids(path, body, session, instance_url)``; ``tokenizer``: a local one, or None."""

    def __init__(self, tokenizer: str | None = None) -> None:
        self.tokenizer_name = tokenizer
        self._tokenizer: Any = None
        if tokenizer is not None:
            from transformers import AutoTokenizer  # the router's tokenizer extra: a clear ImportError without it

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.failures = 0

    async def ids(self, path: str, body: Mapping[str, Any], session: aiohttp.ClientSession,
                  instance: str) -> list[int] | None:
        """The prompt's token ids, or None when they cannot be had (logged at debug, counted)."""
        try:
            if path.endswith("/chat/completions"):
                return await self._remote(session, instance, {k: body[k] for k in _CHAT_KEYS if k in body},
                                          body.get("model"))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None
            special = body.get("add_special_tokens", True) is not False
            if self._tokenizer is not None:
                return await asyncio.to_thread(self._encode, prompt, special)
            return await self._remote(session, instance, {"prompt": prompt, "add_special_tokens": special},
                                      body.get("model"))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError) as error:
            self.failures += 1
            log.debug("the prompt could not be tokenized (%s): placed by load alone", error)
            return None

    def _encode(self, prompt: str, special: bool) -> list[int]:
        ids: list[int] = self._tokenizer(prompt, add_special_tokens=special)["input_ids"]
        return ids

    async def _remote(self, session: aiohttp.ClientSession, instance: str, fields: Mapping[str, Any],
                      model: Any) -> list[int] | None:
        body = {**fields, "model": model} if model is not None else dict(fields)
        async with session.post(f"{instance}/tokenize", json=body,
                                timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)) as reply:
            if reply.status != 200:
                raise ValueError(f"{instance}/tokenize answered {reply.status}")
            tokens: Sequence[Any] = (await reply.json())["tokens"]
        if not all(type(t) is int for t in tokens):
            raise ValueError("/tokenize answered something else than token ids")
        return list(tokens)
