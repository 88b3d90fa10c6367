"""The lab's tiny decoder: a nanoGPT-sized transformers model with a pluggable attention variant.

Read top to bottom: config, RoPE, attention, MLP, block, model, LM head, registration.

* pre-norm (RMSNorm) residual blocks, rotary position embeddings, GELU MLP, untied LM head;
* attention goes through :func:`sinklab.seam.sinklab_attention_forward` (the same function sinklab
  registers with transformers' ``AttentionInterface``), so ``sinklab probe`` and every handler see
  lab checkpoints exactly as they see Llama; when ``config._attn_implementation == "sinklab"`` the
  registered entry is looked up by name (it is the same function);
* ``attention_variant`` (``LAB_VARIANTS``): ``softmax``; ``softmax1``; ``sink`` (a learned logit
  per head, an ``nn.Parameter`` named ``sink_logit``); ``gated`` (softmax, then a sigmoid gate per
  head and query computed from the layer input, :func:`sinklab.attention.output_gate`); ``sigmoid``
  (unnormalised ``sigmoid(s + b)`` with the fixed bias ``b = -log(max_position_embeddings)``, added
  to every score through one extra q/k dimension, since the seam reads no bias); ``relu``
  (``relu(s) / n_keys``, Guo et al. 2024, :func:`sinklab.attention.relu_attention`).

:func:`register_lab_models` registers model type ``sinklab-tiny`` with ``AutoConfig`` and
``AutoModelForCausalLM`` (importing this module registers nothing): :func:`sinklab.lab.register`
calls it, and :func:`sinklab.models.loading.load_model` loads a lab checkpoint after that (the CLI
registers before it loads; the core never imports the lab).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from sinklab.attention import output_gate
from sinklab.errors import SinklabError
from sinklab.seam import ATTN_NAME, sinklab_attention_forward

MODEL_TYPE = "sinklab-tiny"
LAB_VARIANTS = ("softmax", "softmax1", "sink", "gated", "sigmoid", "relu")


class LabConfig(PreTrainedConfig):
    """Sizes and the attention variant of a lab decoder (defaults: the CPU preset)."""

    model_type = MODEL_TYPE

    vocab_size: int = 2048  # the lab tokenizer's size (byte-level BPE)
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int | None = None  # None = 4 * hidden_size (nanoGPT)
    max_position_embeddings: int = 256  # longest sequence; also sets the sigmoid bias
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    attention_variant: str = "softmax"
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = False  # untied: keeps weight loading trivial

    def __post_init__(self, **kwargs: Any) -> None:
        if self.attention_variant not in LAB_VARIANTS:
            raise SinklabError(
                f"unknown lab attention variant {self.attention_variant!r}; "
                f"use one of: {', '.join(LAB_VARIANTS)}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if int(getattr(self, name)) < 1:
                raise SinklabError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads or (self.head_dim % 2):
            raise SinklabError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}) with an even head size (RoPE); change either"
            )
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Rotary tables for ``positions`` (B, T): ``cos, sin`` each (B, 1, T, head_dim)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    angles = positions.float()[..., None] * inv_freq  # (B, T, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, T, head_dim)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, H, T, D) by position (the rotate-half convention of Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # (B, H, T, D)
    return (x * cos + rotated * sin).to(x.dtype)


class LabAttention(nn.Module):
    """Multi-head causal self-attention whose weights come from one of ``LAB_VARIANTS``."""

    def __init__(self, config: LabConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx  # the seam and the probe key layers by this
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.scaling = self.head_dim**-0.5
        self.variant = config.attention_variant
        # the weight function the seam applies; "gated" is softmax with a gate afterwards
        self.attention_variant = "softmax" if self.variant == "gated" else self.variant
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        if self.variant == "sink":
            self.sink_logit = nn.Parameter(torch.zeros(self.n_heads))  # (H,), starts as softmax1
        if self.variant == "gated":
            self.gate = nn.Linear(config.hidden_size, self.n_heads)  # one gate per head and query
        # sigmoid attention's fixed score bias, -log(T_max) (Gu et al. 2025 use -log n)
        self.sigmoid_bias = -math.log(config.max_position_embeddings)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        """``x`` (B, T, C) -> (B, T, C); ``mask`` None (causal) or bool (B|1, 1, T, T)."""
        b, t, c = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.variant == "sigmoid":  # one extra dim adds the bias to every score
            q = torch.cat([q, q.new_full((b, self.n_heads, t, 1), self.sigmoid_bias)], dim=-1)
            k = torch.cat([k, k.new_full((b, self.n_heads, t, 1), 1.0 / self.scaling)], dim=-1)
            v = F.pad(v, (0, 1))  # (B, H, T, D + 1): the seam wants equal head dims
        attend = sinklab_attention_forward
        if self.config._attn_implementation == ATTN_NAME:
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(ATTN_NAME, sinklab_attention_forward)
        out, _ = attend(self, q, k, v, mask, scaling=self.scaling)  # (B, T, H, D (+1))
        out = out[..., : self.head_dim]  # (B, T, H, D)
        if self.variant == "gated":
            gate_logits = self.gate(x).transpose(1, 2)  # (B, H, T)
            out = output_gate(out.transpose(1, 2), gate_logits).transpose(1, 2)  # (B, T, H, D)
        return self.o_proj(out.reshape(b, t, c))


class LabMLP(nn.Module):
    def __init__(self, config: LabConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class LabBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: LabConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LabAttention(config, layer_idx)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LabMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class LabPreTrainedModel(PreTrainedModel):
    config_class = LabConfig
    base_model_prefix = "model"
    _supports_attention_backend = True  # attention dispatches by name: the probe can switch it
    _supports_sdpa = True
    _no_split_modules: ClassVar[list[str]] = ["LabBlock"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.RMSNorm):
            module.weight.fill_(1.0)
        if isinstance(module, LabAttention):
            if hasattr(module, "sink_logit"):
                module.sink_logit.zero_()
            if hasattr(module, "gate"):
                module.gate.bias.fill_(2.0)  # gates start mostly open (sigmoid(2) = 0.88)


def _to_bool_mask(attention_mask: Tensor | None, t: int) -> Tensor | None:
    """None -> None (causal); (B, T) padding 1/0 -> causal AND key valid, bool (B, 1, T, T);
    (B|1, 1, T, T) bool (True = may attend) -> AND causal."""
    if attention_mask is None:
        return None
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()  # (T, T)
    if attention_mask.ndim == 2:
        return causal & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
    if attention_mask.ndim == 4 and attention_mask.dtype == torch.bool:
        return attention_mask & causal
    raise SinklabError(
        f"lab models take attention_mask as (B, T) or bool (B, 1, T, T), got "
        f"{tuple(attention_mask.shape)} {attention_mask.dtype}"
    )


class LabModel(LabPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` blocks, final norm: ids (B, T) -> hidden (B, T, C)."""

    def __init__(self, config: LabConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LabBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        b, t = input_ids.shape
        if t > self.config.max_position_embeddings:
            raise SinklabError(
                f"sequence of {t} tokens is longer than this lab model's "
                f"max_position_embeddings ({self.config.max_position_embeddings}); pass fewer"
            )
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)  # (B, T)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        mask = _to_bool_mask(attention_mask, t)
        x = self.embed_tokens(input_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class LabForCausalLM(LabPreTrainedModel):
    """The lab decoder with its LM head; ``labels`` (B, T) are shifted inside (HF convention)."""

    def __init__(self, config: LabConfig) -> None:
        super().__init__(config)
        self.model = LabModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,  # use_cache, output_attentions, ...: accepted and ignored (no KV cache)
    ) -> CausalLMOutputWithPast:
        hidden = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        logits = self.lm_head(hidden)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),  # (B * (T - 1), V)
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def register_lab_models() -> None:
    """Register ``sinklab-tiny`` with the Auto classes (idempotent)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with contextlib.suppress(ValueError):  # already registered
        AutoConfig.register(MODEL_TYPE, LabConfig)
    with contextlib.suppress(ValueError):
        AutoModelForCausalLM.register(LabConfig, LabForCausalLM)
    # sinklab.models.loading checks this name table to tell causal LMs apart
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(MODEL_TYPE, LabForCausalLM.__name__)
