"""The Hub side of the Trainer: HF's create_model_card, push_to_hub and hub_strategy, through huggingface_hub.

What is uploaded is HF's: `output_dir` (model in safetensors + config.json, tokenizer, training_args.json,
README.md model card), without `checkpoint-*` folders; with hub_strategy "checkpoint" / "all_checkpoints" also the
latest checkpoint as `last-checkpoint/` or every checkpoint under its own name. Checkpoints are pushed once they
are committed (an asynchronous checkpoint commits at the next save or at the end of training).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from transformers.modelcard import TrainingSummary
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy

from jtrainer.checkpointing import checkpoint
from jtrainer.checkpointing.run_lock import LOCK_NAME
from jtrainer.trainer.trainer_parts import TrainerParts

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def _api():
    from huggingface_hub import HfApi

    return HfApi()


def model_files(folder: str) -> list[str]:
    """The model's files in a checkpoint folder: config, weights and, when sharded, the index and its shards."""
    names = [n for n in MODEL_FILES if os.path.isfile(os.path.join(folder, n))]
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        import json

        with open(index) as f:
            names += sorted(set(json.load(f)["weight_map"].values()))
    return names


class HubMixin(TrainerParts):
    """HF's `init_hf_repo`, `create_model_card`, `push_to_hub` and checkpoint pushes for the Trainer."""

    hub_model_id: str | None = None

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        if not self.is_world_process_zero():
            return
        name = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        token = token if token is not None else self.args.hub_token
        private = private if private is not None else self.args.hub_private_repo
        self.hub_model_id = _api().create_repo(name, token=token, private=private, exist_ok=True).repo_id
        self._push_jobs = []

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """HF's model card (README.md in output_dir): hyperparameters, training results table, framework versions."""
        if not self.is_world_process_zero():
            return
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        if "jtrainer" not in tags:
            tags.append("jtrainer")
        summary = TrainingSummary.from_trainer(
            self,
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            finetuned_from=finetuned_from,
            tasks=tasks,
            dataset_tags=dataset_tags,
            dataset=dataset,
            dataset_args=dataset_args,
        )
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "README.md"), "w", encoding="utf-8") as f:
            f.write(summary.to_model_card())

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs,
    ):
        """Save the model, write the model card and upload `output_dir` to `args.hub_model_id`."""
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        model_name = kwargs.pop("model_name", None)
        if model_name is None and self.args.should_save:
            model_name = (self.args.hub_model_id or Path(self.args.output_dir).name).split("/")[-1]
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        self.create_model_card(model_name=model_name, **kwargs)
        self._finish_current_push()
        return _api().upload_folder(
            repo_id=self.hub_model_id,
            folder_path=self.args.output_dir,
            commit_message=commit_message,
            token=token,
            run_as_future=not blocking,
            ignore_patterns=["_*", f"{PREFIX_CHECKPOINT_DIR}-*", f"{LOCK_NAME}*"],
            revision=revision if revision is not None else self.args.hub_revision,
        )

    def _push_from_checkpoint(self, folder: str) -> None:
        """After a checkpoint commits (hub_strategy every_save / checkpoint / all_checkpoints): the model files
        into output_dir, then output_dir (and the checkpoint, per hub_strategy) uploaded in the background."""
        args = self.args
        if not self.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
            return
        self.callback_handler.on_push_begin(args, self.state, self.control)
        for name in model_files(folder):
            shutil.copy(os.path.join(folder, name), os.path.join(args.output_dir, name))
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, checkpoint.TRAINING_ARGS_NAME), "w") as f:
            f.write(args.to_json_string())
        if args.save_strategy == SaveStrategy.STEPS:
            message = f"Training in progress, step {self.state.global_step}"
        else:
            message = f"Training in progress, epoch {int(self.state.epoch)}"
        common = dict(repo_id=self.hub_model_id, token=args.hub_token, run_as_future=True, revision=args.hub_revision)
        jobs = [
            _api().upload_folder(
                folder_path=args.output_dir,
                commit_message=message,
                ignore_patterns=["_*", f"{PREFIX_CHECKPOINT_DIR}-*", f"{LOCK_NAME}*"],
                **common,
            )
        ]
        if args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            in_repo = "last-checkpoint" if args.hub_strategy == HubStrategy.CHECKPOINT else Path(folder).name
            jobs.append(
                _api().upload_folder(
                    folder_path=folder, path_in_repo=in_repo, commit_message=message + ", checkpoint", **common
                )
            )
        self._push_jobs = [*self._push_jobs, *jobs]

    def _finish_current_push(self) -> None:
        """Wait for the background uploads of checkpoints."""
        for job in self._push_jobs:
            if hasattr(job, "result"):
                job.result()
        self._push_jobs = []
