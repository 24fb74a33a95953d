"""Many processes, one program: `jtrainer launch` with 2 processes x 4 CPU devices equals 1 process x 8 devices
(training, evaluation and predict_with_generate),
and a process that dies takes the others down with an error instead of a hang."""

import os
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "jobs", "multihost_job.py")
MESH = '{"data": 2, "fsdp": 4}'


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JTRAINER_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def _spawn_pair(cmd, port):
    """Two processes of `cmd` with 4 CPU devices each, joined through a coordinator on `port`."""
    procs = []
    for i in range(2):
        env = _env(
            JTRAINER_COORDINATOR=f"127.0.0.1:{port}",
            JTRAINER_NUM_PROCESSES="2",
            JTRAINER_PROCESS_ID=str(i),
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
        )
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def test_two_processes_equal_one(tmp_path):
    launched, single = tmp_path / "launched.npz", tmp_path / "single.npz"
    jtrainer = [sys.executable, "-m", "jtrainer.cli"]
    run = subprocess.run(
        jtrainer + ["launch", "--num_processes", "2", "--devices_per_process", "4", JOB, str(launched), MESH],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    subprocess.run(
        [sys.executable, JOB, str(single), MESH],
        env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        check=True,
        capture_output=True,
        timeout=400,
    )
    a, b = np.load(launched), np.load(single)
    assert int(a["processes"]) == 2 and int(b["processes"]) == 1
    assert int(a["compiles"]) == int(b["compiles"]) == 1
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5)
    np.testing.assert_allclose(float(a["eval_loss"]), float(b["eval_loss"]), rtol=1e-5)
    # predict_with_generate: each process decodes its rows of the same program; every process gets all ids. As
    # HF's Seq2SeqTrainer (accelerate's plain gather), the 6 rows completing the last batch of 8 shards stay.
    assert a["generated"].shape == (16, 20)
    np.testing.assert_array_equal(a["generated"][10:], a["generated"][:6])
    np.testing.assert_array_equal(a["generated"], b["generated"])
    params = [k for k in a.files if k.startswith("param:")]
    assert params and set(params) == {k for k in b.files if k.startswith("param:")}
    for key in params:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
        # Gathered in blocks of a few rows across both processes: the same tensors, bit for bit.
        np.testing.assert_array_equal(a["blocked:" + key[len("param:") :]], a[key], err_msg=key)


def test_a_killed_process_makes_the_other_fail_fast(tmp_path):
    out = tmp_path / "killed.npz"
    procs = _spawn_pair([sys.executable, JOB, str(out), MESH, "100000"], port=20000 + os.getpid() % 20000)
    marker = tmp_path / "killed.npz.step1"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert time.monotonic() < deadline, "training never started"
        assert all(p.poll() is None for p in procs), "a process ended before training"
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        code = procs[0].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert code != 0
    assert time.monotonic() - killed_at < 60


def test_sigterm_to_one_process_makes_both_save_the_same_step(tmp_path):
    sys.path.insert(0, HERE)
    from jtrainer.checkpointing import checkpoint

    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(HERE, "jobs", "ckpt_job.py"), str(out), "100000", "0", "0", MESH, "8"]
    procs = _spawn_pair(cmd, port=20000 + (os.getpid() + 7) % 20000)
    deadline = time.monotonic() + 300
    while not (out / "step").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0]
    folder = checkpoint.get_last_checkpoint(str(out))
    assert folder is not None
    checkpoint.verify_checkpoint(folder)
    assert len([n for n in os.listdir(out) if n.startswith("checkpoint-")]) == 1
    # Each process keeps its own host generators (HF's rng_state_{process}.pth), listed in the manifest.
    for process in (0, 1):
        assert checkpoint.load_loop_state(folder, process)["process_rng"] is not None


def test_hyperparameter_search_on_two_processes(tmp_path):
    """Process 0 runs the optuna study; the other process trains the same trials (a collective in every step
    would hang otherwise) and returns None."""
    out = tmp_path / "trials.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jtrainer.cli",
            "launch",
            "--num_processes",
            "2",
            "--devices_per_process",
            "2",
            os.path.join(HERE, "jobs", "hpsearch_job.py"),
            str(out),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    main, other = json.loads(out.read_text()), json.loads((tmp_path / "trials.json.other").read_text())
    # Process 0 calls hp_space twice a trial (to sample, then to set the arguments), the other once, from the
    # parameters it received (a FixedTrial): the same 3 learning rates, in order.
    sampled = main["rates"][::2]
    assert other["best"] is None and len(sampled) == 3 and len(set(sampled)) == 3
    assert [round(r, 12) for r in other["rates"]] == [round(r, 12) for r in sampled]
