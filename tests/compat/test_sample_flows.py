"""Each official LLM-DataDist Python sample's flow, ported (``flows/``), run as separate processes.

Two variants of each: ``as-sample`` keeps everything the sample does (``Placement.DEVICE`` memory,
``CacheKey`` addressing); ``host-memory`` describes the same memory as HOST and, where the sample
addresses a peer's slot by ``CacheKey``, uses the slot's ``CacheKeyByIdAndIndex``.

Every role checks the bytes the sample only logs; a role that finds a difference exits non-zero.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the sample ports use torch CPU tensors (test extra: torch==2.13.0)")
from flows.harness import free_port, run  # noqa: E402

from kvpush.compat.llm_datadist import Placement

BOTH = ["host-memory", "as-sample"]


def _run(module: str, roles: list[str], variant: str, values: dict[int, int] | None = None) -> None:
    placement = Placement.DEVICE if variant == "as-sample" else Placement.HOST
    codes = run(f"flows.{module}", roles, placement, variant, values or {})
    assert all(code == 0 for code in codes.values()), f"{module} ({variant}): exit codes {codes}"


@pytest.mark.parametrize("variant", BOTH)
def test_push_blocks(variant: str) -> None:
    _run("push_blocks", ["prompt", "decoder"], variant, {0: free_port(), 1: free_port()})


@pytest.mark.parametrize("variant", BOTH)
def test_pull_blocks_over_a_rank_table_link(variant: str) -> None:
    _run("pull_blocks", ["prompt", "decoder"], variant, {0: free_port()})


@pytest.mark.parametrize("variant", BOTH)
def test_pull_cache_over_a_rank_table_link(variant: str) -> None:
    _run("pull_cache", ["prompt", "decoder"], variant, {0: free_port()})


@pytest.mark.parametrize("variant", BOTH)
def test_pull_from_cache_to_blocks(variant: str) -> None:
    _run("pull_from_cache_to_blocks", ["prompt", "decoder"], variant, {0: free_port()})


@pytest.mark.parametrize("variant", BOTH)
def test_push_cache(variant: str) -> None:
    _run("push_cache", ["prompt", "decoder"], variant, {0: free_port()})


@pytest.mark.parametrize("variant", BOTH)
def test_switch_role(variant: str) -> None:
    _run("switch_role", ["prompt", "decoder"], variant, {0: free_port(), 1: free_port()})


@pytest.mark.parametrize("variant", BOTH)
def test_hixl_transfer_backend_links_from_both_ends(variant: str) -> None:
    _run("hixl_transfer_backend", ["prompt", "decoder"], variant, {0: free_port(), 1: free_port()})


@pytest.mark.parametrize("variant", BOTH)
def test_pull_blocks_xpyd_one_decoder_two_prompts(variant: str) -> None:
    _run("pull_blocks_xpyd", ["decoder", "prompt1", "prompt2"], variant,
         {0: free_port(), 1: free_port(), 2: free_port()})


@pytest.mark.parametrize("variant", BOTH)
def test_transfer_cache_async(variant: str) -> None:
    _run("transfer_cache_async", ["prompt", "decoder"], variant, {0: free_port(), 1: free_port()})
