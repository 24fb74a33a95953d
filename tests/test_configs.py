"""Every shipped config parses and dry-runs (`jtrainer check`, shrunk); `jtrainer train` runs every task."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jtrainer.cli import main, parse_train_args
from jtrainer.cli.check import run_check

CONFIGS = sorted(glob.glob("configs/*.yaml"))
SHRINK = [
    "--hidden_size",
    "32",
    "--intermediate_size",
    "64",
    "--num_hidden_layers",
    "2",
    "--num_attention_heads",
    "4",
    "--num_key_value_heads",
    "2",
    "--block_size",
    "32",
    "--max_target_length",
    "16",
    "--tokenizer_vocab_size",
    "128",
    "--per_device_train_batch_size",
    "2",
]


def test_the_configs_are_shipped():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {
        "default.yaml",
        "gpt2_small_tpu_v4_8.yaml",
        "llama_1b_fsdp_v5e_16.yaml",
        "bert_sequence_classification.yaml",
        "t5_summarisation.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS)
def test_every_config_validates_and_compiles_shrunk(path, capsys):
    model_args, data_args, training_args, _ = parse_train_args([path])
    assert training_args.output_dir and data_args.block_size > 0 and model_args.hidden_size > 0
    result = run_check(*parse_train_args([path, *SHRINK], "check")[:3])
    assert result["step_bytes_per_device"] > 0 and result["flops_per_step_per_device"] > 0
    statuses = {name: status for name, _, status, _ in result["fields"]}
    assert statuses.get("learning_rate") == "honoured"
    if "llama_1b" in path:
        assert statuses["activation_checkpointing"] == "emulated" and statuses["bf16"] == "emulated"
    assert "train step compiled" in capsys.readouterr().out


def test_check_on_many_devices_uses_the_configs_mesh(tmp_path):
    """The FSDP config on 4 simulated devices: the mesh's fsdp axis takes them all."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "jtrainer.cli", "check", "configs/llama_1b_fsdp_v5e_16.yaml", *SHRINK],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'fsdp': 4" in out.stdout and "on 4 device(s)" in out.stdout


def test_train_sequence_classification_from_a_local_dataset(tmp_path, capsys):
    import datasets

    rng = np.random.RandomState(0)
    words = ["good", "great", "fine", "bad", "awful", "poor"]
    sentences = [" ".join(rng.choice(words, 4)) for _ in range(64)]
    labels = [int(sum(w in ("good", "great", "fine") for w in s.split()) > 2) for s in sentences]
    datasets.Dataset.from_dict({"sentence": sentences, "label": labels}).save_to_disk(str(tmp_path / "data"))
    main(
        [
            "train",
            "configs/bert_sequence_classification.yaml",
            *SHRINK,
            "--dataset_name",
            str(tmp_path / "data"),
            "--num_train_epochs",
            "2",
            "--eval_strategy",
            "no",
            "--save_strategy",
            "no",
            "--load_best_model_at_end",
            "false",
            "--output_dir",
            str(tmp_path / "out"),
            "--disable_tqdm",
            "true",
            "--learning_rate",
            "0.003",
            "--eval_fraction",
            "0.25",
        ]
    )
    printed = capsys.readouterr().out
    assert "eval_accuracy" in printed
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")


def test_train_seq2seq_from_json_files(tmp_path, capsys):
    rows = [{"article": f"the number {i} is here", "highlights": f"number {i}"} for i in range(24)]
    for name, part in (("train.json", rows[:20]), ("valid.json", rows[20:])):
        with open(tmp_path / name, "w") as f:
            f.write("\n".join(json.dumps(r) for r in part))
    main(
        [
            "train",
            "configs/t5_summarisation.yaml",
            *SHRINK,
            "--dataset_name",
            "",
            "--train_file",
            str(tmp_path / "train.json"),
            "--validation_file",
            str(tmp_path / "valid.json"),
            "--max_steps",
            "4",
            "--eval_strategy",
            "no",
            "--save_strategy",
            "no",
            "--bf16",
            "false",
            "--generation_max_length",
            "8",
            "--generation_num_beams",
            "1",
            "--output_dir",
            str(tmp_path / "out"),
            "--disable_tqdm",
            "true",
        ]
    )
    assert "held-out eval_loss" in capsys.readouterr().out
