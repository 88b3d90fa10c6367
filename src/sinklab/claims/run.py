"""One ``sinklab claims`` run as a library call (the pattern of :class:`sinklab.probe.run.ProbeRun`,
:class:`sinklab.stream.run.StreamRun` and :class:`sinklab.ablate.run.AblationRun`): the config,
checked before any model loads; the run; its parameters; and the command line that reproduces it,
each option spelled once (:data:`OPTIONS`). The command and the report's claims stage both wrap
it, so the report no longer re-lists the command's flags."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sinklab.claims.core import ClaimsConfig, ClaimsResult, claims_on
from sinklab.corpus import Text
from sinklab.models.loading import LoadedModel
from sinklab.parsing import as_option
from sinklab.progress import Progress, quiet

#: config field -> its ``sinklab claims`` option, in the order :meth:`ClaimsRun.argv` writes
#: them (a field left at None is left out; ``prepend`` only where the model options lack it)
OPTIONS = {
    "texts": "--texts",
    "windows": "--windows",
    "claims": "--claims",
    "probe_tokens": "--tokens",
    "stream_tokens": "--stream-tokens",
    "window": "--window",
    "n_sink": "--n-sink",
    "grid": "--grid",
    "probes": "--probes",
    "q0": "--q0",
    "eps": "--eps",
    "sensitivity_tokens": "--sensitivity-tokens",
    "cost_seeds": "--cost-seeds",
    "cost_lengths": "--cost-lengths",
    "cost_steps": "--cost-steps",
    "lab": "--lab",
    "lab_size": "--lab-size",
    "lab_steps": "--lab-steps",
    "seed": "--seed",
    "prepend": "--prepend",
}


@dataclass(frozen=True)
class ClaimsRun:
    """Every claim of docs/claims.md (or ``config.claims``) at ``config``'s sizes."""

    config: ClaimsConfig

    def params(self) -> dict[str, Any]:
        """The run's inputs: the config's fields."""
        return asdict(self.config)

    def options(self) -> dict[str, Any]:
        """The run's options by name (``--n-sink``: ``n_sink``), each value as the command line
        writes it (a tuple comma-separated) and left out where it is None: what :meth:`argv`
        writes and the report's section shows."""
        named = {option.removeprefix("--").replace("-", "_"): getattr(self.config, field)
                 for field, option in OPTIONS.items()}  # fmt: skip
        return {
            name: ",".join(map(str, v)) if isinstance(v, tuple) else v
            for name, v in named.items()
            if v is not None
        }

    def argv(self, model_args: list[str], out: str) -> list[str]:
        """The ``sinklab claims`` command line that runs exactly this (``model_args``:
        ``--model`` and the loading options, ``--prepend`` among them where given)."""
        cmd = ["sinklab", "claims", *model_args]
        for name, value in self.options().items():
            option = "--" + name.replace("_", "-")
            if option not in model_args:
                cmd += [option, as_option(value)]
        return [*cmd, "--out", out]

    def run(
        self,
        loaded: LoadedModel | None,
        progress: Progress = quiet,
        texts: list[Text] | None = None,
    ) -> ClaimsResult:
        """:func:`sinklab.claims.core.claims_on`: the table, with its provenance block."""
        return claims_on(loaded, self.config, progress, texts)
