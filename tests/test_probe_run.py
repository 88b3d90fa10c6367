"""``ProbeRun``: the ``sinklab probe`` run as a library call equals the probe and the length
trend called by hand, counts every layer of every run, and refuses bad sizes before any work."""

from __future__ import annotations

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.probe import ProbeConfig, probe, probe_lengths
from sinklab.probe.run import ProbeRun


def test_a_run_is_the_probe_and_the_trend(tiny_model_factory):
    model = tiny_model_factory("llama", n_layers=3)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1))
    config = ProbeConfig(q0=2, eps=(0.2, 0.5))
    run = ProbeRun(config, tokens=24, lengths=(32, 16, 32), prepend=None)
    assert run.lengths == (16, 32) and run.need == 32 and run.need_option == "--lengths"
    seen: list[tuple[int, int, str]] = []
    result, data = run.run(model, ids, lambda d, t, label: seen.append((d, t, label)))
    want = probe(model, ids[:24], config)
    torch.testing.assert_close(result.sink_mass, want.sink_mass)
    assert data["sink_rate"] == want.to_json()["sink_rate"]
    assert data["by_length"] == probe_lengths(model, ids, (16, 32), config).to_json()
    assert {t for _, t, _ in seen} == {3 * 3}  # 3 layers x (the probe + 2 lengths)
    assert max(d for d, _, _ in seen) == 9 and seen[0][2] == "24 tokens"
    assert run.params() == {**want.config.__dict__, "tokens": 24, "lengths": [16, 32],
                            "prepend": None}  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tokens": 1}, "--tokens must be at least 2"),
        ({"tokens": 8, "config": ProbeConfig(q0=8)}, "--q0 8 leaves no query"),
        ({"lengths": (1, 8)}, "length 1 is outside"),
        ({"prepend": "\\x"}, "broken escape"),
    ],
)
def test_bad_sizes_are_refused_before_any_work(kwargs, needle):
    kwargs = {"config": ProbeConfig(), "tokens": 16, **kwargs}
    with pytest.raises(SinklabError, match=needle):
        ProbeRun(**kwargs)


def test_probe_run_argv_parses_back_to_the_same_run():
    """ProbeRun.argv is the command line the probe command turns back into this run."""
    from sinklab.commands.common import parse_float_list, parse_int_list
    from sinklab.probe import ProbeConfig
    from sinklab.probe.run import ProbeRun

    run = ProbeRun(ProbeConfig(q0=4, eps=(0.45, 0.8)), 64, (32, 64), "bos")
    argv = run.argv(["--model", "m"], "t", "o")
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    back = ProbeRun(
        ProbeConfig(q0=int(opts["--q0"]), eps=tuple(parse_float_list(opts["--eps"], "--eps", ""))),
        int(opts["--tokens"]),
        tuple(parse_int_list(opts["--lengths"], "--lengths")),
        opts["--prepend"],
    )
    assert back == run and argv[:2] == ["sinklab", "probe"] and opts["--out"] == "o"
