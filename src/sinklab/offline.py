"""Offline by construction: sinklab never downloads, so the Hugging Face libraries must not try.

:func:`enforce_offline` sets the Hub's and transformers' offline switches in the environment
(read when those libraries are imported) and, where they are already imported, in their module
state too. ``sinklab/__init__`` calls it before anything imports ``huggingface_hub`` or
``transformers``, and the model loader calls it again before every load: an id is then resolved
in the local cache only, with no DNS query, no user-agent probe and no telemetry.
"""

from __future__ import annotations

import os
import sys

_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
}


def enforce_offline() -> None:
    """Switch the Hugging Face libraries to offline mode (idempotent, cheap)."""
    os.environ.update(_ENV)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # imported before sinklab: its switches were read already
        constants.HF_HUB_OFFLINE = True
        constants.HF_HUB_DISABLE_TELEMETRY = True
        constants.HF_HUB_DISABLE_IMPLICIT_TOKEN = True
