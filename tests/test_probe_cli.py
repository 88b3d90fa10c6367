"""``sinklab probe`` end to end on a tiny model (in-process, for speed), and its one-line errors."""

import json
from pathlib import Path

import pytest

from helpers import assert_one_line_error, run_main

KEYS = {
    "meta",
    "sink_mass",
    "diagonal_mass",
    "prev_token_mass",
    "entropy",
    "value_norm_ratio",
    "sink_output_share",
    "head_kind",
    "first_token_cosine",
    "token_similarity",
    "first_token_norm_ratio",
    "sink_rate",
    "sink_positions",
    "geometry",  # per layer at three sites (sinklab.probe.geometry)
    "attention_path",  # per layer, the route its attention took (sinklab.seam.observe.route)
}


def cli(capsys, *args: str):
    return run_main(capsys, "probe", *args)


def test_probe_writes_json_and_figures(capsys, tmp_path: Path, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    args = ["--model", model, "--text", "shakespeare:hamlet", "--tokens", "48", "--q0", "2"]
    out = tmp_path / "p"  # beside the second run's folder: an --out inside an output is refused
    proc = cli(capsys, *args, "--lengths", "16,48", "--out", str(out), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "probe.json").read_text())
    assert set(data) == KEYS | {"by_length"}
    assert json.loads(proc.stdout)["sink_rate"] == data["sink_rate"]
    assert set(data["sink_rate"]) == {"0.3", "0.8"}
    assert len(data["sink_mass"]) == 2 and len(data["sink_mass"][0]) == 4
    assert len(data["first_token_cosine"]) == 2
    meta = data["meta"]
    params = meta["params"]  # one set of keys: the run's parameters only under params
    assert params["tokens"] == 48 and params["q0"] == 2 and params["eps"] == [0.3, 0.8]
    assert set(meta) == {"model", "text", "first_token", "params", "versions", "machine", "seconds"}
    first = meta["first_token"]  # the tiny tokenizer adds nothing: the text's first word
    assert (first["prepend"], first["added"], first["tokenizer_default"]) == ("default", [], True)
    assert len(meta["text"]["sha256"]) == 64 and "versions" in meta and "seconds" in meta
    assert [e["tokens"] for e in data["by_length"]] == [16, 48]
    for name in ("sink_mass_heatmap", "layer_curves", "length_trend", "by_layer"):
        assert (out / f"{name}.png").stat().st_size > 1000
        plotted = json.loads((out / f"{name}.json").read_text())
        assert plotted.get("title") or plotted["series"]
    heat = json.loads((out / "sink_mass_heatmap.json").read_text())
    assert heat["sink_mass"] == data["sink_mass"]

    proc = cli(capsys, *args, "--out", str(tmp_path / "t"), "--no-figures")
    assert proc.returncode == 0, proc.stderr
    assert "Sink rate:" in proc.stdout and "Top sink heads" in proc.stdout
    assert "First-token cosine per layer at the attention input:" in proc.stdout
    assert "first sink head is in layer" in proc.stdout or "no layer has a sink head" in proc.stdout


def test_summary_is_computed_from_the_numbers():
    from sinklab.probe.metrics import layer_means
    from sinklab.probe.summary import summary_sentences, top_heads_sentence

    data = {
        "meta": {"params": {"q0": 0, "tokens": 10, "eps": [0.3]}, "model": {"name": "m"}},
        "sink_mass": [[0.0, 0.1], [0.5, 0.2], [0.9, 0.95]],
        "sink_rate": {"0.3": 0.5},
        "sink_positions": [{"position": 0, "mass": 0.4}],
    }
    text = "\n".join(summary_sentences(data))
    assert "L2H1 0.95, L2H0 0.90" in top_heads_sentence(data, top=2)
    assert "first sink head is in layer 1" in text
    assert "take over from layer 1 (at least half its heads)" in text
    assert "sink heads per layer: 0 1 2" in text
    nan = float("nan")
    assert layer_means([[0.2, nan], [nan, nan]])[0] == 0.2  # NaN is left out, never counted as 0
    assert layer_means([[nan]])[0] != layer_means([[nan]])[0]


def test_figure_titles_name_the_run_and_leave_out_what_it_lacks(tmp_path):
    """meta always holds sinklab.meta.META_KEYS: a None model or text is left out of the title,
    several texts are joined, a missing key is a bug (KeyError), not a silent 'model'."""
    from sinklab.corpus import Text
    from sinklab.figures import run_names
    from sinklab.meta import attach_meta
    from sinklab.probe.plots import probe_figures

    plays = [Text("shakespeare:hamlet", "x", "a"), Text("shakespeare:macbeth", "y", "b")]
    data = {
        "sink_mass": [[0.1, 0.9], [0.5, float("nan")]],
        "first_token_cosine": [0.2, -0.1],
        "token_similarity": [0.3, 0.4],
    }
    attach_meta(data, None, plays, {"q0": 2, "eps": [0.3], "tokens": 16}, None)
    assert run_names(data["meta"]) == ["shakespeare:hamlet+shakespeare:macbeth"]
    probe_figures(data, tmp_path)
    title = json.loads((tmp_path / "layer_curves.json").read_text())["title"]
    assert title == "per layer\nshakespeare:hamlet+shakespeare:macbeth | 16 tokens | q0=2"
    attach_meta(data, None, None, {"q0": 0, "eps": [0.3], "tokens": 8}, None)
    probe_figures(data, tmp_path)
    heat = json.loads((tmp_path / "sink_mass_heatmap.json").read_text())["title"]
    assert heat == "sink mass\n8 tokens | q0=0" and run_names(data["meta"]) == []
    meta = {**data["meta"], "model": {"name": "m"}, "text": {"name": "t"}}
    assert run_names(meta) == ["m", "t"]
    with pytest.raises(KeyError):
        run_names({"params": {}})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--q0", "64", "--tokens", "64"], "--q0 64 leaves no query among --tokens 64"),
        (["--eps", "1.2"], "strictly between 0 and 1"),
        (["--eps", "0,0.5"], "strictly between 0 and 1"),
        (["--lengths", ","], "--lengths is empty"),
        (["--lengths", "1,16"], "length 1 is outside"),
    ],
)
def test_cheap_bad_inputs_exit_2_before_loading(capsys, args, needle):
    # --model points nowhere: these must fail on the cheap check, before any model load
    proc = cli(capsys, "--model", "/no/such/model", *args)
    assert_one_line_error(proc, needle)


def test_tokens_beyond_text_and_positions(capsys, tmp_path: Path, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    short = tmp_path / "short.txt"
    short.write_text("to be or not to be that is the question\n" * 3)
    proc = cli(capsys, "--model", model, "--text", str(short), "--tokens", "100")
    assert_one_line_error(proc, "has only 30 tokens, fewer than the 100 asked for")
    proc = cli(capsys, "--model", model, "--tokens", "600")
    assert_one_line_error(proc, "--tokens 600 needs 600 positions but ")


def test_uncapturable_model_says_which(capsys, tmp_path: Path, tiny_tokenizer):
    # Falcon computes attention in its own forward, not through AttentionInterface (BioGPT,
    # used here before, does dispatch through it: sinklab.models.arch.dispatches_attention)
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        vocab_size=512,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    FalconForCausalLM(cfg).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    proc = cli(capsys, "--model", str(tmp_path), "--tokens", "16", "--out", str(tmp_path / "o"))
    assert_one_line_error(proc, "FalconForCausalLM does not dispatch attention")
