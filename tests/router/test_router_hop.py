"""What the router puts on a request's path (issue 42): its tokenizing and its re-encoding. Stand-ins for vLLM
(tests/fakevllm.py) record what reaches them; the tokenizer is a real one (``kvpush.cli.tiny_model``'s BPE,
saved to a directory as a model's tokenizer is)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakevllm import FakeVllm

from kvrouter import server
from kvrouter.config import ProxyConfig
from kvrouter.core.placement import Policy
from kvrouter.core.pools import parse_prefill
from kvrouter.tokens import most_tokens, text_prompt

BLOCK = 16


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpush.cli.tiny_model import _train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    _train_tokenizer(512, 0).save_pretrained(str(path))
    return path


class Router:
    def __init__(self, decode: FakeVllm, prefill: FakeVllm, url: str) -> None:
        self.decode, self.prefill, self.url = decode, prefill, url

    async def get(self, session: aiohttp.ClientSession, path: str) -> str:
        async with session.get(self.url + path) as reply:
            return await reply.text()

    async def post(self, session: aiohttp.ClientSession, data: bytes, path: str = "/v1/completions") -> str:
        async with session.post(self.url + path, data=data, headers={"Content-Type": "application/json"}) as reply:
            assert reply.status == 200, await reply.text()
            await reply.read()
            return reply.headers["X-Kvpush-Route"]


async def router(tokenizer: str | None, root: str | None, chat_template: str | None = None) -> AsyncIterator[Router]:
    decode, prefill = await FakeVllm("decode").start(), await FakeVllm("prefill").start()
    decode.model_root = root
    config = ProxyConfig([parse_prefill(f"{prefill.url}#kv=14600")], [decode.url], kv_probe_s=0,
                         policy=Policy(pd_min_tokens=256), block_size=BLOCK, tokenizer=tokenizer,
                         chat_template=chat_template)
    runner = await server.start(config, "127.0.0.1", 0)
    try:
        yield Router(decode, prefill, f"http://127.0.0.1:{server.bound_port(runner)}")
    finally:
        await runner.cleanup()
        for fake in (decode, prefill):
            assert fake.runner is not None
            await fake.runner.cleanup()


@pytest.fixture
async def auto(tokenizer_dir: Path) -> AsyncIterator[Router]:
    """The default (``--tokenizer auto``), in front of a decode whose model's tokenizer is on this host."""
    async for r in router("auto", str(tokenizer_dir)):
        yield r


@pytest.fixture
async def remote(tokenizer_dir: Path) -> AsyncIterator[Router]:
    """``--tokenizer none``: the instances tokenize, whatever is on this host."""
    async for r in router(None, str(tokenizer_dir)):
        yield r


def words(n: int, seed: int) -> str:
    vocabulary = "cache block layer prefill decode push token model engine request".split()
    return " ".join(vocabulary[(seed * 7 + i * 3) % len(vocabulary)] for i in range(n))


def body(prompt: Any, **fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, **fields}, indent=1).encode()


@pytest.fixture(scope="module")
def reference(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


async def test_the_default_finds_the_instances_tokenizer_and_tokenizes_here(auto: Router, reference: Any) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await until(lambda: _contains(auto.get(session, "/metrics"), "kvpush_proxy_tokenizer_local 1"))
        long = words(400, 1)  # long enough to disaggregate: placement needs its blocks
        assert await auto.post(session, body(long)) == "pd"
        assert not auto.decode.tokenized and not auto.prefill.tokenized  # no /tokenize round trip
        # no instance held its head's blocks: it was placed by them, and its ids were all had after its answer
        assert "kvpush_proxy_tokenized_head_total 1" in await auto.get(session, "/metrics")
        ids = reference(long)["input_ids"]
        for instance in (auto.decode, auto.prefill):
            await until(lambda url=instance.url: _contains(  # type: ignore[misc]
                auto.get(session, "/metrics"),
                f'kvpush_proxy_index_blocks{{url="{url}",source="guessed"}} {len(ids) // BLOCK}'))
        # its blocks were hashed from the same ids vLLM computes: the same prompt again is held by the decode, which
        # holds its head too, so it is tokenized whole
        again = words(400, 1) + " push"
        assert await auto.post(session, body(again)) == "decode-only"
        metrics = await auto.get(session, "/metrics")
        assert "kvpush_proxy_tokenized_head_total 1" in metrics
        # ... and it began with the first one, tokenized whole after its answer: only its end was tokenized now
        assert "kvpush_proxy_tokenized_after_known_total 1" in metrics


def chat(messages: list[dict[str, str]], **fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "messages": messages, "max_tokens": 2, **fields}).encode()


def turns(n: int, seed: int) -> list[dict[str, str]]:
    return [{"role": ("user", "assistant")[i % 2], "content": words(20 + 10 * i, seed + i)} for i in range(n)]


async def _chats(router: Router, session: aiohttp.ClientSession) -> tuple[int, int]:
    """(chats tokenized here, chats tokenized by an instance), from the router's metrics."""
    text = await router.get(session, "/metrics")
    counts = [int(line.rsplit(" ", 1)[1]) for where in ("here", "instance") for line in text.splitlines()
              if line.startswith(f'kvpush_proxy_chats_tokenized_total{{where="{where}"}}')]
    return counts[0], counts[1]


async def test_chats_are_tokenized_here_once_one_rendered_here_as_the_instance_rendered_it(
        auto: Router, reference: Any) -> None:
    """A chat's ids need the chat template: the first chat of each set of rendering fields is tokenized by the
    instance (a round trip on its path) and rendered here beside it; equal ids, and later such chats are rendered
    here alone. Chats with fields of their own (a template, tools) or messages that are not a role and a string
    still go to the instance."""
    auto.decode.tokenizer = reference  # the stand-in renders a chat as vLLM does, with the same template
    CHAT = "/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await until(lambda: _contains(auto.get(session, "/metrics"), "kvpush_proxy_tokenizer_local 1"))
        await auto.post(session, chat(turns(2, 0)), CHAT)
        assert len(auto.decode.tokenized) == 1 and await _chats(auto, session) == (0, 1)
        for n in (2, 3, 4):  # the same rendering: here, and no round trip
            await auto.post(session, chat(turns(n, n)), CHAT)
        assert len(auto.decode.tokenized) == 1 and await _chats(auto, session) == (3, 1)
        # other rendering fields: once by the instance, then here
        for seed in (5, 6):
            await auto.post(session, chat(turns(2, seed), add_generation_prompt=False), CHAT)
        assert len(auto.decode.tokenized) == 2 and await _chats(auto, session) == (4, 2)
        # a chat rendered here is a text prompt: one too short to disaggregate is not tokenized on its path (its
        # rendered text bounds its tokens), and a long one whose head no instance holds is placed by its head
        await auto.post(session, chat([{"role": "user", "content": "hi"}]), CHAT)
        assert len(auto.decode.tokenized) == 2 and await _chats(auto, session) == (4, 2)
        metrics = await auto.get(session, "/metrics")
        assert "kvpush_proxy_tokenized_head_total 0" in metrics
        assert await auto.post(session, chat([{"role": "user", "content": words(900, 9)}]), CHAT) == "pd"
        assert len(auto.decode.tokenized) == 2
        assert "kvpush_proxy_tokenized_head_total 1" in await auto.get(session, "/metrics")
        # what is not rendered here: a template of its own, tools, a message with parts
        own = [chat(turns(2, 7), chat_template="{{ messages[0]['content'] }}"),
               chat(turns(2, 8), tools=[{"type": "function", "function": {"name": "f"}}]),
               chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])]
        for sent in own:
            await auto.post(session, sent, CHAT)
        assert len(auto.decode.tokenized) == 2 + len(own)


async def _three_chats(r: Router) -> tuple[int, tuple[int, int]]:
    """Three chats of one rendering through ``r``, once its tokenizer is loaded: (the instance's ``/tokenize``
    calls, (chats tokenized here, chats tokenized by an instance))."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await until(lambda: _contains(r.get(session, "/metrics"), "kvpush_proxy_tokenizer_local 1"))
        for n in (2, 3, 4):
            await r.post(session, chat(turns(n, n)), "/v1/chat/completions")
        return len(r.decode.tokenized), await _chats(r, session)


async def test_chats_rendered_here_are_checked_again_and_go_back_to_the_instance_when_it_differs(
        auto: Router, reference: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One chat in ``RECHECK_EVERY`` rendered here is also asked of the instance, off its path: when the instance
    renders otherwise (here, a template the first chat did not show: it changed), chats of that rendering go to
    the instance again."""
    from kvrouter import tokens

    monkeypatch.setattr(tokens, "RECHECK_EVERY", 2)
    auto.decode.tokenizer = reference

    async def rechecked(calls: int) -> bool:  # (a re-check runs beside its chat: it may end after the answer)
        return len(auto.decode.tokenized) == calls

    # the deciding chat, then two here, the second re-checked (the same ids: nothing changes)
    assert (await _three_chats(auto))[1] == (2, 1)
    await until(lambda: rechecked(2))
    auto.decode.chat_template = OWN_TEMPLATE
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for n in (5, 6):  # the second re-checked: the instance now renders otherwise
            await auto.post(session, chat(turns(n, n)), "/v1/chat/completions")
        await until(lambda: _contains(auto.get(session, "/metrics"), "kvpush_proxy_chat_renderings_refuted_total 1"))
        for n in (7, 8):  # the instance's again
            await auto.post(session, chat(turns(n, n)), "/v1/chat/completions")
        assert len(auto.decode.tokenized) == 5 and await _chats(auto, session) == (4, 3)
        assert "kvpush_proxy_chat_renderings_refuted_total 1" in await auto.get(session, "/metrics")


async def test_chats_that_render_otherwise_here_keep_going_to_the_instance(auto: Router) -> None:
    """An instance that renders chats otherwise (here, the stand-in's own ids) keeps tokenizing them: the router
    never places by ids its own template made."""
    assert await _three_chats(auto) == (3, (0, 3))


async def test_a_text_that_begins_with_a_known_one_tokenizes_as_the_whole_text(reference: Any) -> None:
    """``Known``: a conversation's turns, each the last one and more (joined by a space, new lines, nothing,
    with and without special tokens), and texts that part from a known one before its end, get the ids the whole
    text gets, tokenized after the shared part's ids; the same text again is kept once; what is kept stays within
    its bound, the least recently used leaving first."""
    from kvrouter.tokens import KNOWN_PER_HEAD, Known, Tokens

    tokens = Tokens(None)
    tokens._loaded(reference)
    assert tokens.known is not None
    text, turns = words(900, 1), 0
    for turn, joint in enumerate((" ", "\n", "", ". ", "\n\n", " ", "  ")):
        special = turn != 5
        assert await tokens._encoded(text, special) == reference(text, add_special_tokens=special)["input_ids"]
        turns += turn not in (0, 5)  # (5: no known text was tokenized without special tokens)
        assert tokens.counters["tokenized_after_known"] == turns
        text += joint + words(60, turn)
    # texts that part from a known one before its end: a rendered chat whose one message grew (the known one ends
    # with the template's tail), the same history with another last message
    template = "[user] {}\n[assistant]"
    for grown in (words(700, 3), words(700, 3) + " " + words(50, 4), words(700, 3) + " " + words(30, 5)):
        before = tokens.counters["tokenized_after_known"]
        rendered = template.format(grown)
        assert await tokens._encoded(rendered, False) == reference(rendered, add_special_tokens=False)["input_ids"]
        assert tokens.counters["tokenized_after_known"] == before + (grown != words(700, 3))
    await tokens._encoded(text, True)
    held = tokens.known.tokens
    assert await tokens._encoded(text, True) == reference(text)["input_ids"]  # the same text again: kept once
    assert tokens.known.tokens == held

    known = Known(capacity=3000)
    for seed in range(40):  # different heads: the oldest leave
        ids = reference(words(700, seed))["input_ids"]
        known.remember(words(700, seed), True, ids, list(range(1, len(ids) + 1)))
        assert known.tokens <= 3000
    assert known.find(words(700, 39) + " more", True) is not None and known.find(words(700, 0), True) is None
    shared = Known()
    for n in range(KNOWN_PER_HEAD + 3):  # one head, many texts: at most KNOWN_PER_HEAD of them
        text = words(600, 2) + " " + words(10 + n, n)
        ids = reference(text)["input_ids"]
        shared.remember(text, True, ids, list(range(1, len(ids) + 1)))
    assert len(shared._texts) == 1 and len(next(iter(shared._texts.values()))) == KNOWN_PER_HEAD


def test_a_tokenizer_that_marks_a_texts_first_word_is_not_cut(reference: Any) -> None:
    """SentencePiece's dummy prefix (a text's first word is tokenized as if a space preceded it): a text's tail
    tokenized alone is not the whole text's end, so nothing is tokenized after a known text with such a tokenizer;
    byte-level BPE (the tiny model's) splits cleanly."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvrouter.tokens import Tokens, splits_at_whitespace

    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    model.decoder = tokenizers.decoders.Metaspace()
    model.train_from_iterator([words(200, seed) for seed in range(20)],
                              tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"],
                                                             show_progress=False))
    dummy_prefix = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>")
    assert not splits_at_whitespace(dummy_prefix) and splits_at_whitespace(reference)
    tokens = Tokens(None)
    tokens._loaded(dummy_prefix)
    assert tokens.known is None


OWN_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}<assistant>"


@pytest.fixture
async def own_template(tokenizer_dir: Path) -> AsyncIterator[Router]:
    """``--chat-template``: the router is given the template its instances were started with."""
    async for r in router("auto", str(tokenizer_dir), chat_template=OWN_TEMPLATE):
        yield r


async def test_the_instances_own_chat_template_given_to_the_router_renders_chats_here(
        own_template: Router, reference: Any) -> None:
    """Instances started with a ``--chat-template`` of their own: a router given the same renders their chats as
    they do, and tokenizes them itself after the first."""
    own_template.decode.tokenizer, own_template.decode.chat_template = reference, OWN_TEMPLATE
    assert await _three_chats(own_template) == (1, (2, 1))


async def test_instances_with_a_chat_template_the_router_was_not_given_keep_tokenizing_chats(
        auto: Router, reference: Any) -> None:
    """Instances started with a ``--chat-template`` the router was not given: their chats stay on ``/tokenize``."""
    auto.decode.tokenizer, auto.decode.chat_template = reference, OWN_TEMPLATE
    assert await _three_chats(auto) == (3, (0, 3))


def test_the_router_takes_a_chat_template_as_vllm_does(tmp_path: Path) -> None:
    """``--chat-template``: a file, or the template itself; a path that names no file is an error."""
    from kvrouter.cli import UsageError, _template

    (tmp_path / "t.jinja").write_text(OWN_TEMPLATE)
    assert _template(str(tmp_path / "t.jinja")) == OWN_TEMPLATE == _template(OWN_TEMPLATE)
    assert _template(None) is None
    with pytest.raises(UsageError, match="no such file"):
        _template(str(tmp_path / "missing.jinja"))


def test_a_long_texts_head_tokenizes_as_the_whole_texts_beginning(reference: Any) -> None:
    """``Tokens.head_ids``: the head is cut where whitespace begins, its ids begin the whole text's, and the
    scale estimates the whole prompt's tokens from the head's."""
    from kvrouter.tokens import HEAD_CHARS, Tokens

    tokens = Tokens(None)
    tokens._loaded(reference)
    assert tokens.head_ids("/v1/completions", {"prompt": words(50, 3)}) is None  # short: tokenized whole
    assert tokens.head_ids("/v1/chat/completions", {"messages": [{"role": "user", "content": words(900, 3)}]}) is None
    assert tokens.head_ids("/v1/completions", {"prompt": "x" * (3 * HEAD_CHARS)}) is None  # no whitespace to cut
    for seed in range(5):
        text = words(900, seed)
        head = tokens.head_ids("/v1/completions", {"prompt": text})
        assert head is not None
        ids, scale = head
        whole = reference(text)["input_ids"]
        assert ids == whole[:len(ids)] and 0 < len(ids) < len(whole)
        assert abs(len(ids) * scale - len(whole)) < 0.1 * len(whole)


async def test_none_asks_the_instance(remote: Router) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        assert await remote.post(session, body(words(400, 2))) == "pd"
        assert [t["prompt"] for t in remote.decode.tokenized] == [words(400, 2)]
        assert "kvpush_proxy_tokenizer_local 0" in await remote.get(session, "/metrics")


async def test_a_prompt_too_short_to_disaggregate_goes_untokenized_and_is_learnt_after(remote: Router) -> None:
    """One decode up and a prompt shorter than the threshold however it tokenizes: placement cannot depend on
    its blocks, so the request goes first and its blocks reach the guessed index after its answer."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        short = "a" * 100
        sent = body(short)
        assert await remote.post(session, sent) == "decode-only"
        assert remote.decode.raw == [sent]  # its bytes as the client sent them: not decoded and encoded again

        async def learnt() -> bool:
            return f'kvpush_proxy_index_blocks{{url="{remote.decode.url}",source="guessed"}} {100 // BLOCK}' in \
                await remote.get(session, "/metrics")
        await until(learnt)  # (the stand-in's /tokenize: one token per character)
        assert [t["prompt"] for t in remote.decode.tokenized] == [short]
        assert "kvpush_proxy_tokenize_failed_total 0" in await remote.get(session, "/metrics")


async def _contains(text: Awaitable[str], needle: str) -> bool:
    return needle in await text


def test_an_upper_bound_on_a_prompts_tokens_without_tokenizing_it() -> None:
    assert most_tokens("/v1/completions", {"prompt": [1, 2, 3]}) == 3
    assert most_tokens("/v1/completions", {"prompt": [[1, 2]]}) == 2
    assert most_tokens("/v1/completions", {"prompt": "héllo"}) == len("héllo".encode()) + 8
    assert most_tokens("/v1/completions", {"prompt": ["a", "b"]}) is None  # a batch
    assert most_tokens("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) is None
    assert text_prompt("/v1/completions", {"prompt": ["one"]}) == "one"
    assert text_prompt("/v1/chat/completions", {"prompt": "x"}) is None


def test_token_ids_given_are_always_used() -> None:
    from kvrouter.tokens import given_ids

    assert given_ids("/v1/completions", {"prompt": [1, 2]}) and given_ids("/v1/completions", {"prompt": [[1, 2]]})
    assert not given_ids("/v1/completions", {"prompt": "12"}) and not given_ids("/v1/completions", {"prompt": []})
    assert not given_ids("/v1/chat/completions", {"prompt": [1]})
