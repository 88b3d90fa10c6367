"""End to end: the real ``sinklab report --quick`` on a tiny random model, read back as a person
(HTML parser, a real headless Chromium) and as a machine (results.json), plus robustness:
a failing stage, an interrupted run, a folder that is not a report."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from helpers import assert_one_line_error, run_main
from sinklab.report.cells import aggregate, lookup
from sinklab.report.html import fmt

# the `sinklab` subcommand that reproduces each stage
STAGE_COMMANDS = {
    "claims": "claims",
    "probe": "probe",
    "probe-lengths": "probe",
    "stream": "stream",
    **dict.fromkeys(("first-token", "mask-sink", "density", "sensitivity", "geometry"), "ablate"),
}
STAGE_LIBRARIES = {
    "claims": "sinklab.claims",
    "probe": "sinklab.probe",
    "probe-lengths": "sinklab.probe",
    "stream": "sinklab.stream.evaluate",
    "first-token": "sinklab.ablate",
    "mask-sink": "sinklab.ablate",
    "density": "sinklab.ablate",
    "sensitivity": "sinklab.ablate",
    "geometry": "sinklab.ablate",
}


# --quick with every size shrunk for a 2-layer random model: the test checks that the real stages
# run and render, not SmolLM2's numbers, and must stay within the suite's time budget.
TINY_SIZES = tuple(
    arg
    for kv in (
        "probe_tokens=128",
        "probe_lengths=64,128",
        "q0=4",
        "stream_tokens=96",
        "window=16",
        "recompute_every=8",
        "ablate_tokens=48",
        "sensitivity_grid=3",
        "lab_steps=10",  # the claims' lab runs: trained, not converged, said so
    )
    for arg in ("--set", kv)
)


# A 2-layer model gains nothing from threads, and on a busy machine two OpenMP threads spin-wait
# on each tiny op (measured: 3x the CPU time), so the subprocesses run single-threaded.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}


class PageParser(HTMLParser):
    """Collects what the tests check: sections, images, numeric cells, summary, commands."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.images: list[dict[str, str]] = []
        self.cells: list[tuple[str, str | None, str]] = []  # (data-path, data-agg, text)
        self.summary: list[str] = []
        self.commands: list[str] = []
        self.errors: dict[str, str] = {}
        self._cell: tuple[str, str | None] | None = None
        self._li = self._pre = self._err = False
        self._in_summary = False
        self._stage = ""
        self._buf: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and "data-stage" in a:
            self._stage = a["data-stage"]
            self.sections.append(self._stage)
        if tag == "section" and a.get("id") == "summary":
            self._in_summary = True
        if tag == "img":
            self.images.append({k: v or "" for k, v in a.items()})
        if tag == "td" and "data-path" in a:
            self._cell, self._buf = (a["data-path"], a.get("data-agg")), []
        if tag == "li" and self._in_summary:
            self._li, self._buf = True, []
        if tag == "pre" and "command" in (a.get("class") or ""):
            self._pre, self._buf = True, []
        if tag == "div" and a.get("class") == "error":
            self._err, self._buf = True, []

    def handle_data(self, data):
        self._buf.append(data)

    def handle_endtag(self, tag):
        text = "".join(self._buf).strip()
        if tag == "td" and self._cell:
            self.cells.append((*self._cell, text))
            self._cell = None
        elif tag == "li" and self._li:
            self.summary.append(text)
            self._li = False
        elif tag == "pre" and self._pre:
            self.commands.append(text)
            self._pre = False
        elif tag == "div" and self._err:
            self.errors[self._stage] = text
            self._err = False
        elif tag == "section":
            self._in_summary = False


def parse_page(path: Path) -> PageParser:
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    return parser


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (fails on anything that is not a PNG)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory, tiny_model_dir) -> Path:
    """The real CLI, --quick, on a tiny random Llama (run once for the module)."""
    out = tmp_path_factory.mktemp("report") / "tiny-report"
    model = str(tiny_model_dir("llama"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sinklab.cli",
            "report",
            "--quick",
            "--model",
            model,
            "--out",
            str(out),
            *TINY_SIZES,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ONE_THREAD,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out / "index.html")
    return out


def test_quick_report_renders_every_section(quick_report: Path):
    page = parse_page(quick_report / "index.html")
    data = json.loads((quick_report / "results.json").read_text())
    assert page.sections == list(STAGE_LIBRARIES) == list(data["stages"])
    for name, module in STAGE_LIBRARIES.items():
        stage = data["stages"][name]
        assert importlib.util.find_spec(module) is not None, module
        assert stage["status"] == "ok", (name, stage["error"], stage["traceback"])
        assert name not in page.errors
        assert stage["command"][:2] == ["sinklab", STAGE_COMMANDS[name]]
    assert page.summary == data["summary"] and page.summary
    assert len(page.commands) == len(STAGE_LIBRARIES)
    # no network: nothing on the page points outside it
    text = (quick_report / "index.html").read_text()
    assert "<script" not in text and "http://" not in text and "https://" not in text


def test_every_image_is_embedded_and_decodes(quick_report: Path):
    from matplotlib import image as mpimg

    page = parse_page(quick_report / "index.html")
    data = json.loads((quick_report / "results.json").read_text())
    n_figures = sum(len(s["figures"]) for s in data["stages"].values())
    assert len(page.images) == n_figures
    if data["stages"]["probe"]["status"] == "ok":
        assert n_figures >= 2
    for img in page.images:
        prefix = "data:image/png;base64,"
        assert img["src"].startswith(prefix) and img["alt"]
        raw = base64.b64decode(img["src"][len(prefix) :], validate=True)
        width, height = png_size(raw)
        assert width > 50 and height > 50
        pixels = mpimg.imread(io.BytesIO(raw), format="png")
        assert pixels.shape[:2] == (height, width)


def test_numbers_on_the_page_match_results_json(quick_report: Path):
    page = parse_page(quick_report / "index.html")
    data = json.loads((quick_report / "results.json").read_text())
    for path, agg, text in page.cells:
        keys = [int(k) if k.isdigit() and k not in ("0.3", "0.8") else k for k in path.split("/")]
        value = lookup(data, _json_keys(data, keys))
        assert fmt(aggregate(value, agg)) == text, (path, agg, text)
    if data["stages"]["probe"]["status"] == "ok":
        assert len(page.cells) > 10


VERDICT_QUOTE = re.compile(
    r"`([a-z0-9-]+)` is (not supported|supported|inconclusive) by the claims rule"
)
OWN_VERDICT = re.compile(  # a verdict of an experiment's own ("the claim holds here", "X: holds")
    r"(?:claim|it|:) (?:holds|does not hold)\b|\bholds (?:here|in trend)\b"
    r"|\bthe claim (?:is )?(?:true|false)\b"
)


def test_no_sentence_states_a_verdict_the_claims_table_does_not(quick_report: Path):
    """One verdict per claim on the page (issue 30 item 6): every finding, summary sentence and
    the page's text quote a claim's verdict only as the claims table states it, and none decides
    a claim by a rule of its own ("the claim holds here" from a point estimate)."""
    import html

    data = json.loads((quick_report / "results.json").read_text())
    table = {r["id"]: r["verdict"] for r in data["stages"]["claims"]["json"]["claims"]}
    findings = [
        st["json"]["finding"]
        for st in data["stages"].values()
        if st["status"] == "ok" and isinstance(st["json"], dict) and st["json"].get("finding")
    ]
    page = html.unescape(re.sub(r"<[^>]+>", " ", (quick_report / "index.html").read_text()))
    quoted: set[str] = set()
    for text in [*findings, *data["summary"], page]:
        for cid, verdict in VERDICT_QUOTE.findall(text):
            assert table[cid] == verdict, (cid, verdict, table[cid])
            quoted.add(cid)
        own = OWN_VERDICT.search(text)
        assert own is None, text[max(0, own.start() - 200) : own.end() + 40]
    # the experiments that measure a claim's own effect quote it (the test can fail)
    assert {"first-token-cosine", "sink-stops-mixing", "density-oversmooths"} <= quoted


def _json_keys(data, keys):
    """Turn '3' into 3 only where the JSON has a list there (dict keys stay strings)."""
    out, node = [], data
    for k in keys:
        k = int(k) if isinstance(node, list) else str(k)
        out.append(k)
        node = node[k]
    return out


def _slow_stage_script(model: Path, out: Path, started: Path) -> str:
    """Run the real CLI with one extra stage that waits, so SIGINT lands mid-report."""
    return textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        import sinklab.report.catalog as catalog
        from sinklab.report.stages import Stage, StageOutput

        def run(ctx):
            Path({str(started)!r}).write_text(str(ctx.figures_dir))
            for _ in range(600):
                time.sleep(0.05)
            return StageOutput({{}})

        slow = Stage("slow", "Slow", "waits", lambda c: 1.0, lambda ctx: {{}}, lambda ctx: [], run)
        original = catalog.all_stages
        catalog.all_stages = lambda: [*original(), slow]
        from sinklab.cli import main
        sys.exit(main(["report", "--quick", "--model", {str(model)!r}, "--out", {str(out)!r},
                       "--stages", "slow"]))
        """
    )


def test_sigint_leaves_previous_report_intact(quick_report: Path, tiny_model_dir, tmp_path):
    out = tmp_path / "report"
    shutil.copytree(quick_report, out)
    before = tree_digest(out)
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, "-c", _slow_stage_script(tiny_model_dir("llama"), out, started)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ONE_THREAD,
    )
    deadline = time.monotonic() + 60
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), proc.communicate(timeout=5)
    assert Path(started.read_text()).is_relative_to(tmp_path)  # built beside, not inside, out
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert tree_digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report", "started"]  # no leftovers


def test_failing_stage_shows_error_and_others_remain(tiny_model_dir, tmp_path):
    from sinklab.corpus import load_text
    from sinklab.figures import curves
    from sinklab.models.loading import load_model
    from sinklab.report import ReportConfig, Stage, StageOutput, build_report, select_stages
    from sinklab.report.cells import Cell, FigureSpec, TableSpec

    def boom(ctx):
        raise RuntimeError("the stage broke on purpose")

    def fine(ctx):
        png = curves(
            [0, 1], {"y": [1.0, 2.0]}, ctx.figures_dir / "y.png", title="y", xlabel="x", ylabel="y"
        )
        table = TableSpec("t", ("k", "v"), ((Cell("y1"), Cell(None, ("y", 1))),))
        return StageOutput({"y": [1.0, 2.0]}, [FigureSpec(png, "a line")], [table])

    def stage(name, run):
        return Stage(
            name,
            name.title(),
            "about",
            lambda c: 1.0,
            lambda ctx: {"a": 1},
            lambda ctx: ["sinklab", name],
            run,
        )

    loaded = load_model(str(tiny_model_dir("llama")))
    stages = [stage("before", fine), stage("broken", boom), stage("after", fine)]
    stages.insert(1, select_stages(["probe"])[0])  # a real stage beside them
    report = build_report(
        loaded,
        load_text("shakespeare:hamlet"),
        out=tmp_path / "r",
        stages=stages,
        config=ReportConfig.preset(True),
        model_spec="tiny",
        text_spec="shakespeare:hamlet",
    )
    assert [r.status for r in report.results if r.name != "probe"] == ["ok", "failed", "ok"]
    page = parse_page(report.index)
    assert page.sections == ["before", "probe", "broken", "after"]
    assert page.errors["broken"] == "RuntimeError: the stage broke on purpose"
    assert len(page.images) >= 2 and [c[2] for c in page.cells][:1] == ["2.000"]
    data = json.loads((tmp_path / "r" / "results.json").read_text())
    assert data["stages"]["broken"]["error"] == "RuntimeError: the stage broke on purpose"
    assert "broken" in data["summary"][-1]


def _main_one_line_error(capsys, args: list[str], needle: str) -> None:
    """In process (no model load needed): exit 2 and one line on stderr."""
    assert_one_line_error(run_main(capsys, *args), needle)


def test_refuses_a_folder_that_is_not_a_report(tmp_path, capsys):
    (tmp_path / "thesis.tex").write_text("precious")
    _main_one_line_error(capsys, ["report", "--out", str(tmp_path)], "sinklab did not write")
    assert (tmp_path / "thesis.tex").read_text() == "precious"
    # a user's file named like ours (results.json) does not make the folder a report
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "c.tex").write_text("chapter")
    args = ["report", "--quick", "--stages", "first-token", "--out", str(tmp_path)]
    _main_one_line_error(capsys, args, "sinklab did not write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "results.json", "thesis.tex"]
    assert (tmp_path / "data" / "c.tex").read_text() == "chapter"
    _main_one_line_error(
        capsys, ["report", "--out", str(tmp_path / "thesis.tex")], "is a file; pass a folder"
    )


def test_bad_set_is_one_line_error(tmp_path, capsys):
    _main_one_line_error(
        capsys, ["report", "--set", "windw=3", "--out", str(tmp_path / "r")], "KEY=VALUE"
    )
    _main_one_line_error(
        capsys, ["report", "--set", "window=0", "--out", str(tmp_path / "r")], "at least 1"
    )


def test_unknown_stage_is_one_line_error(tmp_path, capsys):
    _main_one_line_error(
        capsys,
        ["report", "--stages", "probe,nope", "--out", str(tmp_path / "r")],
        "unknown report stage(s) nope",
    )


CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


FIRST_SCREEN = """
const rows = [...document.querySelectorAll('#verdicts tr[data-claim]')];
return {height: window.innerHeight, width: window.innerWidth, rows: rows.map(tr => {
  const badge = tr.querySelector('.verdict').getBoundingClientRect();
  return {claim: tr.dataset.claim, verdict: tr.querySelector('.verdict').textContent,
          top: badge.top, bottom: badge.bottom, left: badge.left, right: badge.right,
          row: tr.getBoundingClientRect().bottom};
})};
"""


def screenshot_page(
    index: Path, png: Path, profile: Path, first_screen: dict | None = None
) -> tuple[list[dict], list[int]]:
    """Open ``index`` from disk in headless Chromium; return (console log, image natural widths)
    and save a full-page screenshot to ``png``. ``first_screen`` (a dict) receives where the
    verdict table's rows sit in the first 1280 x 900 viewport (before any scrolling)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1280,900"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    try:
        driver.set_page_load_timeout(30)
        driver.get(index.as_uri())
        if first_screen is not None:
            first_screen.update(driver.execute_script(FIRST_SCREEN))
        widths = [
            int(driver.execute_script("return arguments[0].naturalWidth;", img))
            for img in driver.find_elements(By.TAG_NAME, "img")
        ]
        height = int(driver.execute_script("return document.documentElement.scrollHeight;"))
        driver.set_window_size(1280, min(max(height, 900), 16000))
        driver.save_screenshot(str(png))
        return driver.get_log("browser"), widths
    finally:
        driver.quit()


@pytest.mark.browser
def test_report_in_headless_chromium(quick_report: Path, tmp_path):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail(
            "headless Chromium is missing: run `make browser` (apt chromium chromium-driver)"
        )
    png = tmp_path / "report.png"
    first: dict = {}
    logs, widths = screenshot_page(quick_report / "index.html", png, tmp_path / "profile", first)
    errors = [entry for entry in logs if entry["level"] in ("SEVERE", "ERROR")]
    assert errors == [], errors
    n_images = parse_page(quick_report / "index.html").images
    assert len(widths) == len(n_images) and all(w > 0 for w in widths), widths
    width, height = png_size(png.read_bytes())
    assert width >= 1000 and height >= 900
    # the first screen states every verdict: each claim's row and badge lie inside the viewport
    claims = json.loads((quick_report / "results.json").read_text())["stages"]["claims"]["json"]
    assert [(r["claim"], r["verdict"]) for r in first["rows"]] == [
        (c["id"], c["verdict"]) for c in claims["claims"]
    ]
    for r in first["rows"]:
        assert r["top"] >= 0 and r["bottom"] <= first["height"] and r["row"] <= first["height"], r
        assert r["left"] >= 0 and r["right"] <= first["width"], r
