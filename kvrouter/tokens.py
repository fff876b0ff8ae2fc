"""A request's prompt as the token ids vLLM will compute (``Tokens``), so the router can hash its blocks.

- ``/v1/completions`` with token ids: those, as they are (free).
- a text prompt: the model's tokenizer, loaded by the router, as vLLM tokenizes it (``add_special_tokens`` as the
  request says, default true). Which tokenizer (``tokenizer``):
  - ``"auto"`` (the default): the one the instances serve, found in the background at start-up from an
    instance's ``GET /v1/models`` (its ``root``: the model's directory or name), loaded from local files only
    (``transformers.AutoTokenizer``, ``local_files_only``: never a download). Until it is loaded, or when it
    cannot be (no ``transformers``, the model is on another host), the instance's own ``POST /tokenize``;
  - a model directory or name: that one, loaded at start-up;
  - None (``--tokenizer none``): always the instance's ``POST /tokenize`` (a round trip on the request's path).
- ``/v1/chat/completions``: a text conversation (each message a role and a string, no template, tools or multimodal
  fields of its own) is rendered here with the tokenizer's chat template and tokenized, once the router has seen that
  this renders as the instances do: the first chat of each set of rendering fields (``add_generation_prompt``,
  ``continue_final_message``, ``add_special_tokens``, ``chat_template_kwargs``) goes to the instance's
  ``POST /tokenize`` and is rendered here beside it, and only equal ids let later ones skip that round trip (one in
  ``RECHECK_EVERY`` is still asked of the instance, off its path: other ids, and they go there again; an
  instance given ``--chat-template`` the router was not given too, or a template that renders otherwise here, keeps
  them going there). Any other chat: the instance's ``POST /tokenize`` (vLLM renders it as it would for the request).

A prompt that cannot be tokenized (a batch of prompts, an instance that does not answer within
``TOKENIZE_TIMEOUT_S``) is placed by load alone. A long text (``INLINE_CHARS`` or more) is tokenized off the
event loop (a thread); a short one on it (a thread's hand-off costs more than its tokenizing).

A long text's head first (``head_ids``): its first ``HEAD_CHARS`` or fewer characters, cut where whitespace
begins, tokenized here. Tokenizers split words at whitespace before they merge, so those ids begin the whole
text's ids. The last block is kept out because an added end token or a boundary merge could change it. Where no
instance holds those blocks, none holds more of the prompt, and placement needs no more ids: the rest of the text
is never tokenized on the request's path (1.5 ms for 900 words with the demo model's tokenizer).

A long text that shares its beginning with one tokenized here before (``Known``: a conversation's next turn begins
with the last one's prompt, rendered chats included) is tokenized from where whitespace begins before the two part,
behind that one's ids up to there: the whole text's ids, for a tokenizer that splits words at whitespace before it
merges, which is checked when it loads (``splits_at_whitespace``: byte-level BPE does; SentencePiece's dummy prefix
does not, and then every text is tokenized whole).
"""

from __future__ import annotations

import array
import asyncio
import bisect
import contextlib
import gc
import importlib.util
import json
import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 2.0
AUTO = "auto"
INLINE_CHARS = 2048  # texts shorter than this are tokenized on the event loop (~50 us for 40 words here)
HEAD_CHARS = 1024  # a text of at least twice this is tokenized head first (``Tokens.head_ids``)
_SPACES = (" ", "\n", "\t")
_CHAT_KEYS = ("messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
              "tools", "add_special_tokens", "mm_processor_kwargs")
# a chat rendered here: its messages and these fields, with vLLM's defaults (a chat's special tokens are its template's)
_RENDERING = (("add_generation_prompt", True), ("continue_final_message", False), ("add_special_tokens", False),
              ("chat_template_kwargs", None))
_OWN_FIELDS = ("chat_template", "tools", "mm_processor_kwargs")  # a chat with one of these goes to the instance
# template arguments the rendering sets itself: a chat whose chat_template_kwargs name one goes to the instance
_RESERVED_KWARGS = frozenset(("tokenize", "chat_template", "tools", "documents", "add_generation_prompt",
                              "continue_final_message", "conversation", "messages", "return_dict"))
MAX_RENDERINGS = 32  # sets of rendering fields whose verdict is kept (beyond: those chats go to the instance)
RECHECK_EVERY = 64  # one chat in this many rendered here is also sent to an instance's /tokenize, off its path


def text_prompt(path: str, body: Mapping[str, Any]) -> str | None:
    """The request's one text prompt (``/v1/completions``), or None (token ids, a batch, a chat)."""
    if path.endswith("/chat/completions"):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _chat_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """What of a chat request renders its prompt (what an instance's ``/tokenize`` is given for it)."""
    return {name: body[name] for name in _CHAT_KEYS if name in body}


def given_ids(path: str, body: Mapping[str, Any]) -> bool:
    """Whether the request gives its prompt as token ids (``/v1/completions``, one prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    return not path.endswith("/chat/completions") and isinstance(prompt, list) and bool(prompt) \
        and all(type(t) is int for t in prompt)


def most_tokens(path: str, body: Mapping[str, Any]) -> int | None:
    """An upper bound on the prompt's tokens without tokenizing it, or None when there is none to be had: token
    ids count themselves; a text has at most one token per UTF-8 byte (byte-level BPE and byte fallback never
    make more) plus a few special tokens."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(type(t) is int for t in prompt) and not path.endswith("/chat/completions"):
        return len(prompt)
    text = text_prompt(path, body)
    return None if text is None else len(text.encode("utf-8", "replace")) + 8


class Tokens:
    """Token ids of requests: ``ids(path, body, session, instance_url)``; ``tokenizer``: ``AUTO``, a local one,
    or None (the instances tokenize). ``loading``: the background load of the auto tokenizer, once started."""

    def __init__(self, tokenizer: str | None = AUTO, counters: Counter[str] | None = None,
                 chat_template: str | None = None) -> None:
        self.tokenizer_name = tokenizer
        self.chat_template = chat_template  # the instances' (their --chat-template), else None: the tokenizer's
        self._tokenizer: Any = None
        self.loading: asyncio.Task[None] | None = None
        #: ``chat_here`` / ``chat_instance``: chats tokenized here or by an instance
        self.counters: Counter[str] = Counter() if counters is None else counters
        # rendering fields (``_rendering``'s key) -> whether the tokenizer here renders them as the instances do
        self.renderings: dict[str, bool] = {}
        #: long texts tokenized here (None: this tokenizer does not split at whitespace as ``Known`` needs)
        self.known: Known | None = None
        self._last_render: tuple[Any, str, str] | None = None  # (its messages, its rendering's key, the text)
        self._rechecks: set[asyncio.Task[None]] = set()
        if tokenizer is not None and tokenizer != AUTO:
            from transformers import AutoTokenizer  # the router's tokenizer extra: a clear ImportError without it

            self._loaded(AutoTokenizer.from_pretrained(tokenizer))
        self.failures = 0

    @property
    def local(self) -> bool:
        """Whether text prompts are tokenized here (else by an instance)."""
        return self._tokenizer is not None

    def discover(self, session: aiohttp.ClientSession, instance: str) -> None:
        """With ``AUTO``: start loading the tokenizer ``instance`` serves, in the background (once)."""
        if self.tokenizer_name == AUTO and self.loading is None and importlib.util.find_spec("transformers"):
            self.loading = asyncio.get_running_loop().create_task(self._discover(session, instance),
                                                                  name="kvpush-proxy-tokenizer")

    async def _discover(self, session: aiohttp.ClientSession, instance: str) -> None:
        """The tokenizer of ``instance``'s model, from its local files; on any failure the instances tokenize."""
        try:
            async with session.get(f"{instance}/v1/models",
                                   timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)) as reply:
                models = (await reply.json())["data"]
            root = models[0].get("root")  # (vLLM's: the model's directory or name; its id may be a served alias)
            if not root:
                raise ValueError("its /v1/models names no root")

            def load() -> Any:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(root, local_files_only=True)
            self._loaded(await asyncio.to_thread(load))
            log.info("text prompts are tokenized here, with %s's tokenizer", root)
        except Exception as error:  # noqa: BLE001 - any failure: the instances keep tokenizing
            log.info("the instances' tokenizer could not be loaded here (%s); they tokenize text prompts",
                     str(error)[:200] or type(error).__name__)

    def text(self, path: str, body: Mapping[str, Any]) -> tuple[str, bool] | None:
        """The prompt as a text this router tokenizes, and whether special tokens are added to it: a completion's
        one text prompt, or a chat rendered here with the chat template (a rendering known to give the instance's
        ids: ``_chat``); None for anything else."""
        text = text_prompt(path, body)
        if text is not None:
            return text, body.get("add_special_tokens", True) is not False
        if not path.endswith("/chat/completions") or self._tokenizer is None:
            return None
        fields = _chat_fields(body)
        key = self._rendering(fields)
        if key is None or not self.renderings.get(key):
            return None
        return self._render(fields, key), fields.get("add_special_tokens", False) is True

    def most_tokens(self, path: str, body: Mapping[str, Any]) -> int | None:
        """``most_tokens``, and for a chat rendered here its text's bound (rendering costs no tokenizing)."""
        bound = most_tokens(path, body)
        if bound is None and path.endswith("/chat/completions"):
            known = self.text(path, body)
            if known is not None:
                bound = len(known[0].encode("utf-8", "replace")) + 8
        return bound

    async def ids(self, path: str, body: Mapping[str, Any], session: aiohttp.ClientSession,
                  instance: str) -> list[int] | None:
        """The prompt's token ids, or None when they cannot be had (logged at debug, counted)."""
        try:
            if self._tokenizer is None:
                self.discover(session, instance)
            chat = path.endswith("/chat/completions")
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if not chat and isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return prompt
            known = self.text(path, body)
            if known is None:
                if chat:
                    return await self._chat(session, instance, _chat_fields(body), body.get("model"))
                return None
            text, special = known
            if self._tokenizer is not None:
                ids = await self._encoded(text, special)
                if chat:
                    self.counters["chat_here"] += 1
                    if self.counters["chat_here"] % RECHECK_EVERY == 0:
                        self._recheck(session, instance, body, ids)
                return ids
            return await self._remote(session, instance, {"prompt": text, "add_special_tokens": special},
                                      body.get("model"))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError) as error:
            self.failures += 1
            log.debug("the prompt could not be tokenized (%s): placed by load alone", error)
            return None

    def head_ids(self, path: str, body: Mapping[str, Any]) -> tuple[list[int], float] | None:
        """A long text prompt's head (a chat's rendered text's too, ``text``), tokenized here: its ids and the text's
        length over the head's (what scales the head's token count to an estimate of the whole prompt's). None:
        not a text of at least twice ``HEAD_CHARS``, no tokenizer here, or no whitespace to cut at."""
        known = self.text(path, body) if self._tokenizer is not None else None
        if known is None or len(known[0]) < 2 * HEAD_CHARS:
            return None
        text, special = known
        if self.known is not None and self.known.find(text, special) is not None:
            return None  # it shares its head with a text tokenized before: its whole ids cost its rest's
        cut = max(text.rfind(space, HEAD_CHARS // 2, HEAD_CHARS + 1) for space in _SPACES)
        if cut <= 0:
            return None
        return self._encode(text[:cut], special), len(text) / cut

    async def _chat(self, session: aiohttp.ClientSession, instance: str, fields: Mapping[str, Any],
                    model: Any) -> list[int] | None:
        """A chat's ids from the instance. The first chat of each rendering (``_rendering``) is rendered and
        tokenized here too: equal ids, and later chats of that rendering are rendered here (``text``)."""
        ids = await self._remote(session, instance, fields, model)
        self.counters["chat_instance"] += 1
        key = self._rendering(fields)
        if key is None or key in self.renderings or len(self.renderings) >= MAX_RENDERINGS or not ids:
            return ids
        try:
            here: list[int] | None = await self._encoded(self._render(fields, key),
                                                         fields.get("add_special_tokens", False) is True)
        except Exception as error:  # noqa: BLE001 - the template does not render here: the instances render
            log.info("chats are tokenized by the instances: the chat template does not render here (%s)",
                     str(error)[:200] or type(error).__name__)
            here = None
        self.renderings[key] = here == ids
        if here is not None and here != ids:
            log.info("chats rendered with %s are tokenized by the instances: the chat template here renders them "
                     "otherwise (an instance started with a --chat-template this router was not given?)", key)
        return ids

    def _recheck(self, session: aiohttp.ClientSession, instance: str, body: Mapping[str, Any],
                 ids: list[int]) -> None:
        """Ask ``instance`` for the ids of a chat rendered here too, off its path: other ids, and chats of that
        rendering go to the instances again (a template whose output depends on what the first chat lacked)."""
        fields = _chat_fields(body)
        key = self._rendering(fields)

        async def check() -> None:
            try:
                theirs = await self._remote(session, instance, fields, body.get("model"))
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError):
                return  # no answer: nothing learnt
            if key is not None and theirs is not None and theirs != ids:
                self.renderings[key] = False
                self.counters["chat_refuted"] += 1
                log.warning("a chat rendered here gave other ids than %s's /tokenize: chats rendered with %s are "
                            "tokenized by the instances from now on", instance, key)

        task = asyncio.get_running_loop().create_task(check(), name="kvpush-proxy-chat-recheck")
        self._rechecks.add(task)
        task.add_done_callback(self._rechecks.discard)

    def _rendering(self, fields: Mapping[str, Any]) -> str | None:
        """The key of a chat's rendering fields, or None when it is not rendered here (no tokenizer here, fields of
        its own, a message that is not a role and a string)."""
        if self._tokenizer is None or any(name in fields for name in _OWN_FIELDS):
            return None
        messages = fields.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                type(m) is dict and len(m) == 2 and type(m.get("role")) is str and type(m.get("content")) is str
                for m in messages):
            return None
        kwargs = fields.get("chat_template_kwargs")
        if kwargs is not None and (type(kwargs) is not dict or not _RESERVED_KWARGS.isdisjoint(kwargs)):
            return None
        try:
            return json.dumps([fields.get(name, default) for name, default in _RENDERING], sort_keys=True)
        except (TypeError, ValueError):
            return None

    def _render(self, fields: Mapping[str, Any], key: str) -> str:
        """A text conversation rendered with the tokenizer's chat template, as vLLM renders it (the last one is
        kept: a request's placement asks for its text more than once)."""
        messages = fields["messages"]
        last = self._last_render
        if last is not None and last[0] is messages and last[1] == key:  # (held: the same list, not a new one)
            return last[2]
        text: str = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=fields.get("add_generation_prompt", True),
            continue_final_message=fields.get("continue_final_message", False), chat_template=self.chat_template,
            **(fields.get("chat_template_kwargs") or {}))
        self._last_render = (messages, key, text)
        return text

    async def _encoded(self, text: str, special: bool) -> list[int]:
        """``_encode`` on the event loop for a short text, in a thread for a long one. A long text that shares its
        beginning with one tokenized here before (a conversation's next turn: ``Known``) is tokenized from where
        whitespace begins before the two part, behind that one's ids."""
        if len(text) < INLINE_CHARS:
            return self._encode(text, special)
        if self.known is None:
            return await asyncio.to_thread(self._encode, text, special)
        found = self.known.find(text, special)
        start, head, head_ends = (0, [], []) if found is None else found
        rest = text[start:]
        tail, tail_ends = (self._encode_spans(rest, special and not start) if len(rest) < INLINE_CHARS
                           else await asyncio.to_thread(self._encode_spans, rest, special and not start))
        ids = head + tail
        self.known.remember(text, special, ids, head_ends + [start + end for end in tail_ends] if start else tail_ends)
        self.counters["tokenized_after_known"] += found is not None
        return ids

    def _encode_spans(self, text: str, special: bool) -> tuple[list[int], list[int]]:
        """A text's ids and where each token ends in it (its fast tokenizer's offsets)."""
        encoding = self._tokenizer.backend_tokenizer.encode(text, add_special_tokens=special)
        return encoding.ids, [end for _, end in encoding.offsets]

    def _encode(self, prompt: str, special: bool) -> list[int]:
        backend = getattr(self._tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust core
        if backend is not None:  # what its __call__ runs, without the Python around it (batches, lazy imports)
            fast: list[int] = backend.encode(prompt, add_special_tokens=special).ids
            return fast
        ids: list[int] = self._tokenizer(prompt, add_special_tokens=special)["input_ids"]
        return ids

    def _loaded(self, tokenizer: Any) -> None:
        """``tokenizer`` is the one to use from now on: used once first (what it loads or builds on first use
        happens here, not on a request's path), then what loading it left behind is put out of the garbage
        collector's sight (transformers leaves millions of objects that live as long as the router: a full
        collection that walked them would stall every request in flight for 100 ms or more)."""
        self._tokenizer = tokenizer
        self._encode("warm up: the first use", True)
        self.known = Known() if splits_at_whitespace(tokenizer) else None
        if self.chat_template or getattr(tokenizer, "chat_template", None):  # compiled (4 ms), not on a chat's path
            with contextlib.suppress(Exception):
                tokenizer.apply_chat_template([{"role": "user", "content": "warm up"}], tokenize=False,
                                              chat_template=self.chat_template)
        gc.collect()
        gc.freeze()

    async def close(self) -> None:
        """Cancel the tokenizer's loading and the chats' re-checks still running (before the session closes)."""
        tasks = [*self._rechecks, *([self.loading] if self.loading is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

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


KNOWN_TOKENS = 1 << 20  # token ids ``Known`` keeps (12 MB, and their texts: about 4 characters a token)
KNOWN_PER_HEAD = 8  # texts kept per head (the conversations that share a system prompt's first characters)
_SPLIT_SAMPLE = "a sample: one line,\nanother  with two spaces\tand a tab; numbers 1234 and (brackets) here."


def _whitespace_begins(text: str, end: int) -> int:
    """Where the run of whitespace that holds or ends before ``end`` begins (0: none)."""
    cut = max(text.rfind(space, 0, end) for space in _SPACES)
    while cut > 0 and text[cut - 1] in _SPACES:
        cut -= 1
    return max(cut, 0)


def splits_at_whitespace(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` gives a text's ids as its head's ids and then its tail's, cut where whitespace
    begins (the tail without special tokens): byte-level BPE does (it splits words at whitespace before it
    merges); a tokenizer that marks a text's first word (SentencePiece's dummy prefix) does not. Checked on a
    sample, cut at every run of whitespace, with its fast tokenizer (``Known`` needs its offsets)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        whole = backend.encode(_SPLIT_SAMPLE, add_special_tokens=True).ids
        for cut in {_whitespace_begins(_SPLIT_SAMPLE, end) for end in range(1, len(_SPLIT_SAMPLE))} - {0}:
            split = (backend.encode(_SPLIT_SAMPLE[:cut], add_special_tokens=True).ids
                     + backend.encode(_SPLIT_SAMPLE[cut:], add_special_tokens=False).ids)
            if split != whole:
                return False
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: nothing is reused
        return False
    return True


class Known:
    """Long texts tokenized here, with their ids and where each token ends: a text that shares its beginning with
    one of them (a conversation's next turn begins with the last one's prompt) is tokenized only from where
    whitespace begins before the two part (``find``), behind that one's ids up to there, as the whole text would be
    (``splits_at_whitespace``).
    Bounded: ``KNOWN_TOKENS`` ids, the least recently used texts leave first."""

    def __init__(self, capacity: int = KNOWN_TOKENS) -> None:
        self.capacity = capacity
        self.tokens = 0
        # a text's first HEAD_CHARS characters -> the texts that begin so: (text, special, ids, ends), newest last
        # (arrays: 12 bytes a token, where a list of ints takes 60 or more)
        self._texts: OrderedDict[str, list[tuple[str, bool, array.array[int], array.array[int]]]] = OrderedDict()

    def find(self, text: str, special: bool) -> tuple[int, list[int], list[int]] | None:
        """After the known text ``text`` shares the longest beginning with (a conversation's last prompt, or the
        same history with another last message): where ``text``'s tail begins (where whitespace begins before the
        two part), and the ids before it with their ends; None when no known text shares its head."""
        key = text[:HEAD_CHARS]
        entries = self._texts.get(key)
        if not entries:
            return None
        self._texts.move_to_end(key)
        best, shared = None, 0
        for entry in entries:
            if entry[1] == special:
                length = _shared(entry[0], text)
                if length > shared:
                    best, shared = entry, length
        if best is None:
            return None
        known, _, ids, ends = best
        cut = _whitespace_begins(known, shared)
        if cut <= 0:
            return None
        count = bisect.bisect_right(ends, cut, 0, _regular(ends))  # the tokens that end at the cut or before
        return cut, ids[:count].tolist(), ends[:count].tolist()

    def remember(self, text: str, special: bool, ids: list[int], ends: list[int]) -> None:
        """``text``'s ids, and where each ends in it."""
        if len(ids) > self.capacity or len(ends) != len(ids):
            return
        key = text[:HEAD_CHARS]
        entries = self._texts.setdefault(key, [])
        self._texts.move_to_end(key)
        for index, entry in enumerate(entries):
            if entry[0] == text and entry[1] == special:  # (the same prompt again)
                entries.append(entries.pop(index))
                return
        entries.append((text, special, array.array("q", ids), array.array("I", ends)))
        self.tokens += len(ids)
        if len(entries) > KNOWN_PER_HEAD:
            self.tokens -= len(entries.pop(0)[2])
        while self.tokens > self.capacity:
            _, dropped = self._texts.popitem(last=False)
            self.tokens -= sum(len(entry[2]) for entry in dropped)


def _shared(known: str, text: str) -> int:
    """How many first characters ``text`` shares with ``known`` (slices compared in C, halving: no loop over
    characters)."""
    if text.startswith(known):
        return len(known)
    low, high = 0, min(len(known), len(text))
    while low < high:
        middle = (low + high + 1) // 2
        if known[low:middle] == text[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _regular(ends: array.array[int]) -> int:
    """How many tokens come before the special tokens a text ends with (their offsets are 0)."""
    count = len(ends)
    while count > 1 and ends[count - 1] == 0:
        count -= 1
    return count
