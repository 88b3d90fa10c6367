"""The ``sinklab`` command line. It parses, shows progress and writes files; logic lives below.

User mistakes (:class:`SinklabError`) print as one line and exit 2; set ``SINKLAB_DEBUG=1`` for
the traceback.

This module imports only the standard library at the top: :func:`main` installs the SIGINT /
SIGTERM handlers first and only then imports typer, torch and transformers (seconds), so an
interrupt during start-up is one line and exit 130, never a traceback or a silent 143 (only the
interpreter's own start, some tens of milliseconds before any sinklab code runs, is left).
The typer application is built on first use (:func:`get_app`; ``sinklab.cli.app`` still works).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from sinklab.errors import SinklabError
from sinklab.offline import enforce_offline

# The command line's own settings (``import sinklab`` sets none): offline before any Hugging Face
# import, and figures drawn with Agg (no window, no display needed).
enforce_offline()
os.environ.setdefault("MPLBACKEND", "Agg")

_HELP = (
    "Make attention sinks in transformer LMs visible, measurable, exploitable and "
    "removable.\n\n"
    "Examples:\n\n"
    "  sinklab info                               # the embedded SmolLM2 and corpus\n"
    "  sinklab probe --tokens 1024 --q0 16        # sink mass per layer and head\n"
    "  sinklab stream --policy all --tokens 4000  # streaming perplexity per policy\n"
    "  sinklab ablate --experiment first-token    # drop / replace the first token\n"
    "  sinklab report --quick                     # everything, as one HTML page\n\n"
    "Every command: -h for its options."
)
_APP: Any = None
#: click's context settings for the whole application: ``-h`` is ``--help`` on every command.
CONTEXT = {"help_option_names": ["-h", "--help"]}


VERSION_FLAGS = ("--version", "-V")


def _version_line() -> str:
    import sinklab

    return f"sinklab {sinklab.__version__}"


def _print_version(value: bool) -> None:
    """``--version`` among other arguments: the version on stdout, then exit 0 (eager: before
    any command runs). Alone it never gets here: :func:`_main` answers it before the imports."""
    if value:
        import typer

        print(_version_line())
        raise typer.Exit()


def get_app() -> Any:
    """The typer application with every command registered (built once; imports torch)."""
    global _APP
    if _APP is None:
        import typer

        app = typer.Typer(
            name="sinklab",
            help=_HELP,
            no_args_is_help=True,
            pretty_exceptions_enable=False,
            add_completion=False,
            context_settings=CONTEXT,  # every command and subcommand inherits -h
        )

        @app.callback()
        def _root(
            version: bool = typer.Option(
                False,
                "--version",
                "-V",
                help="Print sinklab's version and exit.",
                is_eager=True,
                callback=_print_version,
            ),
        ) -> None:
            """sinklab: attention sinks, measured."""

        _register_commands(app)
        _APP = app
    return _APP


def __getattr__(name: str) -> Any:
    if name == "app":  # ``from sinklab.cli import app``
        return get_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_commands(app: Any) -> None:
    from sinklab.commands import (
        ablate,
        chat,
        claims,
        cost,
        generate,
        info,
        models,
        probe,
        report,
        serve,
        stream,
        train,
    )
    from sinklab.commands.helptext import apply_plain_help

    commands = (info, models, probe, stream, generate, chat, serve, ablate, report, cost, train)
    for module in (*commands, claims):
        module.register(app)
    apply_plain_help(app)  # docstrings -> what a terminal shows (no RST, no broken wraps)
    for command in app.registered_commands:
        command.callback = _guard_stdout(command.callback)


class _StdoutClosed(Exception):
    """The reader of stdout went away (``| head``): typer would exit 1 without a word."""


def _guard_stdout(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            raise _StdoutClosed from None

    return command


class _Interrupted(Exception):
    """Ctrl-C or SIGTERM reached :func:`main` (typer turns a bare KeyboardInterrupt into a silent
    exit 130, so the signal handlers record that it happened)."""


def _signals() -> tuple[list[int], dict[int, object]]:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt (so every output folder under construction
    is removed and ``--out`` stays as it was) and remember that one arrived."""
    caught: list[int] = []

    def handler(signum: int, frame: object) -> None:
        caught.append(signum)
        raise KeyboardInterrupt

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread: leave them be
            previous[sig] = signal.signal(sig, handler)
    return caught, previous


def _say(message: str) -> None:
    if sys.stderr is not None and _lead_rank():
        print(f"sinklab: {message}", file=sys.stderr)


def _lead_rank() -> bool:
    """Whether this process speaks: under torchrun (``torchrun -m sinklab train``) every rank
    meets the same mistake, and only rank 0 says it (``RANK`` unset or not a number: speak)."""
    rank = os.environ.get("RANK", "0").strip()
    return not rank.isdigit() or int(rank) == 0


def _silence_stdout() -> None:
    """After a broken pipe: point fd 1 at /dev/null so the exit-time flush raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _usage_line(exc: Any) -> str:
    """A usage error as one line: the message and where to read the options."""
    message = " ".join(exc.format_message().split())
    ctx = exc.ctx
    where = f"'{ctx.command_path} --help'" if ctx is not None else "'sinklab --help'"
    return f"{message} (see {where})"


def _run(argv: list[str] | None) -> int:
    app = get_app()  # the heavy imports: after the signal handlers, inside main's try
    import typer
    from typer._click.exceptions import NoArgsIsHelpError, UsageError  # typer's copy of click

    try:
        code = app(args=argv, prog_name="sinklab", standalone_mode=False)
    except NoArgsIsHelpError:
        return _run(["--help"])
    except UsageError as exc:
        raise SinklabError(_usage_line(exc)) from None
    except typer.Abort:  # EOF on a prompt
        raise KeyboardInterrupt from None
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, turning user mistakes into one line and exit code 2."""
    caught, previous = _signals()  # first: an interrupt during the imports below is one line
    try:
        return _main(argv, caught)
    except KeyboardInterrupt:  # between the handlers and _main's own try
        _say("interrupted; nothing was half-written (any --out folder is as it was)")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(argv: list[str] | None, caught: list[int]) -> int:
    debug = os.environ.get("SINKLAB_DEBUG", "") not in ("", "0")
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(message)s")
    if not debug:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        _say(
            "error: standard output is closed; sinklab prints its results there: "
            "redirect it to a file or /dev/null instead"
        )
        return 2
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 1 and args[0] in VERSION_FLAGS:
        print(_version_line())  # at once: no typer, torch or transformers to import
        return 0
    try:
        code = _run(argv)
        if code == 130 and caught:
            raise KeyboardInterrupt
        return code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except SinklabError as exc:
        if debug:
            raise
        _say(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        _say("interrupted; nothing was half-written (any --out folder is as it was)")
        return 130
    except (BrokenPipeError, _StdoutClosed):
        _silence_stdout()
        _say("error: standard output was closed before sinklab finished writing (e.g. by head)")
        return 2
    except Exception as exc:
        if debug:
            raise
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _say(
            f"internal error: {type(exc).__name__}: {msg} "
            "(set SINKLAB_DEBUG=1 for the traceback, and please report it)"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
