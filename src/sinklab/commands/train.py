"""``sinklab train``: train a tiny lab decoder (or a sweep of them) and watch sinks emerge."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from sinklab.commands.common import (
    FormatOpt,
    OutputFormat,
    SeedOpt,
    emit,
    emit_json,
    given,
    progress,
)
from sinklab.errors import SinklabError
from sinklab.lab.limits import MAX_BATCH, MAX_SEQ_LEN, MAX_STEP_TOKENS, MAX_TRAIN_STEPS


class Sweep(StrEnum):
    variants = "variants"
    data = "data"
    length = "length"
    depth = "depth"


class Task(StrEnum):
    text = "text"
    backcopy = "backcopy"


def train(
    ctx: typer.Context,
    task: Annotated[
        Task,
        typer.Option(
            help="text: the plays (BPE); backcopy: the bigram-backcopy task (Guo et al. 2024), "
            "where a sink grows in about a minute."
        ),
    ] = Task.text,
    variant: Annotated[
        str, typer.Option(help="Attention: softmax, softmax1, sink, gated, sigmoid, relu.")
    ] = "softmax",
    data: Annotated[
        str,
        typer.Option(
            help="Data: bos, packed, packed-bos, doc-mask (text); bos, no-bos (backcopy)."
        ),
    ] = "bos",
    preset: Annotated[str, typer.Option(help="Defaults: cpu (minutes on 2 cores) or gpu.")] = "cpu",
    steps: Annotated[
        int | None, typer.Option(help=f"Optimizer steps (at most {MAX_TRAIN_STEPS}).")
    ] = None,
    layers: Annotated[int | None, typer.Option(help="Transformer blocks.")] = None,
    d_model: Annotated[int | None, typer.Option(help="Residual width.")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads.")] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(help=f"Training sequence length, 2..{MAX_SEQ_LEN} tokens."),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            help=f"Sequences per step, 1..{MAX_BATCH} (batch x length at most {MAX_STEP_TOKENS})."
        ),
    ] = None,
    vocab_size: Annotated[int | None, typer.Option(help="BPE vocabulary size.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda.")] = None,
    n_triggers: Annotated[
        int | None, typer.Option(help="backcopy: the N most frequent characters trigger a copy.")
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate, in (0, 1).")] = None,
    warmup: Annotated[int | None, typer.Option(help="Linear warm-up steps.")] = None,
    decay_end: Annotated[
        float | None,
        typer.Option(
            help="Fraction of the steps at which the cosine reaches 0.1 x lr, then holds "
            "(1: decays over the whole run)."
        ),
    ] = None,
    weight_decay: Annotated[
        float | None, typer.Option(help="AdamW weight decay of the matrices, in [0, 1).")
    ] = None,
    n_checkpoints: Annotated[
        int | None,
        typer.Option(help="Probed checkpoints, log-spaced (plus step 0 and 5 in the last 20 %)."),
    ] = None,
    seed: SeedOpt = 0,
    sweep: Annotated[
        Sweep | None,
        typer.Option(
            help="Train every variant, data strategy, length (T 64/128/256) or depth "
            "(1/2/4 layers) and compare."
        ),
    ] = None,
    nproc: Annotated[
        int,
        typer.Option(
            help="Processes (PyTorch DDP: gloo on CPU, nccl on CUDA), each taking an equal share "
            "of the batch; rank 0 writes. One run only."
        ),
    ] = 1,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder.")] = Path("lab-runs"),
    fmt: FormatOpt = OutputFormat.text,
) -> None:
    """Train a tiny decoder, probe sinks at each checkpoint, write train.json and figures.

    Examples:

      sinklab train --task backcopy
      sinklab train --task backcopy --sweep variants
      sinklab train --variant softmax1 --data packed --steps 600
      sinklab train --preset gpu --sweep data
      torchrun --nproc-per-node 2 -m sinklab train --task backcopy  # each process one rank
    """
    from sinklab.lab.distributed import train_distributed
    from sinklab.lab.presets import config_from_options
    from sinklab.lab.ranks import Ranks, check_nproc, process_group
    from sinklab.lab.summary import train_sentences
    from sinklab.lab.sweep import run_sweep
    from sinklab.lab.train import train as run_train
    from sinklab.outputs import check_out, filled_in_place, output_dir

    swept = {Sweep.variants: "variant", Sweep.data: "data"}.get(sweep)
    if swept is not None and given(ctx, swept):
        raise SinklabError(
            f"--{swept} has no effect with --sweep {sweep.value} (the sweep trains every "
            f"{swept}); drop one of them"
        )
    config = config_from_options(
        preset,
        task=task.value,
        variant=variant,
        data=data,
        seed=seed,
        steps=steps,
        layers=layers,
        d_model=d_model,
        heads=heads,
        seq_len=seq_len,
        batch_size=batch_size,
        vocab_size=vocab_size,
        device=device,
        n_triggers=n_triggers,
        lr=lr,
        warmup=warmup,
        decay_end=decay_end,
        weight_decay=weight_decay,
        n_checkpoints=n_checkpoints,
    )
    # under torchrun (or another env:// launcher) this process is one rank of one run
    ranks = Ranks.from_env() if Ranks.launched() else None
    if ranks is not None and (sweep is not None or nproc != 1):
        raise SinklabError(
            "under torchrun each process is one rank of one run (the launcher starts the "
            "processes); drop --sweep and --nproc"
        )
    check_nproc(nproc if ranks is None else ranks.world, config.batch_size)
    if nproc > 1 and sweep is not None:
        raise SinklabError("--nproc trains one run; drop --sweep or --nproc")
    # one run: built aside, replaces OUT whole when it finishes. Under torchrun every rank
    # checks: none waits for a doomed rank 0
    out = check_out(out, "train")
    if ranks is not None and ranks.rank != 0:  # a helper rank: trains its slices, writes nothing
        with process_group(ranks, config.device):
            run_train(config, ranks=ranks)
        return
    tokens = {"unit": "tok", "scale": config.batch_size * config.seq_len}  # per step
    with progress(fmt is OutputFormat.text) as bars:
        if sweep is not None:
            # a sweep fills OUT in place: each finished run (OUT/<value>, written whole) is kept
            # through an interrupt and reused by the next identical sweep; one bar per run
            with filled_in_place(out, "train") as folder:
                result = run_sweep(
                    sweep.value,
                    config,
                    folder,
                    progress_for=lambda name: bars.bar(name, config.steps, **tokens),
                )
            if fmt is OutputFormat.json:
                emit_json({"out": str(out), "rows": result.rows})
            else:
                emit(result.table(), f"wrote {out}/sweep.json, sweep.md, {result.figure_name}")
            return
        if nproc > 1:  # no per-step progress from the worker processes
            with output_dir(out, "train") as folder:
                run = train_distributed(config, folder, nproc)
        else:
            one = bars.bar(f"{config.variant}/{config.data}", config.steps, **tokens)
            with process_group(ranks or Ranks(), config.device), output_dir(out, "train") as folder:
                run = run_train(config, folder, progress=one, ranks=ranks)
    if fmt is OutputFormat.json:
        emit_json({"out": str(out), "val": run.val, "last": run.checkpoints[-1]})
        return
    emit(*train_sentences(run.to_json()), f"wrote {out}/train.json")


def register(app: typer.Typer) -> None:
    app.command("train")(train)
