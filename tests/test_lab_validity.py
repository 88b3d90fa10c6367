"""The validity rules of docs/claims.md#lab-validity on synthetic trajectories: the per-run gate
(copy loss at its floor) and plateau diagnostic, the comparison's settling rule (a drift far under
the gap settles; a gap that still shrinks, flips or oscillates does not), runs that grew no sink
or solved the task with a diagonal head, each giving the stated verdict."""

import math

import pytest

from sinklab.claims.rules import bootstrap_interval
from sinklab.claims.validity import (
    FIDELITY,
    Fidelity,
    RunCheck,
    comparison_settled,
    lab_verdict,
    stated,
)
from sinklab.errors import SinklabError
from sinklab.lab.convergence import (
    BAND,
    convergence,
    copy_loss_at_floor,
    loss_plateau,
    read_out_settled,
    sink_emerged,
    switch_emerged,
)
from sinklab.lab.train import checkpoint_steps

STEPS = 1000


def _checkpoints(mass, copy_loss=0.01, uniform=0.1, prev=0.95):
    """Backcopy checkpoint rows at the real schedule, the read-out ``mass(step)``."""
    return [
        {
            "step": s,
            "sink_rate": {"0.3": 1.0 if mass(s) > 0.3 else 0.0},
            "backcopy": {
                "first_token_mass_nontrigger": mass(s),
                "uniform_first_mass_nontrigger": uniform,
                "backcopy_loss": copy_loss if s == STEPS else 4.0 * (1 - s / STEPS) + copy_loss,
                "prev_token_mass_trigger": prev,
            },
        }
        for s in checkpoint_steps(STEPS, 8)
    ]


def converged(s):  # rises, then flat at 0.6 long before the tail
    return 0.6 * (1 - math.exp(-s / 100))


def rising(s):  # still climbing by 0.2 over the last 20 %
    return 0.6 * s / STEPS


def oscillating(s):  # swings 0.3 <-> 0.6 between tail checkpoints
    return 0.45 + 0.15 * (-1) ** (s // 50)


def flat_low(s):  # never grows: uniform's mass
    return 0.1


def test_the_schedule_has_log_spaced_and_tail_checkpoints():
    steps = checkpoint_steps(STEPS, 8)
    assert steps[0] == 0 and steps[-1] == STEPS and steps == sorted(set(steps))
    assert [s for s in steps if s >= 800] == [800, 850, 900, 950, 1000]
    assert {1, 3, 7, 19, 52, 139, 373} <= set(steps)  # 1000 ** (i / 7)


@pytest.mark.parametrize(
    "mass, plateau, needle",
    [
        (converged, True, ""),
        (rising, False, "read-out 0.48..0.6"),
        (oscillating, False, "read-out 0.3..0.6"),
        (flat_low, True, ""),  # flat (at nothing): the gate holds, emergence will not
    ],
)
def test_the_plateau_is_a_diagnostic_and_the_copy_loss_the_gate(mass, plateau, needle):
    c = convergence(_checkpoints(mass), STEPS)
    assert c["met"] is True and c["reason"] == ""  # copy loss 0.01: the gate holds
    assert "copy loss <= 0.05" in c["criterion"] and "within 0.05" not in c["criterion"]
    (diag,) = c["diagnostics"]
    assert (
        diag["met"] is plateau and needle in diag["detail"] and "within 0.05" in diag["criterion"]
    )


def test_the_copy_loss_gate_reads_the_median_over_the_validation_sequences():
    cps = _checkpoints(converged, copy_loss=0.001)  # the probe's mean: low
    cps[-1]["val"] = {"backcopy_loss_median": 0.2, "n_sequences": 64}  # the median: high
    c = convergence(cps, STEPS)
    assert not c["met"] and "copy loss 0.2" in c["reason"]
    assert "median over 64 validation sequences" in c["criterion"]
    cps[-1]["val"]["backcopy_loss_median"] = 0.004
    assert convergence(cps, STEPS)["met"]


def test_each_criterion_fails_alone():
    assert not convergence(_checkpoints(converged, copy_loss=0.2), STEPS)["met"]
    assert copy_loss_at_floor(0.05).met and not copy_loss_at_floor(0.0501).met
    assert not copy_loss_at_floor(None).met
    pts = [(800, 0.5), (900, 0.5 + BAND - 1e-9), (1000, 0.5)]
    assert read_out_settled(pts, STEPS).met
    assert not read_out_settled([(800, 0.5), (900, 0.5 + BAND + 1e-3), (1000, 0.5)], STEPS).met
    few = read_out_settled([(500, 0.5), (900, 0.5), (1000, 0.5)], STEPS)
    assert not few.met and "only 2 checkpoint(s)" in few.detail
    assert not read_out_settled([(800, 0.5), (900, math.nan), (1000, 0.5)], STEPS).met


def test_text_runs_read_the_loss_plateau():
    flat = [(s, 3.0 + 1.0 / s) for s in range(1, 201)]  # last 10 % falls ~0.0005
    falling = [(s, 5.0 - 0.01 * s) for s in range(1, 201)]  # falls 0.2 per 10 %
    assert loss_plateau(flat).met and not loss_plateau(falling).met
    assert "fell 0.2" in loss_plateau(falling).detail
    rising = [(s, 3.0 + 0.01 * s) for s in range(1, 201)]  # diverging: rises 0.2 per 10 %
    assert not loss_plateau(rising).met and "rose 0.2" in loss_plateau(rising).detail


def test_emergence_criteria():
    assert sink_emerged(0.375, 0.125).met and not sink_emerged(0.29, 0.1).met
    assert "r 2.9" in sink_emerged(0.29, 0.1).detail
    assert not sink_emerged(None, 0.1).met and not sink_emerged(0.3, 0.0).met
    assert switch_emerged(0.5).met and not switch_emerged(0.49).met


def _verdict(masses, fidelity=FIDELITY["softmax1-no-sink"], effects=(0.3, 0.35, 0.4)):
    """A comparison of three seeds whose runs follow ``masses`` (the first must grow a sink)."""
    conv, emer = [], []
    for seed, mass in enumerate(masses):
        cps = _checkpoints(mass)
        c = convergence(cps, STEPS)
        conv.append(RunCheck(f"seed {seed}", c["met"], c["criterion"], c["reason"]))
        last = cps[-1]["backcopy"]
        e = sink_emerged(last["first_token_mass_nontrigger"], last["uniform_first_mass_nontrigger"])
        emer.append(RunCheck(f"seed {seed}", e.met, e.criterion, e.detail))
    interval = bootstrap_interval(list(effects))
    return lab_verdict(interval, "above", 0.0, fidelity, conv, emer)


def test_verdicts_of_synthetic_comparisons():
    v = _verdict([converged] * 3)
    assert v.verdict == "supported" and "on backcopy (a proxy" in v.reason
    assert stated(v.verdict, "backcopy") == "supported on backcopy"
    v = _verdict([converged] * 3, effects=(-0.3, -0.2, -0.1))
    assert v.verdict == "not supported" and stated(v.verdict, "backcopy").endswith("on backcopy")
    v = _verdict([flat_low] * 3)
    assert v.verdict == "inconclusive" and v.reason.startswith("no emergence: seed 0: m 0.1, r 1")
    assert stated("inconclusive", "backcopy") == "inconclusive"


def test_same_protocol_keeps_the_plain_reason_and_none_is_never_judged():
    v = _verdict([converged] * 3, fidelity=FIDELITY["hard-switch-sink"])
    assert v.verdict == "supported" and "proxy" not in v.reason
    v = _verdict([converged] * 3, fidelity=FIDELITY["sinks-grow-depth"])
    assert v.verdict == "inconclusive" and "one switching head at any depth" in v.reason
    assert "benchmarks/lab_gpu.py --depths" in v.reason  # the run that decides it
    none = lab_verdict(None, "above", 0.0, FIDELITY["bos-reliance"], [], [], not_measured="x")
    assert none.verdict == "inconclusive" and none.reason == "not measured: x"


def test_every_lab_claim_has_a_fidelity():
    from sinklab.claims.measure_lab import LAB_CLAIMS

    assert set(FIDELITY) == set(LAB_CLAIMS)
    assert FIDELITY["sinks-grow-length"].label.startswith("proxy: ")
    with pytest.raises(SinklabError, match="fidelity"):
        Fidelity("roughly")


def test_a_comparison_checks_every_run_not_every_label():
    """Runs that differ only in lr share a display label; each one's convergence is checked, so
    a run that did not converge cannot hide behind a converged twin."""
    from sinklab.claims.measure_lab import LabRun, _Compared

    def run(lr: float, wobble: float) -> LabRun:
        config = {"task": "text", "seed": 0, "variant": "softmax", "data": "bos", "lr": lr}
        config |= {"seq_len": 32, "batch_size": 8, "steps": STEPS}
        rows = [
            {"step": s, "first_token_sink_mass": 0.5 + (wobble if i % 2 else 0.0)}
            for i, s in enumerate(checkpoint_steps(STEPS, 8))
        ]
        loss = [(s, 3.0 - (0.01 * s if wobble else 0.0)) for s in range(1, 201)]
        return LabRun(None, config, rows, {}, loss)

    settled, moving = run(1e-3, 0.0), run(3e-3, 0.3)  # the loss of one still falls
    assert settled.label == moving.label
    seen = _Compared()
    seen.runs(settled)
    seen.runs(moving)
    seen.emerged(settled.sink(), settled)
    seen.emerged(moving.sink(), moving)
    assert sorted(c.met for c in seen.convergence.values()) == [False, True]
    assert len(seen.emergence) == 2


TAIL = (800, 850, 900, 950, 1000)


def _tails(*per_sample):
    """Per sample, ``effect(step)`` over the tail checkpoints."""
    return [[(s, f(s)) for s in TAIL] for f in per_sample]


def _ramp(a, b):
    return lambda s: a + (b - a) * (s - 800) / 200


def test_a_drift_far_under_the_gap_settles():
    """The issue's case: softmax drifts 0.60 -> 0.71 over the tail against softmax1 at 0: a
    0.11 drift cannot change a 0.7 gap."""
    tails = _tails(_ramp(0.60, 0.71), _ramp(0.72, 0.78), _ramp(0.95, 0.98))
    c = comparison_settled(tails, "above", 0.0)
    assert c.met, c.reason
    assert "drift 0.11" in c.reason and "from the threshold" in c.reason


def test_a_gap_that_still_shrinks_does_not_settle():
    tails = _tails(_ramp(0.7, 0.2), _ramp(0.6, 0.25), _ramp(0.8, 0.3))  # supported throughout
    c = comparison_settled(tails, "above", 0.0)
    assert not c.met and "drift 0.4" in c.reason and "0.2 from the threshold" in c.reason
    v = lab_verdict(
        bootstrap_interval([0.2, 0.25, 0.3]),
        "above",
        0.0,
        FIDELITY["hard-switch-sink"],
        [RunCheck("r", True, "c")],
        [],
        settled=c,
    )
    assert v.verdict == "inconclusive" and v.reason.startswith("not settled: interval [0.2")


def test_a_flipping_or_oscillating_comparison_does_not_settle_and_a_flat_one_does():
    flip = comparison_settled(
        _tails(_ramp(-0.1, 0.3), _ramp(-0.2, 0.4), _ramp(0.0, 0.5)), "above", 0.0
    )
    assert not flip.met and "verdict changes" in flip.reason

    def wobble(s):  # swings 0.05 <-> 0.3 between tail checkpoints, ending low
        return 0.3 if (s // 50) % 2 else 0.05

    osc = comparison_settled(_tails(wobble, wobble, wobble), "above", 0.0)
    assert not osc.met and "drift 0.25" in osc.reason
    flat = comparison_settled(_tails(lambda s: -0.3, lambda s: -0.2, lambda s: -0.25), "above", 0.0)
    assert flat.met  # not supported, steadily: settled too
    straddle = _tails(lambda s: -0.1 + s / 1e4, lambda s: 0.0, lambda s: 0.1)
    assert comparison_settled(straddle, "above", 0.0).met  # the rule's inconclusive: moot
    assert comparison_settled(_tails(*[lambda s: 0.0] * 3), "above", 0.0).met  # never moved
    few = comparison_settled([[(1000, 0.5)]] * 3, "above", 0.0)
    assert not few.met and "only 1 tail checkpoint" in few.reason


def test_a_diagonal_head_is_no_sink_and_a_kept_sink_is_no_removal():
    from sinklab.claims.measure_lab import LabRun

    def run(m, diag, variant="softmax"):
        bc = {
            "first_token_mass_nontrigger": m,
            "uniform_first_mass_nontrigger": 0.1,
            "diag_mass_nontrigger": diag,
        }
        config = {"task": "backcopy", "seed": 0, "variant": variant, "steps": STEPS}
        return LabRun(None, config, [{"step": STEPS, "backcopy": bc}], {}, [])

    diagonal = run(0.05, 0.9).sink()
    assert not diagonal.met and "solved without a sink: a diagonal head" in diagonal.reason
    assert run(0.8, 0.01).sink().met and "no sink" in run(0.2, 0.1).sink().reason
    kept = run(0.8, 0.0, "softmax1").sink_free()  # r 8: the variant still has a sink
    assert not kept.met and "still carries a first-token sink (m 0.8, r 8), not settled" in (
        kept.reason
    )
    assert run(0.01, 0.0, "softmax1").sink_free().met

    def tailed(ms):  # the variant's first-token mass at tail checkpoints 800..1000
        bc = {"uniform_first_mass_nontrigger": 0.1, "diag_mass_nontrigger": 0.0}
        cps = [
            {"step": st, "backcopy": {**bc, "first_token_mass_nontrigger": m}}
            for st, m in zip(range(800, 1001, 50), ms, strict=True)
        ]
        config = {"task": "backcopy", "seed": 2, "variant": "softmax1", "steps": STEPS}
        return LabRun(None, config, cps, {}, []).sink_free()

    # seed 2 of the quick plan: softmax1 kept its sink flat (0.991..0.993; 0.998 at 2,000 steps)
    flat = tailed([0.993, 0.993, 0.991, 0.993, 0.993])
    assert not flat.met and "settled with a first-token sink" in flat.reason
    assert "kept a flat first-token sink" in flat.reason and "steps 800-1000" in flat.reason
    leaving = tailed([0.9, 0.7, 0.5, 0.4, 0.35])  # on its way out: not settled, not a finding
    assert not leaving.met and "not settled" in leaving.reason
    conv = [RunCheck("seed 2 softmax1/bos T32x128", True, "copy loss", "")]
    interval = bootstrap_interval([0.994, 0.904, 0.006])

    def row(emergence):
        return lab_verdict(interval, "above", 0.0, FIDELITY["softmax1-no-sink"], conv, emergence)

    kept_row = row([flat])  # the row's reason is the finding, not "no emergence"
    assert kept_row.verdict == "inconclusive"
    assert kept_row.reason.startswith("the variant kept the sink: seed 2 softmax1")
    assert row([leaving]).reason.startswith("no emergence: ")
