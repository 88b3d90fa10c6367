"""The bigram-backcopy task: the data obeys its rules, the metrics equal a hand computation,
a sink grows for softmax and not for relu in a short run, and a seed fixes everything."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.lab.backcopy import (
    N_SPECIAL,
    BackcopyConfig,
    BackcopyData,
    BigramTable,
    _cdf,
    _draw,
    bigram_table,
    char_tokenizer,
    sample,
)
from sinklab.lab.backcopy_metrics import HEAD_KEYS, backcopy_summary
from sinklab.lab.config import TrainConfig
from sinklab.lab.data import BOS_ID
from sinklab.lab.model import LabConfig, LabForCausalLM, apply_rope, rope_cos_sin
from sinklab.lab.train import checkpoint_steps, train


@pytest.fixture(scope="module")
def table():
    return bigram_table(None, 3)


def test_table_counts_a_hand_text(tmp_path):
    text = "abcab abd ba ca\nab"
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    tb = bigram_table(str(path), n_triggers=2)
    chars = sorted(set(text))
    assert tb.chars == tuple(chars) and tb.vocab_size == N_SPECIAL + len(chars)
    uni = Counter(text)
    top2 = sorted(chars, key=lambda c: (-uni[c], c))[:2]  # 'a' (6), 'b' (5)
    assert [tb.token(t) for t in tb.triggers] == top2 == ["a", "b"]
    pairs = Counter(itertools.pairwise(text))
    for a in chars:
        row = {b: 0 if (a in top2 and b in top2) else pairs[a, b] for b in chars}
        total = sum(row.values())
        for b in chars:
            got = float(tb.transition[N_SPECIAL + chars.index(a), N_SPECIAL + chars.index(b)])
            assert math.isclose(got, row[b] / total, abs_tol=1e-6), (a, b)
    assert math.isclose(
        float(tb.unigram[N_SPECIAL + chars.index("a")]), 6 / len(text), rel_tol=1e-6
    )
    with pytest.raises(SinklabError, match="n-triggers"):
        bigram_table(str(path), n_triggers=10)


@pytest.mark.parametrize("bos", [True, False])
def test_triggers_are_followed_by_the_copied_token_and_the_rest_follows_the_table(table, bos):
    ids, copied = sample(table, 300, 128, bos, torch.Generator().manual_seed(0))
    start = 1 if bos else 0
    assert (ids[:, 0] == BOS_ID).all() == bos and (ids[:, start:] >= N_SPECIAL).all()
    trig = table.is_trigger(ids)
    assert not trig[:, start].any()  # the first character is never a trigger
    assert not (trig[:, 1:] & trig[:, :-1]).any()  # never two triggers in a row
    # every token after a trigger is the token before the trigger, and only those are copies
    after = torch.zeros_like(trig)
    after[:, 1:] = trig[:, :-1]
    assert torch.equal(copied, after)
    n_copy = int(copied.sum())
    assert n_copy > 5000 and torch.equal(ids[:, 2:][copied[:, 2:]], ids[:, :-2][copied[:, 2:]])
    assert not trig[copied].any()  # a copy is never a trigger: copies never chain
    # everything else is a bigram draw: empirical P(b | a) against the table
    prev, nxt = (
        ids[:, start:-1][~copied[:, start + 1 :]],
        ids[:, start + 1 :][~copied[:, start + 1 :]],
    )
    counts = Counter(prev.tolist())
    checked = 0
    for a, n in counts.most_common(8):
        emp = torch.bincount(nxt[prev == a], minlength=table.vocab_size).double() / n
        p = table.transition[a].double()
        tv = 0.5 * float((emp - p).abs().sum())
        # sampling noise alone: E|emp_b - p_b| ~ sqrt(2 p_b (1 - p_b) / (pi n))
        noise = 0.5 * float((2 * p * (1 - p) / (math.pi * n)).sqrt().sum())
        assert tv < 1.5 * noise + 0.01, (table.token(a), n, tv, noise)
        checked += 1
    assert checked == 8
    # and not the unigram: the check can fail
    emp = torch.bincount(nxt[prev == counts.most_common(1)[0][0]], minlength=table.vocab_size)
    assert 0.5 * float((emp.double() / emp.sum() - table.unigram.double()).abs().sum()) > 0.2


def test_batches_are_seeded_by_step_and_rows_slice_the_global_batch():
    data = BackcopyData(BackcopyConfig(seq_len=32))
    a, b = data.batch(3, 8, seed=1), data.batch(3, 8, seed=1)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"], data.batch(4, 8, seed=1)["input_ids"])
    half = data.batch(3, 8, seed=1, rows=slice(4, 8))["input_ids"]
    assert torch.equal(half, a["input_ids"][4:])
    held, _ = data.held_out(4, seed=1)
    assert not any(torch.equal(held, data.batch(s, 4, seed=1)["input_ids"]) for s in range(5))


def test_char_tokenizer_round_trips(table):
    tok = char_tokenizer(table)
    ids = tok("To be, or not\n", add_special_tokens=False).input_ids
    assert tok.decode(ids) == "To be, or not\n" and len(tok) == table.vocab_size
    assert [table.token(i) for i in ids][:3] == ["T", "o", " "]


@torch.no_grad()
def _independent(model: LabForCausalLM, ids: torch.Tensor, table) -> dict[str, list]:
    """Every per-head number by explicit loops over queries, from the model's own weights."""
    variant = model.config.attention_variant
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        blk.self_attn.register_forward_pre_hook(
            lambda m, a, _i=i: inputs.__setitem__(_i, a[0].detach())
        )
        for i, blk in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        logits = model(ids).logits
    for hk in hooks:
        hk.remove()
    n, t = ids.shape
    trig = table.is_trigger(ids)
    res: dict[str, list] = {k: [] for k in HEAD_KEYS}
    for layer, blk in enumerate(model.model.layers):
        attn, x = blk.self_attn, inputs[layer]
        nh, d = attn.n_heads, attn.head_dim
        q, k, v = attn.qkv(x).view(n, t, 3, nh, d).permute(2, 0, 3, 1, 4)
        cos, sin = rope_cos_sin(torch.arange(t).expand(n, t), d, model.config.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        s = (q @ k.transpose(-1, -2)) * d**-0.5  # (N, H, T, T)
        gate = torch.sigmoid(attn.gate(x)).transpose(1, 2) if variant == "gated" else None
        rows = {key: [] for key in HEAD_KEYS}
        for h in range(nh):
            acc = {key: [] for key in HEAD_KEYS}
            for b in range(n):
                for i in range(1, t):
                    e = s[b, h, i, : i + 1].double().exp()
                    denom = e.sum() + (1.0 if variant == "softmax1" else 0.0)
                    w = e / denom
                    o = (w[:, None] * v[b, h, : i + 1].double()).sum(0).norm()
                    g = float(gate[b, h, i]) if gate is not None else 1.0
                    acc["first_token_mass"].append(float(w[0]))  # every query t >= 1
                    if trig[b, i]:
                        acc["first_token_mass_trigger"].append(float(w[0]))
                        acc["prev_token_mass_trigger"].append(float(w[i - 1]))
                        acc["output_norm_trigger"].append(float(o) * g)
                    else:
                        acc["first_token_mass_nontrigger"].append(float(w[0]))
                        acc["null_mass_nontrigger"].append(1 - float(w.sum()))
                        acc["output_norm_nontrigger"].append(float(o) * g)
                        acc["diag_mass_nontrigger"].append(float(w[i]))
                        acc["uniform_first_mass_nontrigger"].append(1.0 / (i + 1))
                        acc["gate_nontrigger"].append(g)
                acc["bos_value_norm"].append(float(v[b, h, 0].norm()))
            for key in HEAD_KEYS:
                rows[key].append(sum(acc[key]) / len(acc[key]))
        for key in HEAD_KEYS:
            res[key].append(rows[key])
    copy_nll = [
        -float(torch.log_softmax(logits[b, i].double(), -1)[ids[b, i + 1]])
        for b in range(n)
        for i in range(t - 1)
        if trig[b, i]
    ]
    res["backcopy_loss"] = sum(copy_nll) / len(copy_nll)
    return res


@pytest.mark.parametrize("variant", ["softmax1", "gated"])
def test_metrics_equal_a_hand_computation(table, variant):
    tok = char_tokenizer(table)
    texts = ["ab the cat sat", "to be or not t"]  # triggers ' ', 'e', 't'
    ids = torch.tensor([[BOS_ID, *tok(x, add_special_tokens=False).input_ids] for x in texts])
    copied = torch.zeros_like(ids, dtype=torch.bool)
    copied[:, 1:] = table.is_trigger(ids[:, :-1])  # marks the targets after each trigger
    torch.manual_seed(3)
    cfg = LabConfig(
        vocab_size=table.vocab_size,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        attention_variant=variant,
        initializer_range=0.4,
    )
    model = LabForCausalLM(cfg).eval()
    got = backcopy_summary(model, ids, copied, table)
    want = _independent(model, ids, table)
    for key in HEAD_KEYS:
        if key == "gate_nontrigger" and variant != "gated":
            continue
        torch.testing.assert_close(
            torch.tensor(got["per_head"][key], dtype=torch.float64),
            torch.tensor(want[key], dtype=torch.float64),
            atol=1e-5,
            rtol=1e-5,
            msg=key,
        )
    assert math.isclose(got["backcopy_loss"], want["backcopy_loss"], rel_tol=1e-5)
    mass = torch.tensor(want["first_token_mass_nontrigger"])
    layer, head = divmod(int(mass.argmax()), 2)
    assert got["head"] == [layer, head]
    assert (
        got["first_token_mass_nontrigger"]
        == got["per_head"]["first_token_mass_nontrigger"][layer][head]
    )
    if variant == "softmax1":
        assert min(min(r) for r in want["null_mass_nontrigger"]) > 0.01
        assert got["gate_nontrigger"] is None


SHORT = dict(
    task="backcopy",
    steps=150,
    layers=1,
    heads=1,
    d_model=64,
    seq_len=64,
    batch_size=32,
    lr=3e-3,
    warmup=10,
    weight_decay=0.0,
    n_checkpoints=2,
    eval_windows=16,
    keep_checkpoints=False,
)


@pytest.fixture(scope="module")
def short_runs():
    return {v: train(TrainConfig(variant=v, **SHORT)) for v in ("softmax", "relu")}


def test_a_sink_grows_for_softmax_and_not_for_relu(short_runs):
    soft = short_runs["softmax"].checkpoints
    first, last = soft[0]["backcopy"], soft[-1]["backcopy"]
    assert first["first_token_mass_nontrigger"] < 0.1
    assert last["first_token_mass_nontrigger"] > 0.25, last  # measured 0.341 (150 steps)
    assert last["prev_token_mass_trigger"] > 0.5 and last["first_token_mass_trigger"] < 0.2
    relu = short_runs["relu"].checkpoints[-1]["backcopy"]
    assert relu["first_token_mass_nontrigger"] < 0.05, relu  # measured 0.000
    assert set(HEAD_KEYS) | {"backcopy_loss", "head", "per_head"} <= set(last)


def test_same_seed_same_run(short_runs):
    cfg = TrainConfig(variant="softmax", **{**SHORT, "steps": 6})
    a, b = train(cfg), train(cfg)
    assert a.loss == b.loss and a.checkpoints == b.checkpoints and a.val == b.val
    c = train(TrainConfig(variant="softmax", seed=1, **{**SHORT, "steps": 6}))
    assert c.loss != a.loss


def test_backcopy_sweep_draws_one_curve_per_run_and_resumes(tmp_path):
    from sinklab.lab.sweep import run_sweep

    base = TrainConfig(**{**SHORT, "steps": 3, "d_model": 32, "seq_len": 16, "batch_size": 4})
    first = run_sweep("depth", base, tmp_path)
    assert [r["name"] for r in first.rows] == ["L1", "L2", "L4"]
    assert all(0 <= r["first_token_mass_nontrigger"] <= 1 for r in first.rows)
    curves = json.loads((tmp_path / "sweep_emergence.json").read_text())["runs"]
    assert set(curves) == {"L1", "L2", "L4"} and (tmp_path / "sweep_emergence.png").is_file()
    assert curves["L4"]["step"] == checkpoint_steps(3, base.n_checkpoints)  # the run's schedule
    assert curves["L4"]["step"][0] == 0 and curves["L4"]["step"][-1] == 3
    saved = json.loads((tmp_path / "L4" / "train.json").read_text())
    assert len(saved["checkpoints"][-1]["backcopy"]["per_head"]["bos_value_norm"]) == 4
    stamp = (tmp_path / "L2" / "train.json").stat().st_mtime_ns
    assert run_sweep("depth", base, tmp_path).rows == first.rows
    assert (tmp_path / "L2" / "train.json").stat().st_mtime_ns == stamp
    assert "first_token_mass_nontrigger" in (tmp_path / "sweep.md").read_text()


def test_a_row_with_no_probability_mass_is_an_error_not_the_last_index():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0], [math.nan, 0.5, 0.5]])
    with pytest.raises(ValueError, match=r"row\(s\) \[1, 2\] of 3"):
        _draw(_cdf(probs), gen)
    drawn = _draw(_cdf(probs[:1].expand(2000, 3)), gen)  # a zero-probability index: never
    assert set(drawn.tolist()) == {0, 1} and abs(float(drawn.float().mean()) - 0.75) < 0.05
    # a table whose character "b" has no successors: sampling reaches it and says so (before,
    # every "b" was followed by the last character, silently)
    v = N_SPECIAL + 3  # characters a, b, c
    transition = torch.zeros(v, v)
    transition[N_SPECIAL, N_SPECIAL + 1] = 1.0  # a -> b; b -> nothing; c -> a
    transition[N_SPECIAL + 2, N_SPECIAL] = 1.0
    unigram = torch.tensor([0.0] * N_SPECIAL + [0.5, 0.0, 0.5])
    table = BigramTable(("a", "b", "c"), unigram, transition, (N_SPECIAL + 2,))
    with pytest.raises(ValueError, match="no probability mass"):
        sample(table, 4, 6, bos=True, generator=gen)


def test_backcopy_config_errors():
    with pytest.raises(SinklabError, match="for task backcopy"):
        TrainConfig(task="backcopy", data="packed")
    with pytest.raises(SinklabError, match="unknown task"):
        TrainConfig(task="copy")
