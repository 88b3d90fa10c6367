"""Many streams in one SinkCache: each batch row's logits equal that stream decoded alone, with
``model.generate`` (left-padded prompts of different lengths) and with sinklab's own loop
(``StreamBatch``: streams of different lengths, fed different amounts per step, one added mid-way,
one removed)."""

from __future__ import annotations

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.generation import StreamBatch


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    m = tiny_model_factory("llama", seed=21)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(model, cfg: CacheConfig, prompts: list[list[int]], n: int):
    width = max(len(p) for p in prompts)
    x = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(x)
    for b, p in enumerate(prompts):
        x[b, width - len(p) :], mask[b, width - len(p) :] = torch.tensor(p), 1
    out = model.generate(
        x,
        attention_mask=mask,
        cache=SinkCache(model, cfg),
        max_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, width:], torch.stack(out.logits, 1)  # (B, n), (B, n, V)


@pytest.mark.parametrize("policy", ["sink", "window", "dense"])
def test_generate_left_padded_rows_equal_each_prompt_alone(model, policy):
    cfg = CacheConfig(policy, 2, 6)
    prompts = [_ids(9, 1), _ids(3, 2), _ids(6, 3)]  # different lengths: rows start apart
    seqs, logits = _generate(model, cfg, prompts, 20)
    for b, p in enumerate(prompts):
        alone_seq, alone_logits = _generate(model, cfg, [p], 20)
        assert seqs[b].tolist() == alone_seq[0].tolist(), b
        torch.testing.assert_close(logits[b], alone_logits[0], atol=1e-4, rtol=1e-4)


def _alone(model, cfg: CacheConfig, chunks: list[list[int]]) -> list[torch.Tensor]:
    """One stream by itself, read chunk by chunk through sinklab's bounded loop."""
    cache = SinkCache(model, cfg)
    out = []
    with torch.no_grad():
        for part in chunks:
            x = torch.tensor([part])
            out.append(model(x, cache=cache, **cache.prepare(len(part))).logits[0])
    return out


SCHEDULE = {  # step -> {stream: tokens this step}; stream "c" joins at step 3, "b" leaves after 9
    0: {"a": 7, "b": 2},
    1: {"a": 1, "b": 1},
    2: {"a": 1, "b": 5},
    3: {"a": 1, "b": 1, "c": 4},
    **{s: {"a": 1, "b": 1, "c": 1} for s in range(4, 10)},
    10: {"a": 3, "c": 1},
    **{s: {"a": 1, "c": 1} for s in range(11, 22)},
}


@pytest.mark.parametrize(
    "cfg",
    [
        CacheConfig("sink", 2, 6),
        CacheConfig("sink-auto", 3, 6, (0, 4, 7)),
        CacheConfig("window", 2, 6),
        CacheConfig("dense", 2, 6),
    ],
    ids=lambda c: c.policy,
)
def test_stream_batch_rows_equal_each_stream_alone(model, cfg):
    _check_batch(model, cfg)


def test_stream_batch_with_eager_attention(tiny_model_factory):
    """The padding mask reaches eager attention as an additive float mask."""
    eager = tiny_model_factory("llama", seed=22)
    eager.set_attn_implementation("eager")
    _check_batch(eager, CacheConfig("sink", 2, 6))


def _check_batch(model, cfg: CacheConfig) -> None:
    tokens = {"a": iter(_ids(60, 4)), "b": iter(_ids(60, 5)), "c": iter(_ids(60, 6))}
    batch = StreamBatch(model, cfg)
    sid: dict[str, int] = {}
    chunks: dict[str, list[list[int]]] = {k: [] for k in tokens}
    got: dict[str, list[torch.Tensor]] = {k: [] for k in tokens}
    for step in sorted(SCHEDULE):
        plan = SCHEDULE[step]
        for name in plan:
            if name not in sid:
                sid[name] = batch.add()
        for name in [n for n in sid if n not in plan]:
            batch.remove(sid.pop(name))
        feed = {name: [next(tokens[name]) for _ in range(k)] for name, k in plan.items()}
        out = batch.feed({sid[n]: ids for n, ids in feed.items()})
        for name, ids in feed.items():
            chunks[name].append(ids)
            got[name].append(out[sid[name]])
        if cfg.capacity is not None:
            assert batch.cache.kept_length() <= cfg.capacity
    for name in tokens:
        want = _alone(model, cfg, chunks[name])
        torch.testing.assert_close(torch.cat(got[name]), torch.cat(want), atol=1e-4, rtol=1e-4)


def test_stream_batch_errors(model):
    batch = StreamBatch(model, CacheConfig("sink", 2, 6))
    with pytest.raises(SinklabError, match="no such stream"):
        batch.feed({3: [5]})
    with pytest.raises(SinklabError, match="no streams"):
        batch.feed({})


def test_evict_for_space_keeps_sinks_and_makes_room(model):
    cfg = CacheConfig("sink", 2, 6)
    cache = SinkCache(model, cfg)
    ids = _ids(30, 7)
    spans = []
    update = cache.layers[0].update

    def spy(k, v, *args, **kwargs):
        out = update(k, v, *args, **kwargs)
        spans.append(out[0].shape[-2])
        return out

    cache.layers[0].update = spy
    with torch.no_grad():
        model(torch.tensor([ids[:12]]), cache=cache, **cache.prepare(12))
        assert cache.kept_positions() == [0, 1, 6, 7, 8, 9, 10, 11]
        cache.evict_for_space(4)  # 8 kept + 4 new must fit in 8: keep the sinks and 2 recent
        assert cache.kept_positions() == [0, 1, 10, 11]
        model(torch.tensor([ids[12:16]]), cache=cache, **cache.prepare(4))
        assert cache.kept_positions() == [0, 1, 10, 11, 12, 13, 14, 15]
    assert spans[-1] == 8  # the chunk attended to the 4 kept + itself: n_sink + window
