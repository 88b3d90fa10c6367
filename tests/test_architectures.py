"""The compatibility matrix: every decoder family x every feature, on a tiny random config.

Each cell is OK only when the feature's numbers equal an independent computation on that family:

* ``probe``: the weights sinklab's attention seam sees equal eager ``output_attentions`` (1e-5),
  and the probe's per-head sink / diagonal / previous-token masses equal means of those weights;
* ``sink cache``: :class:`~sinklab.stream.cache.SinkCache` (2 sinks + 6 recent, 24 tokens: 16 steps
  after the first eviction) equals the naive StreamingLLM of ``tests/streamref.py`` (1e-4), and
  its layer-0 keys moved to positions 0..n-1 equal the model's own keys computed there;
* ``ablate mask-sink``: runs; its unmasked perplexity equals one computed from the logits, and
  masking the sink in all layers leaves no attention on it;
* ``stream dense``: the dense policy equals the model's own next-token losses;
* ``stream chunked``: ``--method chunked`` (8 queries per forward) equals the step loop (1e-4);
* ``stream (default)``: ``sinklab stream``'s default ``--method auto`` (chunked where
  :func:`sinklab.stream.band.chunked_refusal` finds nothing against the model, else step) runs, and
  its sink-policy NLLs equal the step loop's (1e-4, 24 tokens); the cell names the method auto
  chose.

A cell may instead be a refusal, one line naming the reason; which cells refuse is stated in
:data:`REFUSED` (a cell that starts or stops refusing fails). When the whole matrix ran,
``docs/architectures.md`` is written from the results.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers

from archs import FAMILIES, arch_model
from helpers import Recorder
from sinklab.errors import SinklabError
from sinklab.models.arch import attn_implementation
from sinklab.seam import sinklab_attention
from sinklab.stream.cache import CacheConfig, SinkCache
from streamref import naive_logits

DOC = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
FEATURES = (
    "probe",
    "sink cache",
    "ablate mask-sink",
    "stream dense",
    "stream chunked",
    "stream (default)",
)

#: rows beyond one per family: (row name, family, config overrides)
VARIANTS = {
    "mistral (sliding window)": ("mistral", {"sliding_window": 9}),
    "qwen3 (sliding window)": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "ministral": (
        "ministral",
        {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "falcon (alibi)": ("falcon", {"alibi": True}),
    "glm4 (interleaved RoPE)": ("glm4", {}),
}
ROWS = {**{f: (f, {}) for f in FAMILIES}, **VARIANTS}

_NO_INTERFACE = "does not dispatch attention through transformers' AttentionInterface"
#: (row, feature) -> a phrase the one-line refusal must contain
_CACHE = {  # the sink cache's refusals (chunked streaming builds one first: the same)
    "gpt2": "learned absolute position embeddings",
    "opt": "learned absolute position embeddings",
    "gptj": "precomputed sin/cos table",
    "bloom": "ALiBi",
    "mpt": "ALiBi",
    "falcon (alibi)": "ALiBi",
}
REFUSED = {
    **{
        (r, f): _NO_INTERFACE
        for r in ("falcon", "bloom", "mpt")
        for f in ("probe", "ablate mask-sink", "stream chunked")
    },
    **{(r, f): _NO_INTERFACE for f in ("probe", "ablate mask-sink") for r in ("falcon (alibi)",)},
    **{(r, "sink cache"): why for r, why in _CACHE.items()},
    **{(r, "stream chunked"): why for r, why in _CACHE.items()},
    **{(r, "stream (default)"): why for r, why in _CACHE.items()},
}

RESULTS: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module", autouse=True)
def write_matrix():
    """After the module: write docs/architectures.md when every cell has a result."""
    yield
    if len(RESULTS) == len(ROWS) * len(FEATURES):
        DOC.write_text(render(RESULTS), encoding="utf-8")


def render(results: dict[tuple[str, str], str]) -> str:
    def cell(text: str) -> str:  # the reason without its advice (after ";") or its prefix
        text = text.replace("SinkCache cannot move cached keys of this model: ", "")
        return text.split(";")[0].replace("|", "\\|")

    lines = [
        "# Architectures",
        "",
        "Written by the test suite (`tests/test_architectures.py`; do not edit by hand): each row",
        "is a tiny random model of the family (2 layers, `initializer_range` 0.2, so attention",
        f"is far from uniform), built with transformers {transformers.__version__}. **OK** means",
        "the feature's numbers equal an independent computation on that model:",
        "",
        "- **probe**: the attention weights sinklab sees equal eager `output_attentions` to",
        "  1e-5, and the probe's sink, diagonal and previous-token masses equal their means;",
        "- **sink cache**: `SinkCache` (2 sinks + 6 recent, 24 tokens) equals a naive",
        "  StreamingLLM built on the model's own RoPE to 1e-4, and its layer-0 keys moved to",
        "  cache-relative positions equal the model's own keys there. Hybrid models",
        "  (sliding-window and global layers) keep the model's own window on sliding layers and",
        "  sinks + window on global ones; with a sliding window on every layer, n_sink + window",
        "  must stay below the model's window (else refused: it would hide the sinks);",
        "- **ablate mask-sink**: runs; the unmasked perplexity equals one computed from the",
        "  logits, and masking the sink in every layer leaves attention on it only from query 0;",
        "- **stream dense**: the dense policy's losses equal the model's own;",
        "- **stream chunked**: `stream --method chunked` (8 queries a forward) equals the",
        "  token-by-token step loop to 1e-4 (sink policy, 2 + 6, 40 tokens); on hybrid models",
        "  sliding layers read the model's own window band and global layers the sinks + window,",
        "  NoPE layers score the sinks unrotated, gpt-oss's learned sink logits join each softmax;",
        "- **stream (default)**: `sinklab stream` with its default `--method auto` (chunked",
        "  where chunked streaming serves the model, else the step loop; the cell names which)",
        "  runs, and its NLLs equal the step loop's to 1e-4 (sink policy, 2 + 6, 24 tokens).",
        "  Only models chunked streaming refuses stream this way with the step loop.",
        "",
        "A refusal is a one-line error naming the reason; nothing is listed as working",
        "without a test.",
        "",
        "| model | " + " | ".join(FEATURES) + " |",
        "|---|" + "---|" * len(FEATURES),
    ]
    for row in ROWS:
        lines.append(f"| {row} | " + " | ".join(cell(results[(row, f)]) for f in FEATURES) + " |")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def built():
    cache: dict[str, torch.nn.Module] = {}

    def get(row: str) -> torch.nn.Module:
        if row not in cache:
            family, overrides = ROWS[row]
            cache[row] = arch_model(family, **overrides)
        return cache[row]

    return get


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed))


def _record(row: str, feature: str, run) -> None:
    """Run a cell: OK, or a refusal that must be the stated one (and on one line)."""
    expected = REFUSED.get((row, feature))
    try:
        note = run()
    except SinklabError as exc:
        msg = str(exc)
        if expected is None or expected not in msg or "\n" in msg:
            raise
        RESULTS[(row, feature)] = f"refused: {msg}"
        return
    assert expected is None, f"{row} / {feature} no longer refuses ({expected!r}): update REFUSED"
    RESULTS[(row, feature)] = "OK" if note is None else f"OK ({note})"


def _impl(model) -> str:
    """The implementation sinklab's loader would pick (and registers where it is sinklab's)."""
    from sinklab.seam import register

    register()
    return attn_implementation(type(model))


@pytest.mark.parametrize("row", ROWS)
def test_probe(built, row):
    from sinklab.probe import probe

    model, ids = built(row), _ids(16)

    def run():
        model.set_attn_implementation("eager")
        with torch.no_grad():
            eager = model(ids[None], output_attentions=True).attentions
        seen = Recorder()  # every layer's full weights (B, H, Tq, Tk) as the seam sees them
        with torch.no_grad(), sinklab_attention(model, seen):
            model(ids[None])
        result = probe(model, ids)
        for layer, want in enumerate(eager):
            want = want.double()
            torch.testing.assert_close(seen.weights(layer).double(), want, atol=1e-5, rtol=0)
            w = want[0]  # (H, T, T)
            masses = {
                "sink_mass": w[:, :, 0].mean(-1),
                "diagonal_mass": w.diagonal(dim1=-2, dim2=-1).mean(-1),
                "prev_token_mass": w.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1),
            }
            for name, value in masses.items():
                got = getattr(result, name)[layer].double()
                torch.testing.assert_close(got, value, atol=1e-5, rtol=0)
        assert float(eager[-1][0, :, -1].max()) > 2.0 / ids.numel()  # not uniform

    _record(row, "probe", run)


@pytest.mark.parametrize("row", ROWS)
def test_sink_cache(built, row):
    model, ids = built(row), _ids(24, seed=1).tolist()

    def run():
        model.set_attn_implementation(_impl(model))
        cache = SinkCache(model, CacheConfig("sink", 2, 6))
        with torch.no_grad():
            got = torch.cat([model(torch.tensor([[t]]), cache=cache).logits[0] for t in ids])
        want = naive_logits(model, ids, {0, 1}, 6)
        assert float(want.abs().max()) > 1e-3  # the logits carry a signal
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert cache.kept_positions() == [0, 1, *range(18, 24)]
        if getattr(cache.layers[0], "rotary", False):  # layer-0 keys vs the model's own
            from transformers import DynamicCache

            fresh = DynamicCache(config=model.config)
            kept = cache.kept_positions()
            with torch.no_grad():
                model(torch.tensor([[ids[p] for p in kept]]), cache=fresh)
            torch.testing.assert_close(
                cache.relative_keys(0)[0], fresh.layers[0].keys, atol=1e-5, rtol=1e-5
            )

    _record(row, "sink cache", run)


def _eager_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """Each next token's NLL (T - 1,) from one plain forward over ``ids``: the reference."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].double()
    return torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")


@pytest.mark.parametrize("row", ROWS)
def test_ablate_mask_sink(built, row):
    from sinklab.ablate.registry import run_experiment

    model, ids = built(row), _ids(16, seed=2)

    def run():
        model.set_attn_implementation(_impl(model))
        result = run_experiment("mask-sink", model, None, ids)
        nll = _eager_nll(model, ids)[1:].mean()  # the targets from position 2 on
        never, masked = result.conditions["never"], result.conditions["all layers"]
        assert never["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-6)
        # masked, only query 0 (which sees nothing else) still attends to key 0
        row0 = 1.0 / ids.numel()
        assert masked["mean_sink_mass"] <= row0 + 1e-6 < never["mean_sink_mass"]

    _record(row, "ablate mask-sink", run)


@pytest.mark.parametrize("row", ROWS)
def test_stream_dense(built, row):
    from sinklab.stream.evaluate import stream_nll

    model, ids = built(row), _ids(20, seed=3)

    def run():
        model.set_attn_implementation(_impl(model))
        nll, most, _ = stream_nll(model, ids, CacheConfig("dense", 2, 6))
        want = _eager_nll(model, ids)
        torch.testing.assert_close(nll, want, atol=1e-4, rtol=1e-4)
        assert most == ids.numel() - 1

    _record(row, "stream dense", run)


@pytest.mark.parametrize("row", ROWS)
def test_stream_chunked(built, row):
    from sinklab.stream.band import chunked_nll
    from sinklab.stream.evaluate import stream_nll

    model, ids = built(row), _ids(40, seed=4)

    def run():
        model.set_attn_implementation(_impl(model))
        cfg = CacheConfig("sink", 2, 6)
        got, most, _ = chunked_nll(model, ids, cfg, chunk=8)
        want, most_step, _ = stream_nll(model, ids, cfg)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert most == most_step == 8

    _record(row, "stream chunked", run)


@pytest.mark.parametrize("row", ROWS)
def test_stream_default(built, row):
    from sinklab.stream.evaluate import StreamConfig, stream_nll, streaming_perplexity

    model, ids = built(row), _ids(24, seed=4)

    def run() -> str:
        model.set_attn_implementation(_impl(model))
        config = StreamConfig(("sink",), 2, 6, 24, chunk=8)
        method, _ = config.check_model(model)
        result = streaming_perplexity(model, ids, config)
        want, _, _ = stream_nll(model, ids, config.cache_config("sink"))
        got = torch.tensor(result.policies["sink"].nll, dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert result.method == method
        return method

    _record(row, "stream (default)", run)
