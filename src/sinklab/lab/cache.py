"""Lab runs kept in the user cache, keyed by their configuration and the sinklab version.

``sinklab claims`` (and the report's claims stage) trains the lab runs its claims need
(docs/claims.md#lab-validity); each lands in ``lab_cache_dir() / <key>``, ``key`` the hash of the
run's whole :class:`~sinklab.lab.config.TrainConfig` and ``sinklab.__version__``. A later run
with the identical configuration and version reuses it; any other field or version trains
afresh. The folder is shown by ``sinklab claims --lab-cache`` and emptied by
``sinklab claims --clear-lab-cache``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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
    :func:`sinklab.offline.cache_dir`)."""
    if env := os.environ.get("SINKLAB_LAB_CACHE"):
        return Path(env).expanduser()
    from sinklab.offline import cache_dir

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


class _Worker:
    """One ``python -m sinklab.lab.cache`` process on one thread: it reads a run's configuration
    per line on stdin, trains it into the cache and answers ``ok`` or ``error: ...`` on stdout,
    until its stdin closes. It imports torch and sinklab once for all the runs it is given
    (about 5 s a process: a claims run's dozen tiny runs took longer to start than to train).
    A thread forwards each answer line to ``answers`` as ``(worker, line)``; ``""`` means its
    stdout closed (the process ended)."""

    def __init__(self, env: dict[str, str], answers: queue.Queue) -> None:
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sinklab.lab.cache"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
        )
        self.run: int | None = None  # the index of the run it is training
        self.since = 0.0  # when it was given that run
        self.mark = 0  # where that run's stderr starts in ``err``
        threading.Thread(target=self._forward, args=(answers,), daemon=True).start()

    def _forward(self, answers: queue.Queue) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            answers.put((self, line.decode(errors="replace").strip() or "error: no answer"))
        answers.put((self, ""))

    def give(self, k: int, config: TrainConfig) -> None:
        """Hand it run ``k`` (a worker that died cannot take it: SinklabError, its last words)."""
        assert self.proc.stdin is not None
        self.run, self.since = k, time.monotonic()
        self.mark = self.err.seek(0, os.SEEK_END)
        try:
            self.proc.stdin.write(json.dumps(asdict(config)).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise SinklabError(f"a lab run failed ({config}): {self.last_words()}") from exc

    def last_words(self) -> str:
        """The last line the worker wrote on stderr during its current run, else how it ended
        (called once its stdout closed: it is reaped first, so the status is known)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.err.seek(self.mark)
        lines = self.err.read().decode(errors="replace").strip().splitlines()
        if lines:
            return lines[-1]
        code = self.proc.poll()
        if code is not None and code < 0:
            return f"killed by signal {-code}"
        return f"exit status {code}"

    def close(self, wait: bool) -> None:
        """Close its stdin (an idle worker then exits); stop it unless ``wait`` and it does."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:  # a dead worker's pipe
            pass
        try:
            self.proc.wait(timeout=10 if wait else 0.01)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a worker ignoring SIGTERM
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def train_in_processes(
    configs: Sequence[TrainConfig],
    workers: int,
    on_done: Callable[[int], None],
    deadline: Callable[[TrainConfig], float] = run_deadline,
) -> None:
    """Train each of ``configs`` into the cache on ``workers`` processes (one thread each: tiny
    models gain nothing from more, and on a busy machine two threads spin-wait). Each process
    starts once and takes the next pending run as it finishes one, so torch is imported once a
    worker rather than once a run. ``on_done(k)`` is called as ``configs[k]`` finishes. A
    failed run raises SinklabError with its last line, and so does a run still going after
    ``deadline(config)`` seconds from when it was handed over (a worker's start counts towards
    its first run); an interrupt stops the processes (their half-written folders are hidden and
    never reused)."""
    package_root = str(Path(sinklab.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    pending = list(range(len(configs)))
    answers: queue.Queue = queue.Queue()
    pool: list[_Worker] = []
    finished = False
    try:
        while len(pool) < min(max(1, workers), len(pending)):
            pool.append(_Worker(env, answers))
        for w in pool:
            k = pending.pop(0)
            w.give(k, configs[k])
        while any(w.run is not None for w in pool):
            try:
                w, said = answers.get(timeout=0.1)
            except queue.Empty:
                w, said = None, None
            if w is not None and w.run is not None:
                k = w.run
                if said == "":
                    raise SinklabError(f"a lab run failed ({configs[k]}): {w.last_words()}")
                if said != "ok":
                    raise SinklabError(f"a lab run failed ({configs[k]}): {said}")
                w.run = None
                on_done(k)
                if pending:
                    nxt = pending.pop(0)
                    w.give(nxt, configs[nxt])
            now = time.monotonic()
            for w in pool:
                if w.run is not None and now - w.since > (limit := deadline(configs[w.run])):
                    raise SinklabError(
                        f"a lab run did not finish within {limit:.0f} s and was stopped "
                        f"({configs[w.run]}); is the machine overloaded? retry with fewer workers"
                    )
        finished = True
    finally:
        for w in pool:
            w.close(wait=finished)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sinklab.lab.cache``: the worker of :func:`train_in_processes`. Reads one run's
    configuration (JSON) per line on stdin, trains it into the cache on one thread and answers
    one line on stdout (``ok``, or ``error: ...`` for a configuration it refuses), until stdin
    closes."""
    import logging as _logging
    import warnings

    import torch

    del argv  # no arguments: the runs come on stdin
    warnings.filterwarnings("ignore")
    _logging.disable(_logging.WARNING)
    torch.set_num_threads(1)
    # stopped by the parent (an interrupt, an error elsewhere, a deadline): exit through the
    # run's ``finally``, which removes its half-written folder
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # the answers keep stdout to themselves: anything a run prints goes to stderr
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            cached_train(TrainConfig(**json.loads(line)))
            answer = "ok"
        except (SinklabError, ValueError, TypeError) as exc:
            answer = "error: " + " ".join(str(exc).split())
        answers.write(answer + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
