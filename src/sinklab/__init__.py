"""sinklab: make attention sinks in transformer language models visible, measurable,
exploitable and removable.

The notebook API, each name loaded on first use (importing ``sinklab`` itself has no side effect:
no Hugging Face library is imported, no switch is set, no plotting backend is chosen)::

    from sinklab import load_model, load_text, token_stream, probe
    loaded = load_model()                        # the embedded SmolLM2, offline
    ids = token_stream(load_text(), loaded.tokenizer, 512)
    result = probe(loaded.model, ids)
    result.figures()                             # matplotlib Figures
    result.to_frame()                            # pandas: layer, head, metric columns

The offline switches (:func:`sinklab.offline.enforce_offline`) are set where a model
loads, and by the command line before anything else.
"""

from __future__ import annotations

import importlib
from typing import Any

from sinklab.errors import SinklabError

__version__ = "0.1.0"

#: public name -> (module, attribute)
_LAZY = {
    "load_model": ("sinklab.models.loading", "load_model"),
    "load_text": ("sinklab.corpus", "load_text"),
    "token_stream": ("sinklab.corpus", "token_stream"),
    "probe": ("sinklab", "probe"),  # the package, callable (sinklab.probe.__init__)
    "ProbeConfig": ("sinklab.probe.core", "ProbeConfig"),
    "stream_perplexity": ("sinklab.stream.evaluate", "streaming_perplexity"),
    "StreamConfig": ("sinklab.stream.evaluate", "StreamConfig"),
    "SinkCache": ("sinklab.stream.cache", "SinkCache"),
    "CacheConfig": ("sinklab.stream.policy", "CacheConfig"),
    "mask_sink": ("sinklab.seam.interventions", "mask_sink"),
    "run_claims": ("sinklab.claims.core", "run_claims"),
    "ClaimsConfig": ("sinklab.claims.core", "ClaimsConfig"),
}
__all__ = ["SinklabError", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sinklab' has no attribute {name!r}")
    module, attr = _LAZY[name]
    if module == __name__:  # a subpackage of sinklab: importing binds it here
        return importlib.import_module(f"{__name__}.{attr}")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
