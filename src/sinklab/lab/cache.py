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
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import sinklab
from sinklab.errors import SinklabError
from sinklab.lab.config import TrainConfig
from sinklab.lab.train import TrainResult, load_result, train
from sinklab.meta import write_json_atomic
from sinklab.progress import Progress, quiet

log = logging.getLogger(__name__)

KEY_FILE = "cache_key.json"  # beside train.json: what the folder's name hashes


def lab_cache_dir() -> Path:
    """``$SINKLAB_LAB_CACHE`` when set, else ``<sinklab cache>/lab`` (``$SINKLAB_CACHE``, else
    ``$XDG_CACHE_HOME/sinklab``, else ``~/.cache/sinklab``:
    :func:`sinklab.models.offline.cache_dir`)."""
    if env := os.environ.get("SINKLAB_LAB_CACHE"):
        return Path(env).expanduser()
    from sinklab.models.offline import cache_dir

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
    progress: Progress = quiet,
    root: Path | None = None,
) -> tuple[TrainResult, bool]:
    """``(result, reused)``: the cached run of ``config`` when there is one (identical
    configuration and version), else a fresh run trained into the cache. A run is written to a
    temporary folder and renamed into place whole, so an interrupted one leaves nothing that a
    later call would reuse. Only ``train.json`` is kept (no weights, no figures: the claims
    read the trajectory). ``progress``: :func:`~sinklab.lab.train.train`'s, for a fresh run."""
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
        result = train(config, None, data=data, progress=progress)
        write_json_atomic(tmp / "train.json", result.to_json())
        (tmp / KEY_FILE).write_text(json.dumps(key_data(config), sort_keys=True), encoding="utf-8")
        return _into_place(config, tmp, final, result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; else never reused


def _into_place(
    config: TrainConfig, tmp: Path, final: Path, result: TrainResult
) -> tuple[TrainResult, bool]:
    """Rename the finished run ``tmp`` to ``final``. Processes sharing the cache (pytest-xdist
    workers) may train the same key at once: when a valid run of ``config`` is already at
    ``final`` (another process finished first, or won the rename race) that run is used and
    ``tmp`` discarded; a valid entry is never deleted. Only a stale or mismatched entry is moved
    aside (an atomic rename) and removed."""
    root = final.parent
    for _ in range(3):
        prior = cached_result(config, root)
        if prior is not None:
            return prior, True
        if final.exists():
            stale = root / f".{final.name}.stale-{os.getpid()}"
            shutil.rmtree(stale, ignore_errors=True)
            try:
                final.rename(stale)
            except OSError:
                continue  # another process moved or replaced it first: look again
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(final)
        except OSError:
            continue  # lost the race: another process's run is there now
        result.out = final
        return result, False
    prior = cached_result(config, root)
    if prior is not None:
        return prior, True
    raise SinklabError(f"could not put the lab run into {final}; run --clear-lab-cache and retry")


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


_ENTRY = re.compile(r"(\.)?[0-9a-f]{16}(\.(tmp|stale)-\d+)?")  # <key>, .<key>.tmp-<pid>


def _is_entry(folder: Path) -> bool:
    """Whether ``folder`` is sinklab's: it holds a :data:`KEY_FILE` or is named like a run's key
    or its temporary folder (nothing else below the cache root is touched)."""
    m = _ENTRY.fullmatch(folder.name)
    named = m is not None and bool(m.group(1)) == bool(m.group(2))
    return folder.is_dir() and not folder.is_symlink() and (named or (folder / KEY_FILE).is_file())


def clear_cache(root: Path | None = None) -> int:
    """Remove every cached run (and any half-written one): only sinklab's entries
    (:func:`_is_entry`), so a ``$SINKLAB_LAB_CACHE`` pointed at a folder that holds other things
    keeps them. The number of folders removed; SinklabError (one line) when some could not be."""
    root = root or lab_cache_dir()
    if not root.is_dir():
        return 0
    n, failed = 0, []
    for folder in sorted(root.iterdir()):
        if not _is_entry(folder):
            continue
        try:
            shutil.rmtree(folder)
            n += 1
        except OSError as exc:
            failed.append(f"{folder.name} ({exc.strerror or exc})")
    if failed:
        raise SinklabError(
            f"removed {n} lab run(s) but could not remove {len(failed)} in {root}: "
            f"{', '.join(failed)}; check its permissions"
        )
    return n


RUN_SECONDS = 600.0  # a worker's deadline: this much to start (import torch, build data) ...
RUN_SECONDS_PER_STEP = 2.0  # ... plus this per training step (tiny runs take ~0.05 s a step)


def run_deadline(config: TrainConfig) -> float:
    """Seconds one worker may take before it counts as stuck: generous (a busy machine runs
    many times slower than an idle one), scaled by the run's steps."""
    return RUN_SECONDS + RUN_SECONDS_PER_STEP * config.steps


def train_in_processes(
    configs: Sequence[TrainConfig],
    workers: int,
    on_done: Callable[[int], None],
    deadline: Callable[[TrainConfig], float] = run_deadline,
) -> None:
    """Train each of ``configs`` into the cache, ``workers`` at a time, each in a fresh
    ``python -m sinklab.lab.cache`` process on one thread (tiny models gain nothing from more;
    on a busy machine two threads spin-wait). ``on_done(k)`` is called as ``configs[k]``
    finishes. A failed run raises SinklabError with its last line, and so does a run still going
    after ``deadline(config)`` seconds (it is stopped); an interrupt stops the running processes
    (their half-written folders are hidden and never reused)."""
    package_root = str(Path(sinklab.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    pending = list(range(len(configs)))
    running: dict[int, tuple[subprocess.Popen, Any]] = {}
    started: dict[int, float] = {}
    try:
        while pending or running:
            while pending and len(running) < max(1, workers):
                k = pending.pop(0)
                err = tempfile.TemporaryFile()  # noqa: SIM115 -- closed when the run ends
                blob = json.dumps(asdict(configs[k]))
                cmd = [sys.executable, "-m", "sinklab.lab.cache", blob]
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
                running[k] = (proc, err)
                started[k] = time.monotonic()
            time.sleep(0.1)
            for k, (proc, err) in list(running.items()):
                if proc.poll() is None:
                    limit = deadline(configs[k])
                    if time.monotonic() - started[k] > limit:
                        raise SinklabError(
                            f"a lab run did not finish within {limit:.0f} s and was stopped "
                            f"({configs[k]}); is the machine overloaded? retry with fewer workers"
                        )
                    continue
                del running[k]
                err.seek(0)
                lines = err.read().decode(errors="replace").strip().splitlines()
                err.close()
                if proc.returncode != 0:
                    last = lines[-1] if lines else f"exit status {proc.returncode}"
                    raise SinklabError(f"a lab run failed ({configs[k]}): {last}")
                on_done(k)
    finally:
        for proc, err in running.values():
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a worker ignoring SIGTERM
                proc.kill()
                proc.wait()
            err.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sinklab.lab.cache CONFIG_JSON``: train one run into the cache on one thread
    (the worker of :func:`train_in_processes`)."""
    import logging as _logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    _logging.disable(_logging.WARNING)
    torch.set_num_threads(1)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config = TrainConfig(**json.loads(args[0]))
        cached_train(config)
    except (SinklabError, ValueError, TypeError, IndexError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
