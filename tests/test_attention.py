"""Tests for sinklab.attention: worked numbers, SDPA equivalence, fused == reference, causality,
numerical safety of every variant, and the masks on hand-written matrices."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from sinklab.attention import (
    FUSED_VARIANTS,
    VARIANTS,
    attention_weights,
    causal_mask,
    clipped_softmax,
    fused_attention,
    output_gate,
    reference_attention,
    repeat_kv,
    scaled_scores,
    sigmoid_attention,
    sink_softmax,
    sink_window_mask,
    softmax,
    softmax1,
    window_mask,
)
from sinklab.errors import SinklabError

MASK_KINDS = ("causal", "window", "sink_window")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def qkv(
    b: int, h: int, tq: int, tk: int, d: int, *, hkv: int | None = None, seed: int = 0, dtype=None
) -> tuple[Tensor, Tensor, Tensor]:
    """Seeded random q (b, h, tq, d), k and v (b, hkv, tk, d)."""
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    hkv = hkv or h
    q = torch.randn(b, h, tq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=dtype)
    return q, k, v


def make_mask(kind: str, tq: int, tk: int, window: int = 3, n_sink: int = 1) -> Tensor | None:
    """The mask that, together with is_causal=True, realises a mask kind."""
    if kind == "causal":
        return None
    if kind == "window":
        return window_mask(tq, tk, window)
    return sink_window_mask(tq, tk, n_sink, window)


# ------------------------------------------------------------- docs/science.md#attention


def one_query_weights(dots: list[float], d_k: int, scale: float | None) -> list[float]:
    """Weights of one query whose dot products with the keys are ``dots`` (head dim ``d_k``)."""
    q = torch.zeros(1, 1, 1, d_k, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, len(dots), d_k, dtype=torch.float64)
    k[0, 0, :, 0] = torch.tensor(dots, dtype=torch.float64)
    v = torch.zeros_like(k)
    _, w = reference_attention(q, k, v, scale=scale)
    return w[0, 0, 0].tolist()


def test_worked_numbers_scaled_and_unscaled() -> None:
    assert [round(x, 3) for x in one_query_weights([2.0, 1.0, 0.0], 4, None)] == [
        0.506,
        0.307,
        0.186,
    ]
    assert [round(x, 3) for x in one_query_weights([2.0, 1.0, 0.0], 4, 1.0)] == [
        0.665,
        0.245,
        0.090,
    ]
    assert round(max(one_query_weights([16.0, 8.0], 64, None)), 3) == 0.731
    assert round(max(one_query_weights([16.0, 8.0], 64, 1.0)), 4) == 0.9997


def test_scaled_scores_default_scale_is_inverse_sqrt_d() -> None:
    q, k, _ = qkv(1, 2, 3, 5, 16)
    expected = torch.einsum("bhqd,bhkd->bhqk", q, k) / 4.0
    torch.testing.assert_close(scaled_scores(q, k), expected)


# --------------------------------------------------------------------------- reference vs SDPA


@pytest.mark.parametrize("tq", [9, 4, 1])
@pytest.mark.parametrize("hkv", [6, 2])
def test_reference_causal_matches_sdpa_float64(tq: int, hkv: int) -> None:
    tk = 9
    q_all, k, v = qkv(2, 6, tk, tk, 8, hkv=hkv, dtype=torch.float64)
    # independent computation: SDPA over all tk queries, keep the last tq rows
    expected = F.scaled_dot_product_attention(q_all, k, v, is_causal=True, enable_gqa=hkv != 6)[
        :, :, -tq:
    ]
    out, w = reference_attention(q_all[:, :, -tq:], k, v, is_causal=True)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    assert w.shape == (2, 6, tq, tk)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 6, tq, dtype=torch.float64))


def test_repeat_kv_matches_repeat_interleave() -> None:
    x = torch.randn(2, 3, 5, 4)
    torch.testing.assert_close(repeat_kv(x, 4), x.repeat_interleave(4, dim=1))
    assert repeat_kv(x, 1) is x


# --------------------------------------------------------------------------- fused vs reference


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
@pytest.mark.parametrize(
    ("case", "tq", "hkv"),
    [("causal", 16, 4), ("decode", 5, 4), ("gqa", 16, 2), ("window", 16, 4), ("sinkwin", 7, 4)],
)
def test_fused_matches_reference(variant: str, case: str, tq: int, hkv: int) -> None:
    tk = 16
    q, k, v = qkv(2, 4, tq, tk, 8, hkv=hkv, seed=1)
    q = q * 3  # sharper weights, so the sink logit matters
    sink_logit = torch.tensor([-1.0, 0.0, 1.5, 3.0])
    mask = {"window": window_mask(tq, tk, 4), "sinkwin": sink_window_mask(tq, tk, 2, 3)}.get(case)
    kw = {"mask": mask, "is_causal": True, "variant": variant, "sink_logit": sink_logit}
    expected, _ = reference_attention(q, k, v, **kw)
    torch.testing.assert_close(fused_attention(q, k, v, **kw), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
def test_fused_matches_reference_non_causal_with_gate_and_scale(variant: str) -> None:
    q, k, v = qkv(1, 3, 6, 10, 8, seed=2)
    gate = torch.randn(1, 3, 6)
    kw = {"variant": variant, "sink_logit": torch.tensor([0.5, -2.0, 2.0]), "scale": 0.3}
    expected, _ = reference_attention(q, k, v, gate_logits=gate, **kw)
    torch.testing.assert_close(
        fused_attention(q, k, v, gate_logits=gate, **kw), expected, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
@pytest.mark.parametrize("tq", [7, 3])
def test_fused_matches_reference_with_other_value_head_dim(variant: str, tq: int) -> None:
    q, k, _ = qkv(1, 2, tq, 7, 8, seed=5)
    v = torch.randn(1, 2, 7, 11)  # value head dim 11 != query/key head dim 8
    kw = {"is_causal": True, "variant": variant, "sink_logit": torch.tensor([1.0, -0.5])}
    expected, _ = reference_attention(q, k, v, **kw)
    assert expected.shape == (1, 2, tq, 11)
    torch.testing.assert_close(fused_attention(q, k, v, **kw), expected, atol=1e-5, rtol=0)


def test_fused_sink_with_infinite_logits() -> None:
    q, k, v = qkv(1, 2, 6, 6, 8, seed=6)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    lam = torch.tensor([-math.inf, -math.inf])
    out = fused_attention(q, k, v, is_causal=True, variant="sink", sink_logit=lam)
    torch.testing.assert_close(out, plain)  # a sink of -inf is plain softmax
    lam = torch.tensor([math.inf, 0.0])
    out = fused_attention(q, k, v, is_causal=True, variant="sink", sink_logit=lam)
    ref, _ = reference_attention(q, k, v, is_causal=True, variant="sink", sink_logit=lam)
    assert not out.isnan().any()
    assert torch.equal(out[:, 0], torch.zeros(1, 6, 8))  # a sink of +inf takes all the mass
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_fused_sink_gradients_match_reference() -> None:
    q, k, v = qkv(1, 2, 8, 8, 4, seed=3)
    grads = []
    for fn in (lambda *a, **kw: reference_attention(*a, **kw)[0], fused_attention):
        lam = torch.tensor([0.3, -0.7], requires_grad=True)
        qq = q.clone().requires_grad_(True)
        fn(qq, k, v, is_causal=True, variant="sink", sink_logit=lam).square().sum().backward()
        grads.append((lam.grad, qq.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-4)


def test_unfused_variants_fall_back_to_reference() -> None:
    q, k, v = qkv(1, 2, 6, 6, 4)
    for variant in ("clipped", "sigmoid", "relu"):
        expected, _ = reference_attention(q, k, v, is_causal=True, variant=variant)
        assert torch.equal(fused_attention(q, k, v, is_causal=True, variant=variant), expected)


# --------------------------------------------------------------------------- causality


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=10, deadline=None)
@given(
    t_len=st.integers(2, 10),
    data=st.data(),
    window=st.integers(1, 4),
    n_sink=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_future_never_changes_the_past(
    variant: str,
    kind: str,
    fused: bool,
    t_len: int,
    data: st.DataObject,
    window: int,
    n_sink: int,
    seed: int,
) -> None:
    t = data.draw(st.integers(0, t_len - 2), label="t")  # keys after t change
    tq = data.draw(st.integers(1, t_len), label="tq")  # queries: the last tq positions
    q, k, v = qkv(1, 2, t_len, t_len, 4, seed=seed)
    q = q[:, :, -tq:]
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1 :] = torch.randn_like(k2[:, :, t + 1 :]) * 5
    v2[:, :, t + 1 :] = torch.randn_like(v2[:, :, t + 1 :]) * 5
    # a mask kind must be causal on its own: is_causal only for the plain "causal" kind
    mask = make_mask(kind, tq, t_len, window, n_sink)
    kw = {"mask": mask, "is_causal": mask is None, "variant": variant}
    kw["sink_logit"] = torch.tensor([0.5, -1.0])
    if fused:
        a, b = fused_attention(q, k, v, **kw), fused_attention(q, k2, v2, **kw)
    else:
        a, b = reference_attention(q, k, v, **kw)[0], reference_attention(q, k2, v2, **kw)[0]
    past = t + 1 - (t_len - tq)  # rows at absolute positions <= t
    if past > 0:
        torch.testing.assert_close(a[:, :, :past], b[:, :, :past], atol=1e-6, rtol=0)
    if variant != "relu":  # relu: a row whose visible scores are all <= 0 outputs 0 either way
        assert not torch.allclose(a[:, :, max(past, 0) :], b[:, :, max(past, 0) :])  # real change


# --------------------------------------------------------------------------- numerical safety


@pytest.mark.parametrize("variant", ["softmax1", "sink"])
def test_sink_rows_are_positive_and_sum_below_one(variant: str) -> None:
    scores = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(4)) * 3
    lam = torch.tensor([-2.0, 0.0, 2.0])
    w = attention_weights(variant, scores, causal_mask(5, 7), sink_logit=lam)
    allowed = causal_mask(5, 7).expand_as(w)
    assert (w[allowed] > 0).all()
    assert (w.sum(-1) < 1).all()
    # the missing mass is the sink slot's share: exp(lam) / (exp(lam) + sum exp(s))
    lam_b = torch.zeros(3) if variant == "softmax1" else lam
    z = scores.masked_fill(~allowed, -math.inf).exp().sum(-1)
    missing = lam_b.exp().view(3, 1) / (lam_b.exp().view(3, 1) + z)
    torch.testing.assert_close(1 - w.sum(-1), missing, atol=1e-6, rtol=1e-5)


def test_softmax1_is_sink_softmax_at_zero_and_softmax_at_minus_large() -> None:
    scores = torch.randn(1, 2, 4, 4)
    assert torch.equal(softmax1(scores), sink_softmax(scores, sink_logit=0.0))
    torch.testing.assert_close(sink_softmax(scores, sink_logit=-60.0), softmax(scores))
    assert not torch.allclose(softmax1(scores), softmax(scores))


@pytest.mark.parametrize("variant", VARIANTS)
def test_fully_masked_rows_are_exact_zeros(variant: str) -> None:
    scores = torch.randn(1, 2, 4, 5, generator=torch.Generator().manual_seed(0))
    scores[..., 0, 0] = 1.0  # every head's row 0 has a positive score (relu gives 0 to s <= 0)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    w = attention_weights(variant, scores, mask, sink_logit=torch.tensor([1.0, -1.0]))
    assert not w.isnan().any()
    assert torch.equal(w[:, :, 1], torch.zeros(1, 2, 5))
    assert (w[:, :, 0].sum(-1) > 0).all()
    # the same through full attention: reference and fused, causal with Tq > Tk
    q, k, v = qkv(1, 2, 6, 4, 8)
    for fn in (lambda *a, **kw: reference_attention(*a, **kw)[0], fused_attention):
        out = fn(q, k, v, is_causal=True, variant=variant, sink_logit=torch.tensor([1.0, -1.0]))
        assert not out.isnan().any()
        assert torch.equal(out[:, :, :2], torch.zeros(1, 2, 2, 8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_extreme_scores_stay_finite(variant: str, dtype: torch.dtype) -> None:
    scores = torch.tensor([[1e4, -1e4, 0.0, 1e4], [-1e4, -1e4, -1e4, -1e4]], dtype=dtype)
    scores = scores.view(1, 1, 2, 4).expand(2, 2, 2, 4)
    mask = torch.tensor([True, True, False, True])
    w = attention_weights(variant, scores, mask, sink_logit=torch.tensor([0.0, 5.0]))
    assert w.dtype == dtype
    assert torch.isfinite(w).all()
    if variant == "relu":  # unbounded above: relu(s) / 3 visible keys, exactly
        expected = torch.tensor([[1e4, 0, 0, 1e4], [0, 0, 0, 0]]).expand(2, 2, 2, 4) / 3
        torch.testing.assert_close(w.float(), expected, rtol=1e-2, atol=0)
        return
    assert ((w >= 0) & (w <= 1)).all()
    assert (w[..., 0, :].float().sum(-1) > 0.9).all()  # the two maxima keep (almost) all mass
    if variant == "softmax":  # three tied scores of -1e4: a third each, not NaN or 0
        torch.testing.assert_close(
            w[..., 1, :].float(),
            torch.tensor([1, 1, 0, 1.0]).expand(2, 2, 4) / 3,
            atol=2e-3,
            rtol=0,
        )


def test_variant_specific_semantics() -> None:
    scores = torch.randn(1, 2, 3, 6) * 4
    p = softmax(scores)
    w = clipped_softmax(scores, zeta=1.0, gamma=-0.03)
    torch.testing.assert_close(w, (1.03 * p - 0.03).clamp(0, 1))
    assert (w == 0).any()  # clipping reaches exact zeros, plain softmax cannot
    bias = torch.tensor([0.0, -2.0])
    torch.testing.assert_close(
        sigmoid_attention(scores, bias=bias), torch.sigmoid(scores + bias.view(2, 1, 1))
    )
    with pytest.raises(SinklabError, match="gamma"):
        clipped_softmax(scores, gamma=0.1)
    with pytest.raises(SinklabError, match="per head"):
        sink_softmax(scores, sink_logit=torch.zeros(3))


def test_relu_attention_divides_by_the_visible_keys() -> None:
    scores = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(5)) * 2
    mask = causal_mask(5, 7)
    w = attention_weights("relu", scores, mask)
    for i in range(5):  # query i sees keys 0 .. 2 + i: independent loop over rows
        n = 3 + i
        expected = torch.zeros(2, 3, 7)
        expected[..., :n] = scores[:, :, i, :n].clamp_min(0) / n
        torch.testing.assert_close(w[:, :, i], expected)
    torch.testing.assert_close(attention_weights("relu", scores), scores.clamp_min(0) / 7)
    assert (w.sum(-1) < 1).any() and torch.equal(attention_weights("relu", -scores.abs()), 0 * w)


def test_unknown_variant_names_the_allowed_values() -> None:
    with pytest.raises(SinklabError, match="softmax, softmax1, sink, clipped, sigmoid") as exc:
        attention_weights("softmax2", torch.zeros(1, 1, 1, 1))
    assert "\n" not in str(exc.value)
    with pytest.raises(SinklabError):
        fused_attention(*qkv(1, 1, 2, 2, 4), variant="flash")


def test_output_gate_per_head_and_query() -> None:
    out = torch.randn(2, 3, 4, 5)
    gate = torch.randn(2, 3, 4)
    torch.testing.assert_close(output_gate(out, gate), out * torch.sigmoid(gate)[..., None])
    torch.testing.assert_close(output_gate(out, torch.zeros(2, 3, 4, 5)), out / 2)


# --------------------------------------------------------------------------- masks


def as_bool(rows: list[str]) -> Tensor:
    return torch.tensor([[c == "1" for c in row] for row in rows])


def test_causal_mask_aligns_queries_to_the_end() -> None:
    assert torch.equal(causal_mask(3, 5), as_bool(["11100", "11110", "11111"]))
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(causal_mask(3, 2), as_bool(["00", "10", "11"]))


def test_window_mask_hand_written() -> None:
    expected = as_bool(["10000", "11000", "11100", "01110", "00111"])
    assert torch.equal(window_mask(5, 5, 3), expected)
    assert torch.equal(window_mask(2, 5, 2), as_bool(["00110", "00011"]))
    assert torch.equal(window_mask(3, 3, 1), torch.eye(3, dtype=torch.bool))


def test_sink_window_mask_hand_written() -> None:
    expected = as_bool(["100000", "110000", "111000", "110100", "110010", "110001"])
    assert torch.equal(sink_window_mask(6, 6, 2, 1), expected)
    expected = as_bool(["1000", "1100", "1110", "1011"])
    assert torch.equal(sink_window_mask(4, 4, 1, 2), expected)
    assert torch.equal(sink_window_mask(2, 6, 1, 2), as_bool(["100110", "100011"]))
    assert torch.equal(sink_window_mask(5, 5, 0, 2), window_mask(5, 5, 2))


@pytest.mark.parametrize(
    "bad", [lambda: window_mask(3, 3, 0), lambda: sink_window_mask(3, 3, -1, 2)]
)
def test_mask_arguments_are_validated(bad) -> None:
    with pytest.raises(SinklabError):
        bad()
