"""A model dispatched by accelerate (``load_model(device=...)`` with an accelerate device map)
gives the undispatched model's numbers on every path that runs a model: stream (chunked and
step, dense / window / sink, the recompute oracle), the sink-cache generate loop, chat, every
ablation experiment, and the CLI.

The device map puts the input embedding, the middle decoder layer and the LM head on disk: their
weights are ``meta`` between forwards, so the first parameter's device says nothing and inputs
must go where the embedding runs (:func:`sinklab.models.arch.input_device`). The layers on CPU and
on
disk are also two placements of the same device type, which is what a CPU machine can simulate of
modules on different devices. The tiny model has ``max_position_embeddings`` 32, so a 45-token
stream crosses the position bound and the sink cache and the chunked band re-rotate their keys.
Same machine, same kernels: the numbers agree to float32 round-off (tolerances below). At the
end, the sink cache and the chunked band with one layer's tensors on ``meta`` beside a CPU layer
(the second device a CPU machine has): what each layer creates follows its own keys' device."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
import torch

from conftest import make_tiny_model
from helpers import run_main
from sinklab.ablate import EXPERIMENTS, AblationConfig, run_experiment
from sinklab.models.arch import compute_dtype, input_device, mapped_device
from sinklab.models.loading import load_model
from sinklab.stream.chat import ChatConfig, ChatSession
from sinklab.stream.evaluate import StreamConfig, streaming_perplexity
from sinklab.stream.generation import GenerateConfig, StreamBatch, generate
from sinklab.stream.policy import CacheConfig

OFFLOAD = {
    "model.embed_tokens": "disk",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.norm": "cpu",
    "lm_head": "disk",
}
#: the same float32 kernels on the same inputs: only summation order could differ
ATOL = 1e-5
#: a GPU's float32 reductions run in another order than the CPU's: relative 1e-4 between them
GPU_ATOL = 1e-4
POLICIES = ("dense", "window", "sink", "recompute")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, chat_tokenizer):
    """3 layers, weights large enough that attention is not uniform (positions matter), and a
    position bound of 32 that the streams below cross."""
    path = tmp_path_factory.mktemp("tiny-dispatch")
    model = make_tiny_model("llama", seed=3, n_layers=3, initializer_range=0.2)
    model.config.max_position_embeddings = 32
    model.save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(folder, tmp_path_factory):
    """(plain, dispatched) LoadedModel of the same folder."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SINKLAB_CACHE", str(tmp_path_factory.mktemp("cache")))  # the offload folder
        plain, spread = load_model(str(folder)), load_model(str(folder), device=OFFLOAD)
    return plain, spread


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_map_offloads_the_embedding(pair):
    """What makes the old read wrong: the first parameter is on meta; the inputs' device is the
    embedding's execution device."""
    plain, spread = pair
    model = spread.model
    assert model.hf_device_map == OFFLOAD
    assert model.get_input_embeddings().weight.device.type == "meta"
    assert next(model.parameters()).device.type == "meta"
    assert all(p.device.type == "meta" for p in model.model.layers[1].parameters())
    assert all(p.device.type == "cpu" for p in model.model.layers[2].parameters())
    assert input_device(model) == input_device(plain.model) == torch.device("cpu")
    assert compute_dtype(model) == torch.float32
    assert spread.info.dtype == "float32" and spread.info.n_params == plain.info.n_params


def test_input_device_of_a_fully_offloaded_model(folder, pair):
    """accelerate's own ``cpu_offload``: hooks, no ``hf_device_map``, every weight on meta."""
    from accelerate import cpu_offload

    model = load_model(str(folder)).model
    cpu_offload(model, execution_device="cpu")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert input_device(model) == torch.device("cpu")
    ids = _ids(12)
    with torch.no_grad():
        want = pair[0].model(ids[None])
        got = model(ids[None].to(input_device(model)))
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("device_map", "name", "want"),
    [
        (
            {"model.embed_tokens": 1, "model.layers": 0, "lm_head": "cpu"},
            "model.embed_tokens",
            "cuda:1",
        ),
        ({"model.embed_tokens": "disk", "model.layers": 0}, "model.embed_tokens", "cuda:0"),
        ({"model.embed_tokens": "cpu", "lm_head": "disk"}, "model.embed_tokens", "cpu"),
        ({"model": "cuda:2", "lm_head": "cpu"}, "model.embed_tokens", "cuda:2"),
        ({"": "disk"}, "model.embed_tokens", "cpu"),
        ({"transformer.wte": "mps", "transformer.h": "cpu"}, "transformer.wte", "mps"),
        ({"model.embed": 0, "model.embed_tokens": 1}, "model.embed_tokens", "cuda:1"),
    ],
)
def test_mapped_device_is_accelerates_execution_device(device_map, name, want):
    """An offloaded entry ('cpu', 'disk') runs on the map's main device (the first accelerator
    it names, else the CPU); an int is a CUDA index; the longest matching key wins, by module
    boundary (``model.embed`` is not a parent of ``model.embed_tokens``)."""
    assert mapped_device(device_map, name) == torch.device(want)


@pytest.mark.parametrize("method", ["chunked", "step"])
def test_stream_gives_the_same_numbers(pair, method):
    plain, spread = pair
    ids = _ids(45)  # the sink cache rebases at position 32
    cfg = StreamConfig(
        policies=POLICIES, n_sink=2, window=8, n_tokens=45, method=method, chunk=8, segment=20
    )
    a, b = streaming_perplexity(plain.model, ids, cfg), streaming_perplexity(spread.model, ids, cfg)
    for policy in POLICIES:
        want, got = a.policies[policy], b.policies[policy]
        assert got.n_scored == want.n_scored == 44
        torch.testing.assert_close(
            torch.tensor(got.nll), torch.tensor(want.nll), atol=ATOL, rtol=0, msg=policy
        )
        assert got.max_cache_len == want.max_cache_len
    # the streams are not trivially equal: positions matter, so the policies differ
    assert len({round(a.policies[p].ppl, 3) for p in POLICIES}) == len(POLICIES)


def test_generate_greedy_tokens_identical(pair):
    plain, spread = pair
    cfg = GenerateConfig(max_new_tokens=40, n_sink=2, window=8, stop_at_eos=False)
    prompt = _ids(12, seed=1)
    a = generate(plain.model, plain.tokenizer, prompt, cfg)
    b = generate(spread.model, spread.tokenizer, prompt, cfg)
    assert len(a.new_tokens) == 40 and b.new_tokens == a.new_tokens
    assert a.max_position < 32 and b.max_position == a.max_position  # rebased: 52 tokens read
    assert len(set(a.new_tokens)) > 3  # not one token repeated


def test_stream_batch_rows_identical(pair):
    feeds = [{0: _ids(9, 2).tolist(), 1: _ids(5, 3).tolist()}, {0: _ids(3, 4).tolist()}]
    outs = []
    for loaded in pair:
        batch = StreamBatch(loaded.model, CacheConfig("sink", 2, 8))
        batch.add(), batch.add()
        outs.append([batch.feed(f) for f in feeds])
    for want, got in zip(*outs, strict=True):
        assert want.keys() == got.keys()
        for s in want:
            torch.testing.assert_close(got[s], want[s], atol=ATOL, rtol=0)


def test_chat_replies_identical(pair):
    turns = ["To be or not to be", "that is the question whether tis nobler in the mind"]
    replies = []
    for loaded in pair:
        session = ChatSession(loaded.model, loaded.tokenizer, ChatConfig(2, 12, max_new_tokens=6))
        replies.append([session.turn(t).reply for t in turns])
    assert replies[1] == replies[0] and all(replies[0])


def _numbers(data: Any, path: str = "") -> dict[str, float]:
    """Every number of a JSON result, by its path (timings and memory left out)."""
    if isinstance(data, dict):
        out: dict[str, float] = {}
        for k, v in data.items():
            if k != "meta" and not any(w in k for w in ("seconds", "_per_s", "rss")):
                out |= _numbers(v, f"{path}.{k}")
        return out
    if isinstance(data, list):
        return {k: v for i, x in enumerate(data) for k, v in _numbers(x, f"{path}[{i}]").items()}
    if isinstance(data, bool) or not isinstance(data, int | float):
        return {}
    return {path: float(data)}


def _assert_same_numbers(got: dict[str, float], want: dict[str, float], tol: float) -> None:
    assert got.keys() == want.keys()
    bad = {
        k: (got[k], want[k])
        for k in want
        if not (math.isnan(want[k]) and math.isnan(got[k]))
        and not abs(got[k] - want[k]) <= tol * max(1.0, abs(want[k]))
    }
    assert not bad, bad


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_ablation_gives_the_same_numbers(pair, tiny_tokenizer, name):
    """first-token, mask-sink (perplexity, token similarity), density, sensitivity (Jacobian
    through the offloaded layer) and geometry (three sites, per layer)."""
    ids = torch.stack([_ids(24, 5), _ids(24, 6)])
    config = AblationConfig(grid=3, probes=0, lams=(0.0, 1.0))
    a, b = (run_experiment(name, m.model, m.tokenizer, ids, config).to_json() for m in pair)
    want, got = _numbers(a), _numbers(b)
    assert len(want) > 10
    _assert_same_numbers(got, want, ATOL)
    assert b["finding"] == a["finding"]


def _cli_numbers(tmp_path, capsys, monkeypatch, command: list[str], result: str):
    """Run ``command`` twice through the CLI: ``--device cpu``, then ``--device auto`` with
    accelerate's map replaced by OFFLOAD (a CPU machine's ``auto`` puts every weight on the
    CPU: no dispatch at all). -> the numbers of each run's ``result`` file."""
    import sinklab.models.loading as models

    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path / "cache"))
    real = models.device_map_for
    spread: list[Any] = []

    def fake(device):  # only what `auto` resolves to is replaced; the load is the real one
        return OFFLOAD if device == "auto" else real(device)

    load = models.load_model

    def spy(*args, **kwargs):
        loaded = load(*args, **kwargs)
        spread.append(getattr(loaded.model, "hf_device_map", None))
        return loaded

    monkeypatch.setattr(models, "device_map_for", fake)
    monkeypatch.setattr(models, "load_model", spy)
    out = []
    for device in ("cpu", "auto"):
        folder = tmp_path / device
        code, _, err = run_main(capsys, *command, "--device", device, "--out", str(folder))
        assert code == 0, err
        out.append(json.loads((folder / result).read_text()))
    assert spread == [None, OFFLOAD]
    return out


def test_cli_stream_and_ablate_dispatched(folder, tmp_path, capsys, monkeypatch):
    base = ["--model", str(folder), "--tokens", "48"]
    stream = ["stream", *base, "--n-sink", "2", "--window", "8", "--recompute-every", "4"]
    stream += ["--policy", "window,sink,recompute"]  # 48 tokens: past the 32 positions
    a, b = _cli_numbers(tmp_path / "s", capsys, monkeypatch, stream, "stream.json")
    assert set(a["policies"]) == {"window", "sink", "recompute"}
    _assert_same_numbers(_numbers(b["policies"]), _numbers(a["policies"]), ATOL)
    ablate = ["ablate", "-e", "mask-sink", "--model", str(folder), "--tokens", "24"]
    a, b = _cli_numbers(tmp_path / "a", capsys, monkeypatch, ablate, "ablate.json")
    _assert_same_numbers(_numbers(b["conditions"]), _numbers(a["conditions"]), ATOL)


def test_cli_report_dispatched(folder, tmp_path, capsys, monkeypatch):
    sizes = ["probe_tokens=24", "probe_lengths=12,24", "q0=2", "stream_tokens=40", "window=8"]
    sizes += ["recompute_every=8", "ablate_tokens=24", "sensitivity_grid=3"]
    command = ["report", "--quick", "--model", str(folder), "--stages", "probe,stream,mask-sink"]
    command += [arg for kv in sizes for arg in ("--set", kv)]
    a, b = _cli_numbers(tmp_path, capsys, monkeypatch, command, "results.json")
    assert list(a["stages"]) == ["probe", "stream", "mask-sink"]
    assert all(s["status"] == "ok" for s in b["stages"].values()), b["stages"]
    want, got = _numbers(a["stages"]), _numbers(b["stages"])
    assert len(want) > 50
    _assert_same_numbers(got, want, ATOL)


def test_cli_device_auto_is_the_plain_model(folder, tmp_path, capsys, monkeypatch):
    """Unpatched ``--device auto`` gives ``--device cpu``'s numbers: on a machine without GPU
    accelerate keeps everything on the CPU (the same sums); where a GPU is visible the model goes
    there, and its sums may differ from the CPU's in the last digits (GPU_ATOL)."""
    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path / "cache"))
    runs = []
    for device in ("cpu", "auto"):
        out = tmp_path / device
        args = ["probe", "--model", str(folder), "--tokens", "24", "--out", str(out)]
        code, _, err = run_main(capsys, *args, "--device", device)
        assert code == 0, err
        runs.append(json.loads((out / "probe.json").read_text()))
    got, want = _numbers(runs[1]), _numbers(runs[0])
    assert len(want) > 50 and runs[1]["meta"]["model"] == runs[0]["meta"]["model"]
    _assert_same_numbers(got, want, GPU_ATOL if torch.cuda.is_available() else ATOL)


def _table(rows: list[list[float | None]]) -> torch.Tensor:
    """An L x H table of the read-out (None: no query qualified) as float64, NaN for None."""
    return torch.tensor([[math.nan if x is None else x for x in r] for r in rows])


def test_lab_backcopy_metrics_of_a_dispatched_lab_model(tmp_path):
    """The lab's backcopy read-out (one forward through the seam) on a lab decoder dispatched by
    accelerate itself (embedding and a layer on disk) equals the undispatched read-out."""
    from accelerate import dispatch_model

    from sinklab.lab.backcopy import bigram_table, sample
    from sinklab.lab.backcopy_metrics import HEAD_KEYS, backcopy_summary
    from sinklab.lab.model import LabConfig, LabForCausalLM

    table = bigram_table(None, 3)
    torch.manual_seed(3)
    cfg = LabConfig(
        vocab_size=table.vocab_size,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        initializer_range=0.4,
    )
    model = LabForCausalLM(cfg).eval()
    ids, copied = sample(table, 4, 16, True, torch.Generator().manual_seed(0))
    want = backcopy_summary(model, ids, copied, table)
    device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map |= {"model.norm": "cpu", "lm_head": "cpu"}
    spread = dispatch_model(copy.deepcopy(model), device_map=device_map, offload_dir=tmp_path)
    assert next(spread.parameters()).device.type == "meta"
    got = backcopy_summary(spread, ids, copied, table)
    assert got["head"] == want["head"]
    assert got["backcopy_loss"] == pytest.approx(want["backcopy_loss"], abs=ATOL)
    for key in HEAD_KEYS:
        a, b = (_table(x["per_head"][key]) for x in (want, got))
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0, equal_nan=True, msg=key)


# ------------------------------------------------------------ layers on two devices at once
# A CPU machine has one real device; ``meta`` stands in for the second (shapes and devices, no
# data): whatever a layer's keys re-rotation, band or mask creates must follow that layer's own
# tensors, or mixing a CPU tensor into a meta layer raises, as mixing cuda:0 into cuda:1 would.


def _kv(g: torch.Generator, q: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, q, 8, generator=g), torch.randn(1, 2, q, 8, generator=g)


def test_sink_cache_layers_on_two_devices():
    """Layer 0's keys on the CPU, layer 1's on meta, through evictions and two rebases (the
    rebase re-rotates every layer's kept keys): layer 0 gives the all-CPU cache's keys exactly,
    layer 1 stays on its device with the same shapes."""
    from sinklab.stream.cache import SinkCache

    model = make_tiny_model("llama", n_layers=2, initializer_range=0.2)
    ref, mixed = (SinkCache(model, CacheConfig("sink", 2, 4), max_position=12) for _ in "ab")
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        kv = [_kv(g), _kv(g)]
        for cache, dev in ((ref, "cpu"), (mixed, "meta")):
            cache.prepare(1)
            outs = [cache.update(*kv[0], 0)]
            outs.append(cache.update(*(t.to(dev) for t in kv[1]), 1))
            if cache is ref:
                want = outs
        torch.testing.assert_close(outs[0], want[0], atol=0, rtol=0)
        assert outs[1][0].device.type == "meta" and outs[1][0].shape == want[1][0].shape
    assert ref.rows[0].base > 12 and mixed.rows[0].base == ref.rows[0].base  # rebased 3+ times
    assert mixed.kept_length() == ref.kept_length() == 6


def test_chunked_band_layers_on_two_devices():
    """The chunked band (sinks detached, so queries are rotated back; a rebase of the kept
    keys): a meta layer beside a CPU layer works, and the CPU layer's output is the one it
    gives alone."""
    from sinklab.models.rotary import rope_of
    from sinklab.stream.band import BandState, LayerBand

    model = make_tiny_model("llama", n_layers=2, initializer_range=0.2)
    band = LayerBand((0, 1), 6, rope_of(model))  # 2 sinks + 6 recent, both layers alike
    alone, mixed = BandState([band, band]), BandState([band, band])
    g = torch.Generator().manual_seed(1)
    base = 0
    for t0 in range(0, 40, 4):
        if t0 == 24:
            for state in (alone, mixed):
                state.rebase(10)
            base += 10
        for state in (alone, mixed):
            state.plan(t0, t0 + 4, base)
        q = torch.randn(1, 4, 4, 8, generator=g)
        k, v = _kv(g, 4)
        want = alone.attend(0, q, k, v, 0.35, None)
        got = mixed.attend(0, q, k, v, 0.35, None)
        far = mixed.attend(1, *(t.to("meta") for t in (q, k, v)), 0.35, None)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert far.device.type == "meta" and far.shape == want.shape
        plan = mixed.plans[0]
        if t0 >= 12:  # the window has left the sinks: queries are rotated back to score them
            assert plan.sink_mask is not None and bool(plan.sink_mask.any())
        for state in (alone, mixed):
            state.advance()
    assert mixed.k[1] is not None and mixed.k[1].device.type == "meta"
