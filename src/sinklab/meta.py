"""The ``meta`` block every result carries: model, text, parameters, versions, wall time."""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sinklab.corpus import Text


def versions() -> dict[str, str]:
    import numpy
    import torch
    import transformers

    import sinklab

    return {
        "sinklab": sinklab.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


META_KEYS = ("model", "text", "first_token", "params", "versions", "machine", "seconds")


def bare_meta(params: Any) -> dict[str, Any]:
    """The ``meta`` of a result nobody attached provenance to (a library call, in a notebook):
    every key of :data:`META_KEYS`, None but ``params`` (a dataclass config or a dict), so the
    figure and summary functions read a bare result as they read a command's."""
    meta: dict[str, Any] = dict.fromkeys(META_KEYS)
    meta["params"] = asdict(params) if is_dataclass(params) else dict(params)
    return meta


def attach_meta(
    result: Any,
    model: Any,  # sinklab.models.loading.ModelInfo, or None (the loader writes through meta)
    text: Text | Sequence[Text] | None,
    params: Any,
    seconds: float | None,
    first_token: dict[str, Any] | None = None,
) -> Any:
    """Give ``result`` (an object with a ``meta`` field, or a result's JSON dict) the one
    provenance block, with exactly :data:`META_KEYS` (None where one does not apply, e.g. the
    model of a synthetic fit; a list where a run reads several texts). ``params``: a dataclass
    config or a dict (a config's fields plus the run's own inputs, such as ``tokens``). Every
    command and the report call this; libraries return bare results. ``first_token``: what the
    run's sequences start with (:meth:`sinklab.corpus.FirstToken.record`; None for a run that
    reads no text through a tokenizer). Returns ``result``."""
    if is_dataclass(params):
        params = asdict(params)
    meta = {
        "model": None if model is None else model.to_json(),
        "text": _texts(text),
        "first_token": first_token,
        "params": None if params is None else dict(params),
        "versions": versions(),
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform()},
        "seconds": None if seconds is None else round(float(seconds), 3),
    }
    if isinstance(result, dict):
        result["meta"] = meta
    else:
        result.meta = meta
    return result


def _texts(text: Text | Sequence[Text] | None) -> Any:
    if text is None:
        return None
    if isinstance(text, Sequence):
        return [t.to_json() for t in text]
    return text.to_json()


NON_FINITE = "non_finite"  # beside non-finite numbers: relative JSON pointer -> "NaN", ...


def json_ready(data: Any, unknown: Callable[[Any], Any] | None = None) -> Any:
    """``data`` as strict JSON values (RFC 8259 has no NaN or infinity): every non-finite number
    becomes ``null``, and the table that holds it (the nearest one, for a number in a list) gets a
    :data:`NON_FINITE` entry beside it saying where (a JSON pointer relative to that table) and
    what it was, so nothing is lost and any parser reads the file (:func:`restore_non_finite`
    undoes it). A stage's JSON inside the report's ``results.json`` is therefore written exactly
    as its own command writes it. Arrays and tensors (``tolist``), dataclasses and paths are
    converted too; any other object goes through ``unknown`` (TypeError without one).

    Nothing is dropped silently. ``non_finite`` is reserved: a table's key of that name must
    hold such a table (json_ready's own output, written again: its entries are kept, merged with
    the new ones), else ValueError. A non-finite number with no table to hold its entry (``data``
    itself a number, or a list holding one outside any table) is a ValueError too: wrap ``data``
    in a dict."""
    ready, found = _strict(data, unknown)
    if found:
        where = ", ".join(sorted(found)[:3]) or "the value itself"
        raise ValueError(
            f"non-finite numbers at {where} of a top-level {type(data).__name__} have no table "
            f"to hold their {NON_FINITE!r} entry; wrap the value in a dict"
        )
    return ready


def _is_table(value: Any) -> bool:
    """Whether ``value`` is a :data:`NON_FINITE` table (pointer -> a name in ``_VALUES``)."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and (k == "" or k.startswith("/")) and v in _VALUES
        for k, v in value.items()
    )


def _strict(obj: Any, unknown: Any) -> tuple[Any, dict[str, str]]:
    """(the JSON value, the non-finite numbers it holds outside any nested table)."""
    if isinstance(obj, bool | int | str) or obj is None:
        return obj, {}
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj, {}
        return None, {"": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        out, found = {}, {}
        for k, v in obj.items():
            if k == NON_FINITE:
                if not _is_table(v):
                    raise ValueError(
                        f"the key {NON_FINITE!r} is reserved for the table of the non-finite "
                        f"numbers beside it (this one holds a {type(v).__name__} that is not "
                        "one); rename that key"
                    )
                continue  # an earlier json_ready's table: merged below
            out[k], inner = _strict(v, unknown)
            found.update({f"/{_pointer(k)}{w}": what for w, what in inner.items()})
        if NON_FINITE in obj:
            found = {**obj[NON_FINITE], **found}
        if found:
            out[NON_FINITE] = found
        return out, {}
    if isinstance(obj, list | tuple):
        items, found = [], {}
        for i, v in enumerate(obj):
            value, inner = _strict(v, unknown)
            items.append(value)
            found.update({f"/{i}{w}": what for w, what in inner.items()})
        return items, found
    if hasattr(obj, "tolist"):  # numpy and torch arrays and scalars
        return _strict(obj.tolist(), unknown)
    if is_dataclass(obj) and not isinstance(obj, type):
        return _strict(asdict(obj), unknown)
    if isinstance(obj, Path):
        return str(obj), {}
    if unknown is not None:
        return _strict(unknown(obj), None)
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def _pointer(key: Any) -> str:
    text = key if isinstance(key, str) else json.dumps(key)  # as JSON writes the key
    return text.replace("~", "~0").replace("/", "~1")


_VALUES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def restore_non_finite(data: Any) -> Any:
    """Undo :func:`json_ready` on what ``json.load`` read: the numbers each :data:`NON_FINITE`
    table names are NaN / infinities again and the tables are dropped. Returns ``data``."""
    if isinstance(data, list):
        for item in data:
            restore_non_finite(item)
        return data
    if not isinstance(data, dict):
        return data
    table = data.pop(NON_FINITE, None)
    for value in data.values():
        restore_non_finite(value)
    for where, what in table.items() if isinstance(table, dict) else ():
        parts = [p.replace("~1", "/").replace("~0", "~") for p in str(where).split("/")[1:]]
        node: Any = data
        try:
            for part in parts[:-1]:
                node = node[int(part)] if isinstance(node, list) else node[part]
            last = parts[-1]
            if isinstance(node, list):
                node[int(last)] = _VALUES[what]
            elif isinstance(node, dict) and last in node:
                node[last] = _VALUES[what]
        except (KeyError, IndexError, ValueError, TypeError):
            continue  # a table that does not fit the data: leave the nulls
    return data


def dumps_json(
    data: Any, indent: int | None = 1, unknown: Callable[[Any], Any] | None = None
) -> str:
    """The one JSON encoder of sinklab's outputs (files and ``--format json`` alike): strict JSON
    (:func:`json_ready`), never a bare ``NaN`` or ``Infinity`` that strict parsers reject."""
    return json.dumps(json_ready(data, unknown), indent=indent, allow_nan=False)


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write ``data`` as strict JSON (:func:`dumps_json`) via a temporary file and rename, so a
    crash never leaves half a file.

    The file follows the user's umask like any other (``mkstemp`` alone would make it 0600).
    """
    # serialised before any file exists: an unserialisable value writes none
    return write_text_atomic(path, dumps_json(data) + "\n")


def write_text_atomic(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` via a temporary file beside it and a rename: a crash
    or an error mid-write leaves the previous file (or none), never half a file. The file
    follows the user's umask like any other."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file beside it and a rename (the bytes form of
    :func:`write_text_atomic`: figures, caches)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
