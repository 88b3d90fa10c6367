"""Every command that writes files writes through ``sinklab.outputs``: a bad ``--out`` is refused in
one line before any work, and an interrupt (SIGINT or SIGTERM) or an error leaves the previous
output byte-identical, with no temporary folder left beside it. In-process through
``sinklab.cli.main``; test_report.py covers the report's subprocess SIGINT."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

from helpers import one_line_error, run_main
from sinklab.meta import META_KEYS
from sinklab.outputs import MARKER, output_dir

WRITERS = ("probe", "stream", "ablate", "cost", "generate", "train", "report", "claims")


def _args(command: str, model: str, out: Path) -> list[str]:
    """A tiny, fast run of ``command`` writing to ``out``."""
    m = ["--model", model]
    return {
        "probe": ["probe", *m, "--tokens", "24", "--no-figures"],
        "stream": ["stream", *m, "--tokens", "16", "--policy", "sink", "--n-sink", "2",
                   "--window", "4"],
        "ablate": ["ablate", "-e", "first-token", *m, "--tokens", "16"],
        "cost": ["cost", "--lengths", "8,16", "--task", "sink", "--steps", "10",
                 "--bisections", "1"],
        "generate": ["generate", *m, "--prompt", "To be", "--max-new-tokens", "3",
                     "--window", "8"],
        "train": ["train", "--steps", "2", "--layers", "1", "--d-model", "16", "--heads", "2",
                  "--seq-len", "16", "--batch-size", "2", "--vocab-size", "300"],
        "report": ["report", *m, "--quick", "--stages", "probe", "--set", "probe_tokens=24"],
        "claims": ["claims", *m, "--claims", "first-token-sinks", "--tokens", "24"],
    }[command] + ["--out", str(out)]  # fmt: skip


def digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) -> sha256 of its bytes, plus its mode."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() + oct(p.stat().st_mode)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def no_work(monkeypatch):
    """Fail loudly if a command loads a model or starts its work (cost / train have no model)."""

    def refuse(*a, **k):
        raise AssertionError("work started before --out was checked")

    import sinklab.lab.cost
    import sinklab.lab.sweep
    import sinklab.lab.train
    import sinklab.models.loading

    for target, name in (
        (sinklab.models.loading, "load_model"),
        (sinklab.lab.cost, "run_cost"),
        (sinklab.lab.train, "train"),
        (sinklab.lab.sweep, "run_sweep"),
    ):
        monkeypatch.setattr(target, name, refuse)


def _user_folder(d: Path) -> None:
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    (d / "probe.json").write_text("{}")  # a common result name is not a marker


def _other_output(d: Path) -> None:
    with output_dir(d, "info-does-not-write") as tmp:
        (tmp / "x.json").write_text("{}")


def _file(d: Path) -> None:
    d.write_text("a file of mine")


BAD_OUTS = {
    "file": (_file, lambda d: d, "is a file"),
    "user-folder": (_user_folder, lambda d: d, "sinklab did not write"),
    "other-output": (_other_output, lambda d: d, "'sinklab info-does-not-write' output"),
    "under-a-file": (_file, lambda d: d / "sub", "is a file, not a folder"),
    "proc": (lambda d: None, lambda d: Path("/proc/sinklab-x"), "cannot write in"),
    "unknown-user": (lambda d: None, lambda d: Path("~nosuchuser-sinklab/x"), "cannot be used"),
    "too-long": (lambda d: None, lambda d: d / ("x" * 5000), "cannot be used"),
}


@pytest.mark.parametrize("case", list(BAD_OUTS))
@pytest.mark.parametrize("command", WRITERS)
def test_bad_out_is_refused_before_any_work(capsys, tmp_path, no_work, command, case):
    setup, where, needle = BAD_OUTS[case]
    target = tmp_path / "out"
    setup(target)
    before = digest(tmp_path)
    code, _, err = run_main(capsys, *_args(command, "/never/loaded", where(target)))
    one_line_error(code, err, needle)
    assert digest(tmp_path) == before
    assert not list(tmp_path.glob(".*"))  # no temporary folder left


def _sigterm(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not interrupt")


def _boom(*a, **k):
    raise RuntimeError("a figure broke")


# where each command is stopped part-way (after some of its files exist in the temporary folder)
SABOTAGE = {
    "probe": "sinklab.probe.plots.layer_curves_figure",
    "stream": "sinklab.stream.summary.plot_running_ppl",
    "ablate": "sinklab.ablate.core.AblationResult.figure",
    "cost": "sinklab.lab.plots.plot_cost",
    "generate": "sinklab.outputs._swap_into_place",
}


STOPS = [(_sigterm, 130, "interrupted"), (_boom, 1, "a figure broke")]


@pytest.mark.parametrize(("stop", "exit_code", "needle"), STOPS)
@pytest.mark.parametrize("command", list(SABOTAGE))
def test_interrupt_or_error_keeps_previous_output(
    capsys, tmp_path, tiny_model_dir, monkeypatch, command, stop, exit_code, needle
):
    out = tmp_path / "out"
    args = _args(command, str(tiny_model_dir("llama")), out)
    if command == "probe":
        args.remove("--no-figures")
    code, _, err = run_main(capsys, *args)
    assert code == 0, err
    assert json.loads((out / MARKER).read_text()) == {"command": command}
    meta = json.loads((out / f"{command}.json").read_text())["meta"]  # the one provenance block
    assert tuple(meta) == META_KEYS and meta["params"] and meta["seconds"] >= 0
    assert (meta["model"] is None) == (command == "cost")
    assert (meta["text"] is None) == (command in ("cost", "generate"))
    before = digest(out)
    monkeypatch.setattr(SABOTAGE[command], stop)
    code, _, err = run_main(capsys, *args)
    one_line_error(code, err, needle, exit_code)
    assert digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


def test_train_interrupt_keeps_previous_run(capsys, tmp_path, monkeypatch):
    """A previous train output survives a SIGTERM mid-run (the run is built beside it)."""
    import sinklab.lab.train

    out = tmp_path / "out"
    with output_dir(out, "train") as tmp:
        (tmp / "train.json").write_text('{"previous": true}')
    before = digest(out)

    def half_a_run(config, folder, **kw):
        (folder / "train.json").write_text("half")
        _sigterm()

    monkeypatch.setattr(sinklab.lab.train, "train", half_a_run)
    code, _, err = run_main(capsys, *_args("train", "", out))
    one_line_error(code, err, "interrupted", 130)
    assert digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_outputs_follow_the_umask(capsys, tmp_path, tiny_model_dir):
    old = os.umask(0o022)
    try:
        out = tmp_path / "out"
        code, _, err = run_main(capsys, *_args("probe", str(tiny_model_dir("llama")), out))
    finally:
        os.umask(old)
    assert code == 0, err
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [out, *out.iterdir()]}
    assert modes == {"out": "0o755", MARKER: "0o644", "probe.json": "0o644"}


# the file holding each command's result (train prints a summary of train.json instead)
RESULT_FILE = {
    "probe": "probe.json",
    "stream": "stream.json",
    "ablate": "ablate.json",
    "cost": "cost.json",
    "generate": "generate.json",
    "report": "results.json",
    "claims": "claims.json",
}


@pytest.mark.parametrize("command", WRITERS)
def test_format_json_prints_the_result_on_stdout(capsys, tmp_path, tiny_model_dir, command):
    """``--format json``: stdout is one JSON document, the result the command wrote (no text,
    no generated tokens, no paths printed around it), through the one encoder."""
    out = tmp_path / "out"
    code, stdout, err = run_main(
        capsys, *_args(command, str(tiny_model_dir("llama")), out), "--format", "json"
    )
    assert code == 0, err
    printed = json.loads(stdout)  # the whole of stdout: nothing before or after the JSON
    if command == "train":
        saved = json.loads((out / "train.json").read_text())
        assert printed == {"out": str(out), "val": saved["val"], "last": saved["checkpoints"][-1]}
        return
    saved = json.loads((out / RESULT_FILE[command]).read_text())
    if command == "report":  # and where the page is
        assert printed.pop("index") == str(out / "index.html")
    assert printed == saved and tuple(printed["meta"]) == META_KEYS
