"""One output convention for every command that produces a result: the human-readable result on
stdout, progress and logs on stderr (progress hidden off a terminal, so a run's stderr is empty),
and ``--format json`` pure JSON on stdout. Each command runs once at tiny sizes per format, in
process through ``sinklab.cli.main``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import run_main
from test_cli_outputs import _args

RESULTS = ("probe", "stream", "ablate", "claims", "info", "train", "cost", "report", "models")


def _command(name: str, model: str, out: Path) -> list[str]:
    if name == "info":
        return ["info", "--model", model, "--text", "shakespeare:hamlet"]
    if name == "models":
        return ["models"]
    return _args(name, model, out)


# what each command's text result says on stdout (a word of its summary)
SAYS = {
    "probe": "wrote",
    "stream": "wrote",
    "ablate": "first-token",
    "claims": "first-token-sinks",
    "info": "n_layers",
    "train": "wrote",
    "cost": "wrote",
    "report": "index.html",
    "models": "smollm2-135m",
}


# the logs a command may write on stderr off a terminal: the report's notes on sizes fitted to
# the model and its stages as they finish (its progress); every other command: none
LOGS = {"report": re.compile(r"Sizes: .*|  [\w-]+: (ok|failed)\b.*")}
NONE = re.compile(r"(?!)")


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("name", RESULTS)
def test_result_on_stdout_logs_on_stderr(capsys, tmp_path, tiny_model_dir, name, fmt):
    args = _command(name, str(tiny_model_dir("llama")), tmp_path / "out")
    run = run_main(capsys, *args, "--format", fmt)
    assert run.returncode == 0, run.stderr
    logs = LOGS.get(name, NONE)
    other = [ln for ln in run.stderr.splitlines() if not logs.fullmatch(ln)]
    assert not other, run.stderr  # no result (and no bar: not a terminal) on stderr
    if fmt == "json":
        json.loads(run.stdout)  # the whole of stdout is one JSON document
        return
    assert SAYS[name] in run.stdout, run.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(run.stdout)
