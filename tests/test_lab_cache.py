"""Lab runs in the user cache: reused only for the identical configuration and sinklab version,
listed and cleared; trained whole or not at all."""

import json

import pytest

import sinklab
from sinklab.lab import cache
from sinklab.lab.presets import preset

TINY = dict(task="backcopy", steps=4, d_model=16, seq_len=16, batch_size=4, n_checkpoints=2)


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.delenv("SINKLAB_LAB_CACHE", raising=False)  # the path below the user cache
    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path / "c"))
    return tmp_path / "c" / "lab"


def test_a_run_is_reused_only_for_the_same_config_and_version(root, monkeypatch):
    cfg = preset("cpu", **TINY)
    assert cache.lab_cache_dir() == root
    first, reused = cache.cached_train(cfg)
    assert not reused and first.out == root / cache.run_key(cfg)
    again, reused = cache.cached_train(cfg)
    assert reused and again.to_json()["checkpoints"] == first.to_json()["checkpoints"]
    assert again.loss == first.loss
    other = preset("cpu", **{**TINY, "seed": 1})  # one field differs: a different run
    assert cache.run_key(other) != cache.run_key(cfg) and cache.cached_result(other) is None
    _, reused = cache.cached_train(other)
    assert not reused
    monkeypatch.setattr(sinklab, "__version__", "0.0.0-other")  # another version: retrain
    assert cache.cached_result(cfg) is None
    _, reused = cache.cached_train(cfg)
    assert not reused and len(list(root.iterdir())) == 3
    stored = json.loads((root / cache.run_key(cfg) / cache.KEY_FILE).read_text())
    assert stored == {"config": json.loads(json.dumps(stored["config"])), "sinklab": "0.0.0-other"}


def test_a_changed_train_json_is_not_reused(root):
    cfg = preset("cpu", **TINY)
    res, _ = cache.cached_train(cfg)
    path = res.out / "train.json"
    raw = json.loads(path.read_text())
    raw["config"]["lr"] = 0.5  # a folder whose run is not the key's
    path.write_text(json.dumps(raw))
    assert cache.cached_result(cfg) is None
    assert not cache.cached_train(cfg)[1]


def test_listing_and_clearing(root):
    cfg = preset("cpu", **TINY)
    cache.cached_train(cfg)
    rows = cache.cache_listing()
    assert [r["key"] for r in rows] == [cache.run_key(cfg)]
    assert rows[0]["run"].startswith("backcopy softmax/bos T16x4") and "seed 0" in rows[0]["run"]
    assert rows[0]["converged"] is False  # 4 steps: the copy loss is far from 0
    assert cache.clear_cache() == 1 and cache.cache_listing() == []
    assert cache.clear_cache() == 0


def test_clearing_removes_only_sinklabs_entries(root, monkeypatch):
    mine = root.parent / "mine"  # a user's own folder given as SINKLAB_LAB_CACHE
    monkeypatch.setenv("SINKLAB_LAB_CACHE", str(mine))
    (mine / "photos").mkdir(parents=True)
    (mine / "photos" / "a.jpg").write_text("x")
    (mine / "notes.txt").write_text("x")
    cfg = preset("cpu", **TINY)
    cache.cached_train(cfg)
    (mine / f".{cache.run_key(cfg)}.tmp-123").mkdir()  # a half-written run
    assert cache.clear_cache() == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "photos"]
    assert (mine / "photos" / "a.jpg").is_file()


def test_a_run_finished_second_keeps_the_first_valid_entry(root, monkeypatch):
    """Two workers train one key: the one that finishes second uses the entry already there
    (never deletes it: the first may be reading it) and discards its own."""
    cfg = preset("cpu", **TINY)
    real = cache.train

    def racing(config, out, **kw):
        with monkeypatch.context() as m:  # the other worker (another pid) finishes first
            m.setattr(cache, "train", real)
            m.setattr(cache.os, "getpid", lambda: 999999)
            other, _ = cache.cached_train(config)
        (other.out / "reader-is-here").write_text("x")
        return real(config, out, **kw)

    monkeypatch.setattr(cache, "train", racing)
    res, reused = cache.cached_train(cfg)
    final = root / cache.run_key(cfg)
    assert reused and res.out == final and (final / "reader-is-here").is_file()
    assert [p.name for p in root.iterdir()] == [final.name]  # no temporary folder left


def test_an_interrupted_run_leaves_nothing(root, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "train", boom)
    with pytest.raises(KeyboardInterrupt):
        cache.cached_train(preset("cpu", **TINY))
    assert list(root.iterdir()) == []


def test_runs_train_in_worker_processes_into_the_cache(root):
    from sinklab.errors import SinklabError

    cfgs = [preset("cpu", **{**TINY, "seed": s}) for s in (0, 1, 2)]
    done, started = [], []
    popen = cache.subprocess.Popen

    def counted(*args, **kwargs):
        started.append(args[0])
        return popen(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache.subprocess, "Popen", counted)
        cache.train_in_processes(cfgs, 2, done.append)
    assert sorted(done) == [0, 1, 2]
    assert len(started) == 2  # a worker process takes the next run: 3 runs, 2 processes
    for cfg in cfgs:  # each worker's run is the cache's, equal to one trained here
        assert cache.cached_result(cfg).loss == cache.train(cfg).loss
    bad = preset("cpu", **{**TINY, "seq_len": 4})  # the worker refuses it: one line, here
    with pytest.raises(SinklabError, match=r"a lab run failed .*seq_len must be in 8\.\.8192"):
        cache.train_in_processes([bad], 1, done.append)
    assert sorted(done) == [0, 1, 2]  # nothing reported for the failed run


def test_a_stuck_worker_is_stopped_at_its_deadline(root):
    from sinklab.errors import SinklabError

    cfg = preset("cpu", **TINY)
    assert cache.run_deadline(preset("cpu", **{**TINY, "steps": 1000})) > cache.run_deadline(cfg)
    with pytest.raises(SinklabError, match="did not finish within 0 s and was stopped"):
        cache.train_in_processes([cfg], 1, lambda k: None, deadline=lambda c: 0.2)
    assert cache.cached_result(cfg) is None


WORKER = """
import os, signal, sys
from sinklab.lab import cache

real, mode = cache.cached_train, {mode!r}


def patched(config):
    if mode == "noisy":  # a run that prints: its words must not be taken for the answer
        print("a run that prints")
        sys.stdout.flush()
        os.write(1, b"and writes to fd 1\\n")
        return real(config)
    if mode == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def stuck(config, *args, **kwargs):  # training that never ends, its folder half-written
    open({started!r}, "w").close()
    import time

    time.sleep(120)


if mode == "stuck":
    cache.train = stuck  # cached_train's own folder handling runs
else:
    cache.cached_train = patched
sys.exit(cache.main())
"""


def _fake_workers(tmp_path, monkeypatch, mode: str) -> list:
    """Make train_in_processes start ``WORKER`` (in ``mode``) instead of the real worker; ->
    the list its processes are appended to."""
    import stat
    import sys

    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(mode=mode, started=str(tmp_path / "started")))
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    procs, popen = [], cache.subprocess.Popen

    def kept(*args, **kwargs):
        procs.append(popen(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(cache.sys, "executable", str(exe))
    monkeypatch.setattr(cache.subprocess, "Popen", kept)
    return procs


def test_what_a_run_prints_is_not_its_answer(root, tmp_path, monkeypatch):
    procs = _fake_workers(tmp_path, monkeypatch, "noisy")
    cfgs = [preset("cpu", **{**TINY, "seed": s}) for s in (0, 1)]
    done = []
    cache.train_in_processes(cfgs, 1, done.append)
    assert done == [0, 1] and len(procs) == 1 and procs[0].returncode == 0
    assert all(cache.cached_result(c) is not None for c in cfgs)


@pytest.mark.parametrize(("mode", "said"), [("exit", "exit status 3"), ("kill", "signal 9")])
def test_a_worker_that_dies_mid_run_is_one_line_and_none_is_left(
    root, tmp_path, monkeypatch, mode, said
):
    from sinklab.errors import SinklabError

    procs = _fake_workers(tmp_path, monkeypatch, mode)
    cfgs = [preset("cpu", **{**TINY, "seed": s}) for s in (0, 1, 2)]
    with pytest.raises(SinklabError, match=rf"a lab run failed \(.*\): .*{said}"):
        cache.train_in_processes(cfgs, 2, lambda k: None)
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)  # none left running


def test_a_worker_stopped_mid_run_removes_its_half_written_folder(root, tmp_path, monkeypatch):
    """Stopped (SIGTERM) once its run is training, the worker exits through the run's cleanup:
    no hidden temporary folder is left in the cache."""
    from sinklab.errors import SinklabError

    procs = _fake_workers(tmp_path, monkeypatch, "stuck")
    started = tmp_path / "started"

    def deadline(config):  # none until the run is inside train(), then at once
        return 0.0 if started.exists() else 1e9

    cfg = preset("cpu", **TINY)
    with pytest.raises(SinklabError, match="did not finish within 0 s and was stopped"):
        cache.train_in_processes([cfg], 1, lambda k: None, deadline=deadline)
    assert started.exists() and procs[0].returncode == 128 + 15  # exited through SystemExit
    assert list(root.iterdir()) == []  # the half-written .KEY.tmp-PID folder is gone
