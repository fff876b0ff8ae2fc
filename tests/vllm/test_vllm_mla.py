"""MLA (multi-head latent attention, DeepSeek V2/V3, Kimi K2) on real vLLM: a tiny DeepSeek-V2-shaped model
built here (``kvpush.cli.tiny_model --arch deepseek_v2``), served with vLLM's ``CPU_MLA`` attention.

An MLA layer keeps one compressed latent per token (576 values here) and every tensor-parallel rank holds it
whole: a prefill with TP 2 and a decode with TP 1, each in its own session, behind ``kvpush proxy --static``;
the decode rank reads one prefill rank's latent. Greedy outputs must equal a plain instance's (no connector,
TP 1) for prompts of 8 to 2000 tokens, every prompt token cached on the decode (the pushed latent, not
recomputed); then a prefill rank killed mid-request makes the decode recompute at once. vLLM's CPU build runs
MLA with 16-token blocks, without chunked prefill and without prefix caching (its own overrides).

The pushed latent decides the answers: a prefill with other weights (``--weight-seed``) gave a wrong answer for
every one of five prompts, measured by hand (2026-12-06), while the right one gives the plain instance's.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from serving import log_lines
from test_vllm_tp import STARTUP_S, check_outputs, kill_a_prefill_rank_mid_request, plain_reference, start_stack

MLA_ARGS = ("--attention-backend", "CPU_MLA", "--max-model-len", "2100", "--max-num-batched-tokens", "2100")
_rng = random.Random(7)
# the first draw is left out: this random model's greedy first token for it is a near-tie (its top two 0.003 apart
# in log-probability), and vLLM's MLA computes a prompt's last token by two kernel paths (the whole prompt on a
# plain instance; the last token over the pushed latent on the decode) that round apart by more than that
PROMPTS = [[_rng.randrange(50, 1900) for _ in range(n)] for n in (8, 8, 100, 600, 2000)][1:]
KILLED = [_rng.randrange(50, 1900) for _ in range(300)]


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-deepseek-v2")
    subprocess.run([sys.executable, "-m", "kvpush.cli.tiny_model", str(path), "--arch", "deepseek_v2"], check=True,
                   capture_output=True)
    return path


@pytest.fixture(scope="module")
def mla_reference(mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """A plain vLLM instance's greedy tokens (no connector) for PROMPTS + [KILLED]."""
    return plain_reference("plain-mla", mla_model, tmp_path_factory.mktemp("mla-plain"), [*PROMPTS, KILLED],
                           *MLA_ARGS)


@pytest.mark.timeout(3 * STARTUP_S)
def test_an_mla_prefill_with_tp2_pushes_its_latent_to_a_tp1_decode_and_a_dead_rank_means_a_recompute(
        mla_model: Path, mla_reference: list[list[int]], tmp_path: Path) -> None:
    with start_stack(mla_model, tmp_path, 2, 1, "auto", *MLA_ARGS) as stack:
        check_outputs(stack, mla_reference, "auto", PROMPTS)
        geometry = log_lines(stack.decode, "KvpushConnector worker", "registered in place")
        print("\n".join(line[-240:] for line in geometry))
        assert geometry and "576" in geometry[0], geometry  # the latent, registered as it is
        kill_a_prefill_rank_mid_request(stack, KILLED, mla_reference[-1])
