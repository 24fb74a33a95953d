"""The launch scripts cannot reach a cloud here: their dry runs print every command, which we check."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    result = subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize(
    "cmd, expected",
    [
        (
            ["create", "--type", "v5litepod-16", "--spot"],
            "gcloud compute tpus tpu-vm create t1 --zone us-x1 --accelerator-type v5litepod-16",
        ),
        (["install"], "--worker=all --command python3\\ -m\\ pip\\ install\\ -U\\ \\'jax\\[tpu\\]\\'"),
        (
            ["run", "--config", "configs/default.yaml", "--", "--max_steps", "5"],
            "jtrainer.cli\\ train\\ configs/default.yaml\\ --max_steps\\ 5",
        ),
        (["logs"], "gcloud compute tpus tpu-vm scp t1:jtrainer/jtrainer-\\*.log ./tpu-logs --zone us-x1 --worker=all"),
        (["delete"], "gcloud compute tpus tpu-vm delete t1 --zone us-x1 --quiet"),
    ],
)
def test_tpu_dry_run_prints_the_commands(cmd, expected):
    out = _run("tpu/tpu.sh", cmd[0], "--name", "t1", "--zone", "us-x1", "--dry-run", *cmd[1:])
    assert expected in out


def test_tpu_script_names_missing_arguments():
    result = subprocess.run(
        ["bash", "tpu/tpu.sh", "run", "--name", "t1", "--zone", "z", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--config is required" in result.stderr


def test_slurm_dry_run_prints_the_batch_script():
    out = _run(
        "tpu/slurm_gpu.sh",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--config",
        "configs/default.yaml",
        "--partition",
        "gpu",
        "--dry-run",
    )
    assert "#SBATCH --nodes=4" in out and "#SBATCH --gpus-per-node=8" in out and "#SBATCH --partition=gpu" in out
    assert "srun python3 -m jtrainer.cli train configs/default.yaml" in out
