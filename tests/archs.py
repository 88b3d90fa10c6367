"""Tiny random configs of every decoder family the architecture matrix covers (tests only).

Each config: 2 layers, hidden 32, 4 query heads, 2 KV heads where the family has GQA, head dim 8,
512 positions, ``initializer_range`` 0.2 so that attention is far from uniform and a position
error shows in the numbers.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128
FAMILIES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "olmo2",
    "olmo3",
    "gpt_neox",
    "falcon",
    "stablelm",
    "cohere",
    "cohere2",
    "granite",
    "smollm3",
    "starcoder2",
    "gpt_oss",
    "gpt2",
    "gptj",
    "opt",
    "bloom",
    "mpt",
)

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_HYBRID = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])
_EXTRA: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=None),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(use_sliding_window=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma2": dict(**_HYBRID, query_pre_attn_scalar=8),
    "gemma3_text": dict(**_HYBRID, query_pre_attn_scalar=8),
    "phi": dict(partial_rotary_factor=0.5, num_key_value_heads=4),
    "phi3": dict(sliding_window=None, partial_rotary_factor=1.0),
    "olmo3": dict(**_HYBRID),
    "gpt_neox": dict(rotary_pct=0.5, num_key_value_heads=None),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False),
    "stablelm": dict(partial_rotary_factor=0.5),
    "cohere2": dict(**_HYBRID),
    "smollm3": dict(no_rope_layers=[1, 0], use_sliding_window=False),
    "starcoder2": dict(sliding_window=None),
    "gpt_oss": dict(**_HYBRID, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=512, n_inner=64),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, n_positions=512, rotary_dim=4, n_inner=64),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32, enable_bias=True),
    "bloom": dict(n_layer=2, n_head=4),
    "mpt": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=512, expansion_ratio=2),
}


def arch_config(family: str, **overrides: Any):
    """The tiny config of ``family``, with ``overrides`` set on it."""
    from transformers import AutoConfig

    kwargs = {**_COMMON, **_EXTRA.get(family, {}), **overrides}
    if family == "falcon":
        kwargs.pop("head_dim")  # a read-only property there: hidden_size // heads = 8
        kwargs.pop("num_key_value_heads")  # real Falcon configs say num_kv_heads only
    cfg = AutoConfig.for_model(family, **kwargs)
    for key, value in kwargs.items():  # configs that ignore a kwarg (e.g. gpt2's hidden_size)
        if hasattr(cfg, key) and getattr(cfg, key) != value and key in overrides:
            setattr(cfg, key, value)
    return cfg


def arch_model(family: str, seed: int = 0, attn: str = "eager", **overrides: Any):
    """A seeded tiny random model of ``family`` in eval mode, float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        arch_config(family, **overrides), attn_implementation=attn, dtype=torch.float32
    )
    return model.eval()


def save_arch_model(family: str, folder, tokenizer, **overrides: Any):
    """:func:`arch_model` (vocab sized to ``tokenizer``) saved with ``tokenizer`` into ``folder``,
    for ``--model DIR``; returns ``folder``."""
    arch_model(family, vocab_size=len(tokenizer), **overrides).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
