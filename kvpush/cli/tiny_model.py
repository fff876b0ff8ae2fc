"""A tiny Llama-style model made on this machine: no download, deterministic, loads in vLLM's CPU build
(``kvpush demo --vllm`` serves it; the vLLM tests and the benchmark's model are built with it too).
``--arch`` makes one of the other families the field disaggregates instead: ``deepseek_v2`` (MLA attention;
vLLM serves it on CPU with ``--attention-backend CPU_MLA``), ``gemma3`` (sliding-window layers with a full-attention
one every ``window_every`` layers) or ``granite_hybrid`` (Granite-4-shaped: Mamba2 layers beside attention ones).

    python -m kvpush.cli.tiny_model /tmp/tiny-llama            # or: make_tiny_model(path)

The weights are random (fixed seed) and float32: bf16 changed greedy tokens against fp32 on this
host, and the P/D tests compare greedy tokens. The tokenizer is a byte-level BPE trained here on
generated text and saved beside the weights, so ``AutoTokenizer`` and vLLM load the directory as any
Hugging Face model; it carries a chat template (``CHAT_TEMPLATE``), so vLLM serves ``/v1/chat/completions`` for it as
it does for a real model, with no ``--chat-template``. Needs ``torch``, ``transformers`` and ``tokenizers`` (vLLM
brings all three).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are were or not but "
    "cache block layer prefill decode push pull token model engine request server client kernel "
    "memory page tensor head value key attention batch queue stream socket link cluster transfer "
    "fast slow small large first last next previous every many few some all none one two three "
    "four five six seven eight nine ten red green blue river mountain city garden window table "
    "light dark morning evening winter summer north south east west old new quiet loud open close"
).split()

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
#: the tokenizer's chat template: each message as ``[role] content`` on its own line, then ``[assistant]``
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")

#: the families ``--arch`` builds (see ``Shape.arch``)
ARCHS = ("llama", "deepseek_v2", "gemma3", "granite_hybrid")


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Generated sentences with digits and punctuation, so the BPE learns merges beyond the words."""
    rng = random.Random(seed)
    text = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        text.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?;,"))
    return text


def _train_tokenizer(vocab_size: int, seed: int) -> Any:  # a transformers.PreTrainedTokenizerFast
    import importlib

    tokenizers: Any = importlib.import_module("tokenizers")  # untyped for mypy: the CLI's typing stops here
    transformers: Any = importlib.import_module("transformers")
    Tokenizer, decoders, models = tokenizers.Tokenizer, tokenizers.decoders, tokenizers.models
    pre_tokenizers, trainers = tokenizers.pre_tokenizers, tokenizers.trainers
    PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", model_max_length=1 << 20)
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass(frozen=True)
class Shape:
    """The model's geometry (the default: 2 layers, 4 query and 2 KV heads of 32, ~2k vocabulary)."""

    num_layers: int = 2
    hidden: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate: int | None = None
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    #: "llama", or "deepseek_v2": DeepSeek-V2's multi-head latent attention (MLA: one latent of
    #: ``kv_lora_rank`` + 64 rotary values per token, no KV heads), its MLP dense in every layer
    arch: str = "llama"
    kv_lora_rank: int = 512  # 512 + 64 = 576: the latent width vLLM's CPU MLA kernels take
    #: "gemma3": tokens each windowed layer sees; every ``window_every``-th layer attends fully
    sliding_window: int = 128
    window_every: int = 4
    #: "granite_hybrid": every ``window_every``-th layer is attention, the others Mamba2 (state of
    #: ``mamba_heads`` x ``head_dim`` x ``mamba_state``)
    mamba_heads: int = 8
    mamba_state: int = 16


def make_tiny_model(path: str | os.PathLike[str], shape: Shape | None = None, seed: int = 0,
                    weight_seed: int | None = None) -> Path:
    """Write a Llama-style model (config, safetensors weights, tokenizer) into ``path`` and return it.

    Same arguments, same bytes: the weights come from ``torch.manual_seed(seed)`` and the tokenizer
    from a corpus generated with ``seed`` (``weight_seed``, if given, seeds the weights alone: another
    model with the same tokenizer and KV geometry, for negative controls). The model's vocabulary is
    the tokenizer's (BPE may stop short of ``vocab_size`` on a small corpus), so every id vLLM
    samples decodes.
    """
    import importlib

    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")

    g = shape or Shape()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(g.vocab_size, seed)
    common = {"vocab_size": len(tokenizer), "hidden_size": g.hidden, "num_hidden_layers": g.num_layers,
              "intermediate_size": g.intermediate if g.intermediate is not None else 4 * g.hidden,
              "num_attention_heads": g.num_heads, "max_position_embeddings": g.max_position_embeddings,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "tie_word_embeddings": False, "dtype": "float32"}
    if g.arch == "deepseek_v2":
        config = transformers.DeepseekV2Config(
            **common, num_key_value_heads=g.num_heads, kv_lora_rank=g.kv_lora_rank, q_lora_rank=None,
            qk_rope_head_dim=64, qk_nope_head_dim=g.head_dim, v_head_dim=g.head_dim, rope_scaling=None,
            first_k_dense_replace=g.num_layers, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=g.hidden // 2)
        model_class = transformers.DeepseekV2ForCausalLM
    elif g.arch == "gemma3":
        kinds = ["full_attention" if (i + 1) % g.window_every == 0 else "sliding_attention"
                 for i in range(g.num_layers)]
        config = transformers.Gemma3TextConfig(
            **common, num_key_value_heads=g.num_kv_heads, head_dim=g.head_dim, sliding_window=g.sliding_window,
            layer_types=kinds, query_pre_attn_scalar=g.head_dim, rope_scaling=None)
        model_class = transformers.Gemma3ForCausalLM
    elif g.arch == "granite_hybrid":
        kinds = ["attention" if (i + 1) % g.window_every == 0 else "mamba" for i in range(g.num_layers)]
        config = transformers.GraniteMoeHybridConfig(
            **common, num_key_value_heads=g.num_kv_heads, layer_types=kinds, num_local_experts=0,
            shared_intermediate_size=g.intermediate if g.intermediate is not None else 4 * g.hidden,
            mamba_n_heads=g.mamba_heads, mamba_d_head=g.head_dim, mamba_d_state=g.mamba_state, mamba_n_groups=1,
            mamba_expand=g.mamba_heads * g.head_dim // g.hidden, mamba_chunk_size=64, position_embedding_type="rope")
        model_class = transformers.GraniteMoeHybridForCausalLM
    elif g.arch == "llama":
        config = transformers.LlamaConfig(**common, num_key_value_heads=g.num_kv_heads, head_dim=g.head_dim)
        model_class = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown architecture {g.arch!r} ({', '.join(ARCHS)})")
    torch.manual_seed(seed if weight_seed is None else weight_seed)
    model = model_class(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # vLLM reads generation defaults from here; keep them to the token ids (no sampling defaults).
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": tokenizer.bos_token_id,
                                                            "eos_token_id": tokenizer.eos_token_id}))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-seed", type=int, default=None)
    parser.add_argument("--arch", choices=ARCHS, default="llama",
                        help="deepseek_v2: multi-head latent attention (MLA), as DeepSeek V2/V3 and Kimi K2; gemma3: "
                             "sliding-window layers mixed with full ones; granite_hybrid: Mamba2 layers beside "
                             "attention ones (Granite 4)")
    parser.add_argument("--window-every", type=int, default=4,
                        help="gemma3: every N-th layer attends fully; granite_hybrid: every N-th is attention")
    parser.add_argument("--sliding-window", type=int, default=128)
    args = parser.parse_args(argv)
    started = time.monotonic()
    shape = Shape(num_layers=args.layers, hidden=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
                  head_dim=args.head_dim, intermediate=args.intermediate, vocab_size=args.vocab, arch=args.arch,
                  window_every=args.window_every, sliding_window=args.sliding_window)
    out = make_tiny_model(args.path, shape, seed=args.seed, weight_seed=args.weight_seed)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"{out}: {size / 1e6:.1f} MB in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
