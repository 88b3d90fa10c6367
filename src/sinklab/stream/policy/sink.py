"""``sink``: StreamingLLM's cache, the first ``n_sink`` positions plus the ``window`` most
recent ones."""

from __future__ import annotations

from sinklab.stream.policy.base import CachePolicy


class Sink(CachePolicy):
    name = "sink"
