"""jtrainer.trl on a mesh of 8 devices ({data: 2, fsdp: 4}: one process, or two launched by `jtrainer launch`)
gives TRL's numbers on one torch process with the same global batch: SFT on BFD-packed rows, DPO with its
reference sharded like the policy. (Full batches only: with several data shards, a short last batch is completed
with rows from the start, as accelerate's even_batches does on several GPUs.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import datasets
import pytest

pytest.importorskip("trl")

import trl  # noqa: E402

from tests import trl_cases as cases  # noqa: E402
from tests.test_trl_dpo import DPO_KEYS  # noqa: E402
from tests.test_trl_sft import SFT_KEYS  # noqa: E402


def _job(tmp_path, name, launched: bool) -> dict:
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "trl_mesh_job.py")
    out = tmp_path / name / "logs.json"
    out.parent.mkdir()
    prefix = [sys.executable, "-m", "jtrainer.cli", "launch", "--num_processes", "2", "--devices_per_process", "4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JTRAINER_")}
    done = subprocess.run(
        [*(prefix if launched else [sys.executable]), job, str(out)],
        env=dict(env, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_sft_and_dpo_on_a_mesh_as_trl(tmp_path):
    """One process of 8 devices, and `jtrainer launch` of 2 processes x 4 devices, each against TRL."""
    runs = [_job(tmp_path, "single", launched=False), _job(tmp_path, "launched", launched=True)]
    assert [run["processes"] for run in runs] == [1, 2]
    model = cases.torch_llama()
    fields = dict(per_device_train_batch_size=8, max_steps=2)
    sft = trl.SFTTrainer(
        model=cases.twin(model),
        args=trl.SFTConfig(**cases.config_fields(tmp_path / "sft", packing=True, max_length=24, **fields)),
        train_dataset=datasets.Dataset.from_list(cases.text_rows(60)),
        processing_class=cases.tokenizer(),
    )
    sft.train()
    dpo = trl.DPOTrainer(
        model=cases.twin(model),
        ref_model=cases.twin(model),
        args=trl.DPOConfig(**cases.config_fields(tmp_path / "dpo", learning_rate=1e-3, **fields)),
        train_dataset=datasets.Dataset.from_list(cases.preference_rows(16)),
        processing_class=cases.tokenizer(),
    )
    dpo.train()
    for ours in runs:
        cases.assert_logs_match(ours["sft"], sft.state.log_history, SFT_KEYS)
        cases.assert_logs_match(ours["dpo"], dpo.state.log_history, DPO_KEYS)
