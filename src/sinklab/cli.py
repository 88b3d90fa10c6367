"""The ``sinklab`` command line. It parses, shows progress and writes files; logic lives below.

User mistakes (:class:`SinklabError`) print as one line and exit 2; set ``SINKLAB_DEBUG=1`` for
the traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import typer

from sinklab.errors import SinklabError

app = typer.Typer(
    name="sinklab",
    help=(
        "Make attention sinks in transformer LMs visible, measurable, exploitable and "
        "removable.\n\n"
        "Examples:\n\n"
        "  sinklab info                                  # the embedded SmolLM2 and corpus\n\n"
        "  sinklab probe --tokens 1024 --q0 16           # sink mass per layer and head\n\n"
        "  sinklab stream --policy all --tokens 4000     # streaming perplexity, sink vs window\n\n"
        "  sinklab ablate --experiment first-token       # drop / replace the first token\n\n"
        "  sinklab report --quick                        # everything, as one HTML page"
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """sinklab: attention sinks, measured."""


def _register_commands() -> None:
    from sinklab.commands import info

    # Each command module exposes register(app); keep one line per command here.
    for module in (info,):
        module.register(app)
    # --- command registrations below (one import + register per command) ---
    from sinklab.commands import cost, train

    cost.register(app)
    train.register(app)
    from sinklab.commands import report

    report.register(app)
    from sinklab.commands import probe as probe_command

    probe_command.register(app)
    from sinklab.commands import ablate

    ablate.register(app)
    from sinklab.commands import generate, stream

    generate.register(app)
    stream.register(app)


_register_commands()


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, turning user mistakes into one line and exit code 2."""
    debug = os.environ.get("SINKLAB_DEBUG", "") not in ("", "0")
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(message)s")
    if not debug:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        app(args=argv, prog_name="sinklab")  # standalone: usage errors exit 2 via SystemExit
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except SinklabError as exc:
        if debug:
            raise
        print(f"sinklab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sinklab: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"sinklab: internal error: {type(exc).__name__}: {msg} "
            "(set SINKLAB_DEBUG=1 for the traceback, and please report it)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
