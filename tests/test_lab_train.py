"""Training: the loss falls for every variant and data strategy; a seed fixes the loss curve."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.lab.config import TrainConfig
from sinklab.lab.data import DATA_STRATEGIES, DataConfig, LabData
from sinklab.lab.model import LAB_VARIANTS
from sinklab.lab.train import build_model, checkpoint_steps, probe_summary, train
from sinklab.meta import META_KEYS
from sinklab.models.loading import file_sha256
from sinklab.probe import ProbeConfig, probe

TINY = dict(
    steps=40,
    layers=1,
    d_model=32,
    heads=2,
    seq_len=24,
    batch_size=4,
    vocab_size=320,
    lr=1e-2,
    warmup=5,
    n_checkpoints=2,
    eval_windows=4,
    max_docs=8,
    keep_checkpoints=False,
)


@pytest.fixture(scope="session")
def shared_tokenizer():
    return LabData(DataConfig(seq_len=24, vocab_size=320, max_docs=8)).tokenizer


def _data(config: TrainConfig, tokenizer) -> LabData:
    return LabData(config.data_config(), tokenizer=tokenizer)


def _drop(loss: list[tuple[int, float]]) -> float:
    first = sum(v for _, v in loss[:5]) / 5
    last = sum(v for _, v in loss[-5:]) / 5
    return first - last


@pytest.mark.parametrize(
    ("variant", "data"),
    [(v, "bos") for v in LAB_VARIANTS] + [("softmax", d) for d in DATA_STRATEGIES[1:]],
)
def test_a_few_dozen_steps_lower_the_loss(variant, data, shared_tokenizer):
    config = TrainConfig(variant=variant, data=data, **TINY)
    result = train(config, data=_data(config, shared_tokenizer))
    assert _drop(result.loss) > 0.5, result.loss[:3] + result.loss[-3:]
    last = result.checkpoints[-1]
    assert set(last["sink_rate"]) == {"0.3", "0.8"} and "probe" not in last
    assert len(last["sink_mass"]) == 1 and len(last["sink_mass"][0]) == 2
    assert result.val["ppl_with_first"] > 1 and result.val["ppl_without_first"] > 1


def test_same_seed_same_loss_curve_and_outputs(tmp_path, shared_tokenizer):
    config = TrainConfig(variant="sink", data="doc-mask", **{**TINY, "steps": 8})
    a = train(config, tmp_path / "a", data=_data(config, shared_tokenizer))
    b = train(config, data=_data(config, shared_tokenizer))
    assert a.loss == b.loss
    other = train(
        TrainConfig(variant="sink", data="doc-mask", seed=1, **{**TINY, "steps": 8}),
        data=_data(config, shared_tokenizer),
    )
    assert other.loss != a.loss
    saved = json.loads((tmp_path / "a" / "train.json").read_text())
    assert saved["loss"] == [list(x) for x in a.loss] and "meta" in saved
    assert {"ppl_with_first", "ppl_without_first", "damage"} <= set(saved["val"])
    for name in ("loss", "sinks"):
        assert (tmp_path / "a" / f"{name}.png").is_file()
        assert (tmp_path / "a" / f"{name}.json").is_file()
    final = tmp_path / "a" / "checkpoints" / "step-8"
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    # the one provenance block; the run's own facts beside it, not in it
    meta, run = saved["meta"], saved["run"]
    assert tuple(meta) == META_KEYS and meta["params"] == asdict(config)
    assert meta["text"]["name"] == "shakespeare" and len(meta["text"]["sha256"]) == 64
    model = meta["model"]
    assert model["model_type"] == "sinklab-tiny" and model["source"] == "checkpoints/step-8"
    assert model["weights_sha256"] == file_sha256(final / "model.safetensors")
    n_params = sum(p.numel() for p in build_model(config, config.vocab_size).parameters())
    assert model["n_params"] == n_params and model["n_layers"] == 1 and model["n_heads"] == 2
    data = _data(config, shared_tokenizer)
    assert run["corpus"] == "first 8 scenes" and run["n_train_tokens"] == data.n_train_tokens
    assert run["n_sequences"] == data.ids.shape[0] and run["processes"] == 1
    assert run["probe"] == {"q0": 0, "eps": [0.3, 0.8], "key": 0, "n_tokens": 24}
    assert 0 < run["step_seconds"] <= meta["seconds"]
    assert b.meta["model"]["source"] == "in memory (not saved)" and b.run.keys() == run.keys()


def test_checkpoint_rows_are_the_probes_own_numbers():
    """A checkpoint's sink rate is the probe's ``sink_rate`` (not recomputed), equal to a count
    by hand; the mean sink mass is the mean of the probe's ``sink_mass``."""
    model = build_model(TrainConfig(layers=2, d_model=24, heads=3, vocab_size=320)).eval()
    with torch.no_grad():  # sharper attention: some heads above 0.3, some below (rate 5/6)
        for name, p in model.named_parameters():
            if "qkv" in name:
                p.mul_(8)
    ids = torch.randint(3, 300, (8,), generator=torch.Generator().manual_seed(0))
    row = probe_summary(model, ids)
    own = probe(model, ids, config=ProbeConfig(q0=0, eps=(0.3, 0.8)))
    assert row["sink_rate"] == own.sink_rate and row["sink_mass"] == own.sink_mass.tolist()
    flat = [m for layer in row["sink_mass"] for m in layer]
    for eps in (0.3, 0.8):
        by_hand = sum(m > eps for m in flat) / len(flat)
        assert abs(row["sink_rate"][f"{eps:g}"] - by_hand) < 1e-6
    assert 0 < row["sink_rate"]["0.3"] < 1  # the count is not trivially all or none
    assert row["first_token_sink_mass"] == pytest.approx(sum(flat) / len(flat), abs=1e-12)


def test_checkpoint_schedule():
    steps = checkpoint_steps(1000, 5)
    assert steps[0] == 0 and steps[-1] == 1000 and steps == sorted(set(steps))
    assert checkpoint_steps(1, 3) == [0, 1]


def test_checkpoint_schedule_fills_the_tail_convergence_reads():
    from sinklab.lab.convergence import tail
    from sinklab.lab.train import TAIL_POINTS

    for steps in (*range(20, 400), 1003, 2503, 10007):  # 1003: round(0.8 S) = 802 < 802.4
        pts = [(s, 0.0) for s in checkpoint_steps(steps, 8)]
        assert len(tail(pts, steps)) >= TAIL_POINTS, steps


def test_bad_train_config_is_one_error():
    with pytest.raises(SinklabError, match="d-model"):
        TrainConfig(d_model=30, heads=4)
    with pytest.raises(SinklabError, match="variant"):
        TrainConfig(variant="relu2")


def test_sweep_resumes_finished_runs_and_retrains_changed_ones(tmp_path):
    from dataclasses import replace

    from sinklab.lab.sweep import run_sweep
    from sinklab.lab.train import load_result

    base = TrainConfig(**{**TINY, "steps": 4})
    seen: dict[str, list[tuple[float, float, str]]] = {}

    def progress_for(name: str):  # one Progress per run, as the CLI's one bar per run
        seen[name] = []
        return lambda done, total, note: seen[name].append((done, total, note))

    first = run_sweep("data", base, tmp_path, progress_for=progress_for)
    assert list(seen) == list(DATA_STRATEGIES)
    assert all([(d, t) for d, t, _ in s] == [(i, 4) for i in range(1, 5)] for s in seen.values())
    assert all(note.startswith("loss ") for s in seen.values() for _, _, note in s)
    stamps = {d: (tmp_path / d / "train.json").stat().st_mtime_ns for d in DATA_STRATEGIES}
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["kind"] == "data" and saved["rows"] == first.rows and saved["swept"] == "data"
    assert tuple(saved["meta"]) == META_KEYS and saved["meta"]["params"] == asdict(base)
    assert saved["meta"]["model"] is None and saved["meta"]["text"]["name"] == "shakespeare"
    assert (tmp_path / "sweep_compare.png").is_file() and (tmp_path / "sweep.md").is_file()
    again = run_sweep("data", base, tmp_path, progress_for=progress_for)
    assert again.rows == first.rows
    assert all([(d, t) for d, t, _ in s] == [(4, 4)] for s in seen.values())  # reused: done
    assert stamps == {d: (tmp_path / d / "train.json").stat().st_mtime_ns for d in DATA_STRATEGIES}
    # a different configuration is not "finished": it is trained again
    changed = run_sweep("data", replace(base, seed=1), tmp_path)
    assert all(
        (tmp_path / d / "train.json").stat().st_mtime_ns != stamps[d] for d in DATA_STRATEGIES
    )
    assert [r["final_loss"] for r in changed.rows] != [r["final_loss"] for r in first.rows]
    (tmp_path / "packed" / "train.json").write_text("{not json")
    assert load_result(tmp_path / "packed") is None
    assert load_result(tmp_path / "nowhere") is None


def test_sweep_md_is_written_atomically(tmp_path):
    """A sweep's outputs are rewritten when it resumes: a failure while writing sweep.md (here a
    run name UTF-8 cannot encode) leaves the previous sweep.md whole (before: truncated), and
    no temporary file behind."""
    from sinklab.lab.sweep import COLUMNS, SweepResult, write_outputs

    def sweep(name: str) -> SweepResult:
        row = {c: 0.5 for c in COLUMNS} | {"name": name, "seconds": 1.0}
        return SweepResult("variants", TrainConfig(steps=2), [row], swept="variant")

    write_outputs(sweep("softmax"), tmp_path, [])
    before = (tmp_path / "sweep.md").read_text(encoding="utf-8")
    assert "| softmax | 0.500 |" in before
    with pytest.raises(UnicodeEncodeError):
        write_outputs(sweep("bad\ud800name"), tmp_path, [])
    assert (tmp_path / "sweep.md").read_text(encoding="utf-8") == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
