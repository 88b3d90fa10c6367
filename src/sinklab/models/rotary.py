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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sinklab.errors import SinklabError
from sinklab.models.arch import decoder_config

# Position schemes, by how a cached key depends on its position.
ROPE, ALIBI, ABSOLUTE, NONE = "rope", "alibi", "absolute", "none"

# Why each ALiBi model's bias cannot be made cache-relative (keys carry no position there, so
# StreamingLLM needs the bias to follow the cached keys' order instead).
_ALIBI_WHY = {
    "falcon": "its bias is built over every token seen (the cache's get_seq_length, which must "
    "stay the stream length), not over the cached keys, so the public API cannot make it "
    "cache-relative; use --policy dense, or a RoPE model",
    "bloom": "its bias is built from the attention mask when one is passed (as generate does), "
    "over every token seen, so the public API cannot make it cache-relative; use --policy "
    "dense, or a RoPE model",
    "mpt": "its bias follows the order of the keys it is given, and the sink cache returns "
    "them in ring-slot order (it moves no key), so the bias would be wrong; not supported "
    "(it could be, by returning keys in stream order); use --policy dense, or a RoPE model",
}

# RoPE types whose frequencies do not depend on the sequence length: a score depends only on the
# difference of positions, which is what makes moving a key possible.
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Rope:
    """The model's rotary embedding as a rotation we can apply by any angle.

    ``inv_freq`` (rot_dim / 2,) float64; rotation over the first ``rot_dim`` dims of a head, in
    Llama's ``rotate_half`` layout (pairs ``(i, i + rot_dim/2)``) or, ``interleaved``, in
    GPT-J's (pairs ``(2i, 2i + 1)``: Cohere, GLM); checked against the model's own
    ``apply_rotary_pos_emb``.

    The angles are built on the device of the positions they are asked for, from a copy of
    ``inv_freq`` made once per device: a rotation on an accelerator costs no host-device copy.
    """

    inv_freq: Tensor
    rot_dim: int
    rope_type: str
    interleaved: bool = False
    # inv_freq on each device it was used on (device -> tensor), filled on first use
    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def inv_freq_on(self, device: torch.device) -> Tensor:
        """``inv_freq`` on ``device``, copied there once: float64, or float32 where the device
        has no float64 (MPS)."""
        if device == self.inv_freq.device:
            return self.inv_freq
        if device not in self._on_device:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            self._on_device[device] = self.inv_freq.to(device, dtype)
        return self._on_device[device]

    def cos_sin(self, delta: Tensor, dtype: torch.dtype, dim: int | None = None):
        """Rotation by ``delta`` positions (S,) -> cos, sin (S, dim) in ``dtype`` on ``delta``'s
        device; angles in float64 (float32 on MPS). Dims past ``rot_dim`` (partial RoPE) get
        cos 1, sin 0: left alone."""
        inv = self.inv_freq_on(delta.device)
        ang = delta.to(inv.dtype)[:, None] * inv[None, :]  # (S, rot_dim/2)
        if self.interleaved:
            ang = ang.repeat_interleave(2, dim=-1)  # (S, rot_dim): a0 a0 a1 a1 ...
        else:
            ang = torch.cat((ang, ang), dim=-1)  # (S, rot_dim): a0 a1 ... a0 a1 ...
        cos, sin = ang.cos(), ang.sin()
        if dim is not None and dim > self.rot_dim:
            pad = (0, dim - self.rot_dim)
            cos, sin = F.pad(cos, pad, value=1.0), F.pad(sin, pad, value=0.0)
        return cos.to(dtype), sin.to(dtype)

    def rotate_half(self, x: Tensor) -> Tensor:
        """(..., D) -> the layout's rotate_half over the first ``rot_dim`` dims, zeros after."""
        r, half = self.rot_dim, self.rot_dim // 2
        if self.interleaved:
            pairs = torch.stack((-x[..., 1:r:2], x[..., 0:r:2]), dim=-1)  # (..., r/2, 2)
            rot = pairs.flatten(-2)
        else:
            rot = torch.cat((-x[..., half:r], x[..., :half]), dim=-1)
        return rot if r == x.shape[-1] else F.pad(rot, (0, x.shape[-1] - r))

    def shift(self, x: Tensor, delta: Tensor) -> Tensor:
        """``x`` (..., S, D) rotated by ``delta`` (S,) positions; cos and sin are built on
        ``x``'s device (``delta`` is moved there if it lives elsewhere)."""
        cos, sin = self.cos_sin(delta.to(x.device), x.dtype, x.shape[-1])
        return x * cos + self.rotate_half(x) * sin


def position_scheme(config: Any) -> str:
    """How the model encodes positions: decides whether a sink cache can move cached keys.

    ALiBi is read first: Falcon configs carry RoPE parameters even with ``alibi=True``."""
    model_type = config.model_type
    attn_config = getattr(config, "attn_config", None)  # MPT keeps its ALiBi switch there
    mpt_alibi = model_type == "mpt" and getattr(attn_config, "alibi", True)
    if getattr(config, "alibi", False) or model_type == "bloom" or mpt_alibi:
        return ALIBI
    if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None):
        return ROPE
    if model_type in {"gptj", "codegen"}:  # rotary over rotary_dim dims, from a sin/cos table
        return ROPE
    if model_type in {"gpt2", "gpt_neo", "opt", "biogpt", "xglm"}:
        return ABSOLUTE
    if getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None):
        # A learned or sinusoidal table that is not RoPE: positions are baked into the inputs.
        return ABSOLUTE if model_type not in {"mamba", "rwkv"} else NONE
    return NONE


def _refuse(reason: str) -> SinklabError:
    return SinklabError(f"SinkCache cannot move cached keys of this model: {reason}")


class _Rotary:
    """One RoPE of a model's rotary module: ``cos, sin = rotary(x, position_ids)`` as the model
    computes them (Gemma 3 and OLMo 3 keep one RoPE per layer type in one module)."""

    def __init__(self, module: Any, layer_type: str | None) -> None:
        self.module, self.layer_type = module, layer_type
        prefix = f"{layer_type}_" if layer_type else ""
        self.inv_freq = getattr(module, f"{prefix}inv_freq")
        rope_type = module.rope_type
        self.rope_type = rope_type[layer_type] if isinstance(rope_type, dict) else rope_type
        self.scale = float(getattr(module, f"{prefix}attention_scaling", 1.0) or 1.0)

    def __call__(self, x: Tensor, pos: Tensor):
        if self.layer_type:
            return self.module(x, pos, self.layer_type)
        return self.module(x, pos)


def _global_rotary(model: Any, config: Any, layer_type: str) -> _Rotary:
    """The RoPE of the layers whose keys a sink cache moves (the global-attention ones)."""
    found = [m for m in model.modules() if hasattr(m, "rope_type")]
    plain = [m for m in found if hasattr(m, "inv_freq")]
    if plain:
        first = plain[0]
        if any(not torch.equal(m.inv_freq, first.inv_freq) for m in plain[1:]):
            raise _refuse("its layers use different RoPE frequencies (per-layer RoPE)")
        return _Rotary(first, None)
    typed = [m for m in found if hasattr(m, f"{layer_type}_inv_freq")]
    if typed:
        return _Rotary(typed[0], layer_type)
    if config.model_type in {"gptj", "codegen"}:
        raise _refuse(
            f"{config.model_type} applies RoPE from a precomputed sin/cos table inside its "
            "attention, with no rotary module sinklab can read frequencies from; not supported"
        )
    raise _refuse(f"no rotary embedding module found in {type(model).__name__}")


def rope_of(model: Any, layer_type: str = "full_attention") -> Rope:
    """The rotary embedding of a RoPE model's global-attention layers (``layer_type``
    "sliding_attention": of its sliding-window layers, which have their own in Gemma 3), or
    :class:`SinklabError` naming why not. (Sliding-window layers of hybrid models keep the
    model's own window and are moved only when the cache rebases positions; NoPE layers have
    nothing to move.)"""
    config = decoder_config(model)
    scheme = position_scheme(config)
    if scheme == ABSOLUTE:
        raise _refuse(
            f"{config.model_type} uses learned absolute position embeddings (position scheme "
            f"{scheme!r}), added to the inputs, so a cached key cannot be moved to another "
            "position; use a RoPE model (Llama, Mistral, Qwen2, Gemma)"
        )
    if scheme == ALIBI:
        raise _refuse(f"{config.model_type} uses ALiBi: {_ALIBI_WHY.get(config.model_type, '')}")
    if scheme != ROPE:
        raise _refuse(f"{config.model_type} has position scheme {scheme!r}; only RoPE is supported")
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types - {"full_attention", "sliding_attention"}:
        other = ", ".join(sorted(types - {"full_attention", "sliding_attention"}))
        raise _refuse(f"it has {other} layers; only full and sliding-window layers are supported")
    rotary = _global_rotary(model, config, layer_type)
    if rotary.rope_type not in SUPPORTED_ROPE:
        raise _refuse(
            f"rope_type {rotary.rope_type!r} changes its frequencies with the sequence length; "
            f"supported: {', '.join(SUPPORTED_ROPE)}"
        )
    inv = rotary.inv_freq.detach().to("cpu", torch.float64)
    return _checked_layout(model, config, rotary, inv)


def _head_dim(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def _checked_layout(model: Any, config: Any, rotary: _Rotary, inv: Tensor) -> Rope:
    """The layout (rotate_half or interleaved) whose rotation equals the model's own
    ``apply_rotary_pos_emb``, applied as the model applies it: to the whole head, or, where the
    model rotates only a slice (Phi, StableLM: ``partial_rotary_factor``), to that slice."""
    apply = getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None)
    head_dim = _head_dim(config)
    rot_dim = 2 * inv.numel()
    if apply is None or rot_dim > head_dim:
        raise _refuse(f"cannot find or check how {type(model).__name__} applies RoPE")
    g = torch.Generator().manual_seed(0)
    dev = rotary.inv_freq.device
    k = torch.randn(1, 1, 3, head_dim, generator=g).to(dev)
    pos = torch.tensor([[0, 5, 37]], device=dev)
    with torch.no_grad():
        cos, sin = rotary(k, pos)
        width = head_dim
        try:
            _, theirs = apply(k, k, cos, sin)
        except RuntimeError:  # the model rotates a slice of the head and passes the rest
            width = cos.shape[-1]
            try:
                _, theirs = apply(k[..., :width], k[..., :width], cos, sin)
            except Exception as exc:
                raise _refuse(f"its apply_rotary_pos_emb is not Llama-style ({exc})") from None
        except Exception as exc:  # a different signature: we cannot vouch for the layout
            raise _refuse(f"its apply_rotary_pos_emb is not Llama-style ({exc})") from None
    theirs = theirs[0, 0].cpu().double()
    x = k[0, 0, :, :width].cpu().double()
    for interleaved in (False, True):
        rope = Rope(inv, rot_dim, rotary.rope_type, interleaved)
        ours = rope.shift(x, pos[0].cpu()) * rotary.scale
        if width > rot_dim:  # dims past rot_dim are not scaled
            ours[..., rot_dim:] = x[..., rot_dim:]
        if torch.allclose(theirs, ours, atol=1e-4, rtol=1e-4):
            return rope
    raise _refuse("its RoPE layout is neither Llama's rotate_half nor interleaved pairs")
