"""The ``meta`` block every result carries: model, text, parameters, versions, wall time."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sinklab.corpus import Text
    from sinklab.models.loading import ModelInfo


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


META_KEYS = ("model", "text", "params", "versions", "machine", "seconds")


def attach_meta(
    result: Any,
    model: ModelInfo | None,
    text: Text | Sequence[Text] | None,
    params: Any,
    seconds: float | None,
) -> Any:
    """Give ``result`` (an object with a ``meta`` field, or a result's JSON dict) the one
    provenance block, with exactly :data:`META_KEYS` (None where one does not apply, e.g. the
    model of a synthetic fit; a list where a run reads several texts). ``params``: a dataclass
    config or a dict (a config's fields plus the run's own inputs, such as ``tokens``). Every
    command and the report call this; libraries return bare results. Returns ``result``."""
    if is_dataclass(params):
        params = asdict(params)
    meta = {
        "model": None if model is None else model.to_json(),
        "text": _texts(text),
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


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write JSON via a temporary file and rename, so a crash never leaves half a file.

    The file follows the user's umask like any other (``mkstemp`` alone would make it 0600).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, allow_nan=True, default=_default)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if is_dataclass(obj):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialize {type(obj).__name__}")
