"""Helpers shared by the tests: running the CLI (in process or as a real process), the one-line
error check, and a recording attention handler."""

from __future__ import annotations

import subprocess
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sinklab.seam import AttentionHandler


class CliRun(NamedTuple):
    """What a CLI run gave: exit code, stdout, stderr (unpacks as a tuple, reads like a
    ``subprocess.CompletedProcess``)."""

    returncode: int
    stdout: str
    stderr: str


def run_main(capsys, *args: str) -> CliRun:
    """``sinklab ARGS`` in this process through ``sinklab.cli.main`` (the entry point's own code):
    no interpreter start-up. Output printed before the call is dropped."""
    from sinklab.cli import main

    capsys.readouterr()
    code = main(list(args))
    cap = capsys.readouterr()
    return CliRun(code, cap.out, cap.err)


def run_process(*args: str, timeout: int = 300, env: dict | None = None) -> CliRun:
    """``python -m sinklab.cli ARGS`` as a fresh process: the end-to-end path."""
    proc = subprocess.run(
        [sys.executable, "-m", "sinklab.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return CliRun(proc.returncode, proc.stdout, proc.stderr)


def one_line_error(code: int, err: str, needle: str, exit_code: int = 2) -> str:
    """A user mistake: exit ``exit_code``, exactly one non-empty line on stderr holding ``needle``,
    no traceback. Returns that line."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == exit_code and len(lines) == 1, (code, err)
    assert needle in lines[0] and "Traceback" not in err, err
    return lines[0]


def assert_one_line_error(run: CliRun, needle: str, exit_code: int = 2) -> str:
    """:func:`one_line_error` on a :class:`CliRun`; returns the line."""
    return one_line_error(run.returncode, run.stderr, needle, exit_code)


class Recorder(AttentionHandler):
    """Records ``fields`` of every chunk it observes, per layer (``chunks[layer]``: one dict per
    chunk). With ``trim=True`` it opts into causal trimming and pads each chunk's ``weights``
    back to the full key axis with zeros, so :meth:`cat` still gives (B, H, T, T)."""

    def __init__(self, fields: tuple[str, ...] = ("weights",), trim: bool = False) -> None:
        self.fields = fields
        self.causal_trim = trim
        self.chunks: dict[int, list[dict[str, torch.Tensor]]] = {}

    def observe(self, chunk) -> None:
        rec = {k: getattr(chunk, k).clone() for k in self.fields}
        if self.causal_trim and "weights" in rec:
            full = chunk.q_offset + chunk.n_queries
            rec["weights"] = F.pad(rec["weights"], (0, full - rec["weights"].shape[-1]))
        self.chunks.setdefault(chunk.layer, []).append(rec)

    def cat(self, layer: int, key: str = "weights") -> torch.Tensor:
        """``key`` of ``layer`` over all chunks (query rows concatenated); ``value`` is the last
        chunk's (every key, unless trimmed)."""
        parts = [c[key] for c in self.chunks[layer]]
        return parts[-1] if key == "value" else torch.cat(parts, dim=2)

    def weights(self, layer: int) -> torch.Tensor:
        return self.cat(layer, "weights")


def await_side_venvs(timeout_s: float = 1800.0) -> None:
    """When ``make test`` builds the side venvs (vLLM, lm-eval) in the background while the suite
    runs, it names the file their build's exit status will be written to in
    ``SINKLAB_SIDE_VENVS_RC``: wait for it (a test that needs a side venv then runs once it is
    built, while the other worker goes on), and fail with the build log's tail if the build
    failed. Without the variable (a venv built beforehand, or none): return at once."""
    import os
    import time
    from pathlib import Path

    import pytest

    rc_file = os.environ.get("SINKLAB_SIDE_VENVS_RC")
    if not rc_file:
        return
    path, start = Path(rc_file), time.monotonic()
    while not path.is_file() or not path.read_text().strip():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"the side venvs' build did not finish in {timeout_s:.0f} s ({path})")
        time.sleep(2.0)
    if path.read_text().strip() != "0":
        log = path.with_suffix(".log")
        tail = log.read_text(errors="replace")[-2000:] if log.is_file() else "(no log)"
        pytest.fail(f"building the side venvs failed (make side):\n{tail}")
