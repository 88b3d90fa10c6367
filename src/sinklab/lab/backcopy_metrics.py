"""What each head of a backcopy model does at trigger and non-trigger queries.

Measured through sinklab's attention seam (:func:`sinklab.seam.sinklab_attention` with one
observing handler), on held-out sequences, for every layer and head. Query ``t`` is a *trigger*
query when token ``t`` is a trigger (the head should copy: attend to ``t - 1``) and a
*non-trigger* query otherwise (the head should do nothing); query 0 is left out of both (it sees
only itself). Per head (means over the queries of a kind, over every sequence):

* ``first_token_mass_nontrigger`` / ``first_token_mass_trigger``: ``A[t, 0]``;
* ``first_token_mass``: ``A[t, 0]`` over every query ``t >= 1``: the head's sink score as
  Barbero et al. and Gu et al. read it (``sink_rate``, per model: the fraction of heads whose
  score exceeds :data:`SINK_EPS`);
* ``prev_token_mass_trigger``: ``A[t, t - 1]``;
* ``null_mass_nontrigger``: ``1 - sum_j A[t, j]``: the invisible slot's mass for softmax1 and
  sink (learned logit), 0 for softmax and gated; for sigmoid and relu the weights are not
  normalised, so it is 1 minus their total (it can be negative);
* ``gate_nontrigger``: the mean output gate ``sigmoid(g)`` (gated only; None otherwise);
* ``bos_value_norm``: ``||v_0||``, the value at the first position (the "value drain");
* ``output_norm_nontrigger`` / ``output_norm_trigger``: ``||o_t||`` of the head's output
  ``sum_j A[t, j] v_j`` (times the gate for gated), before the output projection: a hard switch
  is ``output_norm_nontrigger`` ~ 0;
* ``uniform_first_mass_nontrigger``: ``1 / (t + 1)``, the mass uniform causal attention would
  put on the first token at the same queries: the baseline a first-token mass is read against
  (it shrinks with the context length; docs/claims.md#lab-validity);
* ``diag_mass_nontrigger`` (``A[t, t]``: the soft switch), ``sink_token`` / ``sink_token_mass``
  (the token whose keys get the most mass at non-trigger queries, and that mass) and
  ``sink_token_key_share`` (the fraction of keys that are that token: uniform attention's mass).

``backcopy_loss`` (per model): mean NLL (nats) of the copied targets of the same sequences.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sinklab.lab.backcopy import BigramTable
from sinklab.models.arch import input_device
from sinklab.seam import AttentionChunk, AttentionHandler, sinklab_attention

SINK_EPS = 0.3  # a sink head: first-token mass over the queries above this (Gu et al. 2025)
HEAD_KEYS = (
    "first_token_mass",
    "first_token_mass_nontrigger",
    "first_token_mass_trigger",
    "prev_token_mass_trigger",
    "null_mass_nontrigger",
    "gate_nontrigger",
    "bos_value_norm",
    "output_norm_nontrigger",
    "output_norm_trigger",
    "diag_mass_nontrigger",
    "uniform_first_mass_nontrigger",
)
_SUMS = (
    ("first_all", "all"),
    ("first_nt", "nt"),
    ("first_tr", "tr"),
    ("prev_tr", "tr"),
    ("null_nt", "nt"),
    ("gate_nt", "nt"),
    ("out_nt", "nt"),
    ("out_tr", "tr"),
    ("diag_nt", "nt"),
    ("unif_nt", "nt"),
)


class BackcopyCapture(AttentionHandler):
    """Accumulates the per-head sums of every layer from the chunks the seam hands over."""

    def __init__(self, ids: Tensor, trigger: Tensor, vocab_size: int) -> None:
        self.ids, self.trigger, self.vocab_size = ids, trigger, vocab_size  # (N, T) each
        self.sums: dict[int, dict[str, Tensor]] = {}
        self.gates: dict[int, Tensor] = {}  # layer -> (N, H, T), set by a pre-hook (gated)

    def _layer(self, layer: int, h: int, tk: int) -> dict[str, Tensor]:
        if layer not in self.sums:
            z = torch.zeros(h, dtype=torch.float64)
            self.sums[layer] = {name: z.clone() for name, _ in _SUMS}
            self.sums[layer].update(nt=z.clone(), tr=z.clone(), all=z.clone(), bos_v=z.clone())
            self.sums[layer]["tok"] = torch.zeros(h, self.vocab_size, dtype=torch.float64)
        return self.sums[layer]

    def observe(self, chunk: AttentionChunk) -> None:
        w = chunk.weights.detach().double().cpu()  # (B, H, c, Tk)
        b, h, c, tk = w.shape
        s = self._layer(chunk.layer, h, tk)
        pos = chunk.q_offset + chunk.q_start + torch.arange(c)  # (c,) key position of each row
        trig = self.trigger[:, pos]  # (B, c)
        real = (pos >= 1)[None, :]  # query 0 sees only itself
        masks = {"nt": (~trig & real).double(), "tr": (trig & real).double()}  # (B, c)
        masks["all"] = masks["nt"] + masks["tr"]

        def at(offset: int) -> Tensor:  # A[t, t + offset]: (B, H, c)
            idx = (pos + offset).clamp(0, tk - 1).view(1, 1, c, 1).expand(b, h, c, 1)
            return w.gather(-1, idx)[..., 0]

        gate = self.gates.get(chunk.layer)
        gate = gate[:, :, pos].double() if gate is not None else None  # (B, H, c)
        out = chunk.output.detach().double().cpu().norm(dim=-1)  # (B, H, c)
        if gate is not None:
            out = out * gate
        values = {
            "first_all": w[..., 0],
            "first_nt": w[..., 0],
            "first_tr": w[..., 0],
            "prev_tr": at(-1),
            "null_nt": 1.0 - w.sum(-1),
            "gate_nt": gate if gate is not None else torch.zeros_like(w[..., 0]),
            "out_nt": out,
            "out_tr": out,
            "diag_nt": at(0),
            # what uniform causal attention gives key 0 at query t: 1 / (t + 1)
            "unif_nt": (1.0 / (pos + 1).double()).view(1, 1, c).expand(b, h, c),
        }
        for name, kind in _SUMS:
            s[name] += (values[name] * masks[kind][:, None]).sum(dim=(0, 2))
        for kind, m in masks.items():
            s[kind] += m.sum()
        if chunk.q_start == 0:
            s["bos_v"] += chunk.value[:, :, 0].detach().double().cpu().norm(dim=-1).sum(0)  # (H,)
        # mass received by each key token at non-trigger queries: (H, V)
        per_key = (w * masks["nt"][:, None, :, None]).sum(dim=2)  # (B, H, Tk)
        key_ids = self.ids[:, :tk].unsqueeze(1).expand(b, h, tk)  # (B, H, Tk)
        tok = torch.zeros(b, h, self.vocab_size, dtype=torch.float64)
        s["tok"] += tok.scatter_add_(-1, key_ids, per_key).sum(0)

    def per_head(self, n_seq: int, gated: bool, table: BigramTable) -> dict[str, list]:
        """``{key: [layer][head]}`` for every key of :data:`HEAD_KEYS` and the sink token."""
        out: dict[str, list] = {k: [] for k in (*HEAD_KEYS, "sink_token", "sink_token_mass")}
        out["sink_token_key_share"] = []
        counts = torch.bincount(self.ids.flatten(), minlength=self.vocab_size).double()
        for layer in sorted(self.sums):
            s = self.sums[layer]
            nt, tr = s["nt"].clamp_min(1), s["tr"].clamp_min(1)
            row = {
                "first_token_mass": s["first_all"] / s["all"].clamp_min(1),
                "first_token_mass_nontrigger": s["first_nt"] / nt,
                "first_token_mass_trigger": s["first_tr"] / tr,
                "prev_token_mass_trigger": s["prev_tr"] / tr,
                "null_mass_nontrigger": s["null_nt"] / nt,
                "bos_value_norm": s["bos_v"] / n_seq,
                "output_norm_nontrigger": s["out_nt"] / nt,
                "output_norm_trigger": s["out_tr"] / tr,
                "diag_mass_nontrigger": s["diag_nt"] / nt,
                "uniform_first_mass_nontrigger": s["unif_nt"] / nt,
            }
            for k, v in row.items():
                out[k].append(v.tolist())
            out["gate_nontrigger"].append(
                (s["gate_nt"] / nt).tolist() if gated else [None] * len(nt)
            )
            tok = s["tok"] / nt[:, None]  # (H, V) mean mass per non-trigger query
            top = tok.argmax(dim=-1)  # (H,)
            out["sink_token"].append([table.token(int(i)) for i in top])
            out["sink_token_mass"].append([float(tok[j, i]) for j, i in enumerate(top)])
            share = counts / counts.sum()
            out["sink_token_key_share"].append([float(share[i]) for i in top])
        return out


@torch.no_grad()
def backcopy_summary(
    model: nn.Module, ids: Tensor, copied: Tensor, table: BigramTable
) -> dict[str, Any]:
    """``checkpoints[i].backcopy``: the keys of the head with the largest non-trigger first-token
    mass (``head`` = [layer, head]), ``backcopy_loss``, ``sink_rate`` (``{"0.3": fraction of
    heads whose first-token mass over all queries exceeds SINK_EPS}``) and ``per_head`` (every
    key, L x H)."""
    device = input_device(model)
    ids, copied = ids.to(device), copied.to(device)
    trigger = table.is_trigger(ids)
    capture = BackcopyCapture(ids.cpu(), trigger.cpu(), table.vocab_size)
    hooks = []
    gated = getattr(model.config, "attention_variant", "") == "gated"
    if gated:
        for i, block in enumerate(model.model.layers):

            def grab(module: nn.Module, args: tuple, _i: int = i) -> None:
                capture.gates[_i] = torch.sigmoid(module.gate(args[0])).transpose(1, 2).cpu()

            hooks.append(block.self_attn.register_forward_pre_hook(grab))
    try:
        with sinklab_attention(model, capture):
            logits = model(ids).logits  # (N, T, V)
    finally:
        for hk in hooks:
            hk.remove()
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    target_copied = copied[:, 1:]  # (N, T - 1)
    loss = float(nll[target_copied].mean()) if target_copied.any() else float("nan")
    heads = capture.per_head(ids.shape[0], gated, table)
    mass = torch.tensor(heads["first_token_mass_nontrigger"])  # (L, H)
    flat = int(mass.argmax())
    layer, head = divmod(flat, mass.shape[1])
    best = {k: heads[k][layer][head] for k in heads}
    score = torch.tensor(heads["first_token_mass"])  # (L, H)
    rate = {str(SINK_EPS): float((score > SINK_EPS).double().mean())}
    return {
        **best,
        "backcopy_loss": loss,
        "head": [layer, head],
        "sink_rate": rate,
        "per_head": heads,
    }
