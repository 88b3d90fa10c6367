"""The one progress protocol: ``progress(done, total, note)``.

Every long library run (:class:`~sinklab.probe.run.ProbeRun`,
:class:`~sinklab.stream.run.StreamRun`, the report's stages) reports through a callable of this
shape: ``done`` out of ``total`` units of its work (layers, tokens, weighted tokens), and a short
``note`` saying what it is doing. The CLI's bars (``commands.common.Bars.bar``) and the
report's overall bar are both such callables, so a run never knows who is watching. The loops
below the runs (the probe, the stream loops, the ablation experiments, training, the cost fits,
the model install) take one too, always as a parameter named ``progress`` that defaults to
:func:`quiet`; a run whose parts go one after another and are shown one bar each (a stream's
policies, a sweep's runs) takes a :data:`ProgressFor` instead.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[float, float, str], None]


def quiet(done: float, total: float, note: str = "") -> None:
    """A :data:`Progress` that shows nothing (the default of a library call)."""


ProgressFor = Callable[[str], Progress]
"""One :data:`Progress` per named part of a run that does its parts one after another (a
stream's policies, a sweep's runs), for a caller that shows one bar per part: called once with
the part's name before the part starts, each part's ``done`` then counts that part alone."""


def quiet_for(name: str) -> Progress:
    """A :data:`ProgressFor` whose every part is :func:`quiet` (the default of a library call)."""
    return quiet


Tick = Callable[[str], None]
"""One more step of a counted run done, ``note`` naming it (what a run's parts call; the run
turns the count into :data:`Progress` with :func:`counter`)."""


def counter(progress: Progress, total: float) -> Tick:
    """A :data:`Tick` that reports each call as one more of ``total`` steps to ``progress``."""
    done = 0

    def tick(note: str = "") -> None:
        nonlocal done
        done += 1
        progress(done, total, note)

    return tick
