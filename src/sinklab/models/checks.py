"""Checks on a local model folder before transformers reads a byte of it.

transformers trusts a folder: a ``model.safetensors`` that is a FIFO blocks its loader forever,
``num_hidden_layers: 100000`` with weights for 2 layers builds for minutes and gigabytes before it
compares, ``num_attention_heads: 4.5`` and a ``tokenizer.json`` nested 100,000 levels deep fail
with internal errors. :func:`check_model_folder` refuses all of these in one line, cheaply:

* every file the loaders may open is a regular file, bounded in size, and its JSON parses
  (:mod:`sinklab.safeio`);
* the config's sizes are positive integers below bounds no real causal LM reaches
  (:data:`CONFIG_BOUNDS`);
* the config agrees with the weights actually present (layer count, vocabulary and width of the
  input embedding), read from the safetensors headers alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sinklab.errors import SinklabError
from sinklab.safeio import check_regular, read_bytes, read_json

#: Files transformers' config, model and tokenizer loaders may open in a model folder, by kind.
JSON_FILES = {
    "config.json": "model config",
    "generation_config.json": "model config",
    "model.safetensors.index.json": "model config",
    "tokenizer.json": "tokenizer",
    "tokenizer_config.json": "tokenizer",
    "special_tokens_map.json": "tokenizer",
    "added_tokens.json": "tokenizer",
    "vocab.json": "tokenizer",
}
OTHER_FILES = {
    "merges.txt": "tokenizer",
    "tokenizer.model": "tokenizer",
    "chat_template.jinja": "tokenizer",
}

#: Upper bounds on a decoder config's sizes: far above every released causal LM (the largest
#: have ~130 layers, width ~25k, vocabularies ~260k, 10M positions), far below what would
#: exhaust a machine before transformers compares config and weights.
CONFIG_BOUNDS = {
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "head_dim": 1 << 13,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 27,
}
# GPT-2-style names of the same sizes.
_ALIASES = {
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_embd": "hidden_size",
}

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
_EMBEDDING = re.compile(r"(?:embed_tokens|wte|word_embeddings|tok_embeddings)\.weight$")


def _decoder_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's sizes: ``text_config`` where a multimodal config nests them."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def check_config_sizes(config: Any, source: str) -> dict[str, int]:
    """The config's sizes as ints, or a one-line refusal naming the field (not an integer, not
    positive, or past :data:`CONFIG_BOUNDS`)."""
    if not isinstance(config, dict):
        raise SinklabError(f"{source} is not a JSON object; pass the model's config.json")
    fields = _decoder_fields(config)
    sizes: dict[str, int] = {}
    for raw, value in fields.items():
        name = _ALIASES.get(raw, raw)
        if name not in CONFIG_BOUNDS or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SinklabError(f"{source}: {raw} is {value!r}, not a whole number; fix the config")
        if float(value) != int(value):
            raise SinklabError(f"{source}: {raw} is {value!r}, not a whole number; fix the config")
        low = 1
        if not low <= int(value) <= CONFIG_BOUNDS[name]:
            raise SinklabError(
                f"{source}: {raw} is {int(value)}, outside 1..{CONFIG_BOUNDS[name]} (no causal LM "
                "sinklab can run has that); fix the config"
            )
        sizes[name] = int(value)
    heads, kv = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise SinklabError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; "
            "fix the config"
        )
    return sizes


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor table of a safetensors file (header only; its validity is checked by the
    loader's own safetensors check)."""
    import json

    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if n < 2 or n > min(path.stat().st_size - 8, 100 * (1 << 20)):
            return {}
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            return {}
    return header if isinstance(header, dict) else {}


def check_weights_fit(
    folder: Path,
    sizes: dict[str, int],
    source: str,
    *,
    nested: bool = False,
    projected: bool = False,
) -> None:
    """Refuse a config that asks for another number of layers than the weights hold, or whose
    vocabulary or width differs from the input embedding's shape (read from the headers, nothing
    loaded). ``nested``: a multimodal folder (other towers have layers too: no layer count);
    ``projected``: the embedding has a width of its own (OPT's ``word_embed_proj_dim``)."""
    layers: set[int] = set()
    embedding: list[int] | None = None
    for path in sorted(folder.glob("*.safetensors")):
        for name, entry in _safetensors_header(path).items():
            if (m := _LAYER_INDEX.search(name)) is not None:
                layers.add(int(m.group(1)))
            if embedding is None and _EMBEDDING.search(name) and isinstance(entry, dict):
                shape = entry.get("shape")
                if isinstance(shape, list) and len(shape) == 2:
                    embedding = [int(s) for s in shape]
    n_layers = sizes.get("num_hidden_layers")
    if layers and n_layers is not None and not nested and n_layers != max(layers) + 1:
        raise SinklabError(
            f"{source} says num_hidden_layers {n_layers} but the weights in {str(folder)!r} hold "
            f"{max(layers) + 1} layers; pass the config the weights were saved with"
        )
    if embedding is not None:
        for field, got in (("vocab_size", embedding[0]), ("hidden_size", embedding[1])):
            want = sizes.get(field)
            if field == "hidden_size" and projected:
                continue
            if want is not None and want != got:
                raise SinklabError(
                    f"{source} says {field} {want} but the input embedding in {str(folder)!r} is "
                    f"{embedding[0]} x {embedding[1]}; pass the config the weights were saved with"
                )


def check_model_folder(folder: Path) -> None:
    """Every check above on a local model folder, before any loader opens a file in it."""
    for name, kind in {**JSON_FILES, **OTHER_FILES}.items():
        path = folder / name
        if not path.exists() and not path.is_symlink():
            continue
        if name in JSON_FILES:
            read_json(path, "model file", kind)
        else:
            read_bytes(path, "model file", kind)
    for path in sorted(folder.glob("*.safetensors")):
        check_regular(path, "weights file")
    config = folder / "config.json"
    if config.exists():
        raw = read_json(config, "model config", "model config")
        sizes = check_config_sizes(raw, str(config))
        fields = _decoder_fields(raw)
        check_weights_fit(
            folder,
            sizes,
            str(config),
            nested=fields is not raw,
            projected=any(k in fields for k in ("word_embed_proj_dim", "embedding_size")),
        )


def check_causal_lm(config: Any, spec: str, embedded: bool = False) -> None:
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


def check_sinklab_types(folder: str) -> None:
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


def check_weight_files(folder: Path, spec: str) -> None:
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


def check_loading_report(spec: str, report: dict[str, Any]) -> None:
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
