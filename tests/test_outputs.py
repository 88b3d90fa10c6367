"""The one output writer: user folders are refused, previous outputs replaced whole or kept."""

from __future__ import annotations

import os

import pytest

from sinklab.errors import SinklabError
from sinklab.outputs import MARKER, check_out, marker_command, output_dir


def _write(out, command: str, name: str, text: str) -> None:
    with output_dir(out, command) as tmp:
        (tmp / name).write_text(text)


def test_new_folder_is_written_with_marker_and_umask(tmp_path):
    out = tmp_path / "a" / "run"
    old = os.umask(0o022)
    try:
        _write(out, "probe", "probe.json", "{}")
    finally:
        os.umask(old)
    assert marker_command(out) == "probe"
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "probe.json"])
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert [p.name for p in tmp_path.joinpath("a").iterdir()] == ["run"]  # no temp left


def test_previous_output_of_same_command_is_replaced_whole(tmp_path):
    out = tmp_path / "run"
    _write(out, "probe", "old.json", "1")
    _write(out, "probe", "new.json", "2")
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "new.json"])


def test_error_or_interrupt_keeps_previous_output_byte_identical(tmp_path):
    out = tmp_path / "run"
    _write(out, "probe", "probe.json", "good")
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)), output_dir(out, "probe") as tmp:
            (tmp / "probe.json").write_text("half")
            raise exc
        assert (out / "probe.json").read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (lambda d: (d / "notes.txt").write_text("x"), "sinklab did not write"),
        (lambda d: (d / "results.json").write_text("{}"), "sinklab did not write"),
        (lambda d: (d / MARKER).write_text('{"command": "cost"}'), "'sinklab cost' output"),
    ],
)
def test_other_folders_are_refused_untouched(tmp_path, setup, needle):
    out = tmp_path / "run"
    out.mkdir()
    setup(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SinklabError, match=needle):
        _write(out, "probe", "probe.json", "{}")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(SinklabError, match="is a file"):
        check_out(tmp_path / "f", "probe")
    with pytest.raises(SinklabError, match="is a file, not a folder"):
        check_out(tmp_path / "f" / "sub", "probe")
    assert (tmp_path / "f").read_text() == "mine"
