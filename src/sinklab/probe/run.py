"""One ``sinklab probe`` run as a library call: the probe at ``tokens`` and, optionally, the same
text's length trend (:func:`~sinklab.probe.core.probe_lengths`), checked before any model loads
and returned as one JSON dict (``by_length`` beside the probe's own keys)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor, nn

from sinklab.corpus import check_token_spec
from sinklab.errors import SinklabError
from sinklab.models.arch import model_shape
from sinklab.probe.core import ProbeConfig, ProbeResult, check_lengths, probe, probe_lengths
from sinklab.progress import Progress, quiet


@dataclass(frozen=True)
class ProbeRun:
    """The probe at ``tokens`` tokens; with ``lengths``, also at each prefix length; with
    ``prepend``, that token first (a token spec of :func:`sinklab.corpus.check_token_spec`)."""

    config: ProbeConfig
    tokens: int = 1024
    lengths: tuple[int, ...] | None = None
    prepend: str | None = None

    def __post_init__(self) -> None:
        if self.tokens < 2:
            raise SinklabError(f"--tokens must be at least 2, got {self.tokens}")
        q0 = self.config.q0
        if q0 >= self.tokens:
            raise SinklabError(
                f"--q0 {q0} leaves no query among --tokens {self.tokens}; use q0 < {self.tokens}"
            )
        if self.lengths is not None:  # the upper bound is the model's positions (the caller's)
            lengths = tuple(check_lengths(self.lengths, max(self.lengths), q0))
            object.__setattr__(self, "lengths", lengths)
        if self.prepend is not None:
            check_token_spec(self.prepend)

    @property
    def need(self) -> int:
        """Tokens the run reads: the longest of ``tokens`` and ``lengths``."""
        return max((self.tokens, *(self.lengths or ())))

    @property
    def need_option(self) -> str:
        """The option that sets :attr:`need` (for a position-limit error)."""
        return "--tokens" if self.need == self.tokens else "--lengths"

    def params(self) -> dict[str, Any]:
        """``meta.params``: the config's fields and the run's own sizes."""
        lengths = None if self.lengths is None else list(self.lengths)
        sizes = {"tokens": self.tokens, "lengths": lengths, "prepend": self.prepend}
        return {**asdict(self.config), **sizes}

    def argv(self, model_args: list[str], text: str, out: str) -> list[str]:
        """The ``sinklab probe`` command line that runs exactly this (``model_args``: ``--model``
        and the loading options; ``text``: the ``--text`` spec)."""
        trend = ["--lengths", ",".join(map(str, self.lengths))] if self.lengths else []
        first = ["--prepend", self.prepend] if self.prepend is not None else []
        return [
            *("sinklab", "probe", *model_args, "--text", text),
            *("--tokens", str(self.tokens), *trend, "--q0", str(self.config.q0)),
            *("--eps", ",".join(map(str, self.config.eps)), *first, "--out", out),
        ]

    def run(
        self, model: nn.Module, ids: Tensor, progress: Progress = quiet
    ) -> tuple[ProbeResult, dict[str, Any]]:
        """Probe ``ids[:tokens]`` (``ids``: at least :attr:`need` tokens), then each length:
        the probe's result and its JSON, with ``by_length`` when lengths were asked.
        ``progress(done, total, note)`` (:data:`~sinklab.progress.Progress`) counts layers over
        every run, its note naming the run."""
        n_layers = model_shape(model)[0]
        total = n_layers * (1 + len(self.lengths or ()))  # layers over every run

        def say(done: float, label: str) -> None:
            progress(done, total, label)

        label = f"{self.tokens} tokens"
        result = probe(model, ids[: self.tokens], self.config, lambda d, _t, _n: say(d, label))
        data = result.to_json()
        if self.lengths:
            trend = probe_lengths(
                model,
                ids,
                self.lengths,
                self.config,
                progress=lambda d, _t, note: say(n_layers + d, f"lengths: {note}"),
                known=result,
            )
            data["by_length"] = trend.to_json()
        return result, data
