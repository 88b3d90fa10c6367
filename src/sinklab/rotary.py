"""Position schemes, and the model's RoPE as a rotation sinklab can apply by any offset.

:func:`position_scheme` says how a model encodes positions (``ROPE``, ``ALIBI``, ``ABSOLUTE``,
``NONE``), which decides whether a sink cache can move a cached key.
:func:`rope_of` finds a model's rotary embedding, refuses what a sink cache cannot move (learned
absolute positions, ALiBi, per-layer or length-dependent RoPE, sliding-window layers) with an
error naming the reason, and checks our rotation against the model's own
``apply_rotary_pos_emb`` so a different layout can never give silent garbage.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sinklab.errors import SinklabError

# Position schemes, by how a cached key depends on its position.
ROPE, ALIBI, ABSOLUTE, NONE = "rope", "alibi", "absolute", "none"

# RoPE types whose frequencies do not depend on the sequence length: a score depends only on the
# difference of positions, which is what makes moving a key possible.
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Rope:
    """The model's rotary embedding as a rotation we can apply by any angle.

    ``inv_freq`` (rot_dim / 2,) float64; rotation over the first ``rot_dim`` dims of a head with
    Llama's ``rotate_half`` layout (checked against the model's own ``apply_rotary_pos_emb``).
    """

    inv_freq: Tensor
    rot_dim: int
    rope_type: str

    def cos_sin(self, delta: Tensor, dtype: torch.dtype, dim: int | None = None):
        """Rotation by ``delta`` positions (S,) -> cos, sin (S, dim) in ``dtype``; angles in
        float64. Dims past ``rot_dim`` (partial RoPE) get cos 1, sin 0: left alone."""
        ang = delta.to(torch.float64)[:, None] * self.inv_freq[None, :]  # (S, rot_dim/2)
        ang = torch.cat((ang, ang), dim=-1)  # (S, rot_dim)
        cos, sin = ang.cos(), ang.sin()
        if dim is not None and dim > self.rot_dim:
            pad = (0, dim - self.rot_dim)
            cos, sin = F.pad(cos, pad, value=1.0), F.pad(sin, pad, value=0.0)
        return cos.to(dtype), sin.to(dtype)

    def rotate_half(self, x: Tensor) -> Tensor:
        """(..., D) -> Llama's rotate_half over the first ``rot_dim`` dims, zeros after."""
        r, half = self.rot_dim, self.rot_dim // 2
        rot = torch.cat((-x[..., half:r], x[..., :half]), dim=-1)
        return rot if r == x.shape[-1] else F.pad(rot, (0, x.shape[-1] - r))

    def shift(self, x: Tensor, delta: Tensor) -> Tensor:
        """``x`` (..., S, D) rotated by ``delta`` (S,) positions."""
        cos, sin = self.cos_sin(delta.to(x.device), x.dtype, x.shape[-1])
        return x * cos + self.rotate_half(x) * sin


def position_scheme(config: Any) -> str:
    """How the model encodes positions: decides whether a sink cache can move cached keys."""
    if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None):
        return ROPE
    if getattr(config, "alibi", False) or config.model_type in {"bloom", "mpt", "falcon_alibi"}:
        return ALIBI
    if config.model_type in {"gpt2", "gpt_neo", "opt", "gptj_absolute", "biogpt", "xglm"}:
        return ABSOLUTE
    if getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None):
        # A learned or sinusoidal table that is not RoPE: positions are baked into the inputs.
        return ABSOLUTE if config.model_type not in {"mamba", "rwkv"} else NONE
    return NONE


def text_config(model: Any) -> Any:
    """The decoder's config (multimodal wrappers keep it inside)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _refuse(reason: str) -> SinklabError:
    return SinklabError(f"SinkCache cannot move cached keys of this model: {reason}")


def rope_of(model: Any) -> Rope:
    """The rotary embedding of a RoPE model, or :class:`SinklabError` naming why not."""
    config = text_config(model)
    scheme = position_scheme(config)
    if scheme == ABSOLUTE:
        raise _refuse(
            f"{config.model_type} uses learned absolute position embeddings (position scheme "
            f"{scheme!r}), added to the inputs, so a cached key cannot be moved to another "
            "position; use a RoPE model (Llama, Mistral, Qwen2, Gemma)"
        )
    if scheme == ALIBI:
        raise _refuse(
            f"{config.model_type} uses ALiBi (position scheme 'alibi'), not supported yet"
        )
    if scheme != ROPE:
        raise _refuse(f"{config.model_type} has position scheme {scheme!r}; only RoPE is supported")
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise _refuse(
            f"it has {', '.join(sorted(types))} layers; only full-attention layers are supported"
        )
    rotaries = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "rope_type")]
    if not rotaries:
        raise _refuse(f"no rotary embedding module found in {type(model).__name__}")
    first = rotaries[0]
    if any(not torch.equal(m.inv_freq, first.inv_freq) for m in rotaries[1:]):
        raise _refuse("its layers use different RoPE frequencies (per-layer RoPE)")
    if first.rope_type not in SUPPORTED_ROPE:
        raise _refuse(
            f"rope_type {first.rope_type!r} changes its frequencies with the sequence length; "
            f"supported: {', '.join(SUPPORTED_ROPE)}"
        )
    inv = first.inv_freq.detach().to("cpu", torch.float64)
    rope = Rope(inv_freq=inv, rot_dim=2 * inv.numel(), rope_type=first.rope_type)
    _check_rotation(model, first, rope)
    return rope


def _check_rotation(model: Any, rotary: Any, rope: Rope) -> None:
    """Our rotation must equal the model's own ``apply_rotary_pos_emb`` (layout, partial dims)."""
    apply = getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None)
    head_dim = getattr(model.config, "head_dim", None) or (
        model.config.hidden_size // model.config.num_attention_heads
    )
    if apply is None or rope.rot_dim > head_dim:
        raise _refuse(f"cannot find or check how {type(model).__name__} applies RoPE")
    g = torch.Generator().manual_seed(0)
    dev = rotary.inv_freq.device
    k = torch.randn(1, 1, 3, head_dim, generator=g).to(dev)
    pos = torch.tensor([[0, 5, 37]], device=dev)
    with torch.no_grad():
        cos, sin = rotary(k, pos)
        try:
            _, theirs = apply(k, k, cos, sin)
        except Exception as exc:  # a different signature: we cannot vouch for the layout
            raise _refuse(f"its apply_rotary_pos_emb is not Llama-style ({exc})") from None
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    ours = rope.shift(k[0, 0].cpu().double(), pos[0].cpu()) * scale
    if not torch.allclose(theirs[0, 0].cpu().double(), ours, atol=1e-4, rtol=1e-4):
        raise _refuse("its RoPE layout differs from Llama's rotate_half")
