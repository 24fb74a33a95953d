"""Signals outside Trainer.train() and to `jtrainer launch`, tested by sending them: `jtrainer train` stopped by
SIGTERM while it reads data or after its last step releases output_dir's lock, keeps the committed checkpoints and
says so in one line (exit 143), and a rerun finishes the job; SIGTERM to `jtrainer launch` reaches every process
(each saves the current step and exits 0), a killed launcher leaves no process training on, and a process killed
by a signal makes the launcher exit 128 + N naming it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from jtrainer.checkpointing import checkpoint
from jtrainer.checkpointing.run_lock import LOCK_NAME

HERE = os.path.dirname(__file__)
CLI_JOB = os.path.join(HERE, "jobs", "cli_job.py")
CKPT_JOB = os.path.join(HERE, "jobs", "ckpt_job.py")
SMALL = (
    "--hidden_size 32 --intermediate_size 64 --num_hidden_layers 1 --num_attention_heads 2 --num_key_value_heads 1 "
    "--block_size 16 --tokenizer_vocab_size 300 --max_chars 20000 --max_steps 2 --save_steps 2 --sample_tokens 2 "
    "--disable_tqdm true --report_to none"
).split()


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JTRAINER_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return env


def _wait_for(path, proc, seconds=240):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _text_dir(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(4):
        (folder / f"f{i}.txt").write_text(" ".join(f"w{(i + j) % 30}" for j in range(400)))
    return str(folder)


def test_ctrl_c_of_jtrainer_train_is_one_line(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "marker"
    argv = [*SMALL, "--text_dir", _text_dir(tmp_path), "--output_dir", str(out)]
    proc = subprocess.Popen(
        [sys.executable, CLI_JOB, "data", str(marker), *argv], env=_env(), stderr=subprocess.PIPE, text=True
    )
    _wait_for(marker, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("jtrainer train: interrupted (Ctrl-C)")
    assert not os.path.exists(out / LOCK_NAME)


@pytest.mark.parametrize("phase", ["data", "after"])
def test_sigterm_outside_training_releases_the_lock_in_one_line(tmp_path, phase):
    out, marker = tmp_path / "run", tmp_path / "marker"
    argv = [*SMALL, "--text_dir", _text_dir(tmp_path), "--output_dir", str(out)]
    proc = subprocess.Popen(
        [sys.executable, CLI_JOB, phase, str(marker), *argv],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(marker, proc)
    assert os.path.exists(out / LOCK_NAME)  # held while the job runs
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("jtrainer train: ")]
    assert len(lines) == 1 and "stopped by SIGTERM outside training" in lines[0], stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == lines[0]
    assert not os.path.exists(out / LOCK_NAME)
    last = checkpoint.get_last_checkpoint(str(out))
    assert (last is None) == (phase == "data")
    assert not (out / "model.safetensors").exists()
    if phase == "after":  # the rerun continues from checkpoint-2, evaluates and exports
        from jtrainer.cli import main

        assert main(["train", *argv]) == 0
        assert (out / "model.safetensors").exists()


def _processes_with(text: str) -> list[int]:
    """Pids of live processes whose command line holds `text`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _launch(out):
    """`jtrainer launch` of a long two-process run (2 x 4 CPU devices) into `out`, in a session of its own (as a
    terminal's foreground job: Ctrl-C goes to its whole process group)."""
    cmd = [sys.executable, "-m", "jtrainer.cli", "launch", "--num_processes", "2", "--devices_per_process", "4"]
    cmd += [CKPT_JOB, str(out), "100000", "0", "0", '{"data": 2, "fsdp": 4}', "8"]
    return subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.parametrize("how", ["sigterm", "kill", "ctrl-c"])
def test_a_signalled_launcher_leaves_no_process_training(tmp_path, how):
    out = tmp_path / "run"
    launcher = _launch(out)
    try:
        _wait_for(out / "step", launcher, 300)
        if how == "ctrl-c":
            os.killpg(launcher.pid, signal.SIGINT)  # the processes are in groups of their own: they get it once
        else:
            launcher.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        code = launcher.wait(timeout=120)
        deadline = time.monotonic() + 120
        while _processes_with(str(out)):  # the workers: preempted, each saves the current step and exits
            assert time.monotonic() < deadline, "workers kept running after the launcher"
            time.sleep(0.5)
    finally:
        for pid in _processes_with(str(out)):
            os.kill(pid, signal.SIGKILL)
    assert not os.path.exists(out / LOCK_NAME)
    if how == "ctrl-c":  # an interrupt saves no new checkpoint: each process stops with its exit code
        assert code == 130, launcher.stderr.read()[-3000:]
        return
    if how == "sigterm":
        assert code == 0, launcher.stderr.read()[-3000:]
    folder = checkpoint.get_last_checkpoint(str(out))
    assert folder is not None
    checkpoint.verify_checkpoint(folder)
    assert not os.path.exists(out / LOCK_NAME)


def test_a_killed_worker_makes_the_launcher_exit_128_plus_the_signal(tmp_path):
    out = tmp_path / "run"
    launcher = _launch(out)
    try:
        _wait_for(out / "step", launcher, 300)
        workers = [pid for pid in _processes_with(str(out)) if pid != launcher.pid]
        assert len(workers) == 2
        os.kill(max(workers), signal.SIGKILL)
        code = launcher.wait(timeout=120)
    finally:
        for pid in _processes_with(str(out)):
            os.kill(pid, signal.SIGKILL)
    stderr = launcher.stderr.read()
    assert code == 128 + signal.SIGKILL, stderr[-3000:]
    assert "was killed by SIGKILL; stopping the others" in stderr
