"""Probe metrics as pure functions: hand-built heads, independent loops, chunked == unchunked."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sinklab.errors import SinklabError
from sinklab.probe import ProbeConfig, spec
from sinklab.probe import metrics as M

T = 12


def causal_random(b: int, h: int, t: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(b, h, t, t, generator=g, dtype=torch.float64) * 2
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1)  # (B, H, T, T)


def pure_sink(t: int = T) -> torch.Tensor:
    w = torch.zeros(1, 1, t, t, dtype=torch.float64)
    w[..., 0] = 1.0
    return w


def pure_diagonal(t: int = T) -> torch.Tensor:
    return torch.eye(t, dtype=torch.float64)[None, None]


def prev_token(t: int = T) -> torch.Tensor:
    w = torch.zeros(t, t, dtype=torch.float64)
    w[0, 0] = 1.0
    w[torch.arange(1, t), torch.arange(t - 1)] = 1.0
    return w[None, None]


def uniform(t: int = T) -> torch.Tensor:
    w = torch.ones(t, t, dtype=torch.float64).tril()
    return (w / w.sum(-1, keepdim=True))[None, None]


def harmonic(a: int, b: int) -> float:
    return sum(1.0 / k for k in range(a, b + 1))


@pytest.mark.parametrize("q0", [0, 3])
def test_hand_built_heads(q0):
    n = T - q0
    # pure sink: all attention on key 0
    w = pure_sink()
    assert M.sink_mass(w, q0=q0).item() == pytest.approx(1.0)
    assert M.diagonal_mass(w, q0=q0).item() == pytest.approx((q0 == 0) / n)
    assert M.prev_token_mass(w, q0=q0).item() == pytest.approx((q0 <= 1) / (T - max(1, q0)))
    assert M.mean_entropy(w, q0=q0).item() == pytest.approx(0.0)
    assert M.received_attention(w, q0=q0)[0, 0, 0].item() == pytest.approx(1.0)
    assert M.received_attention(w, q0=q0)[0, 0, 1:].abs().max().item() == 0.0
    # pure diagonal: each token attends to itself
    w = pure_diagonal()
    assert M.sink_mass(w, q0=q0).item() == pytest.approx((q0 == 0) / n)
    assert M.diagonal_mass(w, q0=q0).item() == pytest.approx(1.0)
    assert M.prev_token_mass(w, q0=q0).item() == pytest.approx(0.0)
    assert M.mean_entropy(w, q0=q0).item() == pytest.approx(0.0)
    # previous token
    w = prev_token()
    assert M.prev_token_mass(w, q0=q0).item() == pytest.approx(1.0)
    # uniform causal: A[t, j] = 1 / (t + 1)
    w = uniform()
    expect = harmonic(q0 + 1, T) / n
    assert M.sink_mass(w, q0=q0).item() == pytest.approx(expect)
    assert M.diagonal_mass(w, q0=q0).item() == pytest.approx(expect)
    p0 = max(1, q0)
    assert M.prev_token_mass(w, q0=q0).item() == pytest.approx(harmonic(p0 + 1, T) / (T - p0))
    ent = sum(math.log(t + 1) for t in range(q0, T)) / n
    assert M.mean_entropy(w, q0=q0).item() == pytest.approx(ent, rel=1e-6)


def test_head_kind_and_sink_rate():
    sink = torch.tensor([[0.9, 0.05, 0.1, 0.2]])
    diag = torch.tensor([[0.05, 0.9, 0.1, 0.2]])
    prev = torch.tensor([[0.0, 0.0, 0.7, 0.1]])
    assert M.head_kind(sink, diag, prev) == [["sink", "diagonal", "previous-token", "mixed"]]
    # one head's masses, shapes (1, 1) -> nested lists [[kind]]
    for make, kind in (
        (pure_sink, "sink"),
        (pure_diagonal, "diagonal"),
        (prev_token, "previous-token"),
        (uniform, "mixed"),  # T = 16: every mass is below the 0.3 floor
    ):
        w = make(16)
        masses = (M.sink_mass(w), M.diagonal_mass(w), M.prev_token_mass(w))
        assert M.head_kind(*masses) == [[kind]], kind
    per_head = [M.sink_mass(x()).item() for x in (pure_sink, pure_diagonal, prev_token, uniform)]
    masses = [
        [M.diagonal_mass(x()).item() for x in (pure_sink, pure_diagonal, prev_token, uniform)]
    ]
    prevs = [
        [M.prev_token_mass(x()).item() for x in (pure_sink, pure_diagonal, prev_token, uniform)]
    ]
    assert M.head_kind([per_head], masses, prevs) == [
        ["sink", "diagonal", "previous-token", "mixed"]
    ]
    sm = torch.tensor([[0.9, 0.5], [0.2, float("nan")]])
    assert M.sink_rate(sm, 0.3) == 0.5 and M.sink_rate(sm, 0.8) == 0.25


def test_metrics_equal_explicit_loops():
    w = causal_random(2, 3, T)
    q0, key = 2, 1
    for b in range(2):
        for h in range(3):
            a = w[b, h]
            rows = range(max(key, q0), T)
            assert M.sink_mass(w, key=key, q0=q0)[b, h] == pytest.approx(
                sum(a[t, key] for t in rows).item() / len(rows), rel=1e-6
            )
            ent = [-(a[t, : t + 1] * a[t, : t + 1].log()).sum().item() for t in range(q0, T)]
            assert M.mean_entropy(w, q0=q0)[b, h] == pytest.approx(sum(ent) / len(ent), rel=1e-6)
            for j in range(T):
                seen = [a[t, j].item() for t in range(max(j, q0), T)]
                assert M.received_attention(w, q0=q0)[b, h, j] == pytest.approx(
                    sum(seen) / len(seen), rel=1e-6
                )


def test_value_norm_and_output_share():
    w = causal_random(1, 2, T, seed=3)
    v = torch.randn(1, 2, T, 5, dtype=torch.float64)
    n = v.norm(dim=-1)
    expect = n[..., 0] / n[..., 1:].mean(-1)
    torch.testing.assert_close(M.value_norm_ratio(v), expect.float())
    out = w @ v
    q0 = 4
    part = (w[..., q0:, 0] * n[..., :1]).sum(-1)
    total = out[..., q0:, :].norm(dim=-1).sum(-1)
    torch.testing.assert_close(M.sink_output_share(w, v, q0=q0), (part / total).float())
    # a pure sink head's output is v_0 on every row: share 1
    assert M.sink_output_share(pure_sink(), v[:, :1]).item() == pytest.approx(1.0)


def test_hidden_state_metrics_equal_explicit():
    h = torch.randn(9, 6, dtype=torch.float64)
    h[0] *= 40
    u = h / h.norm(dim=-1, keepdim=True)
    cos = u @ u.T
    assert M.first_token_cosine(h) == pytest.approx(cos[0, 1:].mean().item())
    inner = cos[1:, 1:]
    off = inner[~torch.eye(8, dtype=torch.bool)]
    assert M.token_similarity(h) == pytest.approx(off.mean().item())
    full = cos[~torch.eye(9, dtype=torch.bool)]
    assert M.token_similarity(h, skip_first=False) == pytest.approx(full.mean().item())
    norms = h.norm(dim=-1)
    assert M.first_token_norm_ratio(h) == pytest.approx((norms[0] / norms[1:].median()).item())
    same = torch.ones(5, 3)
    assert M.token_similarity(same) == pytest.approx(1.0)


def test_sink_positions_far_above_uniform_and_median():
    t = 64
    w = uniform(t).repeat(1, 4, 1, 1) * 0.5
    w[..., 0] += 0.4  # sink on key 0
    w[:, :, 20:, 20] += 0.2  # a secondary sink (a delimiter) at 20
    rec = M.received_attention(w)[0]
    found = M.sink_positions(rec)
    assert [p["position"] for p in found] == [0, 20]
    assert found[0]["mass"] == pytest.approx(rec[:, 0].mean().item())
    assert M.sink_positions(M.received_attention(uniform(t))[0]) == []


def accumulate(w: torch.Tensor, cuts: list[int], q0: int, trim: bool):
    """Per-chunk partial sums over row blocks (optionally with causally trimmed keys)."""
    t = w.shape[-1]
    sums = {k: 0.0 for k in ("s", "d", "p", "e")}
    counts = {k: 0 for k in sums}
    rec, rec_n = torch.zeros((*w.shape[:2], t), dtype=torch.float64), torch.zeros(t)
    bounds = [0, *cuts, t]
    for a, b in itertools.pairwise(bounds):
        c = w[..., a:b, : (b if trim else t)]
        for k, fn in (
            ("s", M.sink_mass_partial(c, 0, q0, a)),
            ("d", M.diagonal_partial(c, q0, a)),
            ("p", M.prev_token_partial(c, q0, a)),
            ("e", M.entropy_partial(c, q0, a)),
        ):
            sums[k] = sums[k] + fn[0]
            counts[k] += fn[1]
        s, n = M.received_partial(c, q0, a)
        rec[..., : s.shape[-1]] += s
        rec_n[: s.shape[-1]] += n
    return {k: sums[k] / counts[k] for k in sums}, rec / rec_n


@settings(max_examples=25, deadline=None)
@given(
    cuts=st.lists(st.integers(1, T - 1), max_size=4, unique=True).map(sorted),
    q0=st.integers(0, T - 1),
    trim=st.booleans(),
)
def test_chunked_equals_unchunked(cuts, q0, trim):
    w = causal_random(1, 2, T, seed=5)
    got, rec = accumulate(w, cuts, q0, trim)
    torch.testing.assert_close(got["s"].float(), M.sink_mass(w, q0=q0))
    torch.testing.assert_close(got["d"].float(), M.diagonal_mass(w, q0=q0))
    if T - max(1, q0) > 0:
        torch.testing.assert_close(got["p"].float(), M.prev_token_mass(w, q0=q0))
    torch.testing.assert_close(got["e"].float(), M.mean_entropy(w, q0=q0))
    torch.testing.assert_close(rec.float(), M.received_attention(w, q0=q0))


def blocks(w, v, cuts, q0, trim):
    """The probe's view of a chunked forward: one spec.Block per row block (keys trimmed or not)."""
    t = w.shape[-1]
    out = w @ v
    for a, b in itertools.pairwise([0, *cuts, t]):
        kend = b if trim else t
        yield spec.Block(w[..., a:b, :kend], v[..., :kend, :], out[..., a:b, :], a, a == 0, q0, 0)


@settings(max_examples=25, deadline=None)
@given(
    cuts=st.lists(st.integers(1, T - 1), max_size=4, unique=True).map(sorted),
    q0=st.integers(0, T - 1),
    trim=st.booleans(),
)
def test_declared_accumulators_chunked_equal_unchunked(cuts, q0, trim):
    """Every attention metric of spec.METRICS, accumulated over row blocks, equals the metric
    function on the whole matrix."""
    w = causal_random(1, 2, T, seed=5)
    v = torch.randn(1, 2, T, 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    acc = spec.Accumulator()
    for block in blocks(w, v, cuts, q0, trim):
        acc.add(block)
    got = acc.result()
    assert set(got) == set(spec.names("attention"))
    whole = {
        "sink_mass": M.sink_mass(w, q0=q0),
        "diagonal_mass": M.diagonal_mass(w, q0=q0),
        "prev_token_mass": M.prev_token_mass(w, q0=q0),
        "entropy": M.mean_entropy(w, q0=q0),
        "value_norm_ratio": M.value_norm_ratio(v),
        "sink_output_share": M.sink_output_share(w, v, q0=q0),
        "received": M.received_attention(w, q0=q0),
    }
    for name, ref in whole.items():
        torch.testing.assert_close(got[name], ref[0], equal_nan=True, msg=name)


def test_metrics_are_causal():
    """Metrics over the first n queries ignore every later row and column."""
    w, n = causal_random(1, 2, T, seed=7), 7
    w2 = w.clone()
    w2[..., n:, :] = causal_random(1, 2, T, seed=8)[..., n:, :]  # another future
    for fn in (M.sink_mass, M.diagonal_mass, M.prev_token_mass, M.mean_entropy):
        torch.testing.assert_close(fn(w[..., :n, :]), fn(w2[..., :n, :]))
        torch.testing.assert_close(fn(w[..., :n, :n]), fn(w2[..., :n, :]))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"eps": (0.3, 1.0)}, "between 0 and 1"),
        ({"eps": (0.0,)}, "between 0 and 1"),
        ({"eps": ()}, "eps is empty"),
        ({"q0": -1}, "q0 must be"),
        ({"sink_factor": 0.5}, "sink_factor"),
    ],
)
def test_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(SinklabError, match=needle):
        ProbeConfig(**kwargs)


def test_config_defaults_are_the_contract():
    c = ProbeConfig()
    assert c.q0 == 0 and c.eps == (0.3, 0.8)


# ------------------------------------------------------------------- (layer, head) tables
def test_nan_mean_leaves_out_nan_and_none_never_zero():
    nan = math.nan
    assert M.nan_mean([0.2, nan, 0.4]) == pytest.approx(0.3)  # not (0.2 + 0 + 0.4) / 3
    assert M.nan_mean([[0.1, None], [nan, 0.5]]) == pytest.approx(0.3)  # nested, None = missing
    t = torch.tensor([[1.0, nan], [3.0, 5.0]])
    assert M.nan_mean(t) == pytest.approx(3.0) == float(t.nanmean())
    for empty in ([], [nan, None], torch.full((2, 2), nan)):
        assert math.isnan(M.nan_mean(empty))


def test_layer_means_match_a_loop_over_heads():
    g = torch.Generator().manual_seed(1)
    mass = torch.rand(4, 5, generator=g, dtype=torch.float64)
    mass[1, 2] = mass[3] = math.nan  # a head with no counted query; a layer with none
    want = []
    for row in mass.tolist():
        kept = [v for v in row if not math.isnan(v)]
        want.append(sum(kept) / len(kept) if kept else math.nan)
    for table in (mass, mass.tolist()):
        got = M.layer_means(table)
        assert got[:3] == pytest.approx(want[:3]) and math.isnan(got[3])


def test_top_heads_rank_by_value_nan_left_out_ties_in_layer_head_order():
    nan = math.nan
    table = [[0.1, 0.9, nan], [0.5, 0.9, 0.7]]
    assert M.top_heads(table, 3) == [(0, 1, 0.9), (1, 1, 0.9), (1, 2, 0.7)]
    assert M.top_heads(torch.tensor(table, dtype=torch.float64), 10) == [
        (0, 1, 0.9), (1, 1, 0.9), (1, 2, 0.7), (1, 0, 0.5), (0, 0, 0.1)
    ]  # fmt: skip
    assert M.top_heads([[nan]], 5) == []
