"""One ``sinklab stream`` run as a library call (the pattern of
:class:`sinklab.probe.run.ProbeRun`): its parameters, the run, its figures and the command line
that reproduces it. The command and the report's stream stage both wrap it, so the run is
orchestrated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from sinklab.progress import Progress, quiet
from sinklab.stream import summary
from sinklab.stream.evaluate import StreamConfig, StreamResult, streaming_perplexity


@dataclass(frozen=True)
class StreamRun:
    """Streaming perplexity of every policy of ``config`` on one token stream."""

    config: StreamConfig

    @property
    def tokens(self) -> int:
        """Tokens the run reads."""
        return self.config.n_tokens

    def params(self) -> dict[str, Any]:
        """``meta.params``: the config's fields."""
        return asdict(self.config)

    def run(
        self,
        model: Any,
        ids: Tensor,
        progress: Progress = quiet,
        *,
        each: Mapping[str, Progress] | None = None,
    ) -> StreamResult:
        """Every policy on ``ids`` (the first :attr:`tokens`), one after another. ``progress``
        (:data:`~sinklab.progress.Progress`) counts work over the whole run (a cached token 1,
        an oracle target its window's share: :meth:`StreamConfig.work`), the policy and its
        running perplexity as the note; ``each`` (policy -> Progress) counts each policy's
        targets on its own, the running perplexity as the note (``ppl 12.34``). The result is
        bare (its ``meta`` is the caller's: :func:`sinklab.meta.attach_meta` with
        :meth:`params`)."""
        c = self.config
        n = self.tokens - 1
        weights = {p: c.work(p) for p in c.policies}
        total = n * sum(weights.values())
        before = {p: n * sum(list(weights.values())[:i]) for i, p in enumerate(c.policies)}
        own = each or {}

        def progress_for(policy: str) -> Progress:
            def tick(done: float, of: float, note: str) -> None:
                whole = before[policy] + weights[policy] * done
                progress(whole, total, f"{policy} {done:.0f}/{of:.0f} {note}")
                own.get(policy, quiet)(done, of, note)

            return tick

        return streaming_perplexity(model, ids[: self.tokens], c, progress_for)

    def figures(self, data: dict[str, Any]) -> dict[str, Any]:
        """The running-perplexity and block-perplexity Figures of a result's JSON, by file stem."""
        return {
            summary.FIGURE: summary.running_ppl_figure(data),
            summary.BLOCK_FIGURE: summary.block_ppl_figure(data),
        }

    def write_figures(self, data: dict[str, Any], folder: Path) -> list[Path]:
        """The figures written into ``folder`` (``NAME.png`` + ``NAME.json`` each)."""
        return [summary.plot_running_ppl(data, folder), summary.plot_block_ppl(data, folder)]

    def argv(self, model_args: list[str], text: str, out: str) -> list[str]:
        """The ``sinklab stream`` command line that runs exactly this (``model_args``:
        ``--model`` and the loading options; ``text``: the ``--text`` spec)."""
        c = self.config
        return [
            *("sinklab", "stream", *model_args, "--text", text),
            *("--tokens", str(c.n_tokens), "--policy", ",".join(c.policies)),
            *("--n-sink", str(c.n_sink), "--window", str(c.window)),
            *("--recompute-every", str(c.recompute_every), "--segment", str(c.segment)),
            *("--method", c.method, "--out", out),
        ]
