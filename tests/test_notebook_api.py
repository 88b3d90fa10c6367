"""The notebook API: ``import sinklab`` changes nothing, its names load on first use, results give
matplotlib Figures and pandas frames with or without ``meta``, and examples/quickstart.ipynb runs
top to bottom (executed here with nbclient)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.figure import Figure

from sinklab import figures

ROOT = Path(__file__).resolve().parents[1]


def test_import_sinklab_has_no_side_effects():
    """No environment switch, no Hugging Face or matplotlib import, no backend chosen."""
    code = (
        "import os, sys, json; before = dict(os.environ); import sinklab; "
        "print(json.dumps({'env': dict(os.environ) == before, "
        "'mods': sorted(m for m in ('transformers', 'huggingface_hub', 'matplotlib', 'torch') "
        "if m in sys.modules)}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.pop("MPLBACKEND", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert json.loads(out.stdout) == {"env": True, "mods": []}


def test_the_public_names_load_lazily():
    import sinklab
    from sinklab.claims.core import run_claims
    from sinklab.corpus import load_text, token_stream
    from sinklab.models.loading import load_model
    from sinklab.seam.interventions import mask_sink
    from sinklab.stream.cache import SinkCache
    from sinklab.stream.evaluate import streaming_perplexity

    want = {
        "load_model": load_model,
        "load_text": load_text,
        "token_stream": token_stream,
        "stream_perplexity": streaming_perplexity,
        "SinkCache": SinkCache,
        "mask_sink": mask_sink,
        "run_claims": run_claims,
    }
    for name, obj in want.items():
        assert getattr(sinklab, name) is obj and name in sinklab.__all__, name
    # `probe` is the probe package, and calling it runs the probe
    assert sinklab.probe.__name__ == "sinklab.probe" and sinklab.probe.ProbeConfig
    assert callable(sinklab.probe) and "probe" in sinklab.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        sinklab.nope  # noqa: B018
    import sinklab.stream as stream

    assert stream.StreamBatch.__module__ == "sinklab.stream.generation"
    assert stream.StreamResult.__module__ == "sinklab.stream.evaluate"


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama", seed=5)


def _ids(n: int) -> torch.Tensor:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(6))


def test_a_bare_probe_result_gives_figures_and_a_frame(llama):
    from sinklab import ProbeConfig, probe

    result = probe(llama, _ids(24), ProbeConfig(q0=2))
    assert result.meta == {}
    figs = result.figures()
    assert set(figs) == {"sink_mass_heatmap", "layer_curves"}
    assert all(isinstance(f, Figure) for f in figs.values())
    assert figures.plotted(figs["sink_mass_heatmap"])["sink_mass"] == result.sink_mass.tolist()
    frame = result.to_frame()
    layers, heads = result.sink_mass.shape
    assert list(frame.columns[:3]) == ["layer", "head", "sink_mass"]
    assert len(frame) == layers * heads
    assert "token_similarity" in frame.columns and "received" not in frame.columns
    for _, row in frame.sample(5, random_state=0).iterrows():
        layer, head = int(row["layer"]), int(row["head"])
        assert row["sink_mass"] == pytest.approx(float(result.sink_mass[layer, head]))
        assert row["entropy"] == pytest.approx(float(result.entropy[layer, head]))
        assert row["token_similarity"] == pytest.approx(result.token_similarity[layer])


def test_a_bare_stream_result_gives_figures_and_a_frame(llama, tmp_path):
    from sinklab import StreamConfig, stream_perplexity

    config = StreamConfig(("window", "sink", "recompute"), 2, 6, 30, recompute_every=3, segment=8)
    result = stream_perplexity(llama, _ids(30), config)
    figs = result.figures()
    assert set(figs) == {"running_ppl", "block_ppl"}
    block = figures.plotted(figs["block_ppl"])
    assert set(block["series"]) == {"window", "sink"}  # the oracle has no cache: left out
    assert block["series"]["sink"] == result.policies["sink"].segment_ppl
    frame = result.to_frame()
    assert list(frame["policy"]) == ["window", "sink", "recompute"]
    assert list(frame["ppl"]) == [result.policies[p].ppl for p in frame["policy"]]
    assert frame["max_cache_len"].tolist()[:2] == [8, 8]
    # a writer saves what the figure function returned: PNG + its numbers
    path = figures.save(figs["block_ppl"], tmp_path / "block.png")
    assert path.stat().st_size > 0
    assert json.loads(path.with_suffix(".json").read_text())["series"]["sink"] == pytest.approx(
        result.policies["sink"].segment_ppl, nan_ok=True
    )


def test_a_figure_write_cut_short_leaves_the_previous_file(tmp_path, monkeypatch):
    """figures.save renders the PNG in memory and renames it into place: a failure while
    rendering keeps the old figure and leaves no temporary file beside it."""
    fig = figures.bars_figure(["a", "b"], [1.0, 2.0], title="t", ylabel="y")
    path = figures.save(fig, tmp_path / "bars.png")
    before = path.read_bytes()
    assert before.startswith(b"\x89PNG")

    def broken(self, fname, **kwargs):
        fname.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(type(fig), "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        figures.save(fig, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bars.json", "bars.png"]


@pytest.mark.integration
def test_the_quickstart_notebook_runs():
    """examples/quickstart.ipynb, executed top to bottom in a fresh kernel (its time is measured in
    benchmarks/notebook.py, not asserted here)."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    path = ROOT / "examples" / "quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    shown = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(shown) >= 3  # the probe's figure, the stream's, the claims'
    text = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs)
    assert "sink_mass" in text and "verdict" in text
