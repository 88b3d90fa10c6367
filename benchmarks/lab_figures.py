"""The trajectories behind each lab verdict: one small figure per lab comparison of a
``sinklab claims`` result (docs/lab.md#claims-quick).

Usage: python benchmarks/lab_figures.py CLAIMS_JSON [--out docs/figures] [--extra DIR ...]

For each lab row of ``CLAIMS_JSON`` (``sinklab claims --out DIR`` writes ``DIR/claims.json``)
the figure draws every compared run's first-token mass at non-trigger queries against the step
(one colour per arm, one line style per seed; the hard switch also draws the previous-token mass
at trigger queries), titled with the row's verdict, effect and interval. ``--extra`` adds runs
trained outside the plan (``sinklab train --out DIR`` folders) to the softmax1 figure, dashed
grey, labelled by their folder. Prints one JSON line per figure: the path and what it plots.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LAB = ("softmax1-no-sink", "hard-switch-sink", "sinks-grow-length", "bos-reliance")
STYLES = ("-", "--", ":", "-.", (0, (1, 1)), (0, (3, 1, 1, 1)))


def _arm(label: str) -> str:
    """``seed 0 softmax/bos T32x128`` -> ``softmax/bos T32``."""
    _, _, rest = label.split(" ", 2)
    return rest.rsplit("x", 1)[0]


def _runs(row: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """label -> trajectory, each compared run once."""
    out: dict[str, list[dict[str, Any]]] = {}
    for s in row["samples"]:
        for label, run in (s.get("runs") or {}).items():
            out.setdefault(label, run["trajectory"])
    return out


def _extra(folder: Path) -> tuple[str, list[dict[str, Any]]]:
    raw = json.loads((folder / "train.json").read_text())
    traj = []
    for c in raw["checkpoints"]:
        bc = c.get("backcopy") or {}
        traj.append({"step": c["step"], "m": bc.get("first_token_mass_nontrigger")})
    return folder.name, traj


def figure(row: dict[str, Any], out: Path, extra: list[Path]) -> dict[str, Any]:
    runs = _runs(row)
    arms = sorted({_arm(k) for k in runs})
    colours = {a: f"C{i}" for i, a in enumerate(arms)}
    fig, ax = plt.subplots(figsize=(5.2, 3.2), dpi=90)
    plotted: dict[str, Any] = {}
    for label, traj in sorted(runs.items()):
        seed = int(label.split()[1])
        steps = [max(1, p["step"]) for p in traj]
        m = [p["m"] for p in traj]
        ax.plot(steps, m, color=colours[_arm(label)], ls=STYLES[seed % len(STYLES)], lw=1.2)
        plotted[label] = {"step": steps, "m": m}
        if row["id"] == "hard-switch-sink":
            prev = [p["prev_mass"] for p in traj]
            ax.plot(steps, prev, color="0.6", ls=STYLES[seed % len(STYLES)], lw=0.8)
            plotted[label]["prev_mass"] = prev
    if row["id"] == "softmax1-no-sink":
        for folder in extra:
            name, traj = _extra(folder)
            steps = [max(1, p["step"]) for p in traj]
            ax.plot(steps, [p["m"] for p in traj], color="0.5", ls="--", lw=0.8)
            ax.annotate(name, (steps[-1], traj[-1]["m"]), fontsize=5, color="0.4")
            plotted[name] = {"step": steps, "m": [p["m"] for p in traj]}
    handles = [plt.Line2D([], [], color=colours[a], label=a) for a in arms]
    if row["id"] == "hard-switch-sink":
        handles.append(plt.Line2D([], [], color="0.6", label="prev-token mass, trigger"))
    ax.legend(handles=handles, fontsize=6, loc="center right")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step (line style = seed)", fontsize=7)
    ax.set_ylabel("first-token mass, non-trigger", fontsize=7)
    ax.tick_params(labelsize=6)
    iv = row["interval"]
    span = f"[{iv[0]:.3g}, {iv[1]:.3g}]" if iv else "-"
    verdict = row.get("verdict_stated") or row["verdict"]
    effect = "-" if row["effect"] is None else f"{row['effect']:.3g}"
    ax.set_title(f"{row['id']}: {verdict}\neffect {effect}, 95 % {span}", fontsize=7)
    fig.tight_layout()
    path = out / f"lab-{row['id']}.png"
    fig.savefig(path)
    plt.close(fig)
    return {"figure": str(path), "runs": len(plotted), "verdict": verdict, "interval": iv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("claims_json", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/figures"))
    ap.add_argument("--extra", type=Path, nargs="*", default=[])
    args = ap.parse_args()
    rows = json.loads(args.claims_json.read_text())["claims"]
    args.out.mkdir(parents=True, exist_ok=True)
    for row in rows:
        if row["id"] in LAB and row["samples"]:
            print(json.dumps(figure(row, args.out, args.extra)))


if __name__ == "__main__":
    main()
