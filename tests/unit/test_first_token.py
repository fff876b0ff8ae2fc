"""kvrouter.core.first_token: which requests get the prefill's first token, the client's first event
made of the prefill's answer, and the decode's stream after it (its copy of the token dropped and checked)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvrouter.core.first_token import Follow, Mismatch, is_content, lead_of, leads

GREEDY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "stream": True}


def event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n"


def prefill_chunk(text: str = " the", token: int = 11, finish: str | None = "length") -> dict[str, Any]:
    """What vLLM streams for a ``max_tokens=1`` request asked with ``return_token_ids``."""
    return {"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "stop_reason": None,
                         "prompt_token_ids": [5, 6, 7], "token_ids": [token]}]}


def decode_chunk(text: str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "cmpl-d", "object": "text_completion", "created": 2, "model": "tiny",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "stop_reason": None, **extra}]}


def test_greedy_streamed_completions_of_one_prompt_lead() -> None:
    assert leads("/v1/completions", GREEDY)
    assert leads("/v1/completions", {**GREEDY, "prompt": "hello", "temperature": 0.0, "ignore_eos": True,
                                     "min_tokens": 3, "stream_options": {"include_usage": True}})
    assert leads("/v1/completions", {**GREEDY, "max_tokens": None})  # vLLM's default: the context's rest


@pytest.mark.parametrize("change", [
    {"stream": False}, {"temperature": 0.7}, {"temperature": None}, {"temperature": False}, {"n": 2},
    {"best_of": 3}, {"echo": True}, {"logprobs": 2}, {"prompt_logprobs": 1}, {"stop": ["\n"]}, {"suffix": "x"},
    {"min_tokens": 2}, {"stream_options": {"continuous_usage_stats": True}}, {"max_tokens": 1},
    {"prompt": ["a", "b"]}, {"prompt": [[1, 2], [3]]}, {"prompt": ""}, {"prompt": []},
])
def test_what_treats_the_first_token_differently_on_the_two_sides_does_not_lead(change: dict[str, Any]) -> None:
    assert not leads("/v1/completions", {**GREEDY, **change})


def test_chat_does_not_lead() -> None:
    assert not leads("/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": "hi"}]})


def test_the_prefill_answer_becomes_the_client_first_event_without_its_end_or_ids() -> None:
    lead = lead_of(prefill_chunk(), client_wants_ids=False)
    assert lead is not None and (lead.completion_id, lead.text, lead.token_id) == ("cmpl-p", " the", 11)
    assert lead.event.startswith(b"data: ") and lead.event.endswith(b"\n\n")
    first = json.loads(lead.event[6:])
    assert first["choices"] == [{"index": 0, "text": " the", "finish_reason": None, "stop_reason": None}]
    with_ids = lead_of(prefill_chunk(), client_wants_ids=True)
    assert with_ids is not None
    choice = json.loads(with_ids.event[6:])["choices"][0]
    assert choice["token_ids"] == [11] and choice["prompt_token_ids"] == [5, 6, 7]


@pytest.mark.parametrize("chunk", [
    prefill_chunk(finish="stop"),  # the request ends at its first token: the decode says how
    prefill_chunk(text=""), prefill_chunk(text="ab\ufffd"),  # a partial character the decode would hold back
    {**prefill_chunk(), "choices": []}, {"error": {"message": "boom"}}, [1, 2],
    {**prefill_chunk(), "choices": [{**prefill_chunk()["choices"][0], "token_ids": [1, 2]}]},
    # KvpushConnector's prefill of a recurrent-state model computed the prompt but its last token: its token is
    # the prompt's last one, foretold, and its stop reason says so
    {**prefill_chunk(), "choices": [{**prefill_chunk()["choices"][0], "stop_reason": "kvpush: the decode computes "
                                                                                    "the prompt's last token"}]},
])
def test_a_prefill_answer_that_cannot_lead(chunk: Any) -> None:
    assert lead_of(chunk, client_wants_ids=False) is None


def test_the_decode_copy_of_the_first_token_is_dropped_and_every_event_gets_the_lead_id() -> None:
    lead = lead_of(prefill_chunk(), client_wants_ids=False)
    assert lead is not None
    follow = Follow(lead)
    assert follow.line(b"\n") == b"\n"
    assert follow.line(event(decode_chunk(" the"))) is None
    second = follow.line(event(decode_chunk(" cat")))
    assert second is not None and json.loads(second[6:]) == {**decode_chunk(" cat"), "id": "cmpl-p"}
    usage = follow.line(event({"id": "cmpl-d", "choices": [], "usage": {"completion_tokens": 8}}))
    assert usage is not None and json.loads(usage[6:])["id"] == "cmpl-p"
    assert follow.line(b"data: [DONE]\n") == b"data: [DONE]\n"
    error = follow.line(b'data: {"error": {"message": "boom"}}\n')
    assert error is not None and json.loads(error[6:]) == {"error": {"message": "boom"}}


def test_a_request_that_ends_at_its_first_token_keeps_its_end() -> None:
    lead = lead_of(prefill_chunk(), client_wants_ids=False)
    assert lead is not None
    out = Follow(lead).line(event(decode_chunk(" the", finish="length", token_ids=[11])))
    assert out is not None
    assert json.loads(out[6:])["choices"] == [{"index": 0, "text": "", "finish_reason": "length",
                                               "stop_reason": None}]


@pytest.mark.parametrize("wants_ids", [False, True])
def test_a_decode_event_that_carries_more_than_the_first_token_goes_on_without_it(wants_ids: bool) -> None:
    """vLLM may stream a decode's first tokens in one event (its output fell behind the engine): the client,
    which has the first token, gets the rest of that event."""
    lead = lead_of(prefill_chunk(), client_wants_ids=wants_ids)
    assert lead is not None
    ids = {"token_ids": [11, 12, 13], "prompt_token_ids": [5, 6, 7]} if wants_ids else {}
    out = Follow(lead).line(event(decode_chunk(" the cat sat", **ids)))
    assert out is not None
    choice = json.loads(out[6:])["choices"][0]
    assert choice["text"] == " cat sat" and "prompt_token_ids" not in choice
    assert choice.get("token_ids") == ([12, 13] if wants_ids else None)


@pytest.mark.parametrize("first", [decode_chunk(" a"), decode_chunk(" the", token_ids=[12]),
                                   decode_chunk(" a the", token_ids=[12, 11])])
def test_a_decode_first_token_that_differs_is_refused(first: dict[str, Any]) -> None:
    lead = lead_of(prefill_chunk(), client_wants_ids=False)
    assert lead is not None
    with pytest.raises(Mismatch):
        Follow(lead).line(event(first))


def test_content_events() -> None:
    assert is_content(event(decode_chunk("x")))
    assert is_content(event(decode_chunk("", token_ids=[3])))
    assert not is_content(event(decode_chunk("")))
    assert not is_content(b"data: [DONE]\n") and not is_content(b"\n") and not is_content(b"data: {oops\n")
