"""A request's sampling step, as OpenAI documents it (README, "Serving": sampling).

From one row of next-token logits (the model's own, however the batch was read):

1. ``logit_bias`` is added to the logits of the tokens it names, and each token already sampled
   in this reply is penalised: ``mu[j] - c[j] * frequency_penalty - (c[j] > 0) *
   presence_penalty`` (``c[j]``: how often token ``j`` was sampled in this completion so far);
   a ``response_format`` other than text then sets the adjusted logit of every token its
   grammar does not allow next to -inf (:mod:`.grammar`), so step 2 acts on the allowed ones;
2. temperature 0 takes the argmax of the adjusted logits; otherwise they are divided by the
   temperature, softmaxed (float64), cut to the ``top_k`` most likely (an extension) and to the
   smallest set whose mass reaches ``top_p`` (the token that crosses it included), renormalised
   and sampled with the session's generator;
3. ``logprobs`` report the model's own log-softmax (before any of the above) of the sampled token
   and of its ``top_logprobs`` most likely alternatives.

A non-finite value on the way (a model row that is NaN or inf) raises :class:`NotFinite`, which
fails that request alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch


class TurnFailed(ValueError):
    """This request's turn cannot go on; it fails alone (the batch's others go on) with
    ``status`` and ``code``."""

    code = "turn_failed"

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class NotFinite(TurnFailed):
    """This request's logits or probabilities are not finite numbers; ``status``: 400 when its
    parameters made them so, 500 when the model's own logits are."""

    code = "not_finite"


class NoAllowedToken(TurnFailed):
    """The request's ``response_format`` allows no token of this model's vocabulary next
    (:mod:`.grammar`)."""

    code = "format_unwritable"


@dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters (already checked by the protocol)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0

    def adjusted(self, logits: torch.Tensor, counts: Counter[int]) -> torch.Tensor:
        """Step 1: ``logits`` (V,) with the bias and the penalties applied (float64)."""
        out = logits.detach().double().cpu().clone()
        for tok, bias in self.logit_bias.items():
            out[tok] += bias
        if counts and (self.presence_penalty or self.frequency_penalty):
            ids = torch.tensor(list(counts), dtype=torch.long)
            c = torch.tensor([counts[i] for i in counts], dtype=torch.float64)
            out[ids] -= c * self.frequency_penalty + self.presence_penalty
        return out

    def probabilities(
        self, adjusted: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Step 2 before the draw: the distribution sampled from (temperature > 0), over the
        ``allowed`` tokens only when a format constrains the reply (:mod:`.grammar`)."""
        scaled = adjusted / self.temperature
        if not torch.isfinite(scaled if allowed is None else scaled[allowed]).all():
            raise NotFinite("the logits divided by the temperature are not finite", 400)
        if allowed is not None:
            scaled = scaled.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scaled, -1)
        if self.top_k and self.top_k < probs.numel():
            kth = torch.topk(probs, self.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if self.top_p < 1.0:
            order = torch.argsort(probs, descending=True)
            sorted_p = probs[order]
            before = torch.cumsum(sorted_p, 0) - sorted_p  # the mass ahead of each token
            keep = before < self.top_p
            keep[0] = True
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
        total = probs.sum()
        if not (torch.isfinite(total) and total > 0):
            raise NotFinite("the sampling probabilities are not finite", 400)
        return probs / total

    def pick(
        self,
        logits: torch.Tensor,
        counts: Counter[int],
        gen: torch.Generator,
        allowed: torch.Tensor | None = None,
    ) -> int:
        """The next token from ``logits`` (V,), given the reply's token ``counts`` so far; one of
        the ``allowed`` (V,) bool, when a format constrains the reply (:mod:`.grammar`)."""
        if not torch.isfinite(logits).all():
            raise NotFinite("the model's logits for this request are not finite (NaN or inf)", 500)
        if allowed is not None and not bool(allowed.any()):
            raise NoAllowedToken(
                "response_format: no token of this model's vocabulary continues the reply in "
                "that format",
                400,
            )
        adjusted = self.adjusted(logits, counts)
        if self.temperature == 0:
            if allowed is not None:
                adjusted = adjusted.masked_fill(~allowed, float("-inf"))
            return int(adjusted.argmax())
        probs = self.probabilities(adjusted, allowed)
        return int(torch.multinomial(probs, 1, generator=gen)[0])

    def logprob_entry(self, logits: torch.Tensor, tok: int, tokenizer: Any) -> dict[str, Any]:
        """Step 3: OpenAI's ``logprobs.content`` entry for the sampled ``tok``."""
        logp = torch.log_softmax(logits.detach().double().cpu(), -1)
        entry = _token(tokenizer, tok, float(logp[tok]))
        top: list[dict[str, Any]] = []
        if self.top_logprobs:
            values, ids = torch.topk(logp, min(self.top_logprobs, logp.numel()))
            top = [_token(tokenizer, int(i), float(v)) for v, i in zip(values, ids, strict=True)]
        return {**entry, "top_logprobs": top}


def _token(tokenizer: Any, tok: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([tok])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
