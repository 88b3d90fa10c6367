"""One ``sinklab ablate`` run as a library call (the pattern of
:class:`sinklab.probe.run.ProbeRun` and :class:`sinklab.stream.run.StreamRun`): the experiment,
its config and input size, checked before any model loads; its ids, the run, its figures and
the command line that reproduces it. The command and the report's ablation stages both wrap it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from torch import Tensor

from sinklab.ablate.core import AblationConfig, AblationResult
from sinklab.ablate.inputs import experiment_ids
from sinklab.ablate.registry import check_experiment, get_experiment, run_experiment
from sinklab.corpus import FirstToken, Text
from sinklab.errors import SinklabError
from sinklab.parsing import as_option
from sinklab.progress import Progress, quiet

#: config field -> its ``sinklab ablate`` option, written by :meth:`AblationRun.argv` when it
#: differs from the default (q0 and seed always)
_OPTIONS = {
    "positions": "--positions",
    "layers": "--layers",
    "heads": "--heads",
    "protocol": "--protocol",
    "lams": "--lams",
    "temperatures": "--temperatures",
    "grid": "--grid",
    "probes": "--probes",
}


@dataclass(frozen=True)
class AblationRun:
    """Experiment ``experiment`` with ``config`` on ``tokens`` tokens (``texts`` texts where the
    experiment reads several, e.g. geometry)."""

    experiment: str
    config: AblationConfig
    tokens: int = 256
    texts: int = 1

    def __post_init__(self) -> None:
        check_experiment(self.experiment)
        self.config.check_tokens(self.tokens)
        if not 1 <= self.texts <= 64:
            raise SinklabError(f"--texts must be in 1..64, got {self.texts}")
        if not get_experiment(self.experiment).texts:  # reads one text: the count means nothing
            object.__setattr__(self, "texts", 1)

    @property
    def rows(self) -> int:
        """Texts the experiment reads (1 unless its record reads several)."""
        return self.texts

    def params(self) -> dict[str, Any]:
        """The run's inputs: the config's fields, the experiment and the input's size (what
        :meth:`AblationResult.params` records once the run has read them)."""
        return {**asdict(self.config), "experiment": self.experiment, "tokens": self.tokens,
                "texts": self.rows}  # fmt: skip

    def ids(
        self, text_spec: str | None, text: Text, tokenizer: Any, first: FirstToken | None = None
    ) -> Tensor:
        """The (B, T) token ids the run reads (:func:`sinklab.ablate.inputs.experiment_ids`),
        each row after ``first`` (by default the tokenizer's own start)."""
        return experiment_ids(text_spec, text, tokenizer, self.tokens, self.rows, first)

    def run(
        self, model: Any, tokenizer: Any, ids: Tensor, progress: Progress = quiet
    ) -> AblationResult:
        """The experiment on ``ids``; ``progress(done, total, note)`` over its conditions, the
        note naming the one just done. The result is bare (its ``meta`` is the caller's:
        :func:`sinklab.meta.attach_meta`)."""
        return run_experiment(self.experiment, model, tokenizer, ids, self.config, progress)

    def figures(self, result: AblationResult) -> dict[str, Any]:
        """The experiment's Figure, by name."""
        return result.figures()

    def argv(self, model_args: list[str], text: str, out: str) -> list[str]:
        """The ``sinklab ablate`` command line that runs exactly this: the options whose value
        is not the default, and always ``--tokens``, ``--q0`` and ``--seed``."""
        record, c = get_experiment(self.experiment), self.config
        defaults = {f.name: f.default for f in fields(AblationConfig)}
        cmd = ["sinklab", "ablate", "--experiment", self.experiment, *model_args]
        cmd += ["--text", text, "--tokens", str(self.tokens), "--q0", str(c.q0)]
        for name, option in _OPTIONS.items():
            value = getattr(c, name)
            if value != defaults[name] or (name == "grid" and self.experiment == "sensitivity"):
                cmd += [option, as_option(value)]
        if record.texts:
            cmd += ["--texts", str(self.texts)]
        if "eps" in record.options:
            cmd += ["--eps", as_option(c.eps)]
        return [*cmd, "--seed", str(c.seed), "--out", out]
