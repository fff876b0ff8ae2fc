"""kvrouter.core.placement: a decode alone, or a prefill and a decode, per request."""

from __future__ import annotations

from kvrouter.core.placement import DECODE_ONLY, PD, Candidate, Policy, Prompt, place, uncached

BS = 32
POLICY = Policy(pd_min_tokens=512, prefill_queue=1, waste=1.25, request_tokens=256)


def test_uncached_counts_what_vllm_recomputes() -> None:
    assert uncached(Prompt(100, BS), 0) == 100
    assert uncached(Prompt(100, BS), 2) == 36
    assert uncached(Prompt(96, BS), 3) == 32  # the whole prompt held: its last block is computed again
    assert uncached(Prompt(10, BS), 5) == 10


def test_a_short_prompt_stays_on_a_decode_and_a_long_one_goes_to_a_free_prefill() -> None:
    fleet = [Candidate("p", prefill=True, decode=False), Candidate("d", prefill=False, decode=True)]
    short = place(Prompt(128, BS), fleet, POLICY)
    assert short is not None and (short.route, short.decode, short.prefill) == (DECODE_ONLY, "d", None)
    assert "below the 512-token threshold" in short.reason
    long = place(Prompt(2048, BS), fleet, POLICY)
    assert long is not None and (long.route, long.decode, long.prefill) == (PD, "d", "p")
    assert (long.computed, long.loaded) == (2048, 2048)


def test_a_conversation_stays_where_its_history_is() -> None:
    """Turn n+1 = turn n's prompt and answer (held by the decode that served it) plus a new message."""
    fleet = [Candidate("p", prefill=True, decode=False, held_blocks=10),
             Candidate("d", prefill=False, decode=True, held_blocks=60)]
    turn = place(Prompt(60 * BS + 200, BS), fleet, POLICY)
    assert turn is not None and (turn.route, turn.decode) == (DECODE_ONLY, "d") and turn.computed == 200


def test_a_prefill_that_would_recompute_the_history_is_not_used() -> None:
    fleet = [Candidate("p", prefill=True, decode=False),
             Candidate("d", prefill=False, decode=True, held_blocks=60)]
    turn = place(Prompt(60 * BS + 700, BS), fleet, POLICY)  # 700 new tokens: over the threshold
    assert turn is not None and turn.route == DECODE_ONLY and "no prefill is free" in turn.reason
    fleet[0] = Candidate("p", prefill=True, decode=False, held_blocks=58)  # a prefill that holds it: it pays
    turn = place(Prompt(60 * BS + 700, BS), fleet, POLICY)
    assert turn is not None and (turn.route, turn.prefill) == (PD, "p") and turn.computed == 764


def test_a_busy_prefill_is_not_the_bottleneck_of_short_requests() -> None:
    fleet = [Candidate("p", prefill=True, decode=False, prefilling=1), Candidate("d", prefill=False, decode=True)]
    decision = place(Prompt(2048, BS), fleet, POLICY)
    assert decision is not None and decision.route == DECODE_ONLY


def test_kv_both_instances_move_between_data_parallel_and_pd() -> None:
    a, b = Candidate("a", True, True, running=2), Candidate("b", True, True)
    short = place(Prompt(64, BS), [a, b], POLICY)
    assert short is not None and (short.route, short.decode) == (DECODE_ONLY, "b")  # the less loaded one
    long = place(Prompt(1500, BS), [a, b], POLICY)
    assert long is not None and (long.route, long.prefill, long.decode) == (PD, "b", "a")  # the idle one computes
    busy = place(Prompt(1500, BS), [Candidate("a", True, True, running=1), Candidate("b", True, True, running=1)],
                 POLICY)
    assert busy is not None and busy.route == PD  # as busy as each other: still one prefills for the other


def test_no_decode_no_decision_and_static_is_the_old_proxy() -> None:
    assert place(Prompt(64, BS), [Candidate("p", True, False)], POLICY) is None
    static = Policy(static=True)
    fleet = [Candidate("p1", True, False, running=1), Candidate("p2", True, False),
             Candidate("d", False, True, held_blocks=100)]
    decision = place(Prompt(64, BS), fleet, static)
    assert decision is not None and (decision.route, decision.prefill, decision.decode) == (PD, "p2", "d")
    alone = place(Prompt(64, BS), [Candidate("d", False, True)], static)
    assert alone is not None and alone.route == DECODE_ONLY


def test_queued_prompt_tokens_weigh_more_than_a_count_of_requests() -> None:
    """Two kv_both instances, each running one request: one is computing a 2048-token prompt, the other a
    32-token one. A short request goes to the second, however the counts tie."""
    heavy = Candidate("heavy", True, True, running=1, pending_tokens=2048)
    light = Candidate("light", True, True, running=1, pending_tokens=32)
    for order in ([heavy, light], [light, heavy]):
        decision = place(Prompt(64, BS), order, POLICY)
        assert decision is not None and (decision.route, decision.decode) == (DECODE_ONLY, "light")


def test_a_conversation_leaves_its_history_only_for_an_instance_much_less_loaded() -> None:
    """Its history (1,920 tokens held) is worth keeping against a short queue elsewhere, not against a long one."""
    def fleet(pending: int) -> list[Candidate]:
        return [Candidate("home", True, True, held_blocks=60, running=1, pending_tokens=pending),
                Candidate("other", True, True)]
    stays = place(Prompt(60 * BS + 200, BS), fleet(512), POLICY)
    assert stays is not None and stays.decode == "home"
    moves = place(Prompt(60 * BS + 200, BS), fleet(4096), POLICY)
    assert moves is not None and "other" in (moves.decode, moves.prefill)  # computed where nothing queues


def test_requests_already_answering_weigh_little_against_a_conversation_s_history() -> None:
    """The default policy: the instance holding a conversation's history (640 of its next turn's 890 tokens)
    streams two answers; the other is idle and holds the shared system prompt only (512). The turn stays:
    its 250 new tokens join two decode steps there, where the other would compute 378 alone."""
    home = Candidate("home", True, True, held_blocks=20, running=2)
    other = Candidate("other", True, True, held_blocks=16)
    for order in ([home, other], [other, home]):
        decision = place(Prompt(890, BS), order, Policy())
        assert decision is not None and (decision.route, decision.decode, decision.computed) == (DECODE_ONLY, "home",
                                                                                                  250)
    queued = Candidate("home", True, True, held_blocks=20, running=2, pending_tokens=1024)  # a long prompt first
    decision = place(Prompt(890, BS), [queued, other], Policy())
    assert decision is not None and decision.decode == "other"


def test_a_prompt_is_not_disaggregated_onto_a_decode_with_prompts_queued() -> None:
    """The default threshold (128 tokens): a 400-token prompt would go P/D to the busy decode, whose first steps
    for it would wait behind a 2048-token prompt queued there; the idle instance computes it alone instead."""
    assert Policy().pd_min_tokens == 128
    busy = Candidate("busy", True, True, running=3, pending_tokens=2048)
    idle = Candidate("idle", True, True)
    decision = place(Prompt(400, BS), [busy, idle], Policy())
    assert decision is not None and (decision.route, decision.decode) == (DECODE_ONLY, "idle")
    free = Candidate("busy", True, True, running=3)  # nothing queued there: its three decodes are spared
    decision = place(Prompt(400, BS), [free, idle], Policy())
    assert decision is not None and (decision.route, decision.decode, decision.prefill) == (PD, "busy", "idle")
