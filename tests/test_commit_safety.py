"""Checkpoints are committed when written, whatever happens next (kill -9, Ctrl-C, an exception in a callback),
on_save sees its checkpoint complete, and a run leaves no thread behind (no exit code 134 after success)."""

import os
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from conftest import spawn_checkpoint_job as _spawn
from conftest import wait_until as _wait
from jobs.ckpt_job import PAUSE_ENV, make_trainer

from jtrainer import TrainerCallback
from jtrainer.checkpointing import checkpoint


def _step(out):
    try:
        return int((out / "step").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _params_equal(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a._train_state.params), jax.tree.leaves(b._train_state.params))
    )


def _resumes_exactly(out, tmp_path, folder, steps=6):
    checkpoint.verify_checkpoint(str(folder))
    resumed = make_trainer(str(out), steps, 0, False)
    resumed.train(resume_from_checkpoint=str(folder))
    reference = make_trainer(str(tmp_path / "reference"), steps, 0, False)
    reference.train()
    assert _params_equal(resumed, reference)


def test_kill_after_a_finished_save_keeps_it(tmp_path):
    """kill -9 two steps after checkpoint-2 was written, long before the next save: it is committed already."""
    out = tmp_path / "run"
    proc = _spawn(out, 10_000, 2, 0)
    _wait(lambda: _step(out) >= 3, proc, "step 3")  # checkpoint-2's write had time to finish
    _wait(lambda: (out / "checkpoint-2" / checkpoint.COMMIT_NAME).exists(), proc, "the commit of checkpoint-2")
    proc.kill()
    proc.wait()
    assert checkpoint.get_last_checkpoint(str(out)) is not None
    _resumes_exactly(out, tmp_path, out / "checkpoint-2")


@pytest.mark.parametrize("failure", ["sigint", "callback"])
def test_an_interrupt_or_error_commits_the_save_in_flight(tmp_path, failure):
    """Ctrl-C, or an exception in a callback, while checkpoint-2 is being committed (held open for 4 s): the
    commit finishes, then the error ends the run with its own exit code."""
    out = tmp_path / "run"
    env = {PAUSE_ENV: "2:4"}
    if failure == "callback":
        env["CKPT_JOB_RAISE_AT_STEP"] = "3"
    proc = _spawn(out, 10_000, 2, 0, env=env)
    _wait(lambda: (out / "checkpoint-2.tmp" / "paused").exists(), proc, "the pause before the commit")
    if failure == "sigint":
        proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=120)
    assert code == (130 if failure == "sigint" else 1) or (failure == "sigint" and code == -signal.SIGINT)
    if failure == "callback":
        assert b"a callback failed at step 3" in proc.stderr.read()
    assert not (out / "checkpoint-2.tmp").exists()
    _resumes_exactly(out, tmp_path, out / "checkpoint-2")


@pytest.mark.parametrize("asynchronous", [True, False])
def test_on_save_finds_its_checkpoint_committed(tmp_path, asynchronous):
    seen = []

    class Check(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            seen.append((state.global_step, os.path.isfile(os.path.join(folder, checkpoint.COMMIT_NAME))))

    trainer = make_trainer(str(tmp_path / "run"), 6, 2, False)
    trainer.args.async_checkpointing = asynchronous
    trainer.add_callback(Check())
    trainer.train()
    assert seen == [(2, True), (4, True), (6, True)]


def test_training_leaves_no_thread_behind(tmp_path):
    before = set(threading.enumerate())
    make_trainer(str(tmp_path / "run"), 4, 2, True).train()
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive() and not t.name.startswith("asyncio")]
    assert not [name for name in left if "jtrainer" in name or name.startswith("Thread-")], left


def test_clean_runs_exit_zero(tmp_path):
    """20 finished runs in a row, each process exits 0 (a live prefetch thread at exit used to abort one in three
    with 134). Two at a time, sharing a compilation cache as a user's repeated runs do."""
    env = {"JTRAINER_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    codes = []
    for pair in range(10):
        procs = [_spawn(tmp_path / f"run{pair}-{i}", 3, 2, 0, env=env) for i in range(2)]
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            codes.append(proc.returncode)
            assert proc.returncode == 0, (len(codes), err.decode()[-2000:])
    assert codes == [0] * 20


def _restore_write_access(folder):
    for path, _, _ in os.walk(folder):
        os.chmod(path, 0o755)


@pytest.mark.parametrize("disk", ["full", "readonly"])
def test_a_failing_disk_keeps_the_committed_checkpoints(tmp_path, disk):
    """The disk fills up (no file may grow: EFBIG, as ENOSPC) or the folder turns read-only after checkpoint-2 is
    committed: the save of checkpoint-4 fails with an OSError naming it and the cause, its partial folder is
    gone, and checkpoint-2 is intact."""
    out = tmp_path / "run"
    proc = _spawn(out, 8, 2, 0, env={"CKPT_JOB_DISK_AT_STEP": "3", "CKPT_JOB_DISK": disk})
    _, err = proc.communicate(timeout=300)
    _restore_write_access(out)
    assert proc.returncode == 1, err.decode()[-3000:]
    error = [
        line
        for line in err.decode().splitlines()
        if line.startswith("jtrainer.checkpointing.checkpoint.CheckpointWriteError")
    ]
    assert error, err.decode()[-3000:]
    assert "Could not remove the lock" not in err.decode()  # the disk's refusal is said once, by the error
    cause = "File too large" if disk == "full" else "Permission denied"
    assert f"Checkpoint {out}/checkpoint-4 could not be written ({cause}: {out}/checkpoint-4.tmp" in error[0]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    checkpoint.verify_checkpoint(str(out / "checkpoint-2"))
    assert checkpoint.get_last_checkpoint(str(out)) == str(out / "checkpoint-2")


def test_jtrainer_train_on_a_full_disk_says_so_in_one_line(tmp_path):
    """`jtrainer train` whose first checkpoint cannot be written (no file may grow past 32 KiB): exit code 1 and
    one line naming the file, the cause and the fix."""
    text = tmp_path / "text"
    text.mkdir()
    for i in range(4):
        (text / f"f{i}.txt").write_text(" ".join(f"w{(i + j) % 30}" for j in range(400)))
    limited = (
        "import resource, sys; sys.modules['torch'] = None; "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (32768, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
        "from jtrainer.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    small = [
        "--hidden_size",
        "32",
        "--intermediate_size",
        "64",
        "--num_hidden_layers",
        "1",
        "--num_attention_heads",
        "2",
        "--num_key_value_heads",
        "1",
        "--block_size",
        "16",
        "--tokenizer_vocab_size",
        "300",
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            limited,
            "train",
            "--text_dir",
            str(text),
            "--output_dir",
            str(tmp_path / "out"),
            "--save_steps",
            "1",
            "--max_steps",
            "2",
            "--disable_tqdm",
            "true",
            *small,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 1, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("jtrainer train: ")]
    assert len(said) == 1, done.stderr[-3000:]
    assert said[0].startswith(f"jtrainer train: File too large writing or reading '{tmp_path}/out/checkpoint-1.tmp/")
    assert "run the same command again" in said[0]
    assert not (tmp_path / "out" / "checkpoint-1.tmp").exists()
    # orbax's background threads do not repeat the failure: no traceback, no closed-event-loop noise
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr[-3000:]
