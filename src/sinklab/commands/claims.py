"""``sinklab claims``: every seed claim measured on a model (and the lab), one verdict each."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from sinklab.commands.common import (
    FormatOpt,
    ModelOpt,
    OutputFormat,
    SeedOpt,
    TrustOpt,
    emit_json,
    parse_int_list,
    progress,
    stderr,
)
from sinklab.errors import SinklabError

COMMAND = "claims"


def _names(value: str | None, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    parts = tuple(p.strip() for p in value.split(",") if p.strip())
    if not parts:
        raise SinklabError(f"{name} is empty; pass comma-separated names")
    return parts


def claims(
    model: ModelOpt = None,
    texts: Annotated[
        str | None,
        typer.Option(
            "--texts",
            help="Comma-separated texts, one sample each (e.g. shakespeare:hamlet,my.txt).",
            show_default="shakespeare:hamlet,shakespeare:macbeth,shakespeare:othello",
        ),
    ] = None,
    windows: Annotated[
        int, typer.Option(help="Consecutive windows per text (samples = texts x windows).")
    ] = 1,
    only: Annotated[
        str | None, typer.Option("--claims", help="Comma-separated claim ids (default all).")
    ] = None,
    lab: Annotated[
        Path | None, typer.Option(help="Folder of lab runs (train.json files) for lab claims.")
    ] = None,
    tokens: Annotated[int, typer.Option(help="Tokens for probe, geometry, density.")] = 256,
    stream_tokens: Annotated[int, typer.Option(help="Tokens streamed per text.")] = 320,
    window: Annotated[int, typer.Option(help="Streaming: recent tokens kept.")] = 60,
    n_sink: Annotated[int, typer.Option(help="Streaming: sink tokens kept.")] = 4,
    grid: Annotated[int, typer.Option(help="Sensitivity: grid x grid (t, i) positions.")] = 4,
    q0: Annotated[int, typer.Option(help="First query counted in sink mass.")] = 16,
    cost_lengths: Annotated[str, typer.Option(help="Cost claim: context lengths T.")] = "16,32,64",
    cost_seeds: Annotated[int, typer.Option(help="Cost claim: fitting seeds.")] = 3,
    cost_steps: Annotated[int, typer.Option(help="Cost claim: Adam steps per radius.")] = 300,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Folder for claims.json and the figure.")
    ] = None,
    fmt: FormatOpt = OutputFormat.text,
    seed: SeedOpt = 0,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Test every seed claim with the rule of docs/claims.md: effect, 95 % interval, verdict.

    Examples: sinklab claims; sinklab claims --texts shakespeare:lear,shakespeare:tempest,my.txt;
    sinklab claims --claims first-token-sinks,sink-cheaper --lab runs/ --out claims-out
    """
    from sinklab.claims.core import DEFAULT_TEXTS, ClaimsConfig, run_claims
    from sinklab.claims.measure_lab import LAB_CLAIMS
    from sinklab.corpus import load_text
    from sinklab.meta import attach_meta

    config = ClaimsConfig(
        texts=_names(texts, "--texts") or DEFAULT_TEXTS,
        windows=windows,
        claims=_names(only, "--claims"),
        probe_tokens=tokens,
        stream_tokens=stream_tokens,
        window=window,
        n_sink=n_sink,
        grid=grid,
        q0=q0,
        cost_lengths=tuple(parse_int_list(cost_lengths, "--cost-lengths") or ()),
        cost_seeds=cost_seeds,
        cost_steps=cost_steps,
        lab=str(lab) if lab is not None else None,
        seed=seed,
    )
    if lab is not None and not lab.is_dir():
        raise SinklabError(f"--lab {str(lab)!r} is not a folder; pass a folder of train runs")
    if out is not None:
        from sinklab.outputs import check_out

        out = check_out(out, COMMAND)  # refuse a folder of the user's before any work
    needs_model = any(c not in (*LAB_CLAIMS, "sink-cheaper") for c in config.wanted())
    texts_read = [load_text(t) for t in config.texts] if needs_model else []  # bad text: fail now
    loaded = None
    if needs_model:
        from sinklab.models import load_model

        with stderr.status("loading model"):
            loaded = load_model(model, trust_remote_code=trust_remote_code)
    start = time.perf_counter()
    with progress(fmt is OutputFormat.text) as bars:
        result = run_claims(
            loaded.model if loaded else None,
            loaded.tokenizer if loaded else None,
            config,
            max_positions=loaded.info.max_positions if loaded else None,
            callback=bars.callback("claims"),  # (done, total, label)
        )
    attach_meta(
        result,
        loaded.info if loaded else None,
        texts_read or None,
        config,
        time.perf_counter() - start,
    )
    data = result.to_json()
    if out is not None:
        from sinklab.claims.plots import plot_claims
        from sinklab.outputs import write_results

        name = loaded.info.name if loaded else "lab / cost only"

        def figure(folder: Path) -> list[Path]:
            path = folder / "claims_effects.png"
            plot_claims(data["claims"], path, title=f"Seed claims: {name}")
            return [path]

        write_results(out, COMMAND, {"claims.json": data}, figure)
    if fmt is OutputFormat.json:
        emit_json(data)
        return
    _print_table(data)
    if out is not None:
        stderr.print(f"wrote {out}/claims.json and claims_effects.png")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _print_table(data: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Seed claims (rule: docs/claims.md)", show_lines=False)
    table.add_column("claim", no_wrap=True, min_width=max(len(r["id"]) for r in data["claims"]))
    for col in ("site", "effect", "95% interval", "claimed", "n"):
        table.add_column(col)
    table.add_column("verdict", no_wrap=True)
    for r in data["claims"]:
        iv = r["interval"]
        table.add_row(
            r["id"],
            r["site"],
            _fmt(r["effect"]),
            "-" if iv is None else f"[{_fmt(iv[0])}, {_fmt(iv[1])}]",
            f"{'>' if r['direction'] == 'above' else '<'} {r['threshold']:.3g}",
            f"{r['n_valid']}/{r['n_samples']}",
            r["verdict"],
        )
    console = Console()
    console.print(table)
    for r in data["claims"]:
        if r["verdict"] == "inconclusive":
            console.print(f"{r['id']}: {r['reason']}")


def register(app: typer.Typer) -> None:
    app.command(COMMAND)(claims)
