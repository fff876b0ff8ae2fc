"""Sliding-window and hybrid (Mamba) models on real vLLM, with its hybrid KV cache manager on (KvpushConnector
is ``SupportsHMA``): tiny random-weight models built here (``kvpush.cli.tiny_model``), a prefill and a decode
each in its own session behind ``kvpush proxy --static``.

- ``gemma3``: three sliding-window layers (128 tokens) and one full-attention layer; each windowed group moves
  only its window's blocks.
- ``granite_hybrid`` (Granite 4's shape): three Mamba2 layers and one attention layer; the Mamba state moves
  once, after a prefill that computes the prompt but its last token, which the decode computes from the state.

Greedy outputs must equal a plain instance's (no connector) for prompts of 8 to 2000 tokens with the prompt's
KV loaded on the decode (its cached tokens); then the prefill, killed mid-transfer, makes the decode recompute.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from serving import log_lines
from test_vllm_tp import STARTUP_S, check_outputs, kill_a_prefill_rank_mid_request, plain_reference, start_stack

ARGS = ("--max-model-len", "2100")
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(50, 1900) for _ in range(n)] for n in (8, 100, 600, 2000)]
KILLED = [_rng.randrange(50, 1900) for _ in range(300)]
FAMILIES = {"gemma3": 0, "granite_hybrid": 1}  # family -> prompt tokens the decode computes itself
# vLLM 0.32's CPU build, a plain server (no connector), with prefix caching on (Mamba cache mode "align") fails the
# first prompt longer than a block in its Mamba2 mixer ("IndexError: index 1 is out of bounds for dimension 0 with
# size 1", mamba_mixer2.py conv_ssm_forward): the hybrid runs without it (Mamba cache mode "none")
FAMILY_ARGS = {"gemma3": (), "granite_hybrid": ("--no-enable-prefix-caching",)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    subprocess.run([sys.executable, "-m", "kvpush.cli.tiny_model", str(path), "--arch", request.param, "--layers", "4"],
                   check=True, capture_output=True)
    return request.param, path


@pytest.fixture(scope="module")
def family_reference(family: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """A plain vLLM instance's greedy tokens (no connector) for PROMPTS + [KILLED]."""
    name, model = family
    return plain_reference(f"plain-{name}", model, tmp_path_factory.mktemp(f"{name}-plain"), [*PROMPTS, KILLED],
                           *ARGS, *FAMILY_ARGS[name])


@pytest.mark.timeout(3 * STARTUP_S)
def test_a_hybrid_model_moves_every_kv_cache_group_and_a_dead_prefill_means_a_recompute(
        family: tuple[str, Path], family_reference: list[list[int]], tmp_path: Path) -> None:
    name, model = family
    with start_stack(model, tmp_path, 1, 1, "auto", *ARGS, *FAMILY_ARGS[name]) as stack:
        check_outputs(stack, family_reference, "auto", PROMPTS, short=FAMILIES[name])
        registered = log_lines(stack.decode, "KvpushConnector worker", "registered in place")
        print("\n".join(line[-240:] for line in registered))
        # the server's 32-token blocks: a 128-token window is 4 blocks, plus one for a window off the boundary
        groups = {"gemma3": "[window:5, window:5, window:5, full]", "granite_hybrid": "[state, state, state, full]"}
        assert registered and f"KV cache groups {groups[name]}" in registered[0], registered
        hybrid_off = log_lines(stack.decode, "Turning off hybrid kv cache manager")
        assert not hybrid_off, hybrid_off  # vLLM kept its hybrid KV cache manager on
        kill_a_prefill_rank_mid_request(stack, KILLED, family_reference[-1])
