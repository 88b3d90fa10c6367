"""Perplexity over a fixed set of target tokens, so conditions that edit inputs compare fairly."""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sinklab.errors import SinklabError
from sinklab.models.arch import input_device


@dataclass(frozen=True)
class Perplexity:
    """Mean negative log-likelihood (nats per token) of the targets, and ``exp`` of it."""

    nll: float
    perplexity: float
    n_targets: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def perplexity(model: nn.Module, ids: Tensor, first_target: int = 2) -> Perplexity:
    """Perplexity of ``ids[first_target:]`` given everything before each target.

    ``ids`` LongTensor (T,) or (1, T). ``first_target = 2`` scores the tokens after the first two
    (sinklab's convention for the first-token experiment: after dropping token 0, pass 1 so the
    same original tokens are scored). Runs under whatever interventions are active.
    """
    ids = ids if ids.ndim == 2 else ids[None]  # (1, T)
    t = int(ids.shape[-1])
    if not 1 <= first_target < t:
        raise SinklabError(f"first_target must be in 1..{t - 1} for {t} tokens, got {first_target}")
    kw: dict[str, Any] = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = t - first_target + 1  # logits of positions first_target-1 .. T-1
    device = input_device(model)
    with torch.no_grad():
        logits = model(ids.to(device), **kw).logits[0]  # (T' , V)
    logits = logits[-(t - first_target + 1) : -1].double()  # predict ids[first_target:]
    targets = ids[0, first_target:].to(logits.device)
    nll = float(F.cross_entropy(logits, targets, reduction="mean"))
    return Perplexity(nll=nll, perplexity=math.exp(nll), n_targets=int(targets.numel()))
