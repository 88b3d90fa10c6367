"""The recompute oracle: for each scored target, a fresh forward over exactly the tokens the sink
cache keeps, at positions 0..n (StreamingLLM's "sliding window with re-computation", with sinks).

Two evaluations of the same definition:

* :func:`recompute_nll`, one target per forward (the reference);
* :func:`recompute_nll_batched`: every target whose context is still a prefix of the stream
  (``t < n_sink + window``: nothing evicted yet) read off one causal forward over that prefix,
  then the others (all of length ``n_sink + window + 1``) ``batch`` windows per forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from sinklab.errors import check_positive
from sinklab.memory import SAMPLE_EVERY
from sinklab.models.arch import input_device
from sinklab.progress import Progress, quiet
from sinklab.stream.policy import kept_positions


def _nll_rows(logits: Tensor, targets: Tensor) -> Tensor:
    """logits (N, V), targets (N,) -> -log p (N,) float64 (float32 log-sum-exp, as the loops)."""
    lg, targets = logits.float(), targets.to(logits.device)  # the LM head's device
    return (torch.logsumexp(lg, -1) - lg.gather(-1, targets[:, None])[:, 0]).double().cpu()


def _buffer(n: int, out: Tensor | None) -> Tensor:
    """The (n,) float64 NLL buffer, NaN = not scored (the caller's ``out`` when given)."""
    nll = torch.empty(n, dtype=torch.float64) if out is None else out
    return nll.fill_(math.nan)


def _context(t: int, n_sink: int, window: int) -> list[int]:
    return [*kept_positions(t, tuple(range(n_sink)), window), t]


@torch.inference_mode()
def recompute_nll(
    model: Any,
    ids: Tensor,
    n_sink: int,
    window: int,
    every: int = 1,
    progress: Progress = quiet,
    rss: Callable[[], float] | None = None,
    out: Tensor | None = None,
    period: int | None = None,
) -> tuple[Tensor, int, float]:
    """One forward per target ``t + 1`` (``t % every == 0``) over the tokens the sink cache keeps
    before ``t`` plus ``t``. -> (nll (T-1,) NaN where unscored, longest context, peak RSS MiB).
    ``out`` (T-1,) float64 is filled as it goes; ``progress(done, total, note)`` (the one
    :data:`~sinklab.progress.Progress`: targets done up to, of T-1, the running perplexity in the
    note) every ``period`` targets."""
    dev, n = input_device(model), ids.numel() - 1
    nll = _buffer(n, out)
    period = period or max(1, SAMPLE_EVERY // every)
    sample = rss or (lambda: 0.0)
    targets = range(0, n, every)
    total, longest, peak = 0.0, 0, sample()
    for i, t in enumerate(targets):
        ctx = _context(t, n_sink, window)
        out = model(ids[ctx].view(1, -1).to(dev), use_cache=False, logits_to_keep=1)
        nll[t] = _nll_rows(out.logits[0, -1:], ids[t + 1 : t + 2])[0]
        total += float(nll[t])
        longest = max(longest, len(ctx))
        if (i + 1) % period == 0 or i + 1 == len(targets):
            peak = max(peak, sample())
            progress(t + 1, n, f"ppl {math.exp(total / (i + 1)):.2f}")
    return nll, longest, peak


@torch.inference_mode()
def recompute_nll_batched(
    model: Any,
    ids: Tensor,
    n_sink: int,
    window: int,
    every: int = 1,
    batch: int = 16,
    progress: Progress = quiet,
    rss: Callable[[], float] | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, int, float]:
    """:func:`recompute_nll`'s result, ``batch`` targets' windows per forward; ``progress`` as
    there, after each forward."""
    check_positive({"oracle batch": batch})
    dev, n = input_device(model), ids.numel() - 1
    nll = _buffer(n, out)
    sample = rss or (lambda: 0.0)
    cap = n_sink + window
    targets = list(range(0, n, every))
    early = [t for t in targets if t < cap]  # context 0..t: one causal forward over the prefix
    late = [t for t in targets if t >= cap]  # context: sinks + the window before t, then t
    total, done, peak = 0.0, 0, sample()
    if early:
        end = early[-1] + 1
        logits = model(ids[:end].view(1, -1).to(dev), use_cache=False).logits[0]
        rows = torch.tensor(early)
        nll[rows] = _nll_rows(logits[rows.to(logits.device)], ids[rows + 1])
        total, done = float(nll[rows].sum()), len(early)
        peak = max(peak, sample())
        progress(early[-1] + 1, n, f"ppl {math.exp(total / done):.2f}")
    sinks = torch.arange(n_sink)
    for i in range(0, len(late), batch):
        part = torch.tensor(late[i : i + batch])  # (b,)
        recent = part[:, None] - window + torch.arange(window + 1)[None]  # (b, window + 1)
        ctx = torch.cat((sinks.expand(len(part), -1), recent), 1)  # (b, cap + 1)
        out = model(ids[ctx].to(dev), use_cache=False, logits_to_keep=1)
        got = _nll_rows(out.logits[:, -1], ids[part + 1])
        nll[part] = got
        total, done = total + float(got.sum()), done + len(part)
        peak = max(peak, sample())
        progress(int(part[-1]) + 1, n, f"ppl {math.exp(total / done):.2f}")
    longest = max((len(_context(t, n_sink, window)) for t in targets[-1:]), default=0)
    return nll, longest, peak
