"""The model of the vLLM benchmark (bench/vllm_bench.py): a Llama made on this machine, big enough for real
prefill compute and real KV sizes, built once and reused.

    python bench/vllm_model.py [DIR]        # prints the directory; builds it unless it is already there

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
GEOMETRY = {"num_layers": 24, "hidden": 512, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64,
            "intermediate": 1536, "vocab_size": 2048, "max_position_embeddings": 4096, "seed": 0}


def kv_bytes_per_token(geometry: dict[str, int] | None = None, dtype_bytes: int = 4) -> int:
    g = geometry or GEOMETRY
    return g["num_layers"] * 2 * g["num_kv_heads"] * g["head_dim"] * dtype_bytes


def default_dir() -> Path:
    """Where the model is kept between runs: one directory per geometry (same geometry, same bytes)."""
    digest = hashlib.sha256(json.dumps(GEOMETRY, sort_keys=True).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"kvpush-bench-llama-{digest}"


def ensure_model(path: Path | None = None) -> Path:
    """Build the model into ``path`` (default: ``default_dir()``) unless a complete one is there."""
    out = path or default_dir()
    done = out / ".complete"
    if done.exists():
        return out
    sys.path.insert(0, str(HERE.parent))
    from kvpush.cli.tiny_model import Shape, make_tiny_model

    make_tiny_model(out, Shape(**{k: v for k, v in GEOMETRY.items() if k != "seed"}), seed=GEOMETRY["seed"])
    done.write_text(json.dumps(GEOMETRY))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = ensure_model(Path(args[0]) if args else None)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(json.dumps({"model": str(out), "bytes": size, "kv_bytes_per_token": kv_bytes_per_token()}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
