"""Reading the files sinklab is given, bounded by construction.

Every file sinklab reads (a user's text, a lab run's JSON, a model's config and tokenizer files,
weights) goes through here first, so that no input can hang a command or eat the machine:

* it must be a **regular file**: a FIFO would block ``open`` forever, a character device such as
  ``/dev/zero`` would be read without end (the check follows links, so a link to ``/dev/zero`` is
  refused too);
* it is read with a **size limit stated per kind** (:data:`LIMITS`): one byte over is a refusal,
  never a partial read;
* JSON is parsed with a **nesting limit**: 100,000 ``[`` is a one-line refusal, not a
  ``RecursionError``.

Each failure is a :class:`~sinklab.errors.SinklabError` naming the file and what to do.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from sinklab.errors import SinklabError

MiB = 1 << 20

#: Largest file sinklab reads whole, per kind (bytes). A text of 256 MiB is ~60M tokens, far past
#: any run's ``--tokens``; the largest tokenizer among the zoo's models (Gemma 3's) is 33 MiB.
LIMITS: dict[str, int] = {
    "text": 256 * MiB,
    "lab JSON": 64 * MiB,
    "model config": 4 * MiB,
    "tokenizer": 128 * MiB,
    "output marker": 1 * MiB,
    "session": 64 * MiB,
    # A served session's cache in float32: (n_sink + window) x layers x 2 (keys, values) x KV
    # heads x head dim x 4 bytes; 4096 slots of a 32-layer model with 8 KV heads of 128 dims is
    # 1 GiB, so 4 GiB leaves room for larger windows while still bounding a hostile file.
    "session tensors": 4096 * MiB,
}

#: Deepest JSON nesting sinklab accepts: real configs and results nest fewer than 10 levels.
MAX_JSON_DEPTH = 64


def _kind_of(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def check_regular(path: Path | str, what: str) -> os.stat_result:
    """``path``'s stat when it is a regular file (links followed); else a one-line error.

    Called before anything opens the file: opening a FIFO blocks until a writer comes."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SinklabError(f"{what} {str(path)!r} does not exist") from None
    except OSError as err:
        raise SinklabError(f"cannot read {what} {str(path)!r}: {err.strerror or err}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SinklabError(
            f"{what} {str(path)!r} is {_kind_of(st.st_mode)}, not a regular file; "
            "pass a regular file"
        )
    return st


def read_bytes(path: Path | str, what: str, kind: str) -> bytes:
    """The bytes of the regular file ``path``, at most ``LIMITS[kind]`` of them.

    The file is opened non-blocking (a FIFO swapped in after the check cannot block either) and
    read to one byte past the limit, so a file that grows while it is read is refused too."""
    limit = LIMITS[kind]
    st = check_regular(path, what)
    if st.st_size > limit:
        raise SinklabError(
            f"{what} {str(path)!r} is {st.st_size / MiB:.1f} MiB, over sinklab's limit of "
            f"{limit // MiB} MiB for a {kind} file; pass a smaller file"
        )
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise SinklabError(f"cannot read {what} {str(path)!r}: {err.strerror or err}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the check and the open
            raise SinklabError(f"{what} {str(path)!r} is not a regular file; pass a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise SinklabError(f"cannot read {what} {str(path)!r}: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise SinklabError(
            f"{what} {str(path)!r} is over sinklab's limit of {limit // MiB} MiB for a {kind} "
            "file; pass a smaller file"
        )
    return data


def json_depth_ok(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether no bracket nests deeper than ``limit`` (strings skipped). Linear, no recursion."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def parse_json(text: str, what: str) -> Any:
    """``json.loads`` with the nesting limit and one-line errors (``what`` names the source).
    Python's ``NaN``/``Infinity`` are read as floats, as earlier sinklab versions wrote them."""
    if not json_depth_ok(text):
        raise SinklabError(
            f"{what} nests deeper than {MAX_JSON_DEPTH} levels, which no sinklab or model file "
            "does; pass the original file"
        )
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SinklabError(f"{what} is not valid JSON ({first}); pass a valid JSON file") from None


def read_json(path: Path | str, what: str, kind: str) -> Any:
    """A regular JSON file, bounded in size (``LIMITS[kind]``) and nesting."""
    data = read_bytes(path, what, kind)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SinklabError(
            f"{what} {str(path)!r} is not UTF-8 (bad byte at offset {exc.start}); "
            "pass a valid JSON file"
        ) from None
    return parse_json(text, f"{what} {str(path)!r}")
