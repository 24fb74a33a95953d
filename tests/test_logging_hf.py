"""What an HF script sees of jtrainer's logging and metrics: its own logging.basicConfig takes effect after
`import jtrainer`, no torch advisory without torch, log_metrics prints as transformers' does, n_gpu is HF's."""

import contextlib
import io
import os
import subprocess
import sys

import transformers
from conftest import scratch_dir

from jtrainer import TrainingArguments

SCRIPT = """
import logging, sys
sys.modules["torch"] = None   # a TPU VM: no torch
import jtrainer
logging.basicConfig(format="%(levelname)s|%(name)s|%(message)s", handlers=[logging.StreamHandler(sys.stdout)],
                    level=logging.INFO)
logging.getLogger("run_clm").info("the script's own line")
"""


def test_a_scripts_basic_config_takes_effect_and_no_torch_advisory():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "INFO|run_clm|the script's own line" in done.stdout.splitlines()
    assert "PyTorch was not found" not in done.stderr


def test_log_metrics_prints_as_transformers_and_n_gpu_is_hfs():
    from transformers.trainer_pt_utils import log_metrics

    metrics = {
        "train_runtime": 12.3456,
        "train_samples_per_second": 8.809,
        "epoch": 1.2,
        "total_flos": 3 << 31,
        "train_loss": 4.15712345,
        "eval_steps_per_second": 101.5,
    }

    class Theirs:
        def is_world_process_zero(self):
            return True

        from transformers.trainer_pt_utils import metrics_format

    expected, got = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(expected):
        log_metrics(Theirs(), "train", metrics)
    from jtrainer.trainer.metrics_io import MetricsMixin

    class Ours(MetricsMixin):
        def is_world_process_zero(self):
            return True

    with contextlib.redirect_stdout(got):
        Ours().log_metrics("train", metrics)
    assert got.getvalue() == expected.getvalue()
    assert (
        TrainingArguments(output_dir=scratch_dir()).n_gpu
        == 0
        == transformers.TrainingArguments(output_dir=scratch_dir(), use_cpu=True).n_gpu
    )
