"""The project's own docs: every citation in code, tests and docs names a section that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OLD_PAGE = "SCIENCE" + ".md"  # the shared spec users never see
SHARED_PAGES = (OLD_PAGE, "DESIGN" + ".md", "STYLE" + ".md", "../" + "shared")


def sources() -> list[Path]:
    dirs = ("src", "tests", "benchmarks", "vllm_plugin")
    files = [f for d in dirs for f in ROOT.joinpath(d).rglob("*.py")]
    return [*files, ROOT / "README.md", *DOCS.glob("*.md")]


def anchors(page: Path) -> set[str]:
    """Explicit ``<a id="...">`` anchors and GitHub's heading slugs of ``page``."""
    text = page.read_text(encoding="utf-8")
    ids = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).strip().replace(" ", "-")
        ids.add(slug)
    return ids


def citations() -> list[tuple[Path, str, str]]:
    """(file, page, anchor) for every ``docs/PAGE.md#anchor`` (``PAGE.md#anchor`` inside docs/)."""
    out = []
    for f in sources():
        if f.name == "test_docs.py":  # its own docstrings show the pattern
            continue
        text = f.read_text(encoding="utf-8")
        prefix = "(?:docs/)?" if f.parent == DOCS else "docs/"
        pattern = prefix + r"(\w+)\.md#([\w\-]+)"
        out += [(f, page, anchor) for page, anchor in re.findall(pattern, text)]
    return out


def test_no_citation_of_the_shared_spec():
    hits = [
        f"{f.relative_to(ROOT)}: {page}"
        for f in sources()
        if f.name != "test_docs.py"
        for page in SHARED_PAGES
        if page in f.read_text("utf-8")
    ]
    assert hits == [], f"shared pages cited (cite docs/ instead): {hits}"


def test_every_section_citation_resolves():
    found = citations()
    assert len(found) >= 10  # the code does cite docs/ sections
    bad = [
        f"{f.relative_to(ROOT)}: {page}.md#{anchor}"
        for f, page, anchor in found
        if not (DOCS / f"{page}.md").is_file() or anchor not in anchors(DOCS / f"{page}.md")
    ]
    assert bad == []


def test_science_page_is_self_contained_and_linked():
    page = (DOCS / "science.md").read_text(encoding="utf-8")
    assert "../shared" not in page and "/work" not in page and "seeds/" not in page
    for anchor in ("attention", "sinks", "streamingllm", "softmax-plus-one", "over-mixing", "bos",
                   "depth-and-length", "geometry", "oversmoothing", "hard-switch",
                   "sink-vs-diagonal-cost"):  # fmt: skip
        assert f'<a id="{anchor}"></a>' in page
    assert "(docs/science.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    # every module path the page names exists
    for mod in set(re.findall(r"`(sinklab/[\w/]+\.py|sinklab/[\w/]+/)`", page)):
        assert (ROOT / "src" / mod).exists(), mod
