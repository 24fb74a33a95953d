"""`jtrainer train` with `trainer: sft` / `trainer: dpo`: a chat dataset file and a local model folder, TRL's
config fields in the YAML, resumed from its checkpoint when run again."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("trl")

from jtrainer.cli import main  # noqa: E402
from tests import trl_cases as cases  # noqa: E402


def model_folder(tmp_path):
    folder = tmp_path / "model"
    cases.torch_llama().save_pretrained(folder)
    cases.tokenizer().save_pretrained(folder)
    return folder


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config(tmp_path, trainer, rows, **over):
    values = dict(
        trainer=trainer,
        model_name_or_path=str(model_folder(tmp_path)),
        train_file=str(write_rows(tmp_path / "rows.jsonl", rows)),
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=2,
        bf16=False,
        logging_steps=1,
        save_steps=1,
        report_to="none",
        eval_fraction=0.25,
    )
    values.update(over)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_sft_job_on_a_chat_file_trains_and_resumes(tmp_path, capsys):
    job = config(tmp_path, "sft", cases.conversation_rows(16), assistant_only_loss=True, packing=False)
    assert main(["train", job]) == 0
    out = capsys.readouterr().out
    assert "trainer: sft" in out and "saved in HF format" in out
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert main(["train", job, "--max_steps", "3"]) == 0  # run again: continues from checkpoint-2
    assert "resuming from" in capsys.readouterr().out


def test_dpo_job_trains(tmp_path, capsys):
    job = config(tmp_path, "dpo", cases.preference_rows(16), beta=0.2, loss_type="sigmoid")
    assert main(["train", job]) == 0
    assert "held-out eval_loss" in capsys.readouterr().out


def test_trl_job_refuses_in_one_line(tmp_path, capsys):
    job = config(tmp_path, "sft", cases.preference_rows(8))
    capsys.readouterr()
    assert main(["train", job]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no messages or prompt+completion or text rows" in err[0], err
    job = config(tmp_path, "sft", cases.text_rows(8), model_name_or_path=None)
    capsys.readouterr()
    assert main(["train", job]) == 1
    assert "model_name_or_path: trainer: sft fine-tunes a pretrained model" in capsys.readouterr().err


def test_sft_job_killed_mid_run_continues_from_its_last_checkpoint(tmp_path, capsys):
    """kill -9 during `jtrainer train` (trainer: sft): the committed checkpoints survive, and the same command
    continues from the last one."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import wait_until

    job = config(tmp_path, "sft", cases.text_rows(32), max_steps=500, save_steps=2, packing=True, max_length=24)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jtrainer.cli", "train", job],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: (tmp_path / "out" / "checkpoint-4").is_dir(), proc, "checkpoint-4")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    capsys.readouterr()
    committed = [p.name for p in (tmp_path / "out").glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    last = max(int(name.split("-")[1]) for name in committed)  # (a checkpoint being written is not one)
    assert main(["train", job, "--max_steps", str(last + 2)]) == 0
    assert f"resuming from {tmp_path / 'out' / f'checkpoint-{last}'}" in capsys.readouterr().out


def test_help_all_marks_trl_fields(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--trainer", "dpo", "--help-all"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--beta BETA [TRL, honoured: the loss's temperature]" in text
    assert "--sync-ref-model [SYNC_REF_MODEL] [TRL, refused: TR-DPO" in text
    assert "--learning-rate LEARNING_RATE [honoured]" in text
    assert "(default: 1e-06)" in text  # DPOConfig's default learning rate


def test_check_sizes_sft_and_dpo_steps(tmp_path, capsys):
    """`jtrainer check` compiles TRL's step: SFT's packed rows at max_length; DPO's pairs (two sequences a row)
    with the reference's weights held beside the policy (none with peft: the adapter is disabled instead)."""
    fresh = dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tokenizer_vocab_size=300,
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_length=64,
        bf16=False,
    )
    for name, extra in (("sft", dict(packing=True)), ("dpo", dict(beta=0.2))):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(dict(fresh, trainer=name, **extra)))
        capsys.readouterr()
        assert main(["check", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"tokens per step            {128 * (2 if name == 'dpo' else 1)}" in out, out
        assert ("reference model (DPO, frozen)" in out) == (name == "dpo"), out
        assert "(TRL's " in out  # the TRL fields set, reported with how jtrainer treats them
