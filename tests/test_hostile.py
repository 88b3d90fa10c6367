"""Hostile cases of issue 22 (outputs, data loss, caches, signals, JSON): an unlucky machine and a
careful user. Each case asserts the exit code, one line on stderr, no traceback, and that the
previous output is byte-identical (or, where the run works, that it did the right thing).

A full disk is simulated without a tmpfs: the run is a subprocess with ``RLIMIT_FSIZE`` set and
SIGXFSZ ignored, so a write past the limit fails with EFBIG (``File too large``) as a full disk
fails with ENOSPC. Write-protection is tested as this user, and as root without
``CAP_DAC_OVERRIDE`` (``setpriv``) where the tests run as root. The inputs half of the battery
(bounded reads, configs, numeric bounds, stdin) is ``tests/test_hostile_inputs.py``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import one_line_error, run_main
from sinklab.errors import SinklabError
from sinklab.meta import NON_FINITE, dumps_json, restore_non_finite, write_json_atomic
from sinklab.outputs import exchange_folders, output_dir
from test_cli_outputs import digest

PROBE = ["--tokens", "24", "--no-figures"]
REPORT = ["--quick", "--stages", "probe", "--set", "probe_tokens=24"]
TRAIN = ["--steps", "2", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16",
         "--batch-size", "2", "--vocab-size", "300"]  # fmt: skip


def _previous(out: Path, command: str, text: str = "previous") -> dict[str, str]:
    """A previous ``command`` output at ``out`` (no model needed); its digest."""
    with output_dir(out, command) as tmp:
        (tmp / f"{command}.json").write_text(json.dumps({"text": text}))
        (tmp / "figures").mkdir()
        (tmp / "figures" / "a.png").write_bytes(b"\x89PNG previous")
    return digest(out)


def _process(*args: str, fsize: int | None = None, unprivileged: bool = False, timeout=300):
    """``python -m sinklab.cli ARGS`` as a fresh process, optionally with a file-size limit
    (a write past it fails with EFBIG, as a full disk fails with ENOSPC) or, for root, without
    the capabilities that override file permissions."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    cmd = [sys.executable, "-m", "sinklab.cli", *args]
    if unprivileged and os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--", *cmd]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=limit
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


# ---- 1. data loss: the swap into --out ---------------------------------------------------------


def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("new")
    (b / "x").write_text("old")
    assert exchange_folders(a, b)  # Linux >= 3.15 on the usual file systems (tmp_path's)
    assert (b / "x").read_text() == "new" and (a / "x").read_text() == "old"


_KILL_AFTER_EXCHANGE = """
import os, signal, sys
from pathlib import Path
import sinklab.outputs as o
o._discard = lambda path: os.kill(os.getpid(), signal.SIGKILL)  # after the exchange, before rm
with o.output_dir(Path(sys.argv[1]), "probe") as tmp:
    (tmp / "probe.json").write_text("new")
"""

_KILL_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
import sinklab.outputs as o
o.exchange_folders = lambda a, b: False  # a system without RENAME_EXCHANGE
rename = Path.rename
def second_kills(self, target):
    if self.name.startswith("." + Path(sys.argv[1]).name + ".tmp-"):
        os.kill(os.getpid(), signal.SIGKILL)  # the previous output is aside, the new not in
    return rename(self, target)
Path.rename = second_kills
with o.output_dir(Path(sys.argv[1]), "probe") as tmp:
    (tmp / "probe.json").write_text("new")
"""


@pytest.mark.parametrize("script", ["exchange", "fallback"])
def test_sigkill_mid_swap_never_loses_out(tmp_path, script):
    """SIGKILL at the worst instant of each swap: --out is always whole (the new output after
    the exchange; the previous one, put back by the next run, in the two-rename fallback)."""
    out = tmp_path / "out"
    before = _previous(out, "probe")
    code = {"exchange": _KILL_AFTER_EXCHANGE, "fallback": _KILL_BETWEEN_RENAMES}[script]
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if script == "exchange":
        assert (out / "probe.json").read_text() == "new"  # the new one, whole
        assert len(_siblings(out)) == 2  # and the previous one aside, until the next run
    else:
        assert not out.exists() and _siblings(out)[0] == ".out.old"  # and the new one's build
    with output_dir(out, "probe") as tmp:  # the next run: cleans up (and puts back) first
        if script == "fallback":
            assert digest(out) == before  # the previous output was put back whole
        (tmp / "probe.json").write_text("third")
    assert _siblings(out) == ["out"] and (out / "probe.json").read_text() == "third"


def test_fallback_recovery_is_one_line(tmp_path, caplog):
    """The previous output found aside (``.out.old``) with no ``out`` is put back, saying so."""
    out = tmp_path / "out"
    before = _previous(out, "probe")
    out.rename(tmp_path / ".out.old")
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError), output_dir(out, "probe"):
        raise RuntimeError("this run fails too")
    assert digest(out) == before and _siblings(out) == ["out"]
    assert [r.getMessage() for r in caplog.records if "put back" in r.getMessage()]


@pytest.mark.parametrize("exchange", [True, False])
def test_a_users_folder_named_like_a_swap_leftover_is_never_touched(
    tmp_path, monkeypatch, exchange
):
    import sinklab.outputs

    if not exchange:
        monkeypatch.setattr(sinklab.outputs, "exchange_folders", lambda a, b: False)
    out = tmp_path / "out"
    _previous(out, "probe")
    mine = tmp_path / ".out.old"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for text in ("second", "third"):
        with output_dir(out, "probe") as tmp:
            (tmp / "probe.json").write_text(text)
    assert (mine / "notes.txt").read_text() == "mine" and _siblings(out) == [".out.old", "out"]
    assert (out / "probe.json").read_text() == "third"


@pytest.mark.parametrize("command", ["probe", "report"])
def test_write_protected_previous_output_is_refused_before_work(tmp_path, command):
    """A 0555 previous output in a writable parent could be moved aside but never deleted:
    refused in one line before the model loads (as root too, without CAP_DAC_OVERRIDE)."""
    out = tmp_path / "P"
    _previous(out, command)
    (out / "figures").chmod(0o555)
    out.chmod(0o555)
    before = digest(tmp_path)
    try:
        code, _, err = _process(command, "--model", "/never/loaded", "--out", str(out),
                                unprivileged=True)  # fmt: skip
    finally:
        out.chmod(0o755)
        (out / "figures").chmod(0o755)
    one_line_error(code, err, "write-protected")
    assert digest(tmp_path) == before and _siblings(out) == ["P"]


def test_leftover_that_cannot_be_removed_is_named_in_one_line(tmp_path):
    """A killed run's temporary folder that sinklab cannot delete is named, and the run goes on."""
    out = tmp_path / "c"
    stuck = tmp_path / ".c.tmp-999999999-abc"
    (stuck / "locked").mkdir(parents=True)
    (stuck / "locked" / "f").write_text("x")
    (stuck / "locked").chmod(0o555)
    try:
        cost = ["--lengths", "8,16", "--task", "sink", "--steps", "10", "--bisections", "1"]
        code, _, err = _process("cost", *cost, "--out", str(out), unprivileged=True)
    finally:
        (stuck / "locked").chmod(0o755)
    assert code == 0, err
    named = [ln for ln in err.splitlines() if stuck.name in ln]
    assert len(named) == 1 and "could not remove" in named[0] and "Traceback" not in err
    assert (out / "cost.json").is_file()


def test_out_inside_a_previous_output_is_refused(capsys, tmp_path, monkeypatch):
    import sinklab.models.loading

    monkeypatch.setattr(sinklab.models.loading, "load_model", _no_load)
    report = tmp_path / "R"
    _previous(report, "report")
    before = digest(tmp_path)
    code, _, err = run_main(capsys, "report", "--model", "/x", "--out", str(report / "figures" /
                                                                          "sub"))  # fmt: skip
    one_line_error(code, err, "is inside")
    assert digest(tmp_path) == before


def _no_load(*a, **k):
    raise AssertionError("the model loaded before the refusal")


# ---- 1. data loss: report and train on a full disk, bad sizes, every stage failed --------------


@pytest.fixture(scope="module")
def good_report(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """A good previous report of the tiny llama (and the model folder)."""
    model = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp("good") / "R"
    code, _, err = _process("report", "--model", str(model), *REPORT, "--out", str(out))
    assert code == 0, err
    return out, model


def test_report_on_a_full_disk_keeps_the_previous_report(good_report):
    out, model = good_report
    before = digest(out)
    code, _, err = _process("report", "--model", str(model), *REPORT, "--set",
                            "stream_tokens=512", "--out", str(out), fsize=4096)  # fmt: skip
    one_line_error(code, err, "cannot write there (File too large); the previous output is as")
    assert digest(out) == before and _siblings(out) == ["R"]


def test_report_where_every_stage_failed_keeps_the_previous_report(
    capsys, good_report, monkeypatch
):
    import sinklab.probe.run

    out, model = good_report
    before = digest(out)

    def broken(*a, **k):
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(sinklab.probe.run.ProbeRun, "__init__", broken)
    code, _, err = run_main(capsys, "report", "--model", str(model), *REPORT, "--set",
                            "stream_tokens=512", "--out", str(out))  # fmt: skip
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "every stage of the report failed (probe: RuntimeError: the probe broke)" in last
    assert "previous report is as it was" in last
    assert digest(out) == before and _siblings(out) == ["R"]


@pytest.mark.parametrize(
    ("sizes", "needle", "loads"),
    [
        (["window=100000000"], "window must be at most 1,048,576", False),
        (["window=5000"], "is not below stream_tokens = 4,000", False),
        (["stream_tokens=100000000"], "at most 1,048,576", False),
        (["sensitivity_grid=1000"], "at most 32", False),
        (["window=600"], "is not below stream_tokens = 512", True),  # after the clamp to 512
    ],
)
def test_report_sizes_are_checked_before_any_stage(
    capsys, good_report, monkeypatch, sizes, needle, loads
):
    import sinklab.report.stages

    out, model = good_report
    before = digest(out)
    if not loads:
        import sinklab.models.loading

        monkeypatch.setattr(sinklab.models.loading, "load_model", _no_load)
    monkeypatch.setattr(sinklab.report.stages, "run_stage", _no_load)
    args = [a for kv in sizes for a in ("--set", kv)]
    code, _, err = run_main(capsys, "report", "--model", str(model), "--quick", "--stages",
                            "probe,stream", *args, "--out", str(out))  # fmt: skip
    one_line_error(code, err, needle)
    assert digest(out) == before


@pytest.mark.parametrize("sweep", [False, True])
def test_train_on_a_full_disk_is_one_line(tmp_path, sweep):
    """A checkpoint that does not fit: one line, exit 2; a previous run intact; a new sweep
    folder not left behind holding only its marker."""
    out = tmp_path / ("S" if sweep else "T")
    before = {} if sweep else _previous(out, "train")
    args = ["train", *TRAIN, "--out", str(out), *(["--sweep", "variants"] if sweep else [])]
    code, _, err = _process(*args, fsize=16384)
    one_line_error(code, err, "cannot write there (File too large)")
    if sweep:
        assert _siblings(out) == []
    else:
        assert digest(out) == before and _siblings(out) == ["T"]


# ---- 2. caches heal ----------------------------------------------------------------------------


def _build(calls: list[int]):
    def build(folder: Path) -> None:
        calls.append(1)
        (folder / "model.safetensors").write_bytes(b"w" * 1000)
        (folder / "config.json").write_text("{}")

    return build


@pytest.mark.parametrize("damage", ["truncated", "flipped", "no marker", "file gone"])
def test_a_broken_cache_entry_is_rebuilt_once(tmp_path, caplog, damage):
    from sinklab.models.checkpoint import cached_build
    from sinklab.models.zoo import READY

    target, calls, facts = tmp_path / "entry", [], {"from": "x"}
    assert cached_build(target, _build(calls), facts, "a model") == target
    weights = target / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(b"w" * 10)
    elif damage == "flipped":  # same size, new mtime: the hash finds it
        weights.write_bytes(b"v" + b"w" * 999)
    elif damage == "no marker":  # a build cut short
        (target / READY).unlink()
    else:
        weights.unlink()
    with caplog.at_level("WARNING"):
        cached_build(target, _build(calls), facts, "a model")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "broken" in warned[0] and "rebuilding it once" in warned[0]
    assert weights.read_bytes() == b"w" * 1000 and len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # nothing left beside it
    cached_build(target, _build(calls), facts, "a model")  # whole again: used, not rebuilt
    assert len(calls) == 2


def test_a_cache_that_rebuilding_cannot_heal_says_it_is_safe_to_delete(tmp_path, monkeypatch):
    import sinklab.models.checkpoint as models

    monkeypatch.setattr(models, "cache_problem", lambda folder, facts: "a disk that lies")
    with pytest.raises(SinklabError, match=r"sinklab's own cache of a model .* safe to delete"):
        models.cached_build(tmp_path / "entry", _build([]), {}, "a model")


@pytest.mark.integration
def test_the_embedded_model_cache_heals_in_one_line(tmp_path, smollm2):
    """A truncated embedded-model cache: one line says it is rebuilt, then the run works (no
    GGUF progress bars); the rebuilt files follow the umask. The cache starts as a copy of the
    user's whole one (the ``smollm2`` fixture built it), so the GGUF is converted once here."""
    from sinklab.models.checkpoint import zoo_weights
    from sinklab.models.zoo import SMOLLM2

    whole, _, _ = zoo_weights(SMOLLM2)  # the folder this checkout's GGUF converts to
    shutil.copytree(whole, tmp_path / whole.name)
    env = {**os.environ, "SINKLAB_CACHE": str(tmp_path)}
    run = [sys.executable, "-m", "sinklab.cli", "info", "--format", "json"]
    first = subprocess.run(run, capture_output=True, text=True, env=env, timeout=900)
    assert first.returncode == 0 and first.stderr.strip() == "", first.stderr
    (entry,) = tmp_path.glob("smollm2-135m-*")
    weights = entry / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    again = subprocess.run(run, capture_output=True, text=True, env=env, timeout=900)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 0 and len(lines) == 1, again.stderr
    assert "is broken (model.safetensors is truncated" in lines[0] and "rebuilding" in lines[0]
    assert json.loads(again.stdout)["model"]["n_layers"] == 30
    modes = {p.name: p.stat().st_mode & 0o777 for p in entry.iterdir()}
    assert set(modes.values()) == {0o666 & ~_umask()}, modes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- 3. files follow the umask -----------------------------------------------------------------


def test_train_checkpoints_follow_the_umask(capsys, tmp_path):
    old = os.umask(0o022)
    try:
        code, _, err = run_main(capsys, "train", *TRAIN, "--out", str(tmp_path / "T"))
    finally:
        os.umask(old)
    assert code == 0, err
    files = [p for p in (tmp_path / "T").rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {"0o644"}, modes


# ---- 4. outputs are valid JSON -----------------------------------------------------------------


def _strict_loads(text: str):
    def refuse(name: str):
        raise ValueError(f"bare {name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_null_with_the_reason_beside_them(tmp_path):
    data = {"ppl": math.nan, "rates": {0.3: math.inf, "ok": 1.0}, "curve": [1.0, -math.inf]}
    text = write_json_atomic(tmp_path / "r.json", data).read_text()
    got = _strict_loads(text)
    assert got == {
        "ppl": None,
        "rates": {"0.3": None, "ok": 1.0, NON_FINITE: {"/0.3": "Infinity"}},
        "curve": [1.0, None],
        NON_FINITE: {"/ppl": "NaN", "/curve/1": "-Infinity"},
    }
    back = restore_non_finite(_strict_loads(dumps_json(data)))
    assert math.isnan(back["ppl"]) and back["rates"] == {"0.3": math.inf, "ok": 1.0}
    assert back["curve"] == [1.0, -math.inf]


def test_non_finite_numbers_without_a_table_are_refused_not_dropped(tmp_path):
    """A top-level list or number has no table for the non_finite entries: refused, and no file
    is written (before, the NaN became a bare null with nothing saying what it was)."""
    for data in ([1.0, math.nan], math.inf, [[-math.inf]]):
        with pytest.raises(ValueError, match="no table to hold"):
            dumps_json(data)
        with pytest.raises(ValueError, match="wrap the value in a dict"):
            write_json_atomic(tmp_path / "r.json", data)
    assert not (tmp_path / "r.json").exists()
    # finite lists, and lists whose non-finite numbers sit in a table, are written as before
    assert _strict_loads(dumps_json([1.0, {"ppl": math.nan}])) == [
        1.0,
        {"ppl": None, NON_FINITE: {"/ppl": "NaN"}},
    ]


def test_a_payload_key_named_non_finite_is_refused_and_a_table_is_kept(tmp_path):
    """``non_finite`` is reserved: a payload's own key of that name is refused (before, it was
    overwritten by the table, or read back as one and dropped); json_ready's own output written
    again keeps its table, merged with new entries, and reads back to the same numbers."""
    for bad in ({"non_finite": 3, "ppl": math.nan}, {"rows": [{"non_finite": "yes"}]}):
        with pytest.raises(ValueError, match="'non_finite' is reserved"):
            dumps_json(bad)
    once = _strict_loads(dumps_json({"ppl": math.nan, "rates": [1.0, math.inf]}))
    again = _strict_loads(dumps_json({**once, "loss": -math.inf}))
    assert again[NON_FINITE] == {"/ppl": "NaN", "/rates/1": "Infinity", "/loss": "-Infinity"}
    back = restore_non_finite(again)
    assert math.isnan(back["ppl"]) and back["rates"] == [1.0, math.inf]
    assert back["loss"] == -math.inf and NON_FINITE not in back


def test_claims_on_a_lab_run_holding_nan_writes_strict_json(capsys, tmp_path):
    """A lab run whose damage is NaN (written by another tool, bare NaN and all): claims.json
    and --format json are strict JSON, the NaN a null with its reason beside it."""
    lab = tmp_path / "lab"
    for data in ("bos", "packed"):  # the bos-reliance pair
        code, _, err = run_main(capsys, "train", *TRAIN, "--data", data, "--out", str(lab / data))
        assert code == 0, err
    path = lab / "bos" / "train.json"
    raw = json.loads(path.read_text())
    raw["val"]["damage"] = math.nan
    path.write_text(json.dumps(raw))
    out = tmp_path / "claims"
    code, stdout, err = run_main(capsys, "claims", "--lab", str(lab), "--claims", "bos-reliance",
                                 "--out", str(out), "--format", "json")  # fmt: skip
    assert code == 0, err
    for data in (_strict_loads(stdout), _strict_loads((out / "claims.json").read_text())):
        (row,) = [r for r in data["claims"] if r["id"] == "bos-reliance"]
        (sample,) = row["samples"]
        assert sample["effect"] is None and sample["damage_with_bos"] is None
        assert sample[NON_FINITE] == {"/effect": "NaN", "/damage_with_bos": "NaN"}
        assert isinstance(sample["damage_without_bos"], float)


@pytest.mark.parametrize("texts", ["shakespeare:hamlet,shakespeare:hamlet", "A,B"])
def test_claims_refuses_the_same_text_twice(capsys, tmp_path, monkeypatch, texts):
    import sinklab.models.loading

    monkeypatch.setattr(sinklab.models.loading, "load_model", _no_load)
    (tmp_path / "a.txt").write_text("the same words " * 50)
    shutil.copy(tmp_path / "a.txt", tmp_path / "b.txt")  # another name, the same text
    texts = texts.replace("A", str(tmp_path / "a.txt")).replace("B", str(tmp_path / "b.txt"))
    code, _, err = run_main(capsys, "claims", "--texts", texts, "--out", str(tmp_path / "o"))
    one_line_error(code, err, "the same text")
    assert not (tmp_path / "o").exists()


# ---- 5. signals from the first instant ---------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_during_start_up_is_one_line(tmp_path, sig):
    """The signal lands while torch is still being imported (its library mapped, seconds before
    any command runs): one line, exit 130, no traceback, --out untouched."""
    out = tmp_path / "P"
    before = _previous(out, "probe")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sinklab.cli", "probe", *PROBE, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until torch's shared library is being loaded
        try:
            if "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text():
                break
        except OSError:
            pass
        time.sleep(0.005)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    one_line_error(proc.returncode, err, "interrupted", 130)
    assert digest(out) == before and _siblings(out) == ["P"]


def test_a_new_cache_format_removes_its_older_copies(tmp_path):
    """After a format bump the older copies (with sinklab's marker) go; a folder of the same
    name without the marker is not sinklab's and stays."""
    from sinklab.models.checkpoint import remove_older_formats
    from sinklab.models.zoo import READY

    for v in (1, 2, 3):
        (tmp_path / f"m-abc-v{v}").mkdir()
        (tmp_path / f"m-abc-v{v}" / READY).write_text("{}")
    (tmp_path / "m-abc-v0").mkdir()  # not sinklab's: no marker
    removed = remove_older_formats(tmp_path / "m-abc-v3")
    assert sorted(p.name for p in removed) == ["m-abc-v1", "m-abc-v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-abc-v0", "m-abc-v3"]
