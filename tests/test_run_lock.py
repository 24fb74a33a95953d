"""One run per output_dir: a second run is refused within seconds and leaves the first untouched; a dead
holder's lock is taken over; the lock is released (and an empty folder it created removed) at the end."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import spawn_checkpoint_job as _spawn
from conftest import wait_until as _wait
from jobs.ckpt_job import PAUSE_ENV, make_trainer

from jtrainer.checkpointing import checkpoint, run_lock
from jtrainer.checkpointing.run_lock import LOCK_NAME, OutputDirLocked, RunLock


def _write_lock(folder, host, pid, age_s=0.0):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_NAME)
    with open(path, "w") as f:
        json.dump({"host": host, "pid": pid, "pid_start": None, "started": time.time() - age_s, "token": "x"}, f)
    os.utime(path, (time.time() - age_s,) * 2)
    return path


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_holder_refused_then_released(tmp_path):
    folder = str(tmp_path / "new")
    first = RunLock(folder).acquire()
    started = time.monotonic()
    with pytest.raises(OutputDirLocked, match=rf"output_dir '{folder}' is in use .*pid {os.getpid()} on host "):
        RunLock(folder).acquire()
    assert time.monotonic() - started < 5
    first.release()
    assert not os.path.exists(folder)  # the lock made the folder and the run left it empty
    RunLock(folder).acquire().release()


def test_dead_or_silent_holders_are_taken_over(tmp_path, caplog):
    here = socket.gethostname()
    cases = {
        "same_host_dead": (here, _dead_pid(), 0.0, True),
        "other_host_silent": ("elsewhere", 1, run_lock.STALE_AFTER_S + 60, True),
        "other_host_beating": ("elsewhere", 1, 5.0, False),
    }
    for name, (host, pid, age, stale) in cases.items():
        folder = str(tmp_path / name)
        _write_lock(folder, host, pid, age)
        if not stale:
            with pytest.raises(OutputDirLocked, match=f"pid {pid} on host {host}"):
                RunLock(folder).acquire()
            continue
        with caplog.at_level(logging.WARNING, logger="jtrainer.checkpointing.run_lock"):
            lock = RunLock(folder).acquire()
        assert "Took over the lock" in caplog.text
        with open(lock.path) as f:
            assert json.load(f)["pid"] == os.getpid()
        lock.release()
        assert os.listdir(folder) == []


@pytest.mark.parametrize("content", ["", "{not json"], ids=["empty", "damaged"])
def test_an_empty_or_damaged_lock_is_taken_over_at_once(tmp_path, caplog, content):
    """A lock is written whole and then linked into place: an empty or unreadable one is no live run's."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_NAME).write_text(content)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="jtrainer.checkpointing.run_lock"):
        lock = RunLock(str(folder)).acquire()
    assert time.monotonic() - started < 5 and "Took over the lock" in caplog.text
    with open(lock.path) as f:
        assert json.load(f)["pid"] == os.getpid()
    lock.release()


def test_hold_is_reentrant_and_rejects_a_file(tmp_path):
    folder = str(tmp_path / "run")
    with run_lock.hold(folder):
        with run_lock.hold(folder):  # Trainer.train() inside `jtrainer train`
            assert os.path.exists(os.path.join(folder, LOCK_NAME))
        assert os.path.exists(os.path.join(folder, LOCK_NAME))
    assert not os.path.exists(os.path.join(folder, LOCK_NAME))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        with run_lock.hold(str(tmp_path / "a_file")):
            pass


def test_a_second_training_run_is_refused_and_the_first_unharmed(tmp_path):
    """Run A writes checkpoint-2 (its commit held open for 6 s); run B on the same output_dir fails within
    seconds naming A; A's checkpoint-2.tmp is still there and is committed. After A is killed, B takes over."""
    out = tmp_path / "run"
    proc = _spawn(out, 10_000, 2, 0, env={PAUSE_ENV: "2:6"})
    try:
        _wait(lambda: (out / "checkpoint-2.tmp" / "paused").exists(), proc, "the pause before the commit")
        second = make_trainer(str(out), 2, 0, False)
        started = time.monotonic()
        with pytest.raises(OutputDirLocked, match=rf"pid {proc.pid} on host"):
            second.train()
        assert time.monotonic() - started < 20
        assert (out / "checkpoint-2.tmp").is_dir()  # B removed nothing of A's
        _wait(lambda: (out / "checkpoint-2" / checkpoint.COMMIT_NAME).exists(), proc, "the commit of checkpoint-2")
    finally:
        proc.kill()
        proc.wait()
    assert (out / LOCK_NAME).exists()  # kill -9 left it behind
    make_trainer(str(out), 2, 0, False).train()  # the dead holder's lock is taken over
    assert not (out / LOCK_NAME).exists()
    checkpoint.verify_checkpoint(str(out / "checkpoint-2"))
