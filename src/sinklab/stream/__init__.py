"""Streaming: StreamingLLM's sink + window cache and everything that runs on it.

* :mod:`~sinklab.stream.policy`: what a cache keeps (pure eviction over positions);
* :mod:`~sinklab.stream.slots`: the per-row bookkeeping of one forward (no tensors);
* :mod:`~sinklab.stream.layer` and :mod:`~sinklab.stream.cache`: ``SinkCache`` on transformers'
  cache API (each layer's keys and values, RoPE re-rotation of kept sinks);
* :mod:`~sinklab.stream.evaluate`: streaming perplexity (the step loop) and ``StreamResult``;
* :mod:`~sinklab.stream.band`: the band evaluator (many queries per forward, same NLLs);
* :mod:`~sinklab.stream.oracle`: the recompute oracle;
* :mod:`~sinklab.stream.run`: ``StreamRun``, one ``sinklab stream`` run (params, run, figures,
  the command line), which the command and the report's stage both wrap;
* :mod:`~sinklab.stream.summary`: figures, collapse point and sentences of a stream result;
* :mod:`~sinklab.stream.generation` and :mod:`~sinklab.stream.chat`: bounded-memory decoding,
  one stream or many (``StreamBatch``), and multi-turn chat.

The public names are importable from here (``from sinklab.stream import SinkCache``), each loaded
on first use (a module ``__getattr__``), so importing the package costs nothing and its modules
may import one another without a cycle through it.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module of this package that defines it
_PUBLIC = {
    "CacheConfig": "policy",
    "CACHE_POLICIES": "policy",
    "kept_positions": "policy",
    "SinkCache": "cache",
    "SinkLayer": "layer",
    "METHODS": "evaluate",
    "POLICIES": "evaluate",
    "PolicyResult": "evaluate",
    "StreamConfig": "evaluate",
    "StreamResult": "evaluate",
    "streaming_perplexity": "evaluate",
    "StreamRun": "run",
    "GenerateConfig": "generation",
    "GenerateResult": "generation",
    "StreamBatch": "generation",
    "generate": "generation",
    "ChatConfig": "chat",
    "ChatSession": "chat",
    "chunked_refusal": "band",
    "recompute_nll": "oracle",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'sinklab.stream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"sinklab.stream.{_PUBLIC[name]}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
