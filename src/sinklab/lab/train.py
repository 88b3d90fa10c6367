"""Train one lab decoder, deterministically for a seed, probing sinks at every checkpoint.

:func:`train` returns a :class:`TrainResult` (config, loss curve, one probe summary per
checkpoint, validation perplexity with and without the first token, ``meta``) and writes
``train.json``, ``loss.png`` and ``sinks.png`` (each beside the JSON of its numbers) and the
checkpoints (``checkpoints/step-N``: weights, config, tokenizer; loadable by
:func:`sinklab.models.load_model`) under ``out``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sinklab.errors import SinklabError
from sinklab.lab.data import DATA_STRATEGIES, DataConfig, LabData
from sinklab.lab.model import LAB_VARIANTS, LabConfig, LabForCausalLM
from sinklab.meta import build_meta, write_json_atomic
from sinklab.probe import ProbeConfig, probe

log = logging.getLogger(__name__)

EPS = (0.3, 0.8)  # sink-head thresholds (Gu et al., Barbero et al.), docs/metrics.md#q0-eps


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults (the ``cpu`` preset) take a few minutes on 2 CPU cores."""

    variant: str = "softmax"
    data: str = "bos"
    steps: int = 1200
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    device: str = "cpu"
    vocab_size: int = 2048
    n_checkpoints: int = 8  # probed checkpoints, log-spaced in steps, the last one at `steps`
    eval_windows: int = 64  # held-out windows for the final perplexities
    max_docs: int | None = None  # tests: keep the first N documents
    keep_checkpoints: bool = True  # save weights of every checkpoint (the final one always)

    def __post_init__(self) -> None:
        if self.variant not in LAB_VARIANTS:
            raise SinklabError(
                f"unknown variant {self.variant!r}; use one of: {', '.join(LAB_VARIANTS)}"
            )
        if self.data not in DATA_STRATEGIES:
            raise SinklabError(
                f"unknown data strategy {self.data!r}; use one of: {', '.join(DATA_STRATEGIES)}"
            )
        for name, lo in (("steps", 1), ("layers", 1), ("heads", 1), ("batch_size", 1)):
            if getattr(self, name) < lo:
                raise SinklabError(f"--{name.replace('_', '-')} must be >= {lo}")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise SinklabError(
                f"--d-model ({self.d_model}) must be a multiple of --heads ({self.heads}) with an "
                "even head size; e.g. --d-model 128 --heads 4"
            )
        if self.device not in ("cpu", "cuda"):
            raise SinklabError(f"--device must be cpu or cuda, got {self.device!r}")
        if not 0 < self.lr < 1:
            raise SinklabError(f"--lr must be in (0, 1), got {self.lr}")
        if self.n_checkpoints < 1 or self.eval_windows < 1:
            raise SinklabError("n_checkpoints and eval_windows must be >= 1")

    def data_config(self) -> DataConfig:
        return DataConfig(
            strategy=self.data,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            max_docs=self.max_docs,
        )


PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},
    # ~30M parameters, 512-token context: minutes on one modern GPU
    "gpu": {
        "steps": 5000,
        "layers": 8,
        "d_model": 512,
        "heads": 8,
        "seq_len": 512,
        "batch_size": 64,
        "lr": 1e-3,
        "warmup": 300,
        "device": "cuda",
        "vocab_size": 4096,
    },
}


def preset(name: str, **overrides: Any) -> TrainConfig:
    """A :class:`TrainConfig` from a named preset (``cpu``, ``gpu``) with overrides."""
    if name not in PRESETS:
        raise SinklabError(f"unknown preset {name!r}; use one of: {', '.join(PRESETS)}")
    return TrainConfig(**{**PRESETS[name], **overrides})


def checkpoint_steps(steps: int, n: int) -> list[int]:
    """``n`` log-spaced steps in ``1..steps`` (distinct, ending at ``steps``), plus step 0."""
    raw = {round(steps ** (i / max(1, n - 1))) if n > 1 else steps for i in range(n)}
    return sorted({0, *(min(steps, max(1, s)) for s in raw), steps})


@dataclass
class TrainResult:
    """Everything ``train.json`` holds; ``checkpoints`` rows: step, sink_rate, sink_mass."""

    config: TrainConfig
    loss: list[tuple[int, float]]
    checkpoints: list[dict[str, Any]]
    val: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "loss": [[s, v] for s, v in self.loss],
            "checkpoints": self.checkpoints,
            "val": self.val,
            "meta": self.meta,
        }


def load_result(out: Path) -> TrainResult | None:
    """The finished run saved in ``out/train.json``, or None when there is none (or unreadable)."""
    try:
        raw = json.loads((out / "train.json").read_text(encoding="utf-8"))
        config = TrainConfig(**raw["config"])
        loss = [(int(s), float(v)) for s, v in raw["loss"]]
        return TrainResult(config, loss, raw["checkpoints"], raw["val"], raw.get("meta", {}), out)
    except (OSError, ValueError, KeyError, TypeError, SinklabError):
        return None


def _lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10 % of ``lr``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    frac = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]  # norms, sink logits, biases
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def probe_summary(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Sink mass ``(L, H)`` at key 0 (q0 = 0), sink rate at eps 0.3/0.8, via ``sinklab.probe``."""
    result = probe(model, ids, config=ProbeConfig(q0=0, eps=EPS))
    mass = torch.as_tensor(result.sink_mass).to(torch.float64)  # (L, H)
    return {
        "sink_rate": {str(e): float((mass > e).double().mean()) for e in EPS},
        "first_token_sink_mass": float(mass.mean()),
        "sink_mass": mass.tolist(),
    }


@torch.no_grad()
def validation(model: torch.nn.Module, data: LabData, n: int, device: str) -> dict[str, float]:
    """Perplexity on held-out text with and without the first token (BOS, or the token before).

    ``damage`` = ``ppl_without_first / ppl_with_first - 1`` (0 = removing it costs nothing).
    """
    prefix, text = data.eval_windows(n)  # (N,), (N, T - 1)
    prefix, text = prefix.to(device), text.to(device)
    with_first = torch.cat([prefix[:, None], text], dim=1)  # (N, T)
    nll = {}
    for name, ids, skip in (("with_first", with_first, 1), ("without_first", text, 0)):
        total, count = 0.0, 0
        for i in range(0, ids.shape[0], 16):
            batch = ids[i : i + 16]
            logits = model(batch).logits[:, skip:-1]  # predicts text[1:]: (b, T - 2, V)
            target = text[i : i + 16, 1:]  # (b, T - 2)
            total += float(F.cross_entropy(logits.transpose(1, 2), target, reduction="sum"))
            count += target.numel()
        nll[name] = total / count
    ppl_w, ppl_wo = math.exp(nll["with_first"]), math.exp(nll["without_first"])
    return {"ppl_with_first": ppl_w, "ppl_without_first": ppl_wo, "damage": ppl_wo / ppl_w - 1}


def build_model(config: TrainConfig) -> LabForCausalLM:
    """A fresh lab decoder for ``config``, seeded."""
    torch.manual_seed(config.seed)
    model_config = LabConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        max_position_embeddings=config.seq_len,
        attention_variant=config.variant,
    )
    return LabForCausalLM(model_config)


def train(
    config: TrainConfig,
    out: Path | None = None,
    *,
    data: LabData | None = None,
    callback: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train, probe each checkpoint, evaluate; write outputs under ``out`` when given.

    ``data`` lets sweeps reuse one tokenizer (its strategy must match ``config.data``);
    ``callback(step, loss)`` is called after every step.
    """
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SinklabError("--device cuda but no CUDA device is visible; use --device cpu")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI shows its own progress
    t0 = time.perf_counter()
    if data is None or data.config != config.data_config():
        data = LabData(config.data_config(), tokenizer=data.tokenizer if data else None)
    if len(data.tokenizer) > config.vocab_size:
        raise SinklabError(
            f"tokenizer has {len(data.tokenizer)} tokens > vocab {config.vocab_size}"
        )
    model = build_model(config).to(config.device)
    opt = _optimizer(model, config)
    order = data.batch_order(config.steps, config.batch_size, config.seed)
    prefix, text = data.eval_windows(1)
    probe_ids = torch.cat([prefix, text[0]]).to(config.device)  # (T,) the training format
    schedule = set(checkpoint_steps(config.steps, config.n_checkpoints))
    losses: list[tuple[int, float]] = []
    checkpoints: list[dict[str, Any]] = []

    def checkpoint(step: int) -> None:
        model.eval()
        row = {"step": step, **probe_summary(model, probe_ids)}
        if out is not None and (config.keep_checkpoints or step == config.steps):
            folder = out / "checkpoints" / f"step-{step}"
            model.save_pretrained(folder)
            data.tokenizer.save_pretrained(folder)
            row["path"] = str(folder.relative_to(out))  # relative: the run folder may move
        checkpoints.append(row)
        model.train()
        log.info("step %d: sink rate %s", step, row["sink_rate"])

    model.train()
    for step in range(config.steps + 1):
        if step in schedule:
            checkpoint(step)
        if step == config.steps:
            break
        batch = {k: v.to(config.device) for k, v in data.batch(order[step]).items()}
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, config)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        losses.append((step + 1, value))
        if callback is not None:
            callback(step + 1, value)
    model.eval()
    val = validation(model, data, config.eval_windows, config.device)
    meta = build_meta(
        params=config,
        seconds=time.perf_counter() - t0,
        n_params=sum(p.numel() for p in model.parameters()),
        n_train_tokens=data.n_train_tokens,
        n_sequences=int(data.ids.shape[0]),
        probe={"q0": 0, "eps": list(EPS), "key": 0, "n_tokens": int(probe_ids.numel())},
        corpus="shakespeare scenes"
        if config.max_docs is None
        else f"first {config.max_docs} scenes",
    )
    result = TrainResult(config, losses, checkpoints, val, meta, out)
    if out is not None:
        write_outputs(result, out)
    return result


def write_outputs(result: TrainResult, out: Path) -> None:
    """``train.json``, ``loss.png`` and ``sinks.png`` under ``out``."""
    from sinklab.lab.plots import plot_loss, plot_sink_emergence

    c = result.config
    title = f"{c.variant} / {c.data}, seed {c.seed}"
    write_json_atomic(out / "train.json", result.to_json())
    plot_loss(result.loss, out / "loss.png", title=title)
    plot_sink_emergence(result.checkpoints, out / "sinks.png", title=title)
