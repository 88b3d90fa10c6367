"""Output folders that never lose a user's files and are never left half-written.

Every command that writes a folder goes through :func:`output_dir`: the results are written into a
temporary folder beside ``--out`` (same file system) and moved into place whole, so an interrupt or
an error leaves the previous output intact. ``--out`` may be absent, empty, or a previous output
*of the same command*, recognised by the marker file :data:`MARKER` that sinklab writes (never by a
common file name such as ``results.json``); anything else is refused by :func:`check_out` in one
line, before any work starts.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sinklab.errors import SinklabError

MARKER = ".sinklab-output.json"  # {"command": NAME}: a folder sinklab wrote and may replace


def marker_command(path: Path) -> str | None:
    """The command that wrote the folder ``path`` (from its marker), or None when it has none."""
    try:
        data = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    command = data.get("command") if isinstance(data, dict) else None
    return command if isinstance(command, str) else None


def check_out(out: Path, command: str) -> Path:
    """Resolve ``out`` and refuse it unless it is absent, empty or a previous ``command`` output."""
    out = Path(out).expanduser()
    try:
        out = out.resolve()
    except (OSError, RuntimeError) as err:
        raise SinklabError(f"--out {str(out)!r} cannot be resolved ({err})") from None
    if out.exists() and not out.is_dir():
        raise SinklabError(
            f"--out {str(out)!r} is a file; pass a folder (new, empty or a previous "
            f"'sinklab {command}' output)"
        )
    if out.is_dir() and any(out.iterdir()):
        found = marker_command(out)
        if found is None:
            raise SinklabError(
                f"--out {str(out)!r} holds files sinklab did not write (no {MARKER}); "
                "pass a new or empty folder so nothing of yours is replaced"
            )
        if found != command:
            raise SinklabError(
                f"--out {str(out)!r} holds a 'sinklab {found}' output, not 'sinklab {command}'; "
                "pass another folder"
            )
    parent = out.parent
    if parent.exists() and not parent.is_dir():
        raise SinklabError(f"--out {str(out)!r}: {str(parent)!r} is a file, not a folder")
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
