"""Output folders that never lose a user's files and are never left half-written.

Every command that writes a folder goes through :func:`output_dir`: the results are written into a
temporary folder beside ``--out`` (same file system) and moved into place whole, so an interrupt or
an error leaves the previous output intact. ``--out`` may be absent, empty, or a previous output
*of the same command*, recognised by the marker file :data:`MARKER` that sinklab writes (never by a
common file name such as ``results.json``); anything else is refused by :func:`check_out` in one
line, before any work starts.

The new folder replaces the previous one in one step: an exchange (``renameat2`` with
``RENAME_EXCHANGE``, Linux 3.15+ on the usual file systems), so at every instant ``--out`` is
either the whole previous output or the whole new one, and the previous one is deleted only after
that. Where the exchange is not available, the previous output is first renamed to a stable name
(``.DIR.old``) and put back by the next run if the process died between the two renames.
Write-protected previous outputs (which could be renamed but never deleted) and ``--out`` folders
inside another output (which the next run there would delete) are refused before any work.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sinklab.errors import SinklabError
from sinklab.meta import write_json_atomic
from sinklab.safeio import read_json

log = logging.getLogger(__name__)

MARKER = ".sinklab-output.json"  # {"command": NAME}: a folder sinklab wrote and may replace


def _marker(path: Path) -> dict[str, Any] | None:
    """The marker of the folder ``path`` (a small JSON table), or None when it has none."""
    try:  # bounded: a regular file of a few bytes, no FIFO, device or giant
        data = read_json(path / MARKER, "output marker", "output marker")
    except SinklabError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("command"), str) else None


def marker_command(path: Path) -> str | None:
    """The command that wrote the folder ``path`` (from its marker), or None when it has none."""
    data = _marker(path)
    return None if data is None else data["command"]


def _write_marker(folder: Path, command: str, *, in_place: bool = False) -> None:
    data = {"command": command, **({"in_place": True} if in_place else {})}
    (folder / MARKER).write_text(json.dumps(data) + "\n", encoding="utf-8")


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
    _check_not_inside(out)
    if out.is_dir() and any(out.iterdir()):  # an empty folder goes with its parent's permission
        _check_removable(out)
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


def _check_not_inside(out: Path) -> None:
    """Refuse ``out`` inside a previous output (the next run there replaces it whole, and this
    one with it); a folder filled in place (a sweep) holds outputs of its own by design."""
    for parent in out.parents:
        data = _marker(parent)
        if data is not None and not data.get("in_place"):
            raise SinklabError(
                f"--out {_show(out)} is inside {_show(parent)}, a previous 'sinklab "
                f"{data['command']}' output that its next run replaces whole; pass a folder "
                "outside it"
            )


def _writable(path: Path) -> bool:
    effective = os.access in os.supports_effective_ids
    return os.access(path, os.W_OK | os.X_OK, effective_ids=effective)


def _check_removable(out: Path) -> None:
    """Refuse a previous output sinklab could move aside but never delete (a write-protected
    folder in it): the old copy would stay behind for good."""
    for folder in (out, *(p for p in out.rglob("*") if p.is_dir() and not p.is_symlink())):
        if not _writable(folder):
            where = "it" if folder == out else _show(folder)
            raise SinklabError(
                f"--out {_show(out)} is a previous output but {where} is write-protected, so "
                f"it could not be replaced; make it writable (chmod -R u+w {_show(out)}) or pass "
                "another folder"
            )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_builds(out: Path) -> list[Path]:
    """Clean up after runs that were killed hard (SIGKILL, power loss) and whose process is gone.

    A previous output moved aside (``.DIR.old``, or ``.DIR.old-PID`` of older versions) while
    ``out`` is missing is put back, since it is the only copy; temporary folders
    (``.DIR.tmp-PID-*``: a build, or after an exchange the previous output) and old copies beside
    a whole ``out`` are deleted. What cannot be deleted is named in one warning. Returns what was
    removed.
    """
    if not out.exists():
        _recover(out)
    removed = []
    for path in _leftovers(out):
        if _discard(path, LEFTOVER_KEPT):
            removed.append(path)
    return removed


def _dead(name: str, prefix: str) -> bool:
    pid = name.removeprefix(prefix).split("-")[0]
    return pid.isdigit() and not _alive(int(pid))


def _leftovers(out: Path) -> list[Path]:
    tmp, old = f".{out.name}.tmp-", f".{out.name}.old"
    found = []
    for path in sorted(out.parent.glob(f".{glob_escape(out.name)}.*")):
        if not path.is_dir() or path.is_symlink():
            continue
        build = path.name.startswith(tmp) and _dead(path.name, tmp)
        aside = path.name == old and out.exists() and _marker(path) is not None
        legacy = out.exists() and path.name.startswith(old + "-") and _dead(path.name, old + "-")
        if build or aside or (legacy and _marker(path) is not None):
            found.append(path)
    return found


def _recover(out: Path) -> None:
    """Put back a previous output left moved aside by a run killed mid-swap (``out`` missing)."""
    candidates = [out.parent / f".{out.name}.old"]
    candidates += sorted(out.parent.glob(f".{glob_escape(out.name)}.old-*"))
    for path in candidates:
        if path.is_dir() and not path.is_symlink() and _marker(path) is not None:
            if path.name != f".{out.name}.old" and not _dead(path.name, f".{out.name}.old-"):
                continue  # a live run is in the middle of its swap
            path.rename(out)
            log.warning(
                "sinklab: put back the previous output %s (an earlier run was stopped while "
                "replacing it)",
                _show(out),
            )
            return


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters made literal."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange_folders(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one step (``renameat2(RENAME_EXCHANGE)``); False where
    the system or the file system cannot (then nothing was changed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` folder to ``out``; the previous output is deleted last.

    By an exchange where the system has one (no instant without a whole ``out``), else by moving
    the previous output to ``.DIR.old`` first (which the next run puts back should this one die
    between the two renames).
    """
    if not out.exists():
        tmp.rename(out)
        return
    if exchange_folders(tmp, out):
        _discard(tmp)  # tmp now holds the previous output
        return
    old = out.parent / f".{out.name}.old"
    if old.exists() and _marker(old) is not None:
        shutil.rmtree(old)  # an earlier run's copy, beside a whole out
    if old.exists():  # not sinklab's: never touched; the next run recovers a PID-named copy
        old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if not out.exists():
            old.rename(out)  # put the previous output back
        raise
    _discard(old)


LEFTOVER_KEPT = (
    "sinklab: could not remove the leftover folder %s of an earlier run (no permission); "
    "delete it yourself"
)
REPLACED_KEPT = (
    "sinklab: the replaced output was left at %s (it could not be deleted); delete it yourself"
)


def _discard(path: Path, kept: str = REPLACED_KEPT) -> bool:
    """Delete a folder (a replaced output, by default); when it cannot be deleted, name it in
    one warning (``kept``, with the path for its %s). Whether it is gone."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        log.warning(kept, repr(str(path)))
        return False
    return True


@contextmanager
def output_dir(out: Path, command: str) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success mark it as ``command``'s and move it to ``out``.

    On any exception (Ctrl-C included) the temporary folder is removed and ``out`` is untouched;
    a full disk, a quota, a read-only file system or a file-size limit (the place failed the run,
    not sinklab) becomes a one-line :class:`SinklabError`. Every file and folder in it follows the
    user's umask (``mkdtemp`` and some writers, such as safetensors', would leave them 0700/0600).
    """
    out = check_out(out, command)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SinklabError(
            f"--out {_show(out)}: cannot create its parent ({err.strerror})"
        ) from None
    remove_stale_builds(out)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as err:
        raise SinklabError(f"--out {_show(out)}: cannot write there ({err.strerror})") from None
    try:
        yield tmp
        _write_marker(tmp, command)
        follow_umask(tmp)
        _swap_into_place(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = place_error(exc, out.parent)
        if reason is None:
            raise
        kept = "the previous output is as it was" if out.exists() else "nothing was written"
        raise SinklabError(f"--out {_show(out)}: cannot write there ({reason}); {kept}") from None


def follow_umask(root: Path) -> None:
    """Give ``root`` and everything under it at least the permissions the umask allows (files
    0666 & ~umask, folders 0777 & ~umask), as a plain ``open`` would have; links are left alone."""
    mask = current_umask()
    for path in (root, *root.rglob("*")):
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode):
            want = (st.st_mode | (0o777 & ~mask)) & 0o7777 & ~mask
        elif stat.S_ISREG(st.st_mode):
            want = (st.st_mode | (0o666 & ~mask)) & 0o7777 & ~mask
        else:
            continue
        if want != st.st_mode & 0o7777:
            os.chmod(path, want)


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


# errno values that mean "this place cannot take the files" (the user's disk, not a sinklab bug)
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}
_ACCESS_ERRORS = {errno.EACCES, errno.EPERM}


def place_error(exc: BaseException, folder: Path | None = None) -> str | None:
    """Why the place being written failed the run (``No space left on device``, ...), or None.

    Looks through the exception's causes and, for libraries that wrap the system's error in their
    own (safetensors), its message. A permission error counts only for a file under ``folder``.
    """
    if isinstance(exc, SinklabError):  # already said in sinklab's words
        return None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            if current.errno in _DISK_ERRORS:
                return os.strerror(current.errno)
            if current.errno in _ACCESS_ERRORS and _under(current.filename, folder):
                return os.strerror(current.errno)
        current = current.__cause__ or current.__context__
    text = str(exc)
    return next((os.strerror(e) for e in _DISK_ERRORS if os.strerror(e) in text), None)


def _under(name: Any, folder: Path | None) -> bool:
    if name is None or folder is None:
        return False
    return Path(os.fsdecode(name)).resolve().is_relative_to(folder.resolve())


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
    with output_dir(out, command) as tmp:
        for name, data in results.items():
            written.append(write_json_atomic(tmp / name, data))
        written += [Path(p) for p in (figures(tmp) if figures is not None else ())]
    final = Path(out).expanduser().resolve()
    return [final / p.relative_to(tmp) for p in written]


@contextmanager
def filled_in_place(out: Path, command: str) -> Iterator[Path]:
    """Create ``out`` (absent, empty or ``command``'s) as an output that is filled in place, and
    yield it.

    For outputs that must survive an interrupt part-done, such as a sweep whose finished runs are
    resumed: each part is written with :func:`output_dir` inside it. A run that fails before any
    part is in place leaves no folder holding only its marker; a full disk is one line, as in
    :func:`output_dir`.
    """
    out = check_out(out, command)
    existed = out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        _write_marker(out, command, in_place=True)
    except OSError as err:
        raise SinklabError(f"--out {_show(out)}: cannot write there ({err.strerror})") from None
    try:
        yield out
    except BaseException as exc:
        if not existed and [p.name for p in out.iterdir()] == [MARKER]:
            shutil.rmtree(out, ignore_errors=True)
        reason = place_error(exc, out)
        if reason is None:
            raise
        raise SinklabError(
            f"--out {_show(out)}: cannot write there ({reason}); the runs already in place are kept"
        ) from None
