"""Lab figures (made outside pyplot: :func:`sinklab.figures.subplots`). Each takes data and a
path, saves the PNG and the plotted numbers as JSON beside it (same stem, ``.json``), and
returns the PNG path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.ticker import NullFormatter

from sinklab import figures
from sinklab.probe.spec import rate_key


def plot_loss(loss: Sequence[tuple[int, float]], path: Path, *, title: str = "") -> Path:
    """Training loss (nats/token) against step."""
    fig, ax = figures.subplots(figsize=(6, 4))
    steps, values = [s for s, _ in loss], [v for _, v in loss]
    ax.plot(steps, values, lw=0.8)
    ax.set(xlabel="step", ylabel="training loss (nats / token)", title=f"loss: {title}")
    ax.grid(alpha=0.3)
    return figures.save(fig, path, dpi=120, numbers={"step": steps, "loss": values, "title": title})


def plot_sink_emergence(
    checkpoints: Sequence[dict[str, Any]], path: Path, *, title: str = ""
) -> Path:
    """Sink rate (at each eps the checkpoints hold) and mean first-token sink mass against step."""
    steps = [c["step"] for c in checkpoints]
    numbers: dict[str, Any] = {"step": steps, "title": title, "q0": 0}
    fig, ax = figures.subplots(figsize=(6, 4))
    x = [max(s, 0.5) for s in steps]  # log axis: step 0 drawn at 0.5
    for eps in checkpoints[0]["sink_rate"] if checkpoints else []:
        rate = [c["sink_rate"][eps] for c in checkpoints]
        numbers[rate_key(float(eps))] = rate
        ax.plot(x, rate, marker="o", label=f"sink rate (eps {eps})")
    mass = [c["first_token_sink_mass"] for c in checkpoints]
    numbers["first_token_sink_mass"] = mass
    ax.plot(x, mass, marker="s", ls="--", label="mean first-token sink mass")
    ax.set_xscale("log")
    ax.set(xlabel="training step (0 shown at 0.5)", ylabel="fraction", ylim=(-0.02, 1.02))
    ax.set_title(f"sink emergence: {title} (q0 = 0)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return figures.save(fig, path, dpi=120, numbers=numbers)


def plot_sweep(rows: Sequence[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Per run: sink rate (at each eps the rows hold), first-token mass, and the damage of
    removing BOS / the first token."""
    names = [r["name"] for r in rows]
    fig, (a1, a2) = figures.subplots(1, 2, figsize=(10, 4))
    x = range(len(rows))
    keys = (*(k for k in rows[0] if k.startswith("sink_rate@")), "first_token_sink_mass")
    for i, key in enumerate(keys):
        a1.bar([j + (i - 1) * 0.27 for j in x], [r[key] for r in rows], width=0.27, label=key)
    a1.set_xticks(list(x), names, rotation=20)
    a1.set(ylabel="fraction of heads / mean mass", title=f"sinks: {title}", ylim=(0, 1.05))
    a1.legend(fontsize=8)
    a2.bar(list(x), [100 * r["damage"] for r in rows], color="tab:red")
    a2.set_xticks(list(x), names, rotation=20)
    a2.set(ylabel="PPL increase without first token (%)", title="first-token / BOS removal damage")
    for ax in (a1, a2):
        ax.grid(alpha=0.3, axis="y")
    return figures.save(fig, path, dpi=120, numbers={"rows": list(rows), "title": title})


def plot_cost(
    rows: Sequence[dict[str, Any]], fits: dict[str, Any], path: Path, *, subtitle: str = ""
) -> Path:
    """Log-log norm of the fitted layer against T, per pattern, with the fitted power laws."""
    fig, axes = figures.subplots(1, 2, figsize=(10, 4))
    if subtitle:
        fig.suptitle(subtitle, fontsize=9)
    for ax, norm in zip(axes, ("fro", "nuc"), strict=True):
        for task in sorted({r["task"] for r in rows}):
            sub = [r for r in rows if r["task"] == task]
            t = [r["T"] for r in sub]
            y = [r[f"{norm}_total"] for r in sub]
            fit = fits[task][f"{norm}_total"]
            (dots,) = ax.loglog(t, y, "o", label=f"{task}: T^{fit['exponent']:.2f}")
            fitted = [fit["coef"] * tt ** fit["exponent"] for tt in t]
            ax.loglog(t, fitted, "--", lw=0.8, color=dots.get_color())
        name = "Frobenius" if norm == "fro" else "nuclear"
        lengths = sorted({r["T"] for r in rows})
        ax.set_xticks(lengths, labels=[str(t) for t in lengths])  # the measured T, no 4x10^1
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel="context length T (tokens)", ylabel=f"{name} norm ||W_QK|| + ||W_VO||")
        ax.set_title(f"cost of a pattern ({name})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
    return figures.save(fig, path, dpi=120, numbers={"rows": list(rows), "fits": fits})


def plot_emergence_curves(
    curves: dict[str, Sequence[dict[str, Any]]], path: Path, *, title: str = ""
) -> Path:
    """Backcopy sweep: per run (one line each), the chosen head's first-token mass at
    non-trigger queries, previous-token mass at trigger queries, and output norm ratio
    (non-trigger / trigger) against checkpoint step."""
    panels = (
        ("first_token_mass_nontrigger", "first-token mass, non-trigger queries"),
        ("prev_token_mass_trigger", "previous-token mass, trigger queries"),
        ("output_norm_ratio", "||o|| non-trigger / ||o|| trigger"),
    )
    fig, axes = figures.subplots(1, 3, figsize=(14, 4))
    numbers: dict[str, Any] = {"title": title, "runs": {}}
    for name, checkpoints in curves.items():
        steps = [c["step"] for c in checkpoints]
        bc = [c["backcopy"] for c in checkpoints]
        run = {
            "step": steps,
            "first_token_mass_nontrigger": [b["first_token_mass_nontrigger"] for b in bc],
            "prev_token_mass_trigger": [b["prev_token_mass_trigger"] for b in bc],
            "output_norm_ratio": [
                b["output_norm_nontrigger"] / max(b["output_norm_trigger"], 1e-12) for b in bc
            ],
        }
        numbers["runs"][name] = run
        x = [max(s, 0.5) for s in steps]  # log axis: step 0 drawn at 0.5
        for ax, (key, _) in zip(axes, panels, strict=True):
            ax.plot(x, run[key], marker="o", ms=3, label=name)
    for ax, (_, label) in zip(axes, panels, strict=True):
        ax.set_xscale("log")
        ax.set(xlabel="training step (0 shown at 0.5)", title=label)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="mass (head with the largest one)", ylim=(0, 1))
    axes[1].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"sink emergence: {title}", fontsize=10)
    return figures.save(fig, path, dpi=120, numbers=numbers)
