"""vLLM (CPU build, its own venv ``.venv-vllm``) on sinklab's cached zoo checkpoints, and the
pieces of the sinklab-vllm plugin built so far (docs/vllm.md).

* the baseline: plain vLLM's greedy tokens are transformers' greedy choices on the same prompts
  (teacher-forced along vLLM's tokens, docs/vllm.md#baseline);
* the plugin's front door: options and refusals on vLLM's final configuration (#options);
* the pieces, each against an independent reference: the key move against vLLM's RoPE and
  sinklab's ``Rope.shift`` (#rope), the block manager against ``kept_positions`` (#blocks), the
  cache read-back and the decode attention against vLLM's own cache and kernel (#layout,
  #attention).

vLLM pins transformers<5.20 and sinklab >=5.22, so vLLM never runs in this process: scripts in
``tests/vllm_env/`` run in ``.venv-vllm`` and answer one ``SINKLAB-RESULT`` JSON line. The venv
(with the plugin, editable) is made by ``make vllm-venv`` (``make test`` makes it when missing).
Without it the tests fail, saying how to make it; only ``SINKLAB_SKIP_VLLM=1`` skips them, and
says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_helpers import VLLM_PYTHON, first_difference, run_json

GREEDY = Path(__file__).resolve().parent / "vllm_env" / "greedy.py"
NEW_TOKENS = 64
pytestmark = pytest.mark.vllm


def vllm_greedy(
    python: Path, folder: Path, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy tokens from plain vLLM in its own process and venv."""
    request = {"model": str(folder), "prompts": prompts, "max_tokens": max_tokens}
    return run_json(python, GREEDY, request)["tokens"]


def hf_choices(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """Transformers' greedy choice at each of vLLM's steps, teacher-forced: one forward over
    ``prompt + tokens`` (full attention, nothing is evicted), the argmax after the prompt and
    after each of vLLM's tokens but the last. Equal to ``tokens`` everywhere means
    transformers' greedy ``generate`` produces exactly ``tokens`` (by induction: each of its
    steps sees the prefix vLLM saw), at one forward instead of one per token."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def _prompts(tokenizer) -> list[list[int]]:
    from sinklab.corpus import load_text, token_stream

    ids = token_stream(load_text(), tokenizer, 200).tolist()
    return [ids[:37], ids[:200]]  # two lengths in one vLLM batch


def _check(python: Path, loaded) -> None:
    from sinklab.models.zoo import ZOO, dequantized_dir

    folder = dequantized_dir(ZOO[loaded.info.name], loaded.info.weights_sha256)  # the cache
    prompts = _prompts(loaded.tokenizer)
    ours = vllm_greedy(python, folder, prompts, NEW_TOKENS)
    for prompt, v in zip(prompts, ours, strict=True):
        assert len(v) == NEW_TOKENS, len(v)
        h = hf_choices(loaded.model, prompt, v)
        where = first_difference(v, h)
        print(
            f"{loaded.info.name}: transformers chooses vLLM's token on {where}/{NEW_TOKENS} steps"
        )
        assert v == h, f"greedy tokens differ from token {where}: {v[where:]} vs {h[where:]}"
    assert len(set(ours[1])) > 8, ours  # text, not one token over and over


@pytest.mark.integration
def test_plain_vllm_equals_transformers_on_smollm2(vllm_py, smollm2):
    _check(vllm_py, smollm2)


@pytest.mark.integration
def test_plain_vllm_equals_transformers_on_qwen25(vllm_py):
    from sinklab.models.loading import load_model

    _check(vllm_py, load_model("qwen2.5-0.5b"))


def test_the_venv_is_vllm_beside_its_own_transformers(vllm_py):
    """The separate venv is what docs/vllm.md says: vLLM's CPU build on the local torch wheel."""
    code = "import vllm, torch, transformers; print(vllm.__version__, torch.__version__)"
    proc = subprocess.run([str(vllm_py), "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["0.32.0", "2.13.0+cpu"], proc.stdout
    assert sys.executable != str(VLLM_PYTHON)


REFUSALS = Path(__file__).resolve().parent / "vllm_env" / "refusals.py"
SINK = {"n_sink": 4, "window": 252}
EAGER = {"enforce_eager": True, "enable_prefix_caching": False, "dtype": "float32"}


def vllm_configs(python: Path, cases: list[dict]) -> list[dict]:
    """vLLM's verdict on each engine configuration (no engine started), from its own venv."""
    return run_json(python, REFUSALS, cases)


def test_the_plugin_refuses_what_it_cannot_run_exactly(vllm_py, tmp_path):
    """The installed plugin (entry point vllm.general_plugins) checks vLLM's final configuration
    when additional_config has "sinklab": each unsupported setting is refused naming it, bad
    options are refused, and a configuration that passes every check is accepted (the eviction
    runs: test_the_plugin_streams_exactly_as_sinklab_*). Without the key vLLM accepts the
    configuration as before."""
    from sinklab.models.zoo import ZOO, dequantized_dir, is_ready

    smol, qwen = (dequantized_dir(ZOO[name]) for name in ("smollm2-135m", "qwen2.5-0.5b"))
    assert is_ready(smol) and is_ready(qwen), "run `sinklab models install qwen2.5-0.5b`"
    mistral = tmp_path / "mistral"  # a family the plugin does not support (config only)
    mistral.mkdir()
    config = json.loads((smol / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (mistral / "config.json").write_text(json.dumps(config))

    def case(model: Path, options: dict | None = SINK, env: dict | None = None, **kwargs) -> dict:
        extra = {} if options is None else {"additional_config": {"sinklab": options}}
        return {"model": str(model), "env": env or {}, "kwargs": {**EAGER, **extra, **kwargs}}

    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100000.0}
    table = [
        (case(smol, None), None),  # plugin off: plain vLLM, accepted
        (case(smol), None),  # plugin on, nothing refused: accepted (docs/vllm.md#wiring)
        (case(qwen), None),
        # past the model's positions: the rebase runs it (vLLM itself asks for the variable)
        (case(smol, max_model_len=16384, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}), None),
        (
            case(smol, {"n_sink": 4, "window": 8188}),
            "n_sink + window = 8192 must be below the model's 8192 positions",
        ),
        (case(smol, enable_prefix_caching=True), "prefix caching is refused"),
        (case(smol, enforce_eager=False), "CUDA graphs and torch.compile are refused"),
        (
            case(smol, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            "speculative decoding is refused",
        ),
        (
            case(qwen, hf_overrides={"use_sliding_window": True, "sliding_window": 64}),
            "sliding-window layers (sliding_window=64)",
        ),
        (case(qwen, tensor_parallel_size=2), "tensor and pipeline parallelism are refused"),
        (case(smol, kv_cache_dtype="fp8"), "kv_cache_dtype 'fp8' is refused"),
        (case(smol, dtype="bfloat16"), "dtype torch.bfloat16 is refused"),
        (case(smol, hf_overrides={"rope_parameters": dynamic}), "rope type 'dynamic'"),
        (
            case(mistral, skip_tokenizer_init=True),
            "model type 'mistral' is not supported yet (supported: llama, qwen2)",
        ),
        (case(smol, {**SINK, "windw": 3}), "unknown option(s) 'windw'"),
        (case(smol, {"n_sink": 4, "window": 0}), "window must be a positive integer, got 0"),
        (case(smol, {"n_sink": 4}), "missing option(s) window"),
    ]
    verdicts = vllm_configs(vllm_py, [c for c, _ in table])
    for (c, expected), verdict in zip(table, verdicts, strict=True):
        where = f"{Path(c['model']).name} {c['kwargs']}"
        if expected is None:
            assert verdict["ok"], f"{where}: {verdict}"
        else:
            assert not verdict["ok"], f"{where}: accepted, expected {expected!r}"
            assert "sinklab: " in verdict["error"] and expected in verdict["error"], (
                f"{where}: {verdict['error'][:500]}"
            )


ROTARY = Path(__file__).resolve().parent / "vllm_env" / "rotary.py"


@pytest.mark.integration
def test_the_key_mover_is_vllms_rope_and_sinklabs_shift(vllm_py, smollm2):
    """``sinklab_vllm.rotary``: moving a key that vLLM rotated at p1 by p2 - p1 gives vLLM's own
    rotation at p2 (up to the float32 rounding of vLLM's angles, at most |k| * 2^-23 * (p1 + p2)),
    moves compose, and the moved keys equal sinklab's ``Rope.shift`` (``rope_of`` of the same
    model, what ``SinkCache`` re-rotates its sinks with) on SmolLM2 and Qwen2.5."""
    from sinklab.models.loading import load_model
    from sinklab.models.rotary import rope_of
    from sinklab.models.zoo import ZOO, dequantized_dir

    qwen = load_model("qwen2.5-0.5b")
    models = {"smollm2": smollm2, "qwen2.5": qwen}
    cases = [
        {
            "name": name,
            "config": json.loads((dequantized_dir(ZOO[m.info.name]) / "config.json").read_text()),
            "seed": i,
        }
        for i, (name, m) in enumerate(models.items())
    ]
    base = cases[0]["config"]  # the scaled kinds vLLM moves too (no sinklab model of them here)
    scaled = {
        "llama3": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    }
    cases += [
        {"name": kind, "config": {**base, "rope_parameters": params}, "seed": 10 + i}
        for i, (kind, params) in enumerate(scaled.items())
    ]
    results = run_json(vllm_py, ROTARY, cases)
    for r in results:
        bound = r["max_key"] * 2**-23 * r["far_positions"] + 1e-5
        print(
            f"{r['name']} ({r['rotary']}): vLLM's rotation vs moved, max |diff| "
            f"{r['direct_vs_moved_near']:.2e} (positions < 256), {r['direct_vs_moved_far']:.2e} "
            f"(up to {r['max_pos']}; bound {bound:.2e}); compose {r['compose']:.2e}"
        )
        assert r["direct_vs_moved_near"] < r["max_key"] * 2**-23 * 512 + 1e-5, r["name"]
        assert r["direct_vs_moved_far"] < bound, r["name"]
        assert r["compose"] < 1e-5, r["name"]
        if r["name"] not in models:
            continue
        rope = rope_of(models[r["name"]].model)
        inv = torch.tensor(r["inv_freq"], dtype=torch.float64)
        assert torch.equal(inv, rope.inv_freq), (inv - rope.inv_freq).abs().max()
        keys = torch.tensor(r["sample"]["keys"])  # (S, heads, D), vLLM's layout
        delta = torch.tensor(r["sample"]["delta"])
        theirs = rope.shift(keys.transpose(0, 1), delta).transpose(0, 1)
        ours = torch.tensor(r["sample"]["moved"])
        diff = (ours - theirs).abs().max().item()
        print(f"{r['name']}: sinklab's Rope.shift vs the plugin's move, max |diff| {diff:.2e}")
        assert diff == 0.0, diff


BLOCKS = Path(__file__).resolve().parent / "vllm_env" / "blocks.py"


def test_the_block_manager_frees_exactly_what_sinklab_evicts(vllm_py):
    """``sinklab_vllm.blocks.SinkWindowManager`` on vLLM's own BlockPool, stepped as vLLM's
    scheduler steps it, three concurrent requests of different lengths (one 1,200 tokens past its
    prompt): at every step each request holds exactly the blocks that contain what
    ``sinklab.stream.policy.kept_positions`` keeps plus the new token (so nothing still needed is
    freed and every whole block that fell out is), never more than ``max_blocks``, its block table
    stays by stream index, and the pool is whole again once the requests are freed. Then a
    20,000-token request is admitted on the blocks it can hold while a chunk is in flight (the
    sinks, the window and the chunk: vLLM's admission gate reserved all 20,000 tokens' worth
    before), and reading it chunk by chunk (200 tokens, not a multiple of the block) never holds
    more, so a pool of exactly that many blocks serves it."""
    from sinklab.stream.policy import kept_positions

    n_sink, window = 4, 252
    requests = [
        {"prompt": 37, "steps": 1200},
        {"prompt": 200, "steps": 700},
        {"prompt": 5, "steps": 300},
    ]
    runs = [
        {
            "n_sink": n_sink,
            "window": window,
            "block_size": bs,
            "pool_blocks": 128,
            "requests": requests,
            "chunk": 200,
            "long": 20_000,
        }
        for bs in (128, 32)
    ]
    results = run_json(vllm_py, BLOCKS, runs)
    sinks = tuple(range(n_sink))
    for spec, result in zip(runs, results, strict=True):
        bs = spec["block_size"]
        bound = -(-n_sink // bs) + -(-(window + 1) // bs) + 1
        assert result["max_blocks"] == bound
        for rid, steps in result["held"].items():
            for step in steps:
                t = step["t"]
                needed = {p // bs for p in [*kept_positions(t, sinks, window), t]}
                assert set(step["blocks"]) == needed, (bs, rid, t, step["blocks"], sorted(needed))
                assert len(step["blocks"]) <= bound, (bs, rid, t)
                assert step["table"] == t // bs + 1, (bs, rid, t)
        most = max(len(s["blocks"]) for steps in result["held"].values() for s in steps)
        print(
            f"block size {bs}: at most {most} blocks per request (bound {bound}), "
            f"{max(result['in_use'])} in the pool for 3 requests; longest request "
            f"{max(r['prompt'] + r['steps'] for r in requests)} tokens"
        )
        assert most == bound  # the long requests reach the bound: it is tight
        assert max(result["in_use"]) <= 3 * bound
        assert result["in_use_after_free"] == 0
        admit = result["admission"]
        reading = -(-n_sink // bs) + -(-(window + 200) // bs) + 1  # sinks, window + chunk
        assert admit["reserved"] == admit["bound"] == reading < -(-20_000 // bs)
        assert reading - 1 <= admit["most_held"] <= reading, admit  # within a straddle of it
        assert admit["free_after"] == admit["pool"]  # all of it back
        assert result["in_use_at_end"] == 0
        print(
            f"block size {bs}: a 20,000-token request is admitted on {reading} blocks (not "
            f"{-(-20_000 // bs)}) and held at most {admit['most_held']} reading 200 at a time"
        )


LAYOUT = Path(__file__).resolve().parent / "vllm_env" / "layout.py"


def test_the_kv_cache_reads_back_what_vllm_wrote(vllm_py, smollm2):
    """``sinklab_vllm.cache.gather`` reads, by stream position through the block table, exactly
    the keys and values vLLM's CPU attention wrote: inside a running engine (plain vLLM, SmolLM2,
    two requests of 37 and 200 prompt tokens, 12 steps), at every forward of layer 0, both the
    positions just written and every earlier one. The keys are stored transposed per block
    (docs/vllm.md#layout); reading them as rows gives differences of about 12."""
    from sinklab.corpus import load_text, token_stream
    from sinklab.models.zoo import ZOO, dequantized_dir

    folder = dequantized_dir(ZOO[smollm2.info.name], smollm2.info.weights_sha256)
    ids = token_stream(load_text(), smollm2.tokenizer, 200).tolist()
    request = {"model": str(folder), "prompts": [ids[:37], ids], "max_tokens": 12}
    result = run_json(vllm_py, LAYOUT, request)
    print(f"layout: {result}")
    assert result["isa"] == "vec", f"only the vec layout is read (this machine: {result['isa']})"
    assert result["forwards"] == 12
    assert result["checked"] == 12 * (37 + 200) + 2 * sum(range(12))
    assert result["new"] == 0.0 and result["old"] == 0.0, result


ATTENTION = Path(__file__).resolve().parent / "vllm_env" / "attention.py"


def _attention_request(loaded, hf_overrides: dict | None, variants: list[dict]) -> dict:
    from sinklab.corpus import load_text, token_stream
    from sinklab.models.zoo import ZOO, dequantized_dir

    folder = dequantized_dir(ZOO[loaded.info.name], loaded.info.weights_sha256)
    ids = token_stream(load_text(), loaded.tokenizer, 200).tolist()
    return {
        "model": str(folder),
        "prompts": [ids[:37], ids],
        "max_tokens": 12,
        "hf_overrides": hf_overrides,
        "variants": variants,
    }


def test_sink_attention_equals_vllms_kernel_before_eviction(vllm_py, smollm2):
    """``sinklab_vllm.attention.sink_attention`` (gather the kept slots, GQA, float32 softmax) on
    vLLM's own cache, for every decode query of every layer of a running engine (SmolLM2, two
    requests, 11 decode steps: 660 queries), equals vLLM's CPU kernel while nothing is evicted
    (4 + 252 covers every position)."""
    request = _attention_request(smollm2, None, [{"n_sink": 4, "window": 252}])
    (result,) = run_json(vllm_py, ATTENTION, request)
    print(f"sink_attention vs vLLM's kernel: {result}")
    assert result["queries"] == 2 * 11 * 30 and result["evicted"] == 0
    assert result["kept"] == 200 + 11  # the longest request's last query sees everything
    assert result["max_diff"] < 1e-5 * max(1.0, result["max_out"]), result


def test_window_attention_equals_vllms_sliding_window_kernel(vllm_py, smollm2):
    """After eviction, the window part: with SmolLM2's own sliding window forced on (every
    layer, 40 positions, so vLLM's kernel and block manager evict), ``sink_attention`` with no
    sinks and ``window = 39`` (vLLM's window counts the query) equals the kernel on every decode
    query, most of them past eviction, their windows gathered out of partially evicted blocks;
    ``window = 40`` and full attention do not (the comparison can fail). The sinks' part after a
    gap (the move) is pinned separately, bit-equal to sinklab's."""
    variants = [{"n_sink": 0, "window": 39}, {"n_sink": 0, "window": 40}]
    overrides = {"layer_types": ["sliding_attention"] * 30, "sliding_window": 40}
    right, off_by_one = run_json(
        vllm_py, ATTENTION, _attention_request(smollm2, overrides, variants)
    )
    print(f"window 39 vs vLLM's sliding window 40: {right}; window 40: {off_by_one}")
    assert right["queries"] == 660 and right["evicted"] > 500 and right["kept"] == 40
    assert right["max_diff"] < 1e-5 * max(1.0, right["max_out"]), right
    assert off_by_one["max_diff"] > 1e-2, off_by_one
