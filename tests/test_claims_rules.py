"""The verdict rule of docs/claims.md on synthetic intervals, the bootstrap against hand
computations, and the claims table in the docs against the registry."""

import math
import re
from pathlib import Path

import pytest

from sinklab.claims import CLAIMS, Interval, bootstrap_interval, decide, get_claim, verdict
from sinklab.errors import SinklabError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "claims.md"


def iv(lo: float, hi: float, n: int = 3) -> Interval:
    return Interval((lo + hi) / 2, lo, hi, n)


@pytest.mark.parametrize(
    ("lo", "hi", "direction", "theta", "expected"),
    [
        (0.1, 0.5, "above", 0.0, "supported"),
        (-0.5, -0.1, "above", 0.0, "not supported"),
        (-0.1, 0.5, "above", 0.0, "inconclusive"),
        (0.0, 0.5, "above", 0.0, "inconclusive"),  # touching 0 from the claimed side
        (-0.5, 0.0, "above", 0.0, "not supported"),  # no value of [-0.5, 0] is > 0
        (-0.5, -0.1, "below", 0.0, "supported"),
        (0.1, 0.5, "below", 0.0, "not supported"),
        (-0.5, 0.0, "below", 0.0, "inconclusive"),  # touching 0 from the claimed side
        (0.0, 0.5, "below", 0.0, "not supported"),
        (0.8, 0.9, "below", 1.0, "supported"),
        (0.9, 1.1, "below", 1.0, "inconclusive"),
        (0.7, 0.75, "above", math.log(2), "supported"),
        (0.6, 0.69, "above", math.log(2), "not supported"),
        (0.2, 0.2, "above", 0.2, "not supported"),  # a point interval on the threshold
    ],
)
def test_every_verdict_is_reachable(lo, hi, direction, theta, expected):
    v = verdict(iv(lo, hi), direction, theta)
    assert v.verdict == expected, v.reason
    assert v.reason and ("interval" in v.reason)


def test_too_few_samples_is_inconclusive_whatever_the_interval():
    for n in (1, 2):
        v = verdict(iv(5.0, 6.0, n=n), "above", 0.0)
        assert v.verdict == "inconclusive" and "too few samples" in v.reason
    assert verdict(iv(5.0, 6.0, n=3), "above", 0.0).verdict == "supported"


def test_not_measured_is_inconclusive_with_the_reason():
    v = verdict(None, "above", 0.0, not_measured="pass --lab DIR")
    assert v == v.__class__("inconclusive", "not measured: pass --lab DIR")
    interval, v = decide([], "below", 1.0, not_measured="no sink heads")
    assert interval is None and v.verdict == "inconclusive" and "no sink heads" in v.reason


def test_decide_drops_unmeasurable_samples_and_counts_them():
    interval, v = decide([0.5, None, float("nan"), 0.7], "above", 0.0)
    assert interval is not None and interval.n == 2 and v.verdict == "inconclusive"
    interval, v = decide([0.5, None, 0.6, 0.7], "above", 0.0)
    assert interval.n == 3 and v.verdict == "supported"
    assert interval.mean == pytest.approx(0.6)


def test_bad_direction_or_threshold_is_an_error():
    with pytest.raises(SinklabError):
        verdict(iv(0, 1), "sideways", 0.0)
    with pytest.raises(SinklabError):
        verdict(iv(0, 1), "above", float("nan"))
    with pytest.raises(SinklabError):
        bootstrap_interval([])


def test_bootstrap_of_three_samples_is_their_range():
    # P(all three draws = the minimum) = 1/27 = 3.7 % > 2.5 %: both ends are the extremes
    out = bootstrap_interval([0.3, 1.0, 0.4])
    assert (out.low, out.high, out.n) == (0.3, 1.0, 3)
    assert out.mean == pytest.approx(1.7 / 3)


def test_bootstrap_matches_the_exact_resampling_distribution():
    # samples [0, 0, 0, 1]: a resampled mean is k/4 with k ~ Binomial(4, 1/4);
    # P(k <= 2) = 0.949, P(k <= 3) = 0.996, P(k = 0) = 0.316: the 95 % interval is [0, 0.75]
    out = bootstrap_interval([0.0, 0.0, 0.0, 1.0], resamples=20_000)
    assert out.low == 0.0 and out.high == pytest.approx(0.75)
    # two samples [0, 1]: means 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4 -> [0, 1]
    out = bootstrap_interval([0.0, 1.0])
    assert (out.low, out.high) == (0.0, 1.0)


def test_bootstrap_is_deterministic_for_a_seed_and_narrows_with_more_samples():
    xs = [0.1 * i for i in range(30)]
    a, b = bootstrap_interval(xs, seed=3), bootstrap_interval(xs, seed=3)
    assert a == b
    # normal approximation: mean 1.45, standard error sd / sqrt(30); the interval is close to it
    mean = sum(xs) / 30
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / 30)
    half = 1.96 * sd / math.sqrt(30)
    assert a.low == pytest.approx(mean - half, abs=0.05)
    assert a.high == pytest.approx(mean + half, abs=0.05)
    assert a.high - a.low < (max(xs) - min(xs)) / 2


def _doc_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `([a-z0-9-]+)` \|", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in line.strip().strip("|").split("|")]
    return rows


def test_docs_table_and_registry_agree():
    rows = _doc_rows()
    assert list(rows) == [c.id for c in CLAIMS]
    for c in CLAIMS:
        cells = rows[c.id]
        assert len(cells) == 7 and cells[4] == c.site and cells[5] == c.direction, c.id
        assert float(cells[6]) == pytest.approx(c.threshold, abs=1e-4), c.id
    assert get_claim("sink-cheaper").source == "cost"
    with pytest.raises(SinklabError, match="unknown claim"):
        get_claim("nope")


def test_the_experiment_records_name_only_known_claims():
    from sinklab.ablate.registry import RECORDS, experiments_for_claim

    assert all(c in [k.id for k in CLAIMS] for r in RECORDS for c in r.claims)
    assert [r.name for r in experiments_for_claim("sink-stops-mixing")]  # at least one
