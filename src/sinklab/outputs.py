"""Output folders that never lose a user's files and are never left half-written.

Every command that writes a folder goes through :func:`output_dir`: the results are written into a
temporary folder beside ``--out`` (same file system) and moved into place whole, so an interrupt or
an error leaves the previous output intact. ``--out`` may be absent, empty, or a previous output
*of the same command*, recognised by the marker file :data:`MARKER` that sinklab writes (never by a
common file name such as ``results.json``); anything else is refused by :func:`check_out` in one
line, before any work starts.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sinklab.errors import SinklabError
from sinklab.meta import write_json_atomic
from sinklab.safeio import read_json

MARKER = ".sinklab-output.json"  # {"command": NAME}: a folder sinklab wrote and may replace


def marker_command(path: Path) -> str | None:
    """The command that wrote the folder ``path`` (from its marker), or None when it has none."""
    try:
        data = read_json(path / MARKER, "output marker", "output marker")
    except SinklabError:
        return None
    command = data.get("command") if isinstance(data, dict) else None
    return command if isinstance(command, str) else None


def check_out(out: Path, command: str) -> Path:
    """Resolve ``out`` and refuse it unless it is absent, empty or a previous ``command`` output
    in a place sinklab can write to (so a bad ``--out`` fails before any work starts)."""
    try:
        return _check_out(Path(out), command)
    except (OSError, RuntimeError) as err:  # a name too long, ~nosuchuser, a loop of links
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise SinklabError(f"--out {_show(out)}: cannot be used ({reason})") from None


def _show(out: Path | str) -> str:
    text = str(out)
    return repr(text if len(text) <= 80 else text[:60] + "..." + text[-12:])


def _check_out(out: Path, command: str) -> Path:
    out = out.expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise SinklabError(
            f"--out {_show(out)} is a file; pass a folder (new, empty or a previous "
            f"'sinklab {command}' output)"
        )
    if out.is_dir() and any(out.iterdir()):
        found = marker_command(out)
        if found is None:
            raise SinklabError(
                f"--out {_show(out)} holds files sinklab did not write (no {MARKER}); "
                "pass a new or empty folder so nothing of yours is replaced"
            )
        if found != command:
            raise SinklabError(
                f"--out {_show(out)} holds a 'sinklab {found}' output, not 'sinklab {command}'; "
                "pass another folder"
            )
    base = out.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise SinklabError(f"--out {_show(out)}: {_show(base)} is a file, not a folder")
    try:  # the results are built beside --out: can sinklab create a folder there?
        os.rmdir(tempfile.mkdtemp(prefix=".sinklab-probe-", dir=base))
    except OSError as err:
        raise SinklabError(
            f"--out {_show(out)}: cannot write in {_show(base)} ({err.strerror}); "
            "pass a folder you can write to"
        ) from None
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_builds(out: Path) -> list[Path]:
    """Delete ``.DIR.tmp-PID-*`` / ``.DIR.old-PID`` folders left by runs that were killed hard
    (SIGKILL, power loss) and whose process is gone; returns what was removed."""
    removed = []
    for prefix in (f".{out.name}.tmp-", f".{out.name}.old-"):
        for path in out.parent.glob(prefix + "*"):
            pid = path.name.removeprefix(prefix).split("-")[0]
            if path.is_dir() and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` folder to ``out``, deleting the previous output last."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None and not out.exists():
            old.rename(out)  # put the previous output back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def output_dir(out: Path, command: str) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success mark it as ``command``'s and move it to ``out``.

    On any exception (Ctrl-C included) the temporary folder is removed and ``out`` is untouched.
    The folder follows the user's umask (``mkdtemp`` would make it 0700).
    """
    out = check_out(out, command)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SinklabError(
            f"--out {str(out)!r}: cannot create its parent ({err.strerror})"
        ) from None
    remove_stale_builds(out)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as err:
        raise SinklabError(f"--out {str(out)!r}: cannot write there ({err.strerror})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        (tmp / MARKER).write_text(json.dumps({"command": command}) + "\n", encoding="utf-8")
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# errno values that mean "this place cannot take the files" (a user's disk, not a sinklab bug)
_PLACE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def write_results(
    out: Path,
    command: str,
    results: Mapping[str, Any],
    figures: Callable[[Path], Iterable[Path]] | None = None,
) -> list[Path]:
    """The one writer of a command's results and figures: every ``NAME.json`` in ``results`` and
    the figures ``figures(folder)`` draws go into a temporary folder that replaces ``out`` whole.

    A figure that cannot be drawn fails the whole output (``out`` stays as it was). Returns the
    paths written, as they are under ``out``.
    """
    written: list[Path] = []
    try:
        with output_dir(out, command) as tmp:
            for name, data in results.items():
                written.append(write_json_atomic(tmp / name, data))
            written += [Path(p) for p in (figures(tmp) if figures is not None else ())]
    except OSError as err:
        if err.errno not in _PLACE_ERRORS:
            raise
        raise SinklabError(f"--out {str(out)!r}: cannot write there ({err.strerror})") from None
    final = Path(out).expanduser().resolve()
    return [final / p.relative_to(tmp) for p in written]


def mark_in_place(out: Path, command: str) -> Path:
    """Create ``out`` (absent, empty or ``command``'s) as an output that is filled in place.

    For outputs that must survive an interrupt part-done, such as a sweep whose finished runs are
    resumed: each part is written with :func:`output_dir` inside it.
    """
    out = check_out(out, command)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text(json.dumps({"command": command}) + "\n", encoding="utf-8")
    except OSError as err:
        raise SinklabError(f"--out {str(out)!r}: cannot write there ({err.strerror})") from None
    return out
