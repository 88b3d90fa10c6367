"""The report's headline: the areas' own summary sentences, in reading order (sink rate, where
sinks start (depth, position, length), streaming, ablations), then the stages that failed.

The sentences live with their areas (:mod:`sinklab.probe.summary`, :mod:`sinklab.stream.summary`,
each ablation's ``finding``) and read their thresholds from each result's ``meta.params``; this
module only picks them from the stages that ran. A sentence that cannot be computed is left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from sinklab.probe.summary import (
    length_sentence,
    sink_depth_sentence,
    sink_positions_sentence,
    sink_rate_sentence,
)
from sinklab.report.stages import StageResult
from sinklab.stream.summary import stream_sentence

log = logging.getLogger(__name__)


def _sentence_or_none(fn: Callable[[Any], str | None], data: Any) -> str | None:
    try:
        return fn(data)
    except Exception as exc:  # a summary sentence never breaks the report
        log.debug("summary: %s skipped (%s: %s)", fn.__name__, type(exc).__name__, exc)
        return None


def headline(results: Sequence[StageResult]) -> list[str]:
    """The summary sentences, from whatever stages succeeded."""
    ok = {r.name: r.output.json for r in results if r.status == "ok" and r.output is not None}
    sentences: list[str | None] = []
    if "probe" in ok:
        for fn in (sink_rate_sentence, sink_depth_sentence, sink_positions_sentence):
            sentences.append(_sentence_or_none(fn, ok["probe"]))
    if "probe-lengths" in ok:
        sentences.append(_sentence_or_none(length_sentence, ok["probe-lengths"]))
    if "stream" in ok:
        sentences.append(_sentence_or_none(stream_sentence, ok["stream"]))
    from sinklab.ablate.registry import RECORDS  # each experiment's own summary sentence

    for rec in RECORDS:
        if rec.name in ok:
            sentences.append(_sentence_or_none(rec.summary, ok[rec.name]))
    failed = [r.name for r in results if r.status != "ok"]
    if failed:
        sentences.append(
            f"Failed: {len(failed)} stage(s) did not run and show their error: {', '.join(failed)}."
        )
    return [s for s in sentences if s]
