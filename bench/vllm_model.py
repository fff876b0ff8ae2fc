"""The model of the vLLM benchmark (bench/vllm_bench.py): a Llama made on this machine, big enough for real
prefill compute and real KV sizes, built once and reused.

    python bench/vllm_model.py [--family mla|gemma3|granite_hybrid] [DIR]   # builds it unless it is there

Geometry (``GEOMETRY``): hidden 512, 24 layers, 8 query and 8 KV heads of 64 (no grouping, as in
Llama-2-7B), MLP 1536, a byte-level BPE vocabulary of ~2k trained here (kvpush.cli.tiny_model does
the building): 83 M parameters, 334 MB of random float32 weights; 96 KiB of KV per token (24 layers x
2 x 8 heads x 64 x 4 B), so a 2048-token prompt is 192 MiB of KV, 64 blocks of 32 tokens per layer.

Why this size on this host (2 cores, AVX2 without AVX-512 or BF16 units, shared with other work):
float32, because one core does ~80 GFLOP/s in fp32 matmuls and under 1 GFLOP/s in bf16 (no native
bf16: every op converts), and because P/D outputs are compared token for token with a single instance
(fp32 keeps the greedy argmax stable across the prefill and decode kernels' different summation
orders). 24 layers give the layer pipeline tens of boundaries; hidden 512 keeps a 2048-token prefill
on one core at ~9 s (~1.5 s for 512 tokens), so the full benchmark (a single instance and four P/D
pairs, each started and measured) ends in about half an hour. The first candidate, hidden 768 with 6 KV
heads and MLP 2048 (157 M parameters), took 8 s for 512 tokens and 25-50 s for 2048 on this
(then busy) machine, too long for repeated 2048-token requests in every case.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GEOMETRY: dict[str, int | str] = {"num_layers": 24, "hidden": 512, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64,
                                  "intermediate": 1536, "vocab_size": 2048, "max_position_embeddings": 4096, "seed": 0}
#: the other families (``--family``), each the same size: ``mla``, DeepSeek-V2's multi-head latent attention, one
#: latent of ``kv_lora_rank`` + 64 rotary values per token and layer (vLLM's CPU MLA kernels take 576), 54 KiB per
#: token where MHA keeps 96; ``gemma3``, 20 layers attending to a 512-token sliding window and 4 (every 6th) to
#: everything; ``granite_hybrid`` (Granite 4's shape), 20 Mamba2 layers (16 heads of 64, state 16) and 4 attention
#: layers (every 6th)
FAMILIES: dict[str, dict[str, int | str]] = {
    "llama": GEOMETRY,
    "mla": {**GEOMETRY, "arch": "deepseek_v2", "kv_lora_rank": 512},
    "gemma3": {**GEOMETRY, "arch": "gemma3", "sliding_window": 512, "window_every": 6},
    "granite_hybrid": {**GEOMETRY, "arch": "granite_hybrid", "window_every": 6, "mamba_heads": 16, "mamba_state": 16},
}
ROPE_VALUES = 64  # the rotary part of an MLA latent (kvpush.cli.tiny_model's qk_rope_head_dim)


def kv_bytes_per_token(geometry: dict[str, int | str] | None = None, dtype_bytes: int = 4) -> int:
    """What one token's KV takes over all layers (an MLA model: its latent; a windowed or hybrid model: as if every
    layer attended fully - what it moves per request is measured, ``vllm:kvpush_bytes_pushed_total``)."""
    g = geometry or GEOMETRY
    mla = g.get("arch") == "deepseek_v2"
    per_layer = int(g["kv_lora_rank"]) + ROPE_VALUES if mla else 2 * int(g["num_kv_heads"]) * int(g["head_dim"])
    return int(g["num_layers"]) * per_layer * dtype_bytes


def mha_bytes_per_token(geometry: dict[str, int | str], dtype_bytes: int = 4) -> int:
    """What the same model's KV would take per token with full multi-head attention (every head's K and V)."""
    return int(geometry["num_layers"]) * 2 * int(geometry["num_heads"]) * int(geometry["head_dim"]) * dtype_bytes


def default_dir(geometry: dict[str, int | str] | None = None) -> Path:
    """Where the model is kept between runs: one directory per geometry (same geometry, same bytes)."""
    g = geometry or GEOMETRY
    digest = hashlib.sha256(json.dumps(g, sort_keys=True).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"kvpush-bench-{g.get('arch', 'llama')}-{digest}"


def ensure_model(path: Path | None = None, geometry: dict[str, int | str] | None = None) -> Path:
    """Build the model into ``path`` (default: ``default_dir()``) unless a complete one is there. A ``path``
    that holds a model already (its ``config.json``: ``--model DIR``, any model) is used as it is, never
    overwritten."""
    g = geometry or GEOMETRY
    out = path or default_dir(g)
    done = out / ".complete"
    if done.exists() or (path is not None and (path / "config.json").exists()):
        return out
    sys.path.insert(0, str(HERE.parent))
    from kvpush.cli.tiny_model import Shape, make_tiny_model

    make_tiny_model(out, Shape(**{k: v for k, v in g.items() if k != "seed"}), seed=int(g["seed"]))  # type: ignore[arg-type]
    done.write_text(json.dumps(g))
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    family = "llama"
    if args[:1] == ["--family"]:
        family, args = args[1], args[2:]
    geometry = FAMILIES[family]
    out = ensure_model(Path(args[0]) if args else None, geometry)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(json.dumps({"model": str(out), "bytes": size, "family": family, "kv_bytes_per_token": kv_bytes_per_token(
        geometry), "mha_kv_bytes_per_token": mha_bytes_per_token(geometry)}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
