"""The CLI's help and version: ``--version`` (fast, no heavy import), ``-h`` as ``--help`` on
every command and subcommand (the typer application walked, so a new command is covered), and
help texts rendered as plain text (no reStructuredText markup reaches the terminal)."""

from __future__ import annotations

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
