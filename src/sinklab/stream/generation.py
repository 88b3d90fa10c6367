"""Bounded-memory generation in sinklab's own decode loop: one stream (:func:`generate`) or many
at once (:class:`StreamBatch`), through a
:class:`~sinklab.stream.cache.SinkCache` whose positions never
grow (each forward goes through :meth:`SinkCache.prepare`; see :mod:`sinklab.stream.cache`).

Why not ``model.generate``: it computes positions itself (the token's index in the sequence), so
a long stream hands the model ever larger positions; float32 RoPE then drifts (the README's drift
table). ``model.generate(cache=SinkCache(...))`` still works, with that drift.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from sinklab.errors import SinklabError, check_positive
from sinklab.memory import SAMPLE_EVERY, rss_mb
from sinklab.models.arch import input_device
from sinklab.stream.cache import CacheConfig, SinkCache
from sinklab.stream.state import StreamState


def check_decoding(config: Any, sizes: Sequence[str]) -> None:
    """A decoding config's checks (generation's and chat's): each of ``sizes`` a positive integer,
    ``config.temperature`` finite and >= 0 (0 = greedy). Raises :class:`SinklabError`."""
    check_positive({name: getattr(config, name) for name in sizes})
    if not config.temperature >= 0 or math.isinf(config.temperature):
        raise SinklabError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {config.temperature}"
        )


@dataclass(frozen=True)
class GenerateConfig:
    """Bounded-memory generation: the cache never holds more than ``n_sink + window``."""

    max_new_tokens: int = 200
    n_sink: int = 4
    window: int = 508
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    stop_at_eos: bool = True
    prefill_chunk: int = 256  # long prompts are read in chunks of this many tokens

    def __post_init__(self) -> None:
        check_decoding(self, ("max_new_tokens", "n_sink", "window", "prefill_chunk"))


@dataclass
class GenerateResult:
    config: GenerateConfig
    prompt_tokens: int
    new_tokens: list[int]
    text: str
    seconds: float
    tokens_per_s: float
    max_cache_len: int
    peak_rss_mb: float
    max_position: int = 0  # the largest position the model was given
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["n_new_tokens"] = len(self.new_tokens)
        return data


class TextStream:
    """Incremental detokenizer: decodes each new token against a few previous ones (O(1) per
    token; keeps leading spaces and multi-byte characters right)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.context: list[int] = []
        self.pending: list[int] = []

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self.pending += list(ids)
        before = self.tok.decode(self.context, skip_special_tokens=True)
        text = self.tok.decode(self.context + self.pending, skip_special_tokens=True)
        new = text[len(before) :]
        if new.endswith("\ufffd") and not final:  # an incomplete multi-byte character
            return ""
        self.context = (self.context + self.pending)[-4:]
        self.pending = []
        return new


def next_token(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """``logits`` (B, V) -> next tokens (B,): greedy at temperature 0, else sampled."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.double() / temperature, -1)
    return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(logits.device)


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids of the tokenizer and the model's generation config."""
    ids = (
        {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    )
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, list) else ({extra} if extra is not None else set())
    return ids


def _piece(cache: SinkCache, piece: int, fit: bool) -> int:
    """Tokens per forward of a prompt read: at most ``piece``, below the position bound, and
    (``fit``) within the window, so that each piece attends to at most ``n_sink + window``."""
    if cache.max_position and cache.capacity is not None:
        piece = max(1, min(piece, cache.max_position - cache.capacity))
    if fit and cache.capacity is not None:
        piece = min(piece, cache.config.window)
    return piece


@dataclass
class RowsRead:
    """What :func:`read_rows` read: per row, the logits of its last token (V,), the highest
    position it gave the model and the most positions it kept after a forward."""

    logits: list[Tensor]
    top_position: list[int]
    most_kept: list[int]


def left_padded(parts: Sequence[Sequence[int]]) -> Tensor:
    """Token lists of different lengths as one (B, q) batch, each left-padded with 0 to the
    longest (a row with none is all padding): what :meth:`SinkCache.prepare` plans for."""
    q = max((len(p) for p in parts), default=0)
    x = torch.zeros(len(parts), q, dtype=torch.long)
    for b, part in enumerate(parts):
        if part:
            x[b, q - len(part) :] = torch.as_tensor(list(part))
    return x


def read_rows(
    model: Any, cache: SinkCache, ids: Sequence[Sequence[int]], piece: int, fit: bool = False
) -> RowsRead:
    """The prefill: row ``b`` of ``cache`` reads ``ids[b]``, ``piece`` tokens a forward, below
    the position bound; ``fit``: each piece fitted into the cache first
    (:meth:`SinkCache.evict_for_space`), so it attends to at most ``n_sink + window`` positions,
    except a single token, read as a decode step reads it. Many rows read their pieces in one
    left-padded forward; row ``b``'s logits equal the row read alone (up to the summation order
    of a batched matmul). One row is ``generate``'s prompt and ``chat``'s turn; many are the
    server's turns waiting together."""
    if len(ids) != len(cache.rows) or any(len(r) == 0 for r in ids):
        raise SinklabError(
            f"read_rows takes one non-empty token list per stream ({len(cache.rows)})"
        )
    dev = input_device(model)
    piece = _piece(cache, piece, fit)
    n = len(ids)
    logits: list[Tensor | None] = [None] * n
    top, most = [0] * n, [0] * n
    for i in range(0, max(len(r) for r in ids), piece):
        parts = [r[i : i + piece] for r in ids]
        counts = [len(p) for p in parts]
        if fit:
            cache.evict_for_space(
                [c if len(r) > 1 else 0 for c, r in zip(counts, ids, strict=True)]
            )
        q = max(counts)
        extra = cache.prepare(counts)
        out = model(left_padded(parts).to(dev), cache=cache, logits_to_keep=1, **extra).logits
        for b, part in enumerate(parts):
            if not part:
                continue
            top[b] = max(top[b], int(extra["position_ids"][b, q - len(part) :].max()))
            most[b] = max(most[b], cache.kept_length(b))
            if i + piece >= len(ids[b]):
                logits[b] = out[b, -1]
    return RowsRead([lg for lg in logits if lg is not None], top, most)


@torch.inference_mode()
def generate(
    model: Any,
    tokenizer: Any,
    prompt_ids: Tensor,
    config: GenerateConfig,
    on_text: Callable[[str], None] | None = None,
    on_token: Callable[[int], None] | None = None,
    on_logits: Callable[[Tensor], None] | None = None,
) -> GenerateResult:
    """Continue ``prompt_ids`` (T,) with a sink cache, positions bounded: -> the new tokens,
    streamed to ``on_text`` as text pieces; ``on_token(n_generated)`` after each token;
    ``on_logits(logits)`` with each step's logits (V,) before its token is chosen (what another
    engine's log-probabilities are checked against)."""
    cache = SinkCache(model, CacheConfig("sink", config.n_sink, config.window))
    prompt = torch.as_tensor(prompt_ids).reshape(-1).tolist()
    if not prompt:
        raise SinklabError("the prompt has no tokens; pass some text to continue")
    gen = torch.Generator().manual_seed(config.seed)
    stops = eos_ids(model, tokenizer) if config.stop_at_eos else set()
    text, tokens = TextStream(tokenizer), []
    most, peak, top = 0, rss_mb(), 0
    dev = input_device(model)
    start = time.perf_counter()

    read = read_rows(model, cache, [prompt], config.prefill_chunk)
    logits, top = read.logits[0], read.top_position[0]
    while True:
        if on_logits is not None:
            on_logits(logits)
        tok = int(next_token(logits[None], config.temperature, gen)[0])
        tokens.append(tok)
        if on_text is not None and (piece := text.push([tok])):
            on_text(piece)
        if on_token is not None:
            on_token(len(tokens))
        if len(tokens) % SAMPLE_EVERY == 0:
            peak = max(peak, rss_mb())
        if tok in stops or len(tokens) == config.max_new_tokens:
            break
        extra = cache.prepare(1)
        top = max(top, int(extra["position_ids"].max()))
        logits = model(torch.tensor([[tok]], device=dev), cache=cache, **extra).logits[0, -1]
        most = max(most, cache.kept_length())
    if on_text is not None and (piece := text.push([], final=True)):
        on_text(piece)
    seconds = time.perf_counter() - start
    n = len(tokens)
    return GenerateResult(
        config,
        len(prompt),
        tokens,
        tokenizer.decode(tokens, skip_special_tokens=True),
        round(seconds, 3),
        n / seconds if seconds > 0 else math.inf,
        max(most, cache.kept_length()),
        round(max(peak, rss_mb()), 1),
        top,
    )


class StreamBatch:
    """Many independent streams decoded in one batch (one weight read per step for all):
    ``add()`` a stream, ``feed({stream: ids})`` any of them (the others wait), ``remove(stream)``.
    Row ``b``'s logits equal what the stream alone would give."""

    def __init__(self, model: Any, config: CacheConfig, max_position: int | None = None) -> None:
        self.model = model
        self.max_position = max_position
        self.cache = SinkCache(model, config, max_position)
        self.cache.keep_streams([])  # no streams until added
        self.ids: list[int] = []  # stream id of each batch row
        self._next = 0

    def add(self, state: StreamState | None = None) -> int:
        """A new stream, empty or continuing ``state`` (from :meth:`state`, or a cache's
        :meth:`SinkCache.state`); returns its id. Joining with a state rebuilds the batch's cache
        from every stream's state (O(kept) per stream, once per join)."""
        if state is None:
            self.cache.add_streams(1)
        else:
            rows = [self.cache.state(b) for b in range(len(self.ids))]
            self.cache = SinkCache.from_state(self.model, [*rows, state], self.max_position)
        self.ids.append(self._next)
        self._next += 1
        return self.ids[-1]

    def state(self, stream: int) -> StreamState:
        """``stream``'s state now (it stays in the batch; :meth:`remove` it to let it go)."""
        if stream not in self.ids:
            raise SinklabError(f"no such stream: {stream} (streams: {self.ids})")
        return self.cache.state(self.ids.index(stream))

    def remove(self, stream: int) -> None:
        self.cache.keep_streams([b for b, s in enumerate(self.ids) if s != stream])
        self.ids = [s for s in self.ids if s != stream]

    @torch.inference_mode()
    def feed(
        self, tokens: Mapping[int, Sequence[int]], last_only: bool = False
    ) -> dict[int, Tensor]:
        """Read each stream's ``tokens`` in one forward (left-padded to the longest) -> each fed
        stream's logits (n, V) for its new tokens (``last_only``: (1, V), its last token's)."""
        unknown = set(tokens) - set(self.ids)
        if unknown:
            raise SinklabError(f"no such stream: {sorted(unknown)} (streams: {self.ids})")
        parts = [tokens.get(s, ()) for s in self.ids]
        counts = [len(p) for p in parts]
        q = max(counts, default=0)
        x = left_padded(parts)
        extra = self.cache.prepare(counts)
        keep = {"logits_to_keep": 1} if last_only else {}
        x = x.to(input_device(self.model))
        logits = self.model(x, cache=self.cache, **extra, **keep).logits
        if last_only:
            return {s: logits[b] for b, s in enumerate(self.ids) if counts[b]}
        return {s: logits[b, q - counts[b] :] for b, s in enumerate(self.ids) if counts[b]}
