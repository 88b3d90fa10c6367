"""Train one lab decoder, deterministically for a seed, probing sinks at every checkpoint.

Two tasks: ``text`` (the plays, BPE tokens, a data strategy of :mod:`sinklab.lab.data`) and
``backcopy`` (:mod:`sinklab.lab.backcopy`, online bigram-backcopy sequences; every checkpoint also
records ``backcopy``, :func:`sinklab.lab.backcopy_metrics.backcopy_summary`).
:func:`train` returns a :class:`TrainResult` (config, loss curve, one probe summary per
checkpoint, validation perplexity with and without the first token, the ``run`` facts, and the
one provenance block ``meta`` of :func:`sinklab.meta.attach_meta`) and writes ``train.json``,
``loss.png`` and ``sinks.png`` (each beside the JSON of its numbers) and the checkpoints
(``checkpoints/step-N``: weights, config, tokenizer; loadable by
:func:`sinklab.models.loading.load_model` after :func:`sinklab.lab.register`) under ``out``.

``torchrun --nproc-per-node N -m sinklab train [options]`` trains one run with one process per
rank (DDP, :mod:`sinklab.lab.ranks`; rank 0 writes): the one command line, ``sinklab train``,
takes its place from the launcher's environment.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sinklab.corpus import Text, load_text
from sinklab.errors import SinklabError
from sinklab.lab.backcopy import BackcopyData, backcopy_validation
from sinklab.lab.backcopy_metrics import backcopy_summary
from sinklab.lab.config import TrainConfig
from sinklab.lab.convergence import convergence, tail_start
from sinklab.lab.data import LabData
from sinklab.lab.model import LabConfig, LabForCausalLM
from sinklab.lab.ranks import Ranks, check_nproc
from sinklab.meta import attach_meta, restore_non_finite, write_json_atomic
from sinklab.models.loading import describe, file_sha256
from sinklab.probe import ProbeConfig, probe
from sinklab.probe.spec import DEFAULT_EPS
from sinklab.progress import Progress, quiet
from sinklab.safeio import read_json

log = logging.getLogger(__name__)

EPS = DEFAULT_EPS  # the probe's sink-head thresholds at every checkpoint
BACKCOPY_PROBE_SEQUENCES = 16  # held-out sequences each checkpoint's backcopy metrics read


TAIL_POINTS = 5  # tail checkpoints at 0.8 S, 0.85 S, 0.9 S, 0.95 S, S


def checkpoint_steps(steps: int, n: int) -> list[int]:
    """``n`` log-spaced steps in ``1..steps`` (distinct, ending at ``steps``), plus step 0 and
    :data:`TAIL_POINTS` steps evenly spaced from :func:`~sinklab.lab.convergence.tail_start` to
    ``steps`` (the trajectory the convergence criterion of docs/claims.md#lab-validity reads)."""
    raw = {round(steps ** (i / max(1, n - 1))) if n > 1 else steps for i in range(n)}
    start = tail_start(steps)  # the rule convergence.tail reads the tail by
    tail = {math.ceil(start + (steps - start) * i / (TAIL_POINTS - 1)) for i in range(TAIL_POINTS)}
    return sorted({0, *(min(steps, max(1, s)) for s in raw | tail), steps})


@dataclass
class TrainResult:
    """Everything ``train.json`` holds; ``checkpoints`` rows: step, sink_rate, sink_mass.

    ``run``: what the run trained on and how it probed and ran (``corpus``, ``n_train_tokens``,
    ``n_sequences``, backcopy ``triggers``; ``probe``: q0, eps, key, n_tokens; ``processes``,
    ``torch_threads``, ``step_seconds``: wall time inside the optimizer steps, rank 0's).
    ``convergence`` (in ``train.json``): whether the run met the criterion of
    docs/claims.md#lab-validity, computed from the checkpoints and the loss.
    ``meta``: exactly :data:`sinklab.meta.META_KEYS` (the trained model's description as the model).
    """

    config: TrainConfig
    loss: list[tuple[int, float]]
    checkpoints: list[dict[str, Any]]
    val: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None
    run: dict[str, Any] = field(default_factory=dict)

    @property
    def convergence(self) -> dict[str, Any]:
        """Whether the run met the convergence criterion of docs/claims.md#lab-validity (read
        from its checkpoints and loss curve: :func:`sinklab.lab.convergence.convergence`)."""
        return convergence(self.checkpoints, self.config.steps, self.loss)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "loss": [[s, v] for s, v in self.loss],
            "checkpoints": self.checkpoints,
            "val": self.val,
            "convergence": self.convergence if self.checkpoints else None,
            "run": self.run,
            "meta": self.meta,
        }


def load_result(out: Path) -> TrainResult | None:
    """The finished run saved in ``out/train.json``, or None when there is none (or unreadable)."""
    try:
        raw = restore_non_finite(read_json(out / "train.json", "lab run", "lab JSON"))
        config = TrainConfig(**raw["config"])
        loss = [(int(s), float(v)) for s, v in raw["loss"]]
        meta, run = raw.get("meta", {}), raw.get("run", {})
        return TrainResult(config, loss, raw["checkpoints"], raw["val"], meta, out, run)
    except (OSError, ValueError, KeyError, TypeError, SinklabError):
        return None


def _lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10 % of ``lr`` at step ``decay_end x steps``, held
    there to the end (``decay_end`` 1: the decay spans the whole run)."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    end = config.decay_end * config.steps
    frac = (step - config.warmup) / max(1.0, end - config.warmup)
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
    """The probe's own numbers (q0 = 0, eps 0.3/0.8): its ``sink_rate`` per threshold and its
    ``sink_mass`` ``(L, H)`` at key 0; ``first_token_sink_mass`` is their mean over (layer, head)
    (NaN-safe, in float64)."""
    result = probe(model, ids, config=ProbeConfig(q0=0, eps=EPS))
    return {
        "sink_rate": dict(result.sink_rate),
        "first_token_sink_mass": float(result.sink_mass.double().nanmean()),
        "sink_mass": result.sink_mass.tolist(),
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


def build_model(config: TrainConfig, vocab_size: int | None = None) -> LabForCausalLM:
    """A fresh lab decoder for ``config`` (``vocab_size``: the data's, else the config's)."""
    torch.manual_seed(config.seed)
    model_config = LabConfig(
        vocab_size=vocab_size or config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        max_position_embeddings=config.seq_len,
        attention_variant=config.variant,
    )
    return LabForCausalLM(model_config)


def _prepare(config: TrainConfig, data: Any) -> tuple[Any, int, Callable[[int], dict], dict]:
    """The task's data, vocabulary size, ``batch(step)`` and the held-out probe inputs."""
    if config.task == "backcopy":
        if not isinstance(data, BackcopyData) or data.config != config.backcopy_config():
            data = BackcopyData(config.backcopy_config())
        ids, copied = data.held_out(BACKCOPY_PROBE_SEQUENCES, config.seed)

        def batch(step: int) -> dict:
            return data.batch(step, config.batch_size, config.seed)

        probe_in = {"ids": ids, "copied": copied, "first": ids[0]}
        return data, data.table.vocab_size, batch, probe_in
    if not isinstance(data, LabData) or data.config != config.data_config():
        tokenizer = data.tokenizer if isinstance(data, LabData) else None
        data = LabData(config.data_config(), tokenizer=tokenizer)
    if len(data.tokenizer) > config.vocab_size:
        raise SinklabError(
            f"tokenizer has {len(data.tokenizer)} tokens > vocab {config.vocab_size}"
        )
    order = data.batch_order(config.steps, config.batch_size, config.seed)
    prefix, text = data.eval_windows(1)
    first = torch.cat([prefix, text[0]])  # (T,) the training format

    def text_batch(step: int) -> dict:
        return data.batch(order[step])

    return data, config.vocab_size, text_batch, {"first": first}


def train(
    config: TrainConfig,
    out: Path | None = None,
    *,
    data: LabData | BackcopyData | None = None,
    progress: Progress = quiet,
    ranks: Ranks | None = None,
) -> TrainResult:
    """Train, probe each checkpoint, evaluate; write outputs under ``out`` when given.

    ``data`` lets sweeps reuse one tokenizer (text) or bigram table (backcopy); it is rebuilt
    when it does not match ``config``. ``progress(step, steps, note)`` (the one
    :data:`~sinklab.progress.Progress`) is called after every step, the loss in the note
    (``loss 2.345``).
    ``ranks``: this process's place in a DDP run (:mod:`sinklab.lab.distributed`, the process
    group already initialised): it trains on its slice of each global batch; only rank 0
    probes, evaluates and writes (the other ranks return their loss curve only).

    Rank 0's result carries the one provenance block (:func:`sinklab.meta.attach_meta`: params
    the config, model the trained decoder's description, text the corpus the data was cut from);
    this function writes ``train.json`` itself (checkpoints are saved as it trains), so it is
    where the block is attached.
    """
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SinklabError("--device cuda but no CUDA device is visible; use --device cpu")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI shows its own progress
    t0 = time.perf_counter()
    data, vocab_size, get_batch, probe_in = _prepare(config, data)
    model = build_model(config, vocab_size).to(config.device)
    ranks = ranks or Ranks()
    lead, net = ranks.rank == 0, model
    if ranks.world > 1:
        check_nproc(ranks.world, config.batch_size)
        net = torch.nn.parallel.DistributedDataParallel(model)  # averages gradients over ranks
    opt = _optimizer(model, config)
    probe_ids = probe_in["first"].to(config.device)
    schedule = set(checkpoint_steps(config.steps, config.n_checkpoints))
    losses: list[tuple[int, float]] = []
    checkpoints: list[dict[str, Any]] = []
    step_seconds = 0.0

    def checkpoint(step: int) -> None:
        model.eval()
        row = {"step": step, **probe_summary(model, probe_ids)}
        if config.task == "backcopy":
            row["backcopy"] = backcopy_summary(
                model, probe_in["ids"], probe_in["copied"], data.table
            )
            if step >= tail_start(config.steps):  # the tail: what the comparison rule reads
                row["val"] = backcopy_validation(
                    model, data, config.eval_windows, config.seed, config.device
                )
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
        if step in schedule and lead:
            checkpoint(step)
        if step == config.steps:
            break
        tic = time.perf_counter()
        rows = ranks.rows(config.batch_size)
        batch = {k: v[rows].to(config.device) for k, v in get_batch(step).items()}
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, config)
        loss = net(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        if ranks.world > 1:  # the whole batch's loss: the mean over equal slices
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            value = total.item() / ranks.world
        step_seconds += time.perf_counter() - tic
        losses.append((step + 1, value))
        progress(step + 1, config.steps, f"loss {value:.3f}")
    model.eval()
    if not lead:
        return TrainResult(config, losses, [], {}, {}, None)
    if config.task == "backcopy":
        val = backcopy_validation(model, data, config.eval_windows, config.seed, config.device)
    else:
        val = validation(model, data, config.eval_windows, config.device)
    run = {
        **data_facts(config, data),
        "probe": {"q0": 0, "eps": list(EPS), "key": 0, "n_tokens": int(probe_ids.numel())},
        "processes": ranks.world,
        "torch_threads": torch.get_num_threads(),
        "step_seconds": round(step_seconds, 3),
    }
    result = TrainResult(config, losses, checkpoints, val, {}, out, run)
    final = checkpoints[-1].get("path")
    info = describe(
        model,
        f"lab:{config.task}/{config.variant}/{config.data}/seed-{config.seed}",
        final or "in memory (not saved)",
        file_sha256(out / final / "model.safetensors") if out is not None and final else None,
    )
    attach_meta(result, info, corpus_text(), config, time.perf_counter() - t0)
    if out is not None:
        write_outputs(result, out)
    return result


@functools.lru_cache(maxsize=1)
def corpus_text() -> Text:
    """The text every lab task is cut from (the embedded plays), for the provenance block."""
    return load_text(None)


def data_facts(config: TrainConfig, data: LabData | BackcopyData) -> dict[str, Any]:
    """What a run trained on: ``corpus``, ``n_train_tokens``, ``n_sequences`` (and backcopy's
    ``triggers``)."""
    if isinstance(data, BackcopyData):
        return {
            "corpus": "bigram-backcopy on the characters of the embedded plays",
            "n_train_tokens": config.steps * config.batch_size * config.seq_len,
            "n_sequences": config.steps * config.batch_size,
            "triggers": [data.table.token(t) for t in data.table.triggers],
        }
    scenes = "shakespeare scenes" if config.max_docs is None else f"first {config.max_docs} scenes"
    return {
        "corpus": scenes,
        "n_train_tokens": data.n_train_tokens,
        "n_sequences": int(data.ids.shape[0]),
    }


def write_outputs(result: TrainResult, out: Path) -> None:
    """``train.json``, ``loss.png`` and ``sinks.png`` under ``out``."""
    from sinklab.lab.plots import plot_loss, plot_sink_emergence

    c = result.config
    title = f"{c.task}: {c.variant} / {c.data}, seed {c.seed}"
    write_json_atomic(out / "train.json", result.to_json())
    plot_loss(result.loss, out / "loss.png", title=title)
    plot_sink_emergence(result.checkpoints, out / "sinks.png", title=title)
