"""``run_claims`` on tiny models: one row per claim, each effect pinned against an independent
computation of its definition (docs/claims.md), lab claims read from synthetic run folders."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from sinklab.claims import CLAIM_IDS
from sinklab.claims.core import ClaimsConfig, run_claims, text_samples
from sinklab.claims.measure_lab import load_lab_runs, measure_lab
from sinklab.errors import SinklabError

TEXTS = ("shakespeare:hamlet", "shakespeare:macbeth", "shakespeare:othello")
SMALL = dict(
    texts=TEXTS,
    probe_tokens=48,
    stream_tokens=40,
    n_sink=2,
    window=14,
    sensitivity_tokens=24,
    grid=3,
    probes=2,
    cost_lengths=(4, 8),
    cost_steps=10,
    q0=4,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads; on a busy machine two spin-wait (3x the time)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("llama", n_layers=3)


def _row(result, cid):
    return next(r for r in result.to_json()["claims"] if r["id"] == cid)


def test_every_claim_has_one_row_with_the_rule_applied(tiny, tiny_tokenizer, tmp_path):
    cfg = ClaimsConfig(**{**SMALL, "claims": None}, cost_seeds=3, lab=str(tmp_path))
    result = run_claims(tiny, tiny_tokenizer, cfg)
    rows = result.to_json()["claims"]
    assert [r["id"] for r in rows] == list(CLAIM_IDS)
    for r in rows:
        assert r["verdict"] in ("supported", "not supported", "inconclusive")
        assert r["site"] and r["protocol"] and r["reason"]
        if r["interval"] is None:
            assert r["effect"] is None and r["verdict"] == "inconclusive"
        else:
            lo, hi = r["interval"]
            valid = [s["effect"] for s in r["samples"] if s["effect"] is not None]
            assert lo <= r["effect"] <= hi and r["n_valid"] == len(valid)
            assert r["effect"] == pytest.approx(sum(valid) / len(valid))
    for cid in ("softmax1-no-sink", "bos-reliance", "hard-switch-sink"):
        assert _row(result, cid)["reason"].startswith("not measured: no train.json")
    assert _row(result, "sinks-grow-depth")["reason"].startswith("no set-up here can show it")
    assert [s["sample"] for s in _row(result, "first-token-sinks")["samples"]] == list(TEXTS)
    assert len(_row(result, "sink-cheaper")["samples"]) == 3
    assert _row(result, "evict-sinks-collapse")["sizes"]["method"] == "chunked"  # what ran
    run = result.to_json()["run"]
    assert [s["name"] for s in run["samples"]] == list(TEXTS) and set(run["seconds_by_group"])
    assert result.meta == {}  # bare: the caller attaches meta (sinklab.meta.attach_meta)
    json.dumps(result.to_json())  # serialisable


def _eager_weights(model, ids):
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(ids[None], output_attentions=True, use_cache=False)
    finally:
        model.config._attn_implementation = "sdpa"
    return [a[0].double() for a in out.attentions]  # L x (H, T, T)


def test_probe_claims_match_eager_attention(tiny, tiny_tokenizer):
    cfg = ClaimsConfig(**SMALL, claims=("first-token-sinks", "sink-output-small"), eps=0.1)
    result = run_claims(tiny, tiny_tokenizer, cfg)
    samples = text_samples(tiny_tokenizer, cfg, None)
    for (name, ids), row in zip(samples, _row(result, "first-token-sinks")["samples"], strict=True):
        weights = _eager_weights(tiny, ids[: cfg.probe_tokens])
        mass = torch.stack([w[:, cfg.q0 :, 0].mean(-1) for w in weights])  # (L, H)
        assert row["sample"] == name
        assert row["effect"] == pytest.approx(float((mass > 0.1).double().mean()), abs=1e-9)
        assert row["sink_heads"] == int((mass > 0.1).sum())


def test_stream_claim_is_the_log_ppl_ratio_after_eviction(tiny, tiny_tokenizer):
    from sinklab.stream.cache import CacheConfig
    from sinklab.stream.evaluate import stream_nll

    cfg = ClaimsConfig(**SMALL, claims=("evict-sinks-collapse",))
    result = run_claims(tiny, tiny_tokenizer, cfg)
    row = _row(result, "evict-sinks-collapse")
    start = cfg.n_sink + cfg.window
    _, ids = text_samples(tiny_tokenizer, cfg, None, cfg.stream_tokens)[0]
    assert ids.numel() == cfg.stream_tokens
    nll = {
        p: stream_nll(tiny, ids, CacheConfig(p, cfg.n_sink, cfg.window))[0][start:]
        for p in ("window", "sink")
    }
    want = float(nll["window"].mean() - nll["sink"].mean())
    assert row["samples"][0]["effect"] == pytest.approx(want, abs=1e-4)  # chunked vs step
    assert row["samples"][0]["n_targets"] == cfg.stream_tokens - 1 - start
    assert row["sizes"]["first_scored_position"] == start


def test_cost_claim_is_the_exponent_difference():
    from sinklab.lab.cost import CostConfig, run_cost

    cfg = ClaimsConfig(claims=("sink-cheaper",), cost_lengths=(4, 8), cost_seeds=3, cost_steps=10)
    row = _row(run_claims(None, None, cfg), "sink-cheaper")
    res = run_cost(CostConfig(lengths=(4, 8), steps=10, seed=2))
    want = res.fits["diagonal"]["fro_total"]["exponent"] - res.fits["sink"]["fro_total"]["exponent"]
    assert row["samples"][2]["effect"] == pytest.approx(want)
    assert row["n_valid"] == 3 and row["verdict"] in ("supported", "not supported", "inconclusive")


# --------------------------------------------------------------------------- lab claims
def _write_run(folder: Path, *, seed: int, variant: str = "softmax", data: str = "bos", **kw):
    config = {
        "variant": variant,
        "data": data,
        "seed": seed,
        "layers": 1,
        "seq_len": 128,
        "task": "backcopy",
        "device": "cpu",
        "steps": 600,
        "batch_size": 32,
        **{k: v for k, v in kw.items() if k in ("layers", "seq_len", "batch_size")},
    }
    backcopy = {
        "first_token_mass_nontrigger": kw.get("nt", 0.5),
        "first_token_mass_trigger": kw.get("tr", 0.05),
        "output_norm_nontrigger": 0.1,
        "output_norm_trigger": 1.0,
        "null_mass_nontrigger": kw.get("null", 0.0),
        "uniform_first_mass_nontrigger": kw.get("uniform", 0.05),
        "prev_token_mass_trigger": 0.9,
        "backcopy_loss": kw.get("copy_loss", 0.01),
        # the sink rate at eps 0.3 (the one head's first-token mass over all queries)
        "sink_rate": {"0.3": kw.get("rate", 1.0 if kw.get("nt", 0.5) > 0.3 else 0.0)},
    }
    last = {"first_token_sink_mass": kw.get("mass", 0.3), "backcopy": backcopy}
    # a converged trajectory: step 0, then flat over the last 20 % (docs/claims.md#lab-validity)
    val = {"damage": kw.get("damage", 0.1)}
    tail = [{"step": s, **last, "val": val} for s in (480, 510, 540, 570, 600)]
    folder.mkdir(parents=True)
    (folder / "train.json").write_text(
        json.dumps({"config": config, "checkpoints": [{"step": 0}, *tail], "val": val})
    )


def test_lab_claims_pair_runs_that_differ_in_one_field(tmp_path):
    for s in range(3):
        _write_run(tmp_path / f"s{s}" / "softmax", seed=s, nt=0.4 + 0.1 * s)
        _write_run(tmp_path / f"s{s}" / "softmax1", seed=s, variant="softmax1", nt=0.05, null=0.6)
        _write_run(tmp_path / f"s{s}" / "deep", seed=s, layers=4, mass=0.2)  # fewer sinks deeper
        _write_run(tmp_path / f"s{s}" / "packed", seed=s, data="packed", damage=0.3)
    _write_run(tmp_path / "another-sweep" / "softmax", seed=0, nt=0.4)  # a copy: one sample
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "train.json").write_text("{not json")
    assert len(load_lab_runs(tmp_path)) == 12
    cfg = ClaimsConfig(
        claims=(
            "softmax1-no-sink",
            "sinks-grow-depth",
            "sinks-grow-length",
            "bos-reliance",
            "hard-switch-sink",
        ),
        lab=str(tmp_path),
    )
    result = run_claims(None, None, cfg)
    soft = _row(result, "softmax1-no-sink")
    assert [s["effect"] for s in soft["samples"]] == pytest.approx([0.35, 0.45, 0.55])
    assert soft["verdict"] == "supported" and soft["interval"] == pytest.approx([0.35, 0.55])
    depth = _row(result, "sinks-grow-depth")
    assert [s["effect"] for s in depth["samples"]] == pytest.approx([-0.1] * 3)
    # shown, never judged: no set-up here can show the mechanism (docs/claims.md#lab-validity)
    assert depth["verdict"] == "inconclusive" and depth["fidelity"].startswith("none: ")
    bos = _row(result, "bos-reliance")
    assert [s["effect"] for s in bos["samples"]] == pytest.approx([-0.2] * 3)
    assert bos["verdict"] == "not supported"
    switch = _row(result, "hard-switch-sink")
    assert switch["n_valid"] == 6 and switch["verdict"] == "supported"  # 1- and 4-layer runs
    length = _row(result, "sinks-grow-length")
    assert length["reason"].startswith("not measured: no softmax runs that differ only in seq_len")


def test_lab_verdicts_need_converged_runs_that_grew_the_effect(tmp_path):
    for s in range(3):  # seed 1's softmax1 twin is still far from its copy-loss floor
        _write_run(tmp_path / f"s{s}" / "softmax", seed=s, nt=0.5)
        loss = 0.3 if s == 1 else 0.01
        _write_run(tmp_path / f"s{s}" / "softmax1", seed=s, variant="softmax1", copy_loss=loss)
        # length at equal tokens per step (T 128 x 32 = T 512 x 8): raw mass falls, r rises
        _write_run(tmp_path / f"s{s}" / "long", seed=s, seq_len=512, batch_size=8, nt=0.2,
                   uniform=0.01)  # fmt: skip
        # a BOS twin whose with-BOS run grew no sink: nothing to rely on
        _write_run(tmp_path / f"s{s}" / "weak", seed=s, layers=2, nt=0.1)
        _write_run(tmp_path / f"s{s}" / "weak-nobos", seed=s, layers=2, data="no-bos")
    cfg = ClaimsConfig(
        claims=("softmax1-no-sink", "sinks-grow-length", "bos-reliance"), lab=str(tmp_path)
    )
    result = run_claims(None, None, cfg)
    soft = _row(result, "softmax1-no-sink")
    assert soft["verdict"] == "inconclusive" and soft["effect"] is not None
    assert soft["reason"].startswith("not converged: seed 1 softmax1/bos T128x32: copy loss 0.3")
    bad = [c for c in soft["convergence"] if not c["met"]]
    assert [c["run"] for c in bad] == ["seed 1 softmax1/bos T128x32"]
    assert "copy loss <= 0.05" in bad[0]["criterion"] and len(soft["convergence"]) == 6
    assert soft["fidelity"].startswith("proxy: ") and soft["scope"] == "backcopy"
    length = _row(result, "sinks-grow-length")
    # the sink rate: 1 at T 128 (mass 0.5 > 0.3), 0 at T 512 (0.2): -1 per seed, though
    # r = m / u rises (0.5 / 0.05 = 10 at T 128, 0.2 / 0.01 = 20 at T 512): shown, not judged
    assert [s["effect"] for s in length["samples"]] == pytest.approx([-1.0] * 3)
    assert [s["log_r_ratio"] for s in length["samples"]] == pytest.approx([math.log(2)] * 3)
    assert length["samples"][0]["uniform_first_mass"] == {"128": 0.05, "512": 0.01}
    assert length["samples"][0]["tokens_per_step"] == 4096
    assert length["verdict"] == "not supported"
    assert length["verdict_stated"] == "not supported on backcopy"
    assert "on backcopy (a proxy" in length["reason"] and length["settled"]["met"]
    traj = length["samples"][0]["runs"]["seed 0 softmax/bos T512x8"]["trajectory"]
    assert [t["step"] for t in traj] == [0, 480, 510, 540, 570, 600] and traj[-1]["r"] == 20
    bos = _row(result, "bos-reliance")
    assert bos["verdict"] == "inconclusive" and bos["reason"].startswith("no emergence: ")
    assert "seed 0 softmax/bos T128x32: no sink (m 0.1, r 2)" in bos["reason"]


@pytest.mark.usefixtures("one_thread")
def test_default_claims_train_the_lab_runs_and_reuse_them(tmp_path, monkeypatch):
    """No --lab: the claims train their runs (3 seeds per configuration) into the user cache; no
    row says "not measured"; a second run trains nothing and gives the same numbers."""
    from sinklab.lab.cache import cache_listing

    monkeypatch.setenv("SINKLAB_LAB_CACHE", str(tmp_path / "cache"))
    lab = ("softmax1-no-sink", "sinks-grow-depth", "sinks-grow-length", "bos-reliance",
           "hard-switch-sink", "sink-cheaper")  # fmt: skip
    cfg = ClaimsConfig(claims=lab, lab_size="quick", lab_steps=10, cost_lengths=(4, 8),
                       cost_steps=10)  # fmt: skip
    first = run_claims(None, None, cfg).to_json()
    assert first["run"]["lab"]["trained"] == 12 and first["run"]["lab"]["reused"] == 0
    assert len(cache_listing()) == 12  # 3 seeds x (softmax, softmax1, no-bos, long T)
    for row in first["claims"]:
        assert not row["reason"].startswith("not measured"), row
        if row["source"] == "lab" and row["id"] != "sinks-grow-depth":
            n = 6 if row["id"] == "hard-switch-sink" else 3  # every softmax run with BOS
            assert row["n_valid"] == n and row["convergence"] and row["fidelity"]
            # 10 steps: nothing has converged, and the row says so instead of judging
            assert row["verdict"] == "inconclusive" and row["reason"].startswith("not converged")
    length = _row_of(first, "sinks-grow-length")
    assert {s["tokens_per_step"] for s in length["samples"]} == {4096}
    assert [s["seq_len"] for s in length["samples"]] == [[32, 128]] * 3
    second = run_claims(None, None, cfg).to_json()
    assert second["run"]["lab"]["trained"] == 0 and second["run"]["lab"]["reused"] == 12
    assert [r["samples"] for r in second["claims"]] == [r["samples"] for r in first["claims"]]


def _write_plan_run(folder: Path, config, m: float, *, null: float = 0.0, damage: float = 0.05):
    """A settled ``train.json`` for one run of a plan: its own config, the tail flat at
    first-token mass ``m`` (non-trigger queries), a learned copy and a converged copy loss."""
    from dataclasses import asdict

    u = 1.0 / config.seq_len * 3.3  # about uniform's first-token mass at non-trigger queries
    bc = {
        "first_token_mass_nontrigger": m,
        "first_token_mass_trigger": 0.002,
        "uniform_first_mass_nontrigger": u,
        "null_mass_nontrigger": null,
        "diag_mass_nontrigger": 0.001,
        "prev_token_mass_trigger": 0.97,
        "output_norm_nontrigger": 0.3,
        "output_norm_trigger": 1.2,
        "backcopy_loss": 0.005,
        "sink_rate": {"0.3": 1.0 if m > 0.3 else 0.0},
    }
    val = {"damage": damage, "copy_loss_median": 0.005}
    steps = config.steps
    tail = [
        {"step": st, "first_token_sink_mass": m, "backcopy": bc, "val": val}
        for st in range(int(0.8 * steps), steps + 1, steps // 20)
    ]
    folder.mkdir(parents=True)
    raw = {"config": asdict(config), "checkpoints": [{"step": 0}, *tail], "val": val}
    (folder / "train.json").write_text(json.dumps(raw))


def test_the_quick_plans_runs_decide_every_lab_row_they_can(tmp_path):
    """The quick plan (what ``make demo`` trains) pairs into every lab comparison, and once its
    runs settle every lab row but depth is decided by the rule: runs written from the plan's own
    configs (no training: the real numbers live in the report and docs/lab.md#claims-quick)."""
    from sinklab.claims.lab_runs import LAB_SIZES

    configs = LAB_SIZES["quick"].configs()
    assert len(configs) == 12
    for i, c in enumerate(configs):
        variant_sink = c.variant != "softmax"
        m = 0.01 if variant_sink or c.data == "no-bos" else 0.95 - 0.1 * (c.seq_len > 32)
        damage = 0.08 if c.data == "bos" and not variant_sink else 0.02
        _write_plan_run(tmp_path / f"run{i}", c, m, null=0.9 * variant_sink, damage=damage)
    lab = ("softmax1-no-sink", "sinks-grow-depth", "sinks-grow-length", "bos-reliance",
           "hard-switch-sink")  # fmt: skip
    rows = run_claims(None, None, ClaimsConfig(claims=lab, lab=str(tmp_path))).to_json()["claims"]
    for row in rows:
        if row["id"] == "sinks-grow-depth":  # fidelity none: never judged, says why
            assert row["verdict"] == "inconclusive" and "any depth" in row["reason"]
            continue
        assert row["verdict"] in ("supported", "not supported"), (row["id"], row["reason"])
        assert row["n_valid"] == (6 if row["id"] == "hard-switch-sink" else 3)
        assert row["settled"]["met"] and row["verdict_stated"].endswith("on backcopy")
    got = {r["id"]: r["verdict"] for r in rows}
    assert got["softmax1-no-sink"] == "supported" and got["hard-switch-sink"] == "supported"
    assert got["bos-reliance"] == "supported"
    assert got["sinks-grow-length"] == "not supported"  # rate 1 at both lengths: cannot grow


def _row_of(data, cid):
    return next(r for r in data["claims"] if r["id"] == cid)


def test_one_seed_is_too_few_and_no_folder_is_not_measured(tmp_path):
    _write_run(tmp_path / "a", seed=0)
    _write_run(tmp_path / "b", seed=0, variant="sink", nt=0.01)
    result = run_claims(None, None, ClaimsConfig(claims=("softmax1-no-sink",), lab=str(tmp_path)))
    row = _row(result, "softmax1-no-sink")
    assert row["verdict"] == "inconclusive" and row["reason"].startswith("too few samples")
    assert row["effect"] == pytest.approx(0.49)  # the one sample is still shown
    out = measure_lab(None, ["hard-switch-sink"])["hard-switch-sink"]
    assert out.not_measured.startswith("no lab runs given") and not out.samples
    with pytest.raises(SinklabError, match="not a folder"):
        measure_lab(tmp_path / "missing", ["hard-switch-sink"])


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"claims": ("nope",)}, "unknown claim"),
        ({"texts": ()}, "--texts is empty"),
        ({"windows": 0}, "windows must be >= 1"),
        ({"cost_lengths": (16,)}, "cost_lengths"),
        ({"q0": 300}, "q0 must be"),
    ],
)
def test_bad_config_is_one_clear_error(kw, needle):
    with pytest.raises(SinklabError, match=needle):
        ClaimsConfig(**kw)


def test_model_claims_without_a_model_is_an_error():
    with pytest.raises(SinklabError, match="need a model"):
        run_claims(None, None, ClaimsConfig(claims=("first-token-sinks",)))


def test_the_stream_claim_reads_windows_of_its_own_length(tiny, tiny_tokenizer):
    """The stream claim's windows are ``stream_tokens`` long, the others' ``window_tokens``
    (docs/claims.md#stream-claim-sizes): window k of each starts k lengths into the text."""
    from sinklab.corpus import first_token, load_text, token_windows

    cfg = ClaimsConfig(**{**SMALL, "stream_tokens": 64}, windows=2,
                       claims=("evict-sinks-collapse", "first-token-sinks"))  # fmt: skip
    assert cfg.window_tokens == 48  # probe_tokens, not the stream's 64
    result = run_claims(tiny, tiny_tokenizer, cfg)
    tokens = {(s["name"], s["tokens"]) for s in result.run["stream_samples"]}
    assert tokens == {(f"{t}#{k}", 64) for t in TEXTS for k in range(2)}
    assert {s["tokens"] for s in result.run["samples"]} == {48}
    first = first_token(tiny_tokenizer, None)
    stream = token_windows(load_text(TEXTS[0]), tiny_tokenizer, 64, 2, first)
    probe = token_windows(load_text(TEXTS[0]), tiny_tokenizer, 48, 2, first)
    assert torch.equal(stream[0][:48], probe[0])  # the same start
    assert not torch.equal(stream[1][:48], probe[1])  # window 1 starts 64 tokens in, not 48
    got = text_samples(tiny_tokenizer, cfg, None, cfg.stream_tokens)
    assert torch.equal(got[1][1], stream[1])
    row = _row(result, "evict-sinks-collapse")
    assert row["samples"][0]["n_targets"] == 64 - 1 - (cfg.n_sink + cfg.window)


def test_windows_split_one_text(tiny_tokenizer):
    cfg = ClaimsConfig(
        texts=("shakespeare:hamlet",),
        windows=3,
        probe_tokens=16,
        stream_tokens=16,
        sensitivity_tokens=16,
        q0=2,
    )
    samples = text_samples(tiny_tokenizer, cfg, None)
    assert [n for n, _ in samples] == [f"shakespeare:hamlet#{k}" for k in range(3)]
    assert all(ids.numel() == 16 for _, ids in samples)
    assert not torch.equal(samples[0][1], samples[1][1])
    assert math.isfinite(float(samples[2][1].sum()))


def test_geometry_claim_is_the_attention_input_cosine_of_the_middle_layers(tiny, tiny_tokenizer):
    cfg = ClaimsConfig(**SMALL, claims=("first-token-cosine", "density-oversmooths"))
    result = run_claims(tiny, tiny_tokenizer, cfg)
    row = _row(result, "first-token-cosine")
    assert row["sizes"]["layers"] == [1]  # middle third of 3 layers
    _, ids = text_samples(tiny_tokenizer, cfg, None)[0]
    with torch.no_grad():
        hs = tiny(ids[None, : cfg.probe_tokens], output_hidden_states=True).hidden_states
        x = tiny.model.layers[1].input_layernorm(hs[1])[0]  # (T, d): layer 1's attention input
    x = x / x.norm(dim=-1, keepdim=True)
    want = float((x[1:] @ x[0]).mean())
    assert row["samples"][0]["effect"] == pytest.approx(want, abs=1e-5)
    dens = _row(result, "density-oversmooths")
    # the density experiment's rule (docs/experiments.md#density): after the group = layer 2 and
    # the final state (entry 3, after the final norm)
    assert dens["sizes"]["measured_layers"] == [2, "final"] and dens["n_valid"] == 3
    s = dens["samples"][0]
    u, x = s["unmodified"], s["perturbed"]
    assert len(u) == len(x) == 4
    assert s["effect"] == pytest.approx((x[2] + x[3]) / 2 - (u[2] + u[3]) / 2)
    assert s["unmodified"][0] == pytest.approx(s["perturbed"][0])  # before the group: unchanged
    assert abs(x[2] - u[2]) > 1e-6  # the mixed group changes what comes after it


def test_density_claim_is_the_density_experiment_on_the_same_numbers(tiny, tiny_tokenizer):
    """One rule: the claim's effect is what ``ablate -e density`` (mix, the claim's lam) gives."""
    from sinklab.ablate import AblationConfig, run_experiment

    cfg = ClaimsConfig(**SMALL, claims=("density-oversmooths",))
    samples = text_samples(tiny_tokenizer, cfg, None)
    row = _row(run_claims(tiny, tiny_tokenizer, cfg, samples=samples), "density-oversmooths")
    for (_, ids), got in zip(samples, row["samples"], strict=True):
        acfg = AblationConfig(protocol="mix", lams=(0.0, cfg.density_lam))
        res = run_experiment("density", tiny, tiny_tokenizer, ids[: cfg.probe_tokens], acfg)
        s = {k: c["after_group_similarity"]["attention_input"] for k, c in res.conditions.items()}
        assert res.extra["after_layers"] == [2, "final"]
        assert got["effect"] == pytest.approx(s["lam=0.5"] - s["unmodified"], abs=1e-9)
        assert s["lam=0"] == pytest.approx(s["unmodified"], abs=1e-6)  # lam 0 is the model


def test_geometry_finding_and_claim_verdict_agree_on_the_same_numbers(tiny, tiny_tokenizer):
    """``ablate -e geometry`` states the verdict of the claims rule (docs/claims.md) that
    ``sinklab claims`` gives on the same texts: the same per-text effects, interval, verdict."""
    from sinklab.ablate import AblationConfig, run_experiment

    cfg = ClaimsConfig(**SMALL, claims=("first-token-cosine",))
    samples = [(n, ids[: cfg.probe_tokens]) for n, ids in text_samples(tiny_tokenizer, cfg, None)]
    row = _row(run_claims(tiny, tiny_tokenizer, cfg, samples=samples), "first-token-cosine")
    ids = torch.stack([ids for _, ids in samples])  # (3, T): the same three texts
    res = run_experiment("geometry", tiny, tiny_tokenizer, ids, AblationConfig(q0=cfg.q0))
    claim = res.extra["claim"]
    want = [s["effect"] for s in row["samples"]]
    assert claim["effects"] == pytest.approx(want, abs=1e-5)
    assert claim["effect"] == pytest.approx(row["effect"], abs=1e-5)
    assert claim["interval"] == pytest.approx(row["interval"], abs=1e-5)
    assert claim["verdict"] == row["verdict"] and claim["reason"] == row["reason"]
    assert f"`first-token-cosine` is {row['verdict']} by the claims rule" in res.finding
    layer1 = [
        r["layers"][1]["first_token_cosine"]["attention_input"] for r in res.conditions.values()
    ]
    assert claim["effects"] == pytest.approx(layer1)  # middle third of 3 layers: layer 1


def _assert_same_claim(claim: dict, row: dict, finding: str) -> None:
    """An experiment's quoted claim is the claims row on the same samples, word for word."""
    want = [smp["effect"] for smp in row["samples"]]
    assert claim["id"] == row["id"] and claim["effects"] == pytest.approx(want, abs=1e-6)
    assert claim["effect"] == pytest.approx(row["effect"], abs=1e-6)
    assert claim["interval"] == pytest.approx(row["interval"], abs=1e-6)
    assert claim["verdict"] == row["verdict"] and claim["reason"] == row["reason"]
    assert f"`{row['id']}` is {row['verdict']} by the claims rule" in finding
    assert not re.search(r"\bholds?\b|\bthe claim\b", finding)  # no verdict of its own


def test_sensitivity_finding_quotes_the_claims_verdict_on_the_same_texts(tiny, tiny_tokenizer):
    """``ablate -e sensitivity`` on the claims' three texts quotes ``sink-stops-mixing`` as the
    claims table states it (issue 30 item 6: the report said "the claim holds here" from a point
    estimate while the table said inconclusive); each text's effect is log(S_masked / S)."""
    from sinklab.ablate import AblationConfig, run_experiment

    cfg = ClaimsConfig(**SMALL, claims=("sink-stops-mixing",))
    samples = [(n, i[: cfg.sensitivity_tokens]) for n, i in text_samples(tiny_tokenizer, cfg, None)]
    row = _row(run_claims(tiny, tiny_tokenizer, cfg, samples=samples), "sink-stops-mixing")
    acfg = AblationConfig(grid=cfg.grid, probes=cfg.probes, positions=(0,), seed=cfg.seed)
    ids = torch.stack([i for _, i in samples])  # (3, T)
    res = run_experiment("sensitivity", tiny, tiny_tokenizer, ids, acfg)
    _assert_same_claim(res.extra["claim"], row, res.finding)
    for t in res.extra["texts"]:
        assert t["effect"] == pytest.approx(math.log(t["masked"] / t["sensitivity"]))
    one = run_experiment("sensitivity", tiny, tiny_tokenizer, ids[:1], acfg)
    assert one.extra["claim"]["verdict"] == "inconclusive"  # one text: too few for the rule
    assert "too few samples" in one.extra["claim"]["reason"]


def test_density_finding_quotes_the_claims_verdict_on_the_same_texts(tiny, tiny_tokenizer):
    """``ablate -e density`` (mix, the claim's lam 0.5) on the claims' texts quotes
    ``density-oversmooths`` as the claims table states it."""
    from sinklab.ablate import AblationConfig, run_experiment

    cfg = ClaimsConfig(**SMALL, claims=("density-oversmooths",))
    samples = [(n, i[: cfg.probe_tokens]) for n, i in text_samples(tiny_tokenizer, cfg, None)]
    row = _row(run_claims(tiny, tiny_tokenizer, cfg, samples=samples), "density-oversmooths")
    ids = torch.stack([i for _, i in samples])
    res = run_experiment("density", tiny, tiny_tokenizer, ids, AblationConfig(lams=(0.0, 0.5, 1.0)))
    _assert_same_claim(res.extra["claim"], row, res.finding)


def test_geometry_claim_quotes_the_mean_and_names_the_positive_layers():
    """SmolLM2's geometry (docs/experiments.md#geometry; first-token-cosine -0.112 in
    benchmarks/results/2026-12-01/claims-smollm2.md): some middle layers positive, the mean over
    them negative: supported by the claims rule, and the finding still shows the positive layers."""
    from sinklab.ablate.experiments import _positive_layers, geometry_claim

    cos = torch.tensor([[0.3, 0.2, -0.5, 0.1, -0.4, 0.2]] * 2 + [[0.3, 0.2, -0.3, 0.1, -0.2, 0.2]])
    claim = geometry_claim(cos)  # middle third of 6 layers: 2, 3
    assert claim["effects"] == pytest.approx([-0.2, -0.2, -0.1])
    assert claim["effect"] == pytest.approx(-0.5 / 3)
    lo, hi = claim["interval"]
    assert -0.2 - 1e-9 <= lo <= hi <= -0.1 + 1e-9
    assert claim["verdict"] == "supported" and "lies below 0" in claim["reason"]
    assert (
        _positive_layers(cos, [2, 3])
        == "layer 3 positive on average (3 of 6 (text, layer) cells > 0)"
    )
    flipped = geometry_claim(-cos)
    assert flipped["verdict"] == "not supported"


@pytest.mark.integration
def test_claims_on_smollm2_run_over_three_plays(smollm2):
    cfg = ClaimsConfig(claims=("first-token-sinks", "first-token-cosine"), probe_tokens=64)
    result = run_claims(smollm2.model, smollm2.tokenizer, cfg)
    for row in result.to_json()["claims"]:
        assert row["n_valid"] == 3 and row["interval"] is not None, row["reason"]
        assert row["interval"][0] <= row["effect"] <= row["interval"][1]
    assert _row(result, "first-token-cosine")["sizes"]["layers"] == list(range(10, 20))
