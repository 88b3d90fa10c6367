"""``sinklab probe``: every layer's and head's sink metrics, ``DIR/probe.json`` and figures."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from sinklab.commands.common import (
    FormatOpt,
    ModelOpt,
    OutDirOpt,
    OutputFormat,
    TextOpt,
    TrustOpt,
    emit_json,
    parse_int_list,
    progress,
    stderr,
)
from sinklab.errors import SinklabError

DEFAULT_TOKENS = 1024


def parse_eps(value: str) -> tuple[float, ...]:
    """'0.3,0.8' -> (0.3, 0.8); range checks happen in ProbeConfig."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    try:
        return tuple(float(p) for p in parts)
    except ValueError:
        raise SinklabError(
            f"--eps must be numbers in (0, 1), e.g. 0.3,0.8; got {value!r}"
        ) from None


def summary_lines(data: dict[str, Any], eps: float, top: int = 5) -> list[str]:
    """The text summary, computed from the numbers in ``data`` (probe.json's content)."""
    sm = data["sink_mass"]
    n_layers, n_heads = len(sm), len(sm[0])
    meta = data["meta"]
    params = meta["params"]
    q0 = params["q0"]
    rates = ", ".join(f"{v:.1%} at eps={k}" for k, v in data["sink_rate"].items())
    lines = [
        f"{(meta['model'] or {}).get('name', 'model')}: {params['tokens']} tokens, "
        f"{n_layers} layers x {n_heads} heads, q0={q0}",
        f"sink rate (heads with sink mass > eps): {rates}",
    ]
    ranked = sorted(
        ((v, li, h) for li, row in enumerate(sm) for h, v in enumerate(row) if v == v),
        reverse=True,
    )[:top]
    heads = ", ".join(f"L{li}H{h} {v:.2f}" for v, li, h in ranked)
    lines.append(f"top sink heads (layer, head, sink mass): {heads}")
    counts = [sum(v > eps for v in row) for row in sm]
    first = next((i for i, c in enumerate(counts) if c > 0), None)
    half = next((i for i, c in enumerate(counts) if 2 * c >= n_heads), None)
    if first is None:
        lines.append(f"no head puts more than {eps} of its attention on key 0")
    else:
        per_layer = " ".join(str(c) for c in counts)
        lines.append(
            f"sinks start at layer {first} (first layer with a head above eps={eps})"
            + (f"; half the heads or more from layer {half}" if half is not None else "")
            + f"; sink heads per layer: {per_layer}"
        )
    pos = ", ".join(f"{p['position']} ({p['mass']:.3f})" for p in data["sink_positions"])
    lines.append(f"sink positions (key: mean received attention): {pos or 'none'}")
    geo = data.get("geometry")
    for metric in ("first_token_cosine", "token_similarity") if geo else ():
        for site in geo["sites"]:  # per layer at each site (sinklab.geometry)
            vals = [e[metric][site] for e in geo["layers"]]
            shown = " ".join("-" if v is None else f"{v:.2f}" for v in vals)
            lines.append(f"{metric.replace('_', ' ')} per layer, {site.replace('_', ' ')}: {shown}")
    if "by_length" in data:
        trend = "; ".join(
            f"{e['tokens']}: rate {e['sink_rate'].get(f'{eps:g}', float('nan')):.1%}, "
            f"mass {e['mean_sink_mass']:.3f}"
            for e in data["by_length"]
        )
        lines.append(f"by length (eps={eps}): {trend}")
    return lines


def probe(
    model: ModelOpt = None,
    text: TextOpt = None,
    tokens: Annotated[
        int, typer.Option("--tokens", "-n", help="Tokens to probe.")
    ] = DEFAULT_TOKENS,
    lengths: Annotated[
        str | None,
        typer.Option("--lengths", help="Also probe these prefix lengths, e.g. 128,512,2048."),
    ] = None,
    q0: Annotated[int, typer.Option("--q0", help="First query counted in the means.")] = 0,
    eps: Annotated[str, typer.Option("--eps", help="Sink-head thresholds in (0, 1).")] = "0.3,0.8",
    prepend: Annotated[
        str | None,
        typer.Option("--prepend", help="Put this token first: 'bos', 'eos', an id or one token."),
    ] = None,
    out: OutDirOpt = Path("sinklab-probe"),
    fmt: FormatOpt = OutputFormat.text,
    no_figures: Annotated[bool, typer.Option("--no-figures", help="Write JSON only.")] = False,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Measure sink mass, diagonal / previous-token mass, entropy, value norms and hidden-state
    similarity for every layer and head, in one memory-bounded forward.

    Example: sinklab probe --tokens 1024 --q0 16 --lengths 128,512,2048 --out runs/probe
    """
    from sinklab.corpus import load_text, token_stream
    from sinklab.meta import attach_meta
    from sinklab.models import load_model
    from sinklab.outputs import check_out, write_results
    from sinklab.probe import ProbeConfig, check_lengths, probe_lengths
    from sinklab.probe import probe as run_probe
    from sinklab.seam import check_supported

    # cheap checks first, before the model loads
    config = ProbeConfig(q0=q0, eps=parse_eps(eps))
    if tokens < 2:
        raise SinklabError(f"--tokens must be at least 2, got {tokens}")
    if q0 >= tokens:
        raise SinklabError(f"--q0 {q0} leaves no query among --tokens {tokens}; use q0 < {tokens}")
    ns = parse_int_list(lengths, "--lengths")
    if ns is not None:
        ns = check_lengths(ns, 1 << 62, q0)
    need = max([tokens, *(ns or [])])
    out = check_out(out, "probe")
    txt = load_text(text)
    with stderr.status("loading model"):
        loaded = load_model(model, trust_remote_code=trust_remote_code)
    info = loaded.info
    if info.max_positions is not None and need > info.max_positions:
        raise SinklabError(
            f"{need} tokens exceed the {info.max_positions} positions {info.name} supports; "
            f"ask for at most {info.max_positions}"
        )
    ids = token_stream(txt, loaded.tokenizer, need, prepend=prepend)
    check_supported(loaded.model)  # before the progress bar: a clean one-line error

    start = time.perf_counter()
    n_runs = 1 + len(ns or [])
    with progress(enabled=fmt is OutputFormat.text) as bar:
        task = bar.add_task("probe", total=info.n_layers * n_runs, status="")

        def tick(done: int, total: int, base: int = 0, label: str = "") -> None:
            bar.update(task, completed=base + done, status=label)

        result = run_probe(
            loaded.model, ids[:tokens], config, lambda d, t: tick(d, t, 0, f"{tokens} tokens")
        )
        trend = None
        if ns:
            trend = probe_lengths(
                loaded.model,
                ids,
                ns,
                config,
                callback=lambda d, t: tick(d, t, info.n_layers, "lengths"),
                known=result,
            )
    data = result.to_json()
    if trend is not None:
        data["by_length"] = trend.to_json()
    params = {**asdict(config), "tokens": tokens, "lengths": ns, "prepend": prepend}
    attach_meta(data, info, txt, params, time.perf_counter() - start)
    written = write_results(
        out,
        "probe",
        {"probe.json": data},
        None if no_figures else lambda folder: _figures(data, folder, info.name, txt.name),
    )
    if fmt is OutputFormat.json:
        emit_json(data)
        return
    for line in summary_lines(data, config.eps[0]):
        typer.echo(line)
    typer.echo("wrote " + ", ".join(map(str, written)))


def _figures(data: dict[str, Any], out: Path, model: str, text: str) -> list[Path]:
    from sinklab.probe.plots import plot_layer_curves, plot_length_trend, plot_sink_heatmap

    meta = data["meta"]
    p = meta["params"]
    tag = f"{model} | {text} | {p['tokens']} tokens | q0={p['q0']} | seed: none"
    paths = [out / "sink_mass_heatmap.png", out / "layer_curves.png"]
    plot_sink_heatmap(data["sink_mass"], paths[0], f"sink mass per layer and head\n{tag}")
    curves = {
        "sink mass (mean over heads)": [
            sum(v for v in row if v == v) / max(1, len(row)) for row in data["sink_mass"]
        ],
        "first-token cosine": data["first_token_cosine"],
        "token similarity": data["token_similarity"],
    }
    for site in (data.get("geometry") or {}).get("sites", []):  # sinklab.geometry's three sites
        ys = [e["first_token_cosine"][site] for e in data["geometry"]["layers"]]
        if None not in ys:
            curves[f"first-token cosine, {site.replace('_', ' ')} (entering the layer)"] = ys
    plot_layer_curves(curves, paths[1], f"per layer\n{tag}")
    if "by_length" in data:
        paths.append(out / "length_trend.png")
        eps = ",".join(str(e) for e in p["eps"])
        plot_length_trend(
            data["by_length"], paths[2], f"sinks vs context length (eps={eps})\n{tag}"
        )
    return paths


def register(app: typer.Typer) -> None:
    app.command("probe")(probe)
