"""Help texts as plain text: the commands' docstrings are written for readers of the code
(reStructuredText literals and roles), and typer's rich help keeps every single line break of a
docstring, which the terminal then wraps again (a short line after each source line).

:func:`plain_help` turns one docstring into what a terminal should show, and
:func:`apply_plain_help` runs it over every command and group of the typer application once, when
the application is built, so a new command's help is plain without anyone remembering to ask.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

# :class:`X`, :func:`~pkg.mod.f`, :data:`NAME <pkg.NAME>`: the role's text (after ~, its last part)
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)*:`(~?)([^`<]+?)\s*(?:<[^`>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_DEFAULT_ROLE = re.compile(r"(?<![\w`])`([^`\n]+)`(?![\w`])")


def _literal(match: re.Match[str]) -> str:
    """````x```` as the help texts write values: an option or a command as it is typed
    (``--method step``), anything else in single quotes (``'auto'``)."""
    text = " ".join(match.group(1).split())
    return text if text.startswith(("-", "sinklab ")) else f"'{text}'"


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return target.rsplit(".", 1)[-1] if tilde else target


def _join_lines(paragraph: str) -> str:
    """One paragraph's prose lines joined by spaces (the terminal wraps them); an indented line
    (an example command, a list item) stays a line of its own, printed flush left: typer strips
    the indent of some paragraphs and not others (``inspect.cleandoc`` of all but the first), so
    none keeps one."""
    lines: list[str] = []
    kept = True  # the previous line stays whole
    for line in paragraph.splitlines():
        own = line[:1].isspace()
        if lines and line.strip() and not own and not kept:
            lines[-1] = f"{lines[-1]} {line.strip()}"
        else:
            lines.append(line.strip())
        kept = own
    return "\n".join(lines)


def plain_help(text: str | None) -> str | None:
    """``text`` (a docstring or help string) as plain text: reStructuredText roles and literals
    without their markup, each paragraph's prose on one line, indented lines kept as lines,
    paragraphs (blank lines) kept, an ``Example:`` command on its own line; None stays None
    (typer then has nothing to show)."""
    if text is None:
        return None
    text = inspect.cleandoc(text)
    text = _LITERAL.sub(_literal, text)
    text = _ROLE.sub(_role, text)
    text = _DEFAULT_ROLE.sub(r"\1", text)
    paragraphs = [_join_lines(p) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(_example(p) for p in paragraphs)


def _example(paragraph: str) -> str:
    """``Example: COMMAND`` with the command on a line of its own (it wraps less, and reads as
    something to type)."""
    head, sep, command = paragraph.partition(": ")
    if head in ("Example", "Examples") and sep and "\n" not in paragraph:
        return f"{head}:\n\n{command}"
    return paragraph


def apply_plain_help(app: Any) -> None:
    """Make the help text of ``app`` (a typer application), of every command registered on it
    and of every group added to it (recursively) plain text (:func:`plain_help`).

    A command's help is its ``help=`` or else its callback's docstring, a group's what typer
    resolves (``solve_typer_info_help``); either is replaced by its plain form, in place."""
    import typer.models
    from typer.main import solve_typer_info_help

    info = app.info
    if not isinstance(info.help, typer.models.DefaultPlaceholder):
        info.help = plain_help(info.help)
    for command in app.registered_commands:
        text = command.help if command.help is not None else inspect.getdoc(command.callback)
        command.help = plain_help(text)
    for group in app.registered_groups:
        group.help = plain_help(solve_typer_info_help(group))
        if group.typer_instance is not None:
            apply_plain_help(group.typer_instance)
