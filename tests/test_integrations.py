"""report_to: TensorBoard event files, wandb offline runs and an MLflow file store get HF's metric names."""

import glob
import os
import time

import pytest
from conftest import tiny_llama_config, token_rows

from jtrainer import Trainer, TrainingArguments
from jtrainer.models.llama import LlamaForCausalLM


def _train(out, report_to, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=report_to,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        max_steps=3,
        eval_strategy="steps",
        eval_steps=3,
    )
    kw.update(over)
    trainer = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config()),
        TrainingArguments(**kw),
        train_dataset=token_rows(12),
        eval_dataset=token_rows(4, seed=1),
    )
    trainer.train()
    return trainer


def test_report_to_all_and_none():
    from transformers.integrations import get_available_reporting_integrations

    assert TrainingArguments("o", report_to="none").report_to == []
    assert TrainingArguments("o", report_to="all").report_to == get_available_reporting_integrations()
    with pytest.raises(ValueError, match="is not supported"):
        Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), TrainingArguments("o", report_to="nosuch"))


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    trainer = _train(tmp_path, "tensorboard")
    (events,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    reader = EventAccumulator(events)
    reader.Reload()
    tags = reader.Tags()["scalars"]
    for tag in ("train/loss", "train/grad_norm", "train/learning_rate", "eval/loss", "train/train_loss"):
        assert tag in tags
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert [e.step for e in reader.Scalars("train/loss")] == [1, 2, 3]
    assert [e.value for e in reader.Scalars("train/loss")] == pytest.approx(logged, rel=1e-6)
    assert "args/text_summary" in reader.Tags()["tensors"]


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "jtrainer-test")
    trainer = _train(tmp_path, "wandb", run_name="tiny")
    import wandb

    summary = dict(wandb.run.summary)  # HF's callback leaves the run open, as HF does
    wandb.finish()
    assert summary["train/loss"] == pytest.approx(trainer.state.log_history[2]["loss"], rel=1e-6)
    assert {"train/grad_norm", "train/learning_rate", "eval/loss", "train/global_step"} <= set(summary)
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    (log,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    # The offline log, for `wandb sync`: protobuf records with the metric names. wandb's service process writes
    # it; under load the records can land a moment after finish() returns.
    deadline = time.time() + 60
    while b"eval/loss" not in open(log, "rb").read() and time.time() < deadline:
        time.sleep(0.5)
    records = open(log, "rb").read()
    assert b"train/loss" in records and b"eval/loss" in records


def test_mlflow_local_file_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "jtrainer-test")
    trainer = _train(tmp_path, "mlflow")
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("jtrainer-test").experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == pytest.approx(logged, rel=1e-6)
    assert "eval_loss" in run.data.metrics and run.data.params["learning_rate"] == "0.001"
