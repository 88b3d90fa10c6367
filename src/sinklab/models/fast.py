"""The fast decode path: a model's linear layers on 4-bit and 8-bit weights (``--quantize``).

Why: a decode step reads every weight once per token, and on a CPU that read is the step
(SmolLM2-135M in float32: 540 MB a token, 66 % of the step in the linear layers;
docs/benchmarks.md#decode). Two layers replace ``nn.Linear``, each on PyTorch's own CPU kernel
for its layout (no new dependency):

* :class:`Int4Linear` keeps the weight as asymmetric 4-bit integers in groups of 32 along the
  input, with a scale and a zero per group (``torch._weight_int4pack_mm_for_cpu``, the kernel
  that torchao's CPU int4 layout also calls): an eighth of the bytes. It is taken only where the
  weights already are 4-bit groups of 32 spanning their 16 codes (the Q4_1 GGUF blocks of the
  embedded SmolLM2), so the weights lose nothing; a weight that would move more than
  ``MOVE_LIMIT`` is not put on it (Qwen2.5's Q4_K_M blocks, whose codes need not span 0..15).
* :class:`Int8Linear` keeps the weight as symmetric 8-bit integers with one scale per output row
  (``torch._weight_int8pack_mm``): a quarter of the bytes; each weight moves by at most half a
  step, 1/254 of its row's largest magnitude, plus its scale's bfloat16 rounding (the kernel's
  scales are bfloat16: at most 1/256 more; :attr:`FastPath.int8_moved` reports the largest
  move). Measured on the AMD EPYC here (1 thread): SmolLM2's tied head (49152 x 576), which is
  45 % of an int4 step in float32, 12.4 -> 4.3 CPU ms; Qwen2.5's MLP layers 5-9x.

Both multiply bfloat16 activations (neither kernel has a fast float32 path: int4's float32 one
was measured 25x slower, int8's 2x), so each linear layer's output carries bfloat16 rounding
(about 4e-3 relative). Everything else stays as loaded: embeddings, norms, attention, the
residual stream and the sink cache (float32 by default), so the StreamingLLM cache, its
re-rotation and batching run unchanged. The measured divergence from float32 is in
docs/benchmarks.md#decode and pinned by ``tests/test_fast.py``.

The paths: ``int4`` puts the 4-bit layers on int4 and keeps every other linear layer as loaded
(SmolLM2's tied head stays float32, so the logits keep float32's resolution: a bfloat16 head was
measured 4 ms a token faster but rounds the logits to 1/8 at a scale of 30, which ties the top
tokens and let a batched row's greedy token differ from the row alone); ``int8`` puts every
linear layer on int8, the head included (Qwen2.5's 151936 x 896 head is most of its bytes; its
logits come back at bfloat16's resolution); ``none`` keeps the weights as loaded. The rule
(:func:`choose`, then :func:`apply`): ``auto`` picks, for a model on the CPU of a torch build
that runs AVX-512 kernels with ``avx512_bf16`` or AMX (where the kernels were measured faster),
``int4`` when some linear layer already is 4-bit (SmolLM2) and ``int8`` otherwise (Qwen2.5:
bfloat16 weights there were measured barely faster than float32, int8 2x); ``none`` anywhere else.
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

QUANTIZE = ("auto", "none", "int8", "int4")
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
    if quantize in ("int4", "int8"):
        if not on_cpu:
            raise SinklabError(
                f"--quantize {quantize} runs on the CPU only (torch's CPU kernels); pass "
                f"--device cpu, or --quantize none for --device {device}"
            )
        return quantize, "asked for"
    if not on_cpu:
        return "none", f"auto: --device {device} is not the CPU"
    if not int4_measured_fast():
        return "none", "auto: this CPU has neither avx512_bf16 nor AMX (not measured faster)"
    return "int4", "auto: AVX-512 with bfloat16 dot products (measured 2-3x faster a token)"


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


def quantize_weight_int8(weight: Tensor) -> tuple[Tensor, Tensor, float]:
    """A (N, K) weight -> its 8-bit codes (N, K) in -127..127, one scale per row (N,) with
    w = q * scale, and the largest change of any weight relative to its row's largest magnitude
    as the kernel computes with it: half a step (1/254) plus the scale's bfloat16 rounding (at
    most 2^-8 of the row's largest magnitude), so at most 1/254 + 1/256."""
    w = weight.detach().float()
    mag = w.abs().amax(1, keepdim=True).clamp_min(1e-30)
    scale = mag / 127
    q = (w / scale).round_().clamp_(-127, 127)
    stored = scale.bfloat16().float()  # the scale the kernel multiplies by (Int8Linear's buffer)
    moved = float(((q * stored - w).abs_() / mag).max())
    return q.to(torch.int8), scale.reshape(-1), moved


class Int8Linear(nn.Module):
    """A linear layer on 8-bit weights (one scale per output row, torch's CPU int8 kernel):
    inputs go in as bfloat16, outputs come back in the input's dtype, the bias is added in that
    dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale, self.moved = quantize_weight_int8(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("codes", q.contiguous())
        self.register_buffer("scales", scale.to(torch.bfloat16))
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(flat, self.codes, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


@dataclass
class FastPath:
    """What :func:`apply` did: the path, why, how many linear layers it put on int4
    (``converted``) and which on int8 (``int8``), which stayed as loaded (``kept``), the linear
    weights' bytes before and after, the largest relative move of a weight on int4 (0: every
    one already was 4-bit; for a path that kept 4-bit candidates, the largest move seen) and on
    int8 (at most 1/254 + 1/256), and the CPU's facts."""

    quantize: str
    why: str
    converted: int = 0
    kept: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    weight_moved: float = 0.0
    int8: list[str] = field(default_factory=list)
    int8_moved: float = 0.0
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
    """Whether the int4 kernel takes this layer: inputs a multiple of 32, outputs of 16, on the
    CPU, not offloaded."""
    w = linear.weight
    return (
        w.device.type == "cpu"
        and w.is_floating_point()
        and linear.in_features % GROUP == 0
        and linear.out_features % _WIDTH == 0
    )


def int8_convertible(linear: nn.Linear) -> bool:
    """Whether the int8 kernel takes this layer: a floating weight on the CPU with inputs a
    multiple of 32 (the kernel's inner blocks: with 8 inputs it was measured wrong, with 100 it
    crashed, so anything else stays as loaded)."""
    w = linear.weight
    return w.device.type == "cpu" and w.is_floating_point() and linear.in_features % GROUP == 0


def _bytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _to_int8(parent: nn.Module, name: str, linear: nn.Linear, done: FastPath) -> None:
    fast = Int8Linear(linear)
    setattr(parent, name.rpartition(".")[2], fast)
    done.int8.append(name)
    done.bytes_before += _bytes(linear.weight)
    done.bytes_after += _bytes(fast.codes, fast.scales)
    done.int8_moved = max(done.int8_moved, fast.moved)


def _any_four_bit(model: nn.Module) -> bool:
    return any(
        convertible(lin) and quantize_weight(lin.weight)[2] <= MOVE_LIMIT
        for _, _, lin in _linears(model)
    )


@torch.no_grad()
def apply(model: nn.Module, quantize: str = "auto", device: str = "cpu") -> FastPath:
    """Put ``model``'s linear layers (the output head too) on the path :func:`choose` picks, in
    place; -> what was done. The embeddings stay as loaded (a tied head gets its own 8-bit copy,
    the embedding keeps its weights)."""
    path, why = choose(quantize, device)
    if quantize == "auto" and path == "int4" and not _any_four_bit(model):
        path, why = "int8", f"{why}; no linear layer is 4-bit already: int8"
    done = FastPath(path, why)
    if path == "none":
        return done
    for parent, name, linear in list(_linears(model)):
        w = linear.weight
        if path == "int4" and convertible(linear):
            parts = quantize_weight(w)
            if parts[2] <= MOVE_LIMIT:  # 4-bit already: nothing lost
                fast = Int4Linear(linear, parts)
                setattr(parent, name.rpartition(".")[2], fast)
                done.converted += 1
                done.bytes_before += _bytes(w)
                done.bytes_after += _bytes(fast.packed, fast.scales_zeros)
                done.weight_moved = max(done.weight_moved, fast.moved)
                continue
            done.weight_moved = max(done.weight_moved, parts[2])
        if path == "int8" and int8_convertible(linear):
            _to_int8(parent, name, linear, done)
        else:
            done.kept.append(name)
    if not done.converted and not done.int8:
        done.quantize, done.why = "none", f"{why}; no linear layer fits the kernels"
    return done


def load_fast(loaded: Any, quantize: str, device: str) -> Any:
    """A :class:`~sinklab.models.loading.LoadedModel` on the path ``quantize`` picks (in place);
    its ``info.quantize`` says which, so every result records it."""
    import dataclasses

    done = apply(loaded.model, quantize, device)
    loaded.info = dataclasses.replace(loaded.info, quantize=done.quantize)
    return loaded
