"""push_to_hub / hub_strategy / create_model_card, up to the folder that would be uploaded (no hub here)."""

import concurrent.futures
import os
import types

import pytest
from conftest import tiny_llama_config, token_rows
from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects

from jtrainer import Trainer, TrainingArguments
from jtrainer.models.llama import LlamaForCausalLM


@pytest.fixture
def uploads(monkeypatch):
    """HfApi's network calls replaced: each upload records the files huggingface_hub would send."""
    sent = []

    def create_repo(self, repo_id, **kwargs):
        return types.SimpleNamespace(repo_id=f"user/{repo_id}")

    def upload_folder(
        self,
        *,
        repo_id,
        folder_path,
        path_in_repo=None,
        ignore_patterns=None,
        run_as_future=False,
        commit_message=None,
        **kwargs,
    ):
        files = [
            os.path.relpath(os.path.join(root, f), folder_path)
            for root, _, names in os.walk(folder_path)
            for f in names
        ]
        kept = sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns))
        sent.append({"repo": repo_id, "in_repo": path_in_repo, "files": kept, "message": commit_message})
        if run_as_future:
            future = concurrent.futures.Future()
            future.set_result(None)
            return future
        return None

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return sent


def _trainer(out, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        push_to_hub=True,
        hub_model_id="tiny-llama",
        async_checkpointing=False,
    )
    kw.update(over)
    return Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config()), TrainingArguments(**kw), train_dataset=token_rows(16)
    )


def test_hub_strategy_checkpoint_then_push_to_hub(tmp_path, uploads):
    trainer = _trainer(tmp_path, hub_strategy="checkpoint")
    assert trainer.hub_model_id == "user/tiny-llama"
    trainer.train()
    # Each committed save: output_dir (model files, no checkpoint folders) and the checkpoint as last-checkpoint/.
    outputs = [u for u in uploads if u["in_repo"] is None]
    checkpoints = [u for u in uploads if u["in_repo"] == "last-checkpoint"]
    assert [u["message"] for u in outputs] == ["Training in progress, step 2", "Training in progress, step 4"]
    assert {"config.json", "model.safetensors", "training_args.json"} <= set(outputs[-1]["files"])
    assert not any(f.startswith("checkpoint-") for f in outputs[-1]["files"])
    assert {"trainer_state.json", "model.safetensors", "manifest.json"} <= set(checkpoints[-1]["files"])

    uploads.clear()
    trainer.push_to_hub(language="en", license="apache-2.0")
    (final,) = uploads
    assert final["message"] == "End of training" and "README.md" in final["files"]
    card = open(tmp_path / "README.md").read()
    assert "license: apache-2.0" in card and "jtrainer" in card and "learning_rate: 0.001" in card


def test_hub_strategy_end_pushes_only_on_request(tmp_path, uploads):
    trainer = _trainer(tmp_path, hub_strategy="end")
    trainer.train()
    assert uploads == []
    trainer.save_model()  # with push_to_hub, save_model pushes ("Model save"), as HF
    assert [u["message"] for u in uploads] == ["Model save"]


def test_all_checkpoints_keep_their_names(tmp_path, uploads):
    _trainer(tmp_path, hub_strategy="all_checkpoints").train()
    assert [u["in_repo"] for u in uploads if u["in_repo"]] == ["checkpoint-2", "checkpoint-4"]
