"""The first token from the prefill (pure: no I/O; ``proxy_http`` does the reading and writing).

In vLLM's prefill/decode split the prefill computes the prompt and samples the first token, and the decode,
once the KV landed, computes that token again (one decode step: its own forward over the last position)
before it streams anything. For a streamed completion whose first token both sides choose alike (greedy
sampling, nothing that treats the first token differently on the two sides) the proxy sends the client the
prefill's first token as soon as the prefill streams it (``lead_of``), and drops the decode's copy of that
token from the decode's stream (``Follow``): the client's time to first token is the prefill's, not the
prefill's plus the transfer's tail plus a decode step. What the client receives is what the decode alone
would have streamed: the same tokens, text, finish reason and usage, under one completion id.

``leads`` says which requests qualify. The decode's first token is checked against the prefill's
(``Mismatch``: the proxy then cuts the client's connection rather than stream two different tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# body fields that make the two sides' first token differ (or its text, or what a chunk carries)
_NOT_LEADING = ("echo", "logprobs", "prompt_logprobs", "stop", "suffix")


def leads(path: str, body: dict[str, Any]) -> bool:
    """True when the client may get the prefill's first token: a streamed ``/v1/completions`` request for
    one greedy completion of one prompt, at least two tokens long, with nothing that treats the first
    token differently on the prefill (which computes one token, without ``min_tokens``) and the decode:
    no stop strings (the decode holds back text that may start one), no echo or log-probabilities, no
    per-chunk usage."""
    if path != "/v1/completions" or body.get("stream") is not True:
        return False
    temperature = body.get("temperature")
    if type(temperature) not in (int, float) or temperature != 0:
        return False
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if any(body.get(key) for key in _NOT_LEADING) or (body.get("min_tokens") and not body.get("ignore_eos")):
        return False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return False
    limit = body.get("max_tokens", body.get("max_completion_tokens"))
    if limit is not None and (type(limit) is not int or limit < 2):
        return False
    prompt = body.get("prompt")
    return (isinstance(prompt, str) and bool(prompt)) or (
        isinstance(prompt, list) and bool(prompt) and all(type(token) is int for token in prompt))


@dataclass(frozen=True)
class Lead:
    """The prefill's first token: the event the client gets, and what the decode's first token must be."""

    completion_id: str
    text: str
    token_id: int
    event: bytes  # ``data: {...}\n\n``


class Mismatch(Exception):
    """The decode's first token differs from the prefill's, which the client already has."""


def lead_of(chunk: Any, client_wants_ids: bool) -> Lead | None:
    """The prefill's first streamed chunk (its ``max_tokens=1`` answer, asked with ``return_token_ids``) ->
    the client's first event; None when it cannot lead: no single token, the request ended at it (a stop
    token: the decode's answer says so), a token that is no answer's first (a stop reason beside a "length"
    finish: KvpushConnector's prefill of a model with a recurrent state computes the prompt but its last
    token), or a partial character (the decode would hold it back)."""
    if not isinstance(chunk, dict) or not isinstance(chunk.get("id"), str):
        return None
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    text, ids = choice.get("text"), choice.get("token_ids")
    if (choice.get("finish_reason") != "length" or choice.get("stop_reason") is not None
            or not isinstance(text, str) or not text or text.endswith("\ufffd")
            or not isinstance(ids, list) or len(ids) != 1 or type(ids[0]) is not int):
        return None
    first = {**choice, "finish_reason": None, "stop_reason": None}
    if not client_wants_ids:
        first.pop("token_ids", None)
        first.pop("prompt_token_ids", None)
    event = {key: value for key, value in chunk.items() if key not in ("usage", "system_fingerprint")}
    event["choices"] = [first]
    return Lead(chunk["id"], text, ids[0], b"data: " + json.dumps(event).encode() + b"\n\n")


def is_content(line: bytes) -> bool:
    """True for a decode's event that carries generated text or tokens (the first such is its first token)."""
    chunk = event_of(line)
    if chunk is None:
        return False
    choices = chunk.get("choices")
    return isinstance(choices, list) and any(
        isinstance(choice, dict) and (choice.get("text") or choice.get("token_ids")) for choice in choices)


class Follow:
    """The decode's stream after the client got ``lead``: its first token's event goes (checked against the
    lead), every event carries the lead's completion id, and the rest is the decode's as it streamed it."""

    def __init__(self, lead: Lead) -> None:
        self.lead = lead
        self._first_seen = False

    def line(self, line: bytes) -> bytes | None:
        """One line of the decode's stream -> what the client gets (None: nothing). Raises Mismatch."""
        chunk = event_of(line)
        if chunk is None:
            return line  # blank separators, ``data: [DONE]``
        if "id" in chunk:  # (an error event has none)
            chunk["id"] = self.lead.completion_id
        if not self._first_seen and is_content(line):
            self._first_seen = True
            # vLLM may stream the first tokens in one event (its output fell behind the engine): the lead's
            # token is this event's first, the rest goes on
            choice = chunk["choices"][0]
            text, ids = choice.get("text") or "", choice.get("token_ids")
            if not text.startswith(self.lead.text) or (ids is not None and ids[:1] != [self.lead.token_id]):
                raise Mismatch(f"the decode's first token {text!r} differs from the prefill's {self.lead.text!r}")
            choice["text"] = text[len(self.lead.text):]
            choice.pop("prompt_token_ids", None)  # the lead carried them
            if ids is not None and len(ids) > 1:
                choice["token_ids"] = ids[1:]
            else:
                choice.pop("token_ids", None)
            if not choice["text"] and "token_ids" not in choice and choice.get("finish_reason") is None:
                return None  # the first token alone: the client has it
        return b"data: " + json.dumps(chunk).encode() + b"\n"


def event_of(line: bytes) -> dict[str, Any] | None:
    """The JSON object of an event stream's ``data:`` line; None for any other line."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if not payload.startswith(b"{"):
        return None
    try:
        chunk = json.loads(payload)
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None
