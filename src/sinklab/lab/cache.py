"""Lab runs kept in the user cache, keyed by their configuration and the sinklab version.

``sinklab claims`` (and the report's claims stage) trains the lab runs its claims need
(docs/claims.md#lab-validity); each lands in ``lab_cache_dir() / <key>``, ``key`` the hash of the
run's whole :class:`~sinklab.lab.config.TrainConfig` and ``sinklab.__version__``. A later run
with the identical configuration and version reuses it; any other field or version trains
afresh. The folder is shown by ``sinklab claims --lab-cache`` and emptied by
``sinklab claims --clear-lab-cache``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import sinklab
from sinklab.lab.config import TrainConfig
from sinklab.lab.train import TrainResult, load_result, train
from sinklab.meta import write_json_atomic

log = logging.getLogger(__name__)

KEY_FILE = "cache_key.json"  # beside train.json: what the folder's name hashes


def lab_cache_dir() -> Path:
    """``$SINKLAB_LAB_CACHE`` when set, else ``<sinklab cache>/lab`` (``$SINKLAB_CACHE``, else
    ``$XDG_CACHE_HOME/sinklab``, else ``~/.cache/sinklab``: :func:`sinklab.models.cache_dir`)."""
    if env := os.environ.get("SINKLAB_LAB_CACHE"):
        return Path(env).expanduser()
    from sinklab.models import cache_dir

    return cache_dir() / "lab"


def key_data(config: TrainConfig) -> dict[str, Any]:
    """What a cached run's key hashes: the whole configuration and the sinklab version (read at
    call time)."""
    return {"config": asdict(config), "sinklab": sinklab.__version__}


def run_key(config: TrainConfig) -> str:
    """The cache key of a run: 16 hex digits of the SHA-256 of :func:`key_data` (sorted JSON)."""
    blob = json.dumps(key_data(config), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cached_result(config: TrainConfig, root: Path | None = None) -> TrainResult | None:
    """The cached run of exactly ``config`` at this sinklab version, or None."""
    folder = (root or lab_cache_dir()) / run_key(config)
    try:
        stored = json.loads((folder / KEY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    prior = load_result(folder)
    if prior is None or prior.config != config or stored != key_data(config):
        return None
    return prior


def cached_train(
    config: TrainConfig,
    *,
    data: Any = None,
    callback: Callable[[int, float], None] | None = None,
    root: Path | None = None,
) -> tuple[TrainResult, bool]:
    """``(result, reused)``: the cached run of ``config`` when there is one (identical
    configuration and version), else a fresh run trained into the cache. A run is written to a
    temporary folder and renamed into place whole, so an interrupted one leaves nothing that a
    later call would reuse. Only ``train.json`` is kept (no weights, no figures: the claims
    read the trajectory)."""
    root = root or lab_cache_dir()
    prior = cached_result(config, root)
    if prior is not None:
        log.info("reusing the cached lab run %s", prior.out)
        return prior, True
    key = run_key(config)
    final = root / key
    tmp = root / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        result = train(config, None, data=data, callback=callback)
        write_json_atomic(tmp / "train.json", result.to_json())
        (tmp / KEY_FILE).write_text(json.dumps(key_data(config), sort_keys=True), encoding="utf-8")
        shutil.rmtree(final, ignore_errors=True)  # a stale or mismatched run of the same key
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.out = final
    return result, False


def cache_listing(root: Path | None = None) -> list[dict[str, Any]]:
    """One row per cached run: ``key``, what it trained and whether it converged."""
    root = root or lab_cache_dir()
    rows = []
    for folder in sorted(p for p in root.glob("*") if p.is_dir() and not p.name.startswith(".")):
        res = load_result(folder)
        if res is None:
            rows.append({"key": folder.name, "readable": False})
            continue
        c = res.config
        rows.append(
            {
                "key": folder.name,
                "readable": True,
                "run": f"{c.task} {c.variant}/{c.data} T{c.seq_len}x{c.batch_size} "
                f"L{c.layers} d{c.d_model}, {c.steps} steps, seed {c.seed}",
                "converged": res.convergence["met"] if res.checkpoints else None,
            }
        )
    return rows


def clear_cache(root: Path | None = None) -> int:
    """Remove every cached run (and any half-written one); the number of folders removed."""
    root = root or lab_cache_dir()
    if not root.is_dir():
        return 0
    n = 0
    for folder in root.iterdir():
        if folder.is_dir():
            shutil.rmtree(folder)
            n += 1
    return n
