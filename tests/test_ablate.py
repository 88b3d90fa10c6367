"""sinklab ablate: every experiment end to end on a tiny model, the CLI, bad inputs, SmolLM2."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model
from helpers import assert_one_line_error, run_main
from sinklab.ablate import EXPERIMENTS, AblationConfig, get_experiment, perplexity, run_experiment
from sinklab.ablate.first_token import first_token
from sinklab.errors import SinklabError
from sinklab.meta import attach_meta


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", n_layers=3)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_end_to_end(tiny, tiny_tokenizer, tmp_path, name):
    ids = torch.randint(4, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    config = AblationConfig(grid=4, probes=0, lams=(0.0, 0.5, 1.0))
    calls = []
    res = run_experiment(
        name, tiny, tiny_tokenizer, ids, config, lambda d, t, note: calls.append((d, t, note))
    )
    data = json.loads(json.dumps(res.to_json()))
    assert data["experiment"] == name and res.config.grid == 4
    texts = 2 if get_experiment(name).texts else 1  # one row unless the record reads several
    assert res.params() == {**res.config.__dict__, "experiment": name, "tokens": 20,
                            "texts": texts}  # fmt: skip
    assert data["meta"] == {}  # a bare result: the caller attaches meta (sinklab.meta.attach_meta)
    assert data["conditions"] and isinstance(data["finding"], str) and "\n" not in data["finding"]
    done = [d for d, _, _ in calls]  # progress(done, total, note): counts up to its total
    assert done == sorted(done) and calls[-1][0] == calls[-1][1] > 0
    assert all(isinstance(note, str) for _, _, note in calls) and any(n for _, _, n in calls)
    attach_meta(res, None, None, res.params(), None)  # a run without a model or text: left out
    res.save(tmp_path)
    res.figure(tmp_path / f"{name}.png")
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    assert json.loads((tmp_path / "ablate.json").read_text())["finding"] == res.finding
    title = json.loads((tmp_path / f"{name}.json").read_text())["title"]
    assert title == f"{name}: T=20, q0={config.q0}, eps={config.eps}, seed={config.seed}"
    dataclasses.replace(res, meta={}).figure(tmp_path / "bare.png")  # no meta: no traceback
    assert json.loads((tmp_path / "bare.json").read_text())["title"] == title
    if name == "first-token":  # whitespace tokenizer: "\n" is no token, so that mode is skipped
        assert "newline" in data["skipped"] and {"keep", "drop", "bos", "word"} <= set(
            data["conditions"]
        )
        assert len({c["n_targets"] for c in data["conditions"].values()}) == 1
    if name == "density":
        assert data["conditions"]["lam=0"]["lam"] == 0.0 and data["protocol"] == "mix"
    if name == "geometry":
        assert len(data["layers"]) == 3 and data["verdict_site"] == "attention_input"
        assert set(data["layers"][1]["first_token_cosine"]) == {
            "residual",
            "attention_input",
            "key",
        }
        assert "attention input" in data["finding"] and "seed" not in data["finding"]
    if name == "sensitivity":
        m = torch.tensor(data["matrices"]["sink masked"])
        assert m.shape == (4, 4) and m[1:, 0].max() < 1e-6  # the masked sink is cut off


def test_perplexity_scores_the_same_targets(tiny):
    ids = torch.randint(4, 500, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = tiny(ids).logits[0]
    ref = F.cross_entropy(logits[1:-1].double(), ids[0, 2:])
    ppl = perplexity(tiny, ids)
    assert ppl.n_targets == 14 and math.isclose(ppl.nll, float(ref), rel_tol=1e-6)
    drop = first_token(ids, "drop")
    with torch.no_grad():
        logits = tiny(drop.ids).logits[0]
    ref = F.cross_entropy(logits[:-1].double(), ids[0, 2:])
    assert math.isclose(perplexity(tiny, drop.ids, 2 + drop.shift).nll, float(ref), rel_tol=1e-6)


def test_config_and_model_checks(tiny, tiny_tokenizer):
    with pytest.raises(SinklabError, match=r"lam must be in \[0, 1\]"):
        AblationConfig(lams=(0.0, 1.2))
    with pytest.raises(SinklabError, match="mask every key position"):
        AblationConfig(positions=tuple(range(10))).check_tokens(10)
    with pytest.raises(SinklabError, match=r"layer 7 is out of range.*0\.\.2"):
        run_experiment(
            "mask-sink", tiny, tiny_tokenizer, torch.arange(4, 24), AblationConfig(layers=(7,))
        )
    with pytest.raises(SinklabError, match="unknown experiment"):
        run_experiment("nope", tiny, tiny_tokenizer, torch.arange(4, 24))


def test_cli_writes_json_and_figure(capsys, tiny_model_dir, tmp_path):
    proc = run_main(
        capsys,
        "ablate", "-e", "mask-sink", "--model", str(tiny_model_dir("llama")),
        "--tokens", "24", "--out", str(tmp_path), "--format", "json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["meta"]["model"]["n_layers"] == 2 and data["meta"]["text"]["name"]
    assert set(data["conditions"]) >= {"never", "all layers"}
    assert (tmp_path / "mask-sink.png").is_file() and (tmp_path / "ablate.json").is_file()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-e", "shuffle"], "unknown experiment 'shuffle'"),
        (["-e", "density", "--lams", "0,1.5"], "lam must be in [0, 1]"),
        (["-e", "mask-sink", "--tokens", "8", "--positions", "0,1,2,3,4,5,6,7"], "every key"),
        (
            ["-e", "mask-sink", "--layers", "9"],
            "layer 9 is out of range: this model has layers 0..1",
        ),
        (["-e", "mask-sink", "--heads", "4"], "head 4 is out of range: this model has heads 0..3"),
    ],
)
def test_bad_inputs_one_line_exit_2(capsys, tiny_model_dir, args, needle):
    model = ["--model", str(tiny_model_dir("llama")), "--tokens", "16"]
    assert_one_line_error(run_main(capsys, "ablate", *model, *args), needle)


@pytest.mark.integration
def test_smollm2_first_token_and_mask_sink_directions(smollm2):
    # Measured on SmolLM2, shakespeare, T=128: keep 26.4, drop 27.7 (sink rate@0.3 0.77 in every
    # mode); sink masked in all layers 27.7 (= drop: RoPE makes a cut-off token 0 the same as no
    # token 0), first third 27.3, middle third 41.8, last third 67.1.
    from sinklab.corpus import load_text, token_stream

    ids = token_stream(load_text(), smollm2.tokenizer, 128)
    cfg = AblationConfig(modes=("keep", "drop"))
    ft = run_experiment("first-token", smollm2.model, smollm2.tokenizer, ids, cfg).conditions
    assert ft["keep"]["sink_rate@0.3"] > 0.5  # the sink forms at whatever token comes first
    assert abs(ft["drop"]["sink_rate@0.3"] - ft["keep"]["sink_rate@0.3"]) < 0.1
    assert ft["drop"]["perplexity"] > ft["keep"]["perplexity"]
    ms = run_experiment("mask-sink", smollm2.model, smollm2.tokenizer, ids, cfg).conditions
    never = ms["never"]["perplexity"]
    assert ms["last third"]["perplexity"] > 1.5 * never < ms["middle third"]["perplexity"]
    assert math.isclose(ms["all layers"]["perplexity"], ft["drop"]["perplexity"], rel_tol=1e-2)


def test_ablation_run_argv_reproduces_its_config_and_a_bare_result_draws(tiny, tiny_tokenizer):
    """AblationRun's command line carries every option that differs from the defaults (the
    command parses it back to the same config); a bare result gives its Figure and a frame."""
    import typer
    from matplotlib.figure import Figure
    from typer.testing import CliRunner

    from sinklab.ablate.run import AblationRun
    from sinklab.commands import ablate as ablate_command

    config = AblationConfig(q0=2, layers=(0, 1), lams=(0.0, 0.5), seed=3)
    run = AblationRun("density", config, tokens=24)
    argv = run.argv(["--model", "M"], "T", "O")
    assert argv[:4] == ["sinklab", "ablate", "--experiment", "density"]
    opts = dict(zip(argv[4::2], argv[5::2], strict=True))
    assert opts["--layers"] == "0,1" and opts["--lams"] == "0.0,0.5" and opts["--seed"] == "3"
    assert "--grid" not in opts and "--eps" not in opts  # defaults, and not density's options
    seen = {}
    app = typer.Typer()
    app.command()(ablate_command.ablate)
    real = AblationRun.__init__

    def capture(self, *a, **k):  # stop at the run the command built (nothing loads)
        real(self, *a, **k)
        seen["run"] = self
        raise SystemExit(0)

    AblationRun.__init__ = capture
    try:
        CliRunner().invoke(app, argv[2:], catch_exceptions=False)
    finally:
        AblationRun.__init__ = real
    assert seen["run"] == run
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    result = run.run(tiny, tiny_tokenizer, ids)
    figs = result.figures()
    assert list(figs) == ["density"] and isinstance(figs["density"], Figure)
    frame = result.to_frame()
    assert list(frame["condition"]) == list(result.conditions)
    first = next(iter(result.conditions))
    assert frame["ppl"].iloc[0] == pytest.approx(result.conditions[first]["ppl"])
