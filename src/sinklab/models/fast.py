"""The fast decode path: a model's linear layers on 4-bit weights (``--quantize``).

Why: a decode step reads every weight once per token, and on a CPU that read is the step
(SmolLM2-135M in float32: 540 MB a token, 66 % of the step in the linear layers;
docs/benchmarks.md#decode). :class:`Int4Linear` keeps a linear layer's weight as asymmetric 4-bit
integers in groups of 32 along the input, with a scale and a zero per group, and multiplies with
PyTorch's own CPU kernel for that layout (``torch._weight_int4pack_mm_for_cpu``, the kernel that
torchao's CPU int4 layout also calls): an eighth of the bytes. Everything else stays as loaded:
embeddings, norms, attention, the residual stream and the sink cache (float32 by default), so
the StreamingLLM cache, its re-rotation and batching run unchanged.

What it costs in exactness: the kernel multiplies bfloat16 activations by bfloat16 scales and
zeros (it has no fast float32 path: measured 25x slower), so each linear layer's output carries
bfloat16 rounding (about 4e-3 relative); the weights themselves lose nothing where they already
are 4-bit groups of 32 spanning their 16 codes (the Q4_1 GGUF blocks of the embedded SmolLM2;
:func:`quantize_weight` reports how far each one moved), and a weight that would move more than
``MOVE_LIMIT`` stays as loaded (Qwen2.5's Q4_K_M blocks, whose codes need not span 0..15:
none of its 169 linear layers passes). The measured divergence from float32 is in
docs/benchmarks.md#decode and pinned by ``tests/test_fast.py``.

The rule (:func:`choose`): ``auto`` picks ``int4`` on a CPU whose torch build runs AVX-512
kernels and whose flags include ``avx512_bf16`` or AMX (where it was measured), for a model on
the CPU; ``none`` anywhere else. ``int4`` forces it on any CPU; ``none`` keeps the weights as
loaded. int8 weight-only (``torch._weight_int8pack_mm``) and bfloat16 weights were measured
slower than float32 on this path (docs/benchmarks.md#decode), so they are not offered here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sinklab.errors import SinklabError

QUANTIZE = ("auto", "none", "int4")
GROUP = 32  # inputs per scale and zero: the GGUF's Q4 block
MOVE_LIMIT = 1e-3  # a weight that moves more (relative to its group) stays as loaded
_WIDTH = 16  # the kernel packs outputs in blocks of 16 (smaller layers stay as loaded)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo`` on Linux; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_facts() -> dict[str, Any]:
    """What the rule reads and every benchmark records: the model name, torch's kernel level
    and the flags that matter to the decode path."""
    model = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next((x for x in text.splitlines() if x.startswith("model name")), "")
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
    return {
        "cpu_model": model.partition(":")[2].strip(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "flags": sorted(f for f in wanted if f in cpu_flags()),
    }


def int4_measured_fast() -> bool:
    """Whether this CPU is of the kind the int4 path was measured faster on: torch's AVX-512
    kernels, with bfloat16 dot products (``avx512_bf16``) or AMX."""
    flags = cpu_flags()
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX") and bool(
        flags & {"avx512_bf16", "amx_bf16"}
    )


def choose(quantize: str, device: str) -> tuple[str, str]:
    """``--quantize`` on ``--device`` -> (the path, why), by the rule in the module docstring.
    Raises :class:`SinklabError` for an unknown value or int4 off the CPU."""
    if quantize not in QUANTIZE:
        raise SinklabError(f"--quantize {quantize!r} is not one of {', '.join(QUANTIZE)}")
    if quantize == "none":
        return "none", "asked for"
    on_cpu = device == "cpu"
    if quantize == "int4":
        if not on_cpu:
            raise SinklabError(
                f"--quantize int4 runs on the CPU only (torch's CPU kernel); pass --device cpu, "
                f"or --quantize none for --device {device}"
            )
        return "int4", "asked for"
    if not on_cpu:
        return "none", f"auto: --device {device} is not the CPU"
    if not int4_measured_fast():
        return "none", "auto: this CPU has neither avx512_bf16 nor AMX (int4 not measured faster)"
    return "int4", "auto: AVX-512 with bfloat16 dot products (int4 measured 2-3x faster a token)"


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor, float]:
    """A (N, K) weight -> its 4-bit codes (N, K) int32 in 0..15, scales and zeros (K/32, N, 2)
    as the kernel takes them (w = (q - 8) * scale + zero), and the largest change of any weight
    relative to its group's largest magnitude (0 where the weight already is 4-bit groups).

    Each group's step is (max - min) / 15: a Q4_1 block's, whose codes span 0..15, comes back
    to float32 rounding (one pass over the weight; no search for a finer step)."""
    w = weight.detach().float()
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = ((high - low) / 15).clamp_min(1e-30)
    q = ((g - low) / step).round_().clamp_(0, 15)
    best_err = (q * step + low - g).abs_().amax(-1, keepdim=True)
    scale = step.reshape(n, -1)
    zero = (low + 8 * step).reshape(n, -1)
    sz = torch.stack([scale.t(), zero.t()], -1).contiguous()
    mag = g.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    moved = float((best_err / mag).max())
    return q.reshape(n, k).to(torch.int32), sz, moved


class Int4Linear(nn.Module):
    """A linear layer on 4-bit weights (groups of 32, torch's CPU int4 kernel): inputs go in as
    bfloat16, outputs come back in the input's dtype, the bias is added in that dtype."""

    def __init__(
        self, linear: nn.Linear, parts: tuple[Tensor, Tensor, float] | None = None
    ) -> None:
        super().__init__()
        q, sz, self.moved = parts if parts is not None else quantize_weight(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_zeros", sz.to(torch.bfloat16))
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{GROUP}"


@dataclass
class FastPath:
    """What :func:`apply` did: the path, why, how many linear layers it converted (and which
    stayed as loaded), the linear weights' bytes before and after, the largest relative move of
    a weight (0: every converted weight already was 4-bit), and the CPU's facts."""

    quantize: str
    why: str
    converted: int = 0
    kept: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    weight_moved: float = 0.0
    cpu: dict[str, Any] = field(default_factory=cpu_facts)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _linears(module: nn.Module, prefix: str = "") -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            yield module, f"{prefix}{name}", child
        else:
            yield from _linears(child, f"{prefix}{name}.")


def convertible(linear: nn.Linear) -> bool:
    """Whether the kernel takes this layer: inputs a multiple of 32, outputs of 16, on the CPU,
    not offloaded."""
    w = linear.weight
    return (
        w.device.type == "cpu"
        and w.is_floating_point()
        and linear.in_features % GROUP == 0
        and linear.out_features % _WIDTH == 0
    )


@torch.no_grad()
def apply(model: nn.Module, quantize: str = "auto", device: str = "cpu") -> FastPath:
    """Put ``model``'s linear layers (the output head too) on the path :func:`choose` picks, in
    place; -> what was done. The embeddings stay as loaded (a tied head gets its own 4-bit copy,
    the embedding keeps its weights)."""
    path, why = choose(quantize, device)
    done = FastPath(path, why)
    if path == "none":
        return done
    for parent, name, linear in list(_linears(model)):
        w = linear.weight
        if not convertible(linear):
            done.kept.append(name)
            continue
        parts = quantize_weight(w)
        if parts[2] > MOVE_LIMIT:  # not 4-bit already: rounding it would change the model
            done.kept.append(name)
            done.weight_moved = max(done.weight_moved, parts[2])
            continue
        fast = Int4Linear(linear, parts)
        setattr(parent, name.rpartition(".")[2], fast)
        done.converted += 1
        done.bytes_before += w.numel() * w.element_size()
        done.bytes_after += fast.packed.numel() * fast.packed.element_size()
        done.bytes_after += fast.scales_zeros.numel() * fast.scales_zeros.element_size()
        done.weight_moved = max(done.weight_moved, fast.moved)
    if not done.converted:
        done.quantize, done.why = "none", f"{why}; no linear layer fits the int4 kernel"
    return done


def load_fast(loaded: Any, quantize: str, device: str) -> Any:
    """A :class:`~sinklab.models.loading.LoadedModel` on the path ``quantize`` picks (in place);
    its ``info.quantize`` says which, so every result records it."""
    import dataclasses

    done = apply(loaded.model, quantize, device)
    loaded.info = dataclasses.replace(loaded.info, quantize=done.quantize)
    return loaded
