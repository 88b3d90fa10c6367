"""Cost experiment: the exponent fit recovers known exponents; fitted layers realise patterns."""

from __future__ import annotations

import math

import pytest
import torch

from sinklab.attention import reference_attention
from sinklab.errors import SinklabError
from sinklab.lab.cost import CostConfig, embeddings, fit_exponent, fit_layer, target_keys


@pytest.mark.parametrize("exponent", [1.0, 1.5])
def test_exponent_fit_recovers_known_exponents(exponent):
    g = torch.Generator().manual_seed(0)
    ts = [16, 32, 64, 128, 256, 512]
    noise = torch.exp(0.02 * torch.randn(len(ts), generator=g, dtype=torch.float64))
    ys = [3.0 * t**exponent * float(n) for t, n in zip(ts, noise, strict=True)]
    fit = fit_exponent(ts, ys)
    assert abs(fit["exponent"] - exponent) < 0.03 and fit["r2"] > 0.99
    assert math.isclose(fit["coef"], 3.0, rel_tol=0.2)


@pytest.mark.parametrize("shared", [0.0, 1.0])
@pytest.mark.parametrize("task", ["sink", "diagonal"])
def test_fitted_layer_realises_the_pattern_at_every_length(task, shared):
    config = CostConfig(lengths=(8, 16), steps=20, bisections=1, accuracy=0.9, shared=shared)
    for t in config.lengths:
        x, w_qk, w_vo = fit_layer(task, t, config)
        # independent check: the package's reference attention with q = x W_QK, k = v = x
        q = (x @ w_qk)[None, None]  # (1, 1, T, d)
        k = x[None, None]
        out, weights = reference_attention(q, k, k @ w_vo, is_causal=True, scale=1.0)
        keys = target_keys(task, t)
        hit = weights[0, 0, torch.arange(1, t), keys[1:]]  # (T - 1,)
        assert hit.min() >= 0.9, (task, t, hit.min())
        target = torch.zeros_like(x) if task == "sink" else x
        assert (out[0, 0] - target).norm() <= 0.1 * max(float(target.norm()), 1.0)


def test_shared_direction_sets_the_mean_cosine_and_zero_keeps_random_tokens():
    g = torch.Generator().manual_seed(7 * 100_003 + 64)
    z = torch.randn(64, 64, generator=g, dtype=torch.float64)
    assert torch.equal(embeddings(64, 64, 7), z / z.norm(dim=1, keepdim=True))
    for b in (0.5, 1.0, 2.0):
        x = embeddings(64, 64, 7, shared=b)
        assert torch.allclose(x.norm(dim=1), torch.ones(64, dtype=torch.float64))
        cos = x @ x.T
        mean = float((cos.sum() - 64) / (64 * 63))
        assert abs(mean - b * b / (1 + b * b)) < 0.05, (b, mean)


def test_bad_cost_config():
    with pytest.raises(SinklabError, match="lengths"):
        CostConfig(lengths=(2,))
    with pytest.raises(SinklabError, match="2 or more distinct"):
        CostConfig(lengths=(8,))
    for twice in ((8, 8), (8, 16, 16)):  # a fit from one length (R^2 = 1) or a T counted twice
        with pytest.raises(SinklabError, match="twice"):
            CostConfig(lengths=twice)
    with pytest.raises(SinklabError, match="task"):
        CostConfig(tasks=("ring",))
    with pytest.raises(SinklabError, match="shared"):
        CostConfig(shared=-1.0)


def test_summary_lines_state_each_fit_and_what_was_not_realised():
    from sinklab.lab.cost import CostConfig, CostResult

    fit = {"exponent": 0.512, "r2": 0.9987}
    rows = [
        {"task": "sink", "T": 16, "realised": True},
        {"task": "diagonal", "T": 32, "realised": False},
    ]
    result = CostResult(
        CostConfig(), rows, {"sink": {"fro_total": fit, "nuc_total": fit}, "diagonal": {}}
    )
    assert result.summary_lines() == [
        "sink: Frobenius ~ T^0.51 (R2 1.00), nuclear ~ T^0.51 (R2 1.00)",
        "diagonal: no exponent (fewer than 2 lengths, or a zero norm)",
        "not realised at: diagonal@32",
    ]
    rows[1]["realised"] = True
    assert result.summary_lines()[-1] == "realised at every T"
