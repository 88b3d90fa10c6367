"""A stream leaves its SinkCache as a :class:`StreamState` and comes back: the rebuilt cache gives
the next logits the original cache gives (1e-5), through safetensors and JSON too, after
eviction, chunked reads and a position rebase; streams that leave a ``StreamBatch`` and join
another with their state equal each stream decoded alone (1e-4); broken states are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sinklab.errors import SinklabError
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.generation import StreamBatch
from sinklab.stream.state import StreamState


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", seed=23)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _feed(model, cache: SinkCache, parts: list[list[int]]) -> list[torch.Tensor]:
    out = []
    for part in parts:
        x = torch.tensor([part])
        out.append(model(x, cache=cache, **cache.prepare(len(part))).logits[0])
    return out


def _parts(seed: int) -> list[list[int]]:
    ids = _ids(40, seed)  # chunks and single tokens, well past n_sink + window
    return [ids[:5], *[[t] for t in ids[5:20]], ids[20:27], *[[t] for t in ids[27:]]]


@pytest.mark.parametrize(
    ("cfg", "max_position"),
    [
        (CacheConfig("sink", 2, 6), None),
        (CacheConfig("sink", 2, 6), 16),  # rows rebase several times
        (CacheConfig("sink-auto", 3, 6, (0, 4, 7)), None),
        (CacheConfig("window", 2, 6), None),
    ],
    ids=["sink", "sink-rebased", "sink-auto", "window"],
)
def test_state_round_trip_gives_the_same_next_logits(model, cfg, max_position, tmp_path):
    parts = _parts(1)
    after = [[7], _ids(3, 2), *[[t] for t in _ids(10, 3)]]
    cache = SinkCache(model, cfg, max_position)
    _feed(model, cache, parts)
    state = cache.state()
    assert state.positions == cache.kept_positions()
    assert state.seen == 40
    save_file(state.tensors, tmp_path / "s.safetensors")
    (tmp_path / "s.json").write_text(json.dumps(state.to_json()))
    loaded = StreamState.from_json(
        json.loads((tmp_path / "s.json").read_text()), load_file(tmp_path / "s.safetensors")
    )
    want = _feed(model, cache, after)
    for restored in (state, loaded):
        again = SinkCache.from_state(model, [restored], max_position)
        got = _feed(model, again, after)
        torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-5, rtol=1e-5)
        assert again.kept_positions() == cache.kept_positions()


def test_empty_state_continues_like_a_fresh_cache(model):
    cfg = CacheConfig("sink", 2, 6)
    state = SinkCache(model, cfg).state()
    assert state.kept == 0 and not state.tensors
    parts = _parts(4)
    got = _feed(model, SinkCache.from_state(model, [state]), parts)
    want = _feed(model, SinkCache(model, cfg), parts)
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-5, rtol=1e-5)


def test_streams_leave_and_rejoin_a_batch_equal_to_alone(model):
    """Three conversations take turns in one StreamBatch: between turns each leaves as a state
    (the server's idle sessions) and joins again among others at different points."""
    cfg = CacheConfig("sink", 2, 6)
    turns = {  # name -> parts read per turn; each turn: a prompt chunk, then single tokens
        name: [
            [_ids(k, 10 * s + t), *[[x] for x in _ids(6, 10 * s + t + 5)]]
            for t, k in enumerate((5, 3, 4))
        ]
        for s, name in enumerate("abc")
    }
    states = {name: SinkCache(model, cfg).state() for name in turns}
    got: dict[str, list[torch.Tensor]] = {name: [] for name in turns}
    schedule = [("a", "b"), ("c",), ("b", "a", "c"), ("a",), ("c", "b")]  # who runs together
    done = {name: 0 for name in turns}
    for group in schedule:
        batch = StreamBatch(model, cfg)
        sid = {name: batch.add(states[name]) for name in group}
        work = {name: list(turns[name][done[name]]) for name in group}
        while any(work.values()):
            feed = {sid[n]: work[n].pop(0) for n in group if work[n]}
            out = batch.feed(feed)
            for n in group:
                if sid[n] in out:
                    got[n].append(out[sid[n]])
        for name in group:
            states[name] = batch.state(sid[name])
            batch.remove(sid[name])
            done[name] += 1
    for name in turns:
        parts = [p for turn in turns[name][: done[name]] for p in turn]
        want = _feed(model, SinkCache(model, cfg), parts)
        torch.testing.assert_close(torch.cat(got[name]), torch.cat(want), atol=1e-4, rtol=1e-4)


def test_broken_states_are_refused(model):
    cache = SinkCache(model, CacheConfig("sink", 2, 6))
    _feed(model, cache, _parts(5))
    good = cache.state()
    data = good.to_json()
    with pytest.raises(SinklabError, match="do not fit"):
        StreamState.from_json({**data, "positions": data["positions"][::-1]}, good.tensors)
    with pytest.raises(SinklabError, match="not a stream state"):
        StreamState.from_json({k: v for k, v in data.items() if k != "ring"}, good.tensors)
    short = {**good.tensors, "0.keys": good.tensors["0.keys"][:, :3]}
    with pytest.raises(SinklabError, match="shape"):
        StreamState.from_json(data, short)
    with pytest.raises(SinklabError, match="dense"):
        SinkCache(model, CacheConfig("dense", 2, 6)).state()
