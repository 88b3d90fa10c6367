"""Shared fixtures: seeded tiny random models of several families, a tiny tokenizer trained on the
embedded corpus, and the real SmolLM2 (session-scoped, for tests marked ``integration``)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vllm_helpers import vllm_py  # noqa: F401  (the vLLM test files' fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# lab runs the claims train go to a cache of the test session (removed at exit), never the user's
if "SINKLAB_LAB_CACHE" not in os.environ:
    os.environ["SINKLAB_LAB_CACHE"] = tempfile.mkdtemp(prefix="sinklab-lab-cache-")
    atexit.register(shutil.rmtree, os.environ["SINKLAB_LAB_CACHE"], True)
# two threads per process at most; under pytest-xdist the cores are shared among the workers
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

TINY_VOCAB = 512
FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gpt2")


def tiny_config(family: str, *, vocab_size: int = TINY_VOCAB, n_layers: int = 2, **overrides):
    """A tiny random config of a model family: 4 query heads, 2 KV heads (GQA), head dim 8."""
    from transformers import (
        GemmaConfig,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cfg = LlamaConfig(**common, head_dim=8)
    elif family == "mistral":
        cfg = MistralConfig(**common, head_dim=8, sliding_window=None)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=False)
    elif family == "gemma":
        cfg = GemmaConfig(**common, head_dim=8)
    elif family == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab_size,
            n_embd=32,
            n_layer=n_layers,
            n_head=4,
            n_positions=512,
            bos_token_id=1,
            eos_token_id=2,
        )
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A seeded tiny random causal LM in eval mode, float32, SDPA attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_factory() -> Callable[..., torch.nn.Module]:
    return make_tiny_model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A word-level tokenizer (vocab TINY_VOCAB) trained on the first embedded play: fast, real."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sinklab.corpus import documents

    text = documents()[0].text
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Callable[[str], Path]:
    """Factory: a tiny random model of a family saved with the tiny tokenizer, for --model DIR."""
    made: dict[str, Path] = {}

    def make(family: str = "llama") -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            make_tiny_model(family).save_pretrained(folder)
            tiny_tokenizer.save_pretrained(folder)
            made[family] = folder
        return made[family]

    return make


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny random BERT (bidirectional, not a causal LM) saved with the tiny tokenizer."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    BertModel(config).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded SmolLM2-135M (dequantized and cached on first use)."""
    from sinklab.models.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def bos_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with a post-processor that puts <s> before every sequence."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer.from_str(tiny_tokenizer.backend_tokenizer.to_str())
    bos = tiny_tokenizer.bos_token_id
    inner.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=inner, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
    )  # fmt: skip
    assert tok("the king", add_special_tokens=True).input_ids[0] == bos  # the fixture works
    return tok


#: the tiny chat template the chat and serve tests share (words and markers the tiny tokenizer has)
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with :data:`CHAT_TEMPLATE` (a copy: the session fixture stays as is)."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    return tok
