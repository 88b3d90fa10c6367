"""The CLI's help and version: ``--version`` (fast, no heavy import), ``-h`` as ``--help`` on
every command and subcommand (the typer application walked, so a new command is covered), and
help texts rendered as plain text (no reStructuredText markup reaches the terminal)."""

from __future__ import annotations

import itertools
import re

import pytest

import sinklab
from helpers import run_main, run_process


def _command_paths() -> list[tuple[str, ...]]:
    """Every command path of the application, the root included: (), ("probe",), ("models",),
    ("models", "install"), ..."""
    import typer.main

    from sinklab.cli import get_app

    paths: list[tuple[str, ...]] = []

    def walk(command, path: tuple[str, ...]) -> None:
        paths.append(path)
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            walk(sub, (*path, name))

    walk(typer.main.get_command(get_app()), ())
    return paths


PATHS = _command_paths()


def test_every_command_is_walked():
    names = {p[0] for p in PATHS if p}
    assert {"probe", "stream", "ablate", "claims", "info", "models", "train", "cost"} <= names
    assert {"report", "generate", "chat", "serve"} <= names
    assert ("models", "install") in PATHS


def test_version_is_the_package_version():
    """``--version`` alone is answered before typer and torch import (a fresh process)."""
    proc = run_process("--version", timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == f"sinklab {sinklab.__version__}\n"


def test_version_among_other_arguments(capsys):
    """Through typer's eager option too (``-V`` as the short name)."""
    for args in (["-V"], ["--version", "info"]):
        run = run_main(capsys, *args)
        assert run.returncode == 0 and run.stdout == f"sinklab {sinklab.__version__}\n", run


def _help(capsys, path: tuple[str, ...], flag: str) -> str:
    run = run_main(capsys, *path, flag)
    assert run.returncode == 0 and run.stderr == "", (path, run)
    return run.stdout


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "sinklab")
def test_short_h_is_help(capsys, path):
    """``-h`` prints exactly what ``--help`` prints, on every command and subcommand."""
    long = _help(capsys, path, "--help")
    assert "Usage: sinklab" in long and re.search(r"(?<![-\w])-h\b", long)  # listed too
    assert _help(capsys, path, "-h") == long


# reStructuredText that must never reach a terminal: ``literals``, :role:`targets`, `default role`
RST = re.compile(r"``|:[a-z]+(?::[a-z]+)*:`|(?<![\w`])`[^`\n]+`")
WIDTH = 80
EXAMPLES = ("sinklab ", "torchrun ", "printf ")


def _description(help_text: str) -> list[list[str]]:
    """The rendered help's prose (between the usage line and the first box), as blocks of
    lines (stripped; blank lines separate blocks)."""
    lines = help_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("Usage:")) + 1
    end = next((i for i, ln in enumerate(lines) if ln.startswith("╭")), len(lines))
    blocks: list[list[str]] = [[]]
    for line in lines[start:end]:
        if line.strip():
            blocks[-1].append(line.strip())
        elif blocks[-1]:
            blocks.append([])
    return [b for b in blocks if b]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "sinklab")
def test_help_is_plain_text(capsys, monkeypatch, path):
    """No reStructuredText markup in any command's help, and each prose paragraph wrapped once,
    by the terminal: every line but a paragraph's last is full (its next word would not fit),
    so no short line is left where the docstring's source broke its lines."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    text = _help(capsys, path, "--help")
    assert not RST.search(text), RST.search(text)
    checked = 0
    for block in _description(text):
        if block[0].startswith(EXAMPLES):
            continue  # example commands: lines of their own
        checked += 1
        for line, after in itertools.pairwise(block):
            assert len(line) + 1 + len(after.split()[0]) > WIDTH - 2, (path, line, after)
    assert checked >= 1, (path, text)


def test_plain_help_unit():
    from sinklab.commands.helptext import plain_help

    doc = """First line of a
    summary.

    Uses :class:`~sinklab.stream.SinkCache` and :func:`sinklab.probe`; ``--method step`` is the
    reference and ``auto`` the default, `x` a default role.

    Examples:

      sinklab probe --tokens 8
      sinklab stream

    Example: sinklab info
    """
    assert plain_help(doc) == (
        "First line of a summary.\n\n"
        "Uses SinkCache and sinklab.probe; --method step is the reference and 'auto' the "
        "default, x a default role.\n\n"
        "Examples:\n\nsinklab probe --tokens 8\nsinklab stream\n\n"
        "Example:\n\nsinklab info"
    )
    assert plain_help(None) is None
    assert plain_help("One line.") == "One line."
