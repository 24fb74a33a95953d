"""Checkpoints and exports for the Trainer: when and what to save, resume, best model, HF-format export.

The storage itself (atomic commit, manifest, orbax, rotation) lives in `jtrainer.checkpointing.checkpoint`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers.trainer_callback import ExportableState, TrainerControl, TrainerState
from transformers.trainer_utils import SaveStrategy

from jtrainer.checkpointing import checkpoint, hf_checkpoint
from jtrainer.core import host_rng, storage
from jtrainer.core.state import Frozen, LoopState, TrainState, split_params
from jtrainer.numerics import optim
from jtrainer.parallel import sharding
from jtrainer.trainer.trainer_parts import TrainerParts


class Resumed(NamedTuple):
    """What a resume restores for the loop: the train state and where, and how, the loop goes on."""

    train_state: TrainState
    epochs_trained: int  # whole epochs already done
    skip: int  # micro-batches of the resumed epoch already trained
    loop_state: LoopState | None  # the host side of the saved step (collator generator, padded length)


logger = logging.getLogger(__name__)
hf_logger = logging.getLogger("transformers.trainer")  # HF's own messages, through transformers' logger


@jax.jit
def _all_finite(leaves) -> jax.Array:
    """Whether every array is free of NaN and Inf (one program per parameter layout, not one per save)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def params_finite(model) -> bool:
    """Whether a model's parameters are free of NaN and Inf."""
    return bool(_all_finite(jax.tree.leaves(nnx.state(model, nnx.Param))))


def _stateful_callbacks(state: TrainerState) -> dict[str, Any]:
    """HF's TrainerState.stateful_callbacks: a dict of each class's saved state (HF annotates it as a list of
    callbacks, which its __post_init__ turns into this dict)."""
    if state.stateful_callbacks is None:
        state.stateful_callbacks = {}  # type: ignore[assignment]  # HF's own post-init value
    return state.stateful_callbacks  # type: ignore[return-value]


def _state_params_finite(train_state: TrainState | None) -> bool:
    """Whether a train state's parameters are free of NaN and Inf (no state yet: nothing to check)."""
    return train_state is None or bool(_all_finite(jax.tree.leaves(train_state.params)))


def _loop_state_json(process_rng: host_rng.HostRngState, loop_state: LoopState | None) -> dict[str, Any]:
    """One process's loop state as its checkpoint file keeps it (HF's rng_state_{i}): its host generators, the
    collator's stream (now and after the next batch) and the padded length."""

    def as_json(rng_state):
        return None if rng_state is None else rng_state.to_json()

    return {
        "process_rng": process_rng.to_json(),
        "collator_rng": None if loop_state is None else as_json(loop_state.collator_rng),
        "padded_length": None if loop_state is None else loop_state.padded_length,
        "collator_rng_after_next": None if loop_state is None else as_json(loop_state.collator_rng_after_next),
    }


class SavingMixin(TrainerParts):
    """The Trainer's checkpoint, resume and save_model methods (they use the Trainer's state and arguments)."""

    def _get_output_dir(self, trial) -> str:
        if trial is not None and self.hp_search_backend is not None:
            name = self.hp_name(trial) if self.hp_name is not None else f"run-{getattr(trial, 'number', trial)}"
            return storage.join(self.args.output_dir, name)
        return self.args.output_dir

    def _determine_best_metric(self, metrics: dict[str, float]) -> bool:
        name = self.args.metric_for_best_model
        if name is None:
            return False
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(
                f"The `metric_for_best_model` training argument is set to '{key}', which is not found in the "
                f"evaluation metrics. The available evaluation metrics are: {list(metrics.keys())}. Consider "
                "changing the `metric_for_best_model` via the TrainingArguments."
            )
        value = metrics[key]
        better = np.greater if self.args.greater_is_better else np.less
        if self.state.best_metric is None:
            self.state.best_metric = float("-inf") if self.args.greater_is_better else float("inf")
        if better(value, self.state.best_metric):
            self.state.best_metric = value
            if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
                self.state.best_global_step = self.state.global_step
            return True
        return False

    def _commit_pending_checkpoint(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint being written in the background is committed (and rotated), then deliver
        its on_save."""
        if self._pending_checkpoint is not None:
            try:
                self._pending_checkpoint.commit(timeout)  # kept pending until it succeeds (Ctrl-C may interrupt it)
            except checkpoint.CheckpointWriteError:
                self._pending_checkpoint = self._on_save_state = None  # it failed for good: nothing to retry
                raise
            self._pending_checkpoint = None
        self._deliver_on_save()

    def _announce_save(self) -> None:
        """HF's on_save ("after a checkpoint save"), once the checkpoint is committed: at once when it was
        committed in the step (async_checkpointing=False, HF's event order), else at the first step boundary
        after its background commit, with the TrainerState as it was at the save; the last save of a run (training
        stops at this step) is committed at once, in HF's order."""
        self._on_save_state = copy.deepcopy(self.state)
        # The save asked for is done (HF's on_save clears the flag; here it may come later): a later check in
        # the same step, such as the epoch's end, must not write the same checkpoint again.
        self.control.should_save = False
        if self._pending_checkpoint is None:
            self._deliver_on_save()
        elif self.control.should_training_stop:  # the last save: nothing trains meanwhile, so keep HF's order
            self._commit_pending_checkpoint()

    def _deliver_on_save(self) -> None:
        saved_state, self._on_save_state = self._on_save_state, None
        if saved_state is not None:
            state = self.state if saved_state.global_step == self.state.global_step else saved_state
            self.control = self.callback_handler.on_save(self.args, state, self.control)

    def _poll_pending_checkpoint(self) -> None:
        """At a step boundary: a background commit that has finished delivers its on_save (or its error)."""
        if self._pending_checkpoint is not None and self._pending_checkpoint.done:
            self._commit_pending_checkpoint()

    def _finish_checkpoint_after_error(self, timeout: float = 600.0) -> None:
        """On an exception, Ctrl-C or a failed step: commit the checkpoint in flight (bounded wait) so a
        finished write is never lost; the error then goes on (its on_save is not delivered)."""
        pending, self._pending_checkpoint, self._on_save_state = self._pending_checkpoint, None, None
        if pending is not None:
            try:
                pending.commit(timeout)
            except Exception as error:
                logger.error("Could not commit %s after the error: %s", pending.folder, error)

    def _save_checkpoint(self, trial) -> None:
        self._commit_pending_checkpoint()
        run_dir = self._get_output_dir(trial)
        folder = checkpoint.checkpoint_folder(run_dir, self.state.global_step)
        self.store_flos()
        state = self._train_state  # the loop's, as of this step (read once: what this save writes)
        if not _state_params_finite(state):
            logger.error(
                "Parameters are not finite at step %d: not writing %s (earlier checkpoints are kept).",
                self.state.global_step,
                folder,
            )
            return
        # The HF export of our models is read back from the train state just written, inside the commit (off the
        # step's path, on process 0 alone); otherwise gathered now (on many hosts a collective: every process).
        in_commit = self._export_in_commit(state)
        if in_commit:
            self._sync_model()  # callbacks' `model` holds the saved parameters, as with the export gathered here
        tensors = None if in_commit else self._hf_tensors()
        if self.state.best_global_step:
            best = checkpoint.checkpoint_folder(run_dir, self.state.best_global_step)
            if best == folder or storage.exists(best):  # saves are committed in order: an earlier one exists
                self.state.best_model_checkpoint = best
        self._record_callback_states()
        per_evaluation = self._per_evaluation_scheduler()
        scheduler_state = None if per_evaluation is None else per_evaluation.state_dict()  # as of this step
        if self._translated_optimizer is not None:  # a user's torch objects: kept whole, below
            scheduler_state = None
        optimizer_bytes = None if self._translated_optimizer is None else self._translated_optimizer.state_bytes()
        process_rng = host_rng.capture()
        loop_state = self._run.saved_loop_state() if self._run is not None else None

        def write_files(tmp: str) -> None:
            self._write_model(tmp, tensors, weights=not in_commit)
            self.state.save_to_json(os.path.join(tmp, checkpoint.TRAINER_STATE_NAME))
            if scheduler_state is not None:
                with open(os.path.join(tmp, checkpoint.SCHEDULER_NAME), "w") as f:
                    json.dump(scheduler_state, f)
            if optimizer_bytes is not None:
                with open(os.path.join(tmp, checkpoint.TRANSLATED_OPTIMIZER_NAME), "wb") as f:
                    f.write(optimizer_bytes)

        def write_process_files(tmp: str) -> None:  # on every process: its own host generators (HF's rng_state_{i})
            checkpoint.save_loop_state(tmp, self.args.process_index, _loop_state_json(process_rng, loop_state))

        def on_commit() -> None:
            if self.args.should_save:
                checkpoint.rotate_checkpoints(
                    run_dir, self.args.save_total_limit, best_model_checkpoint=self.state.best_model_checkpoint
                )
            if self.args.push_to_hub:
                self._push_from_checkpoint(folder)

        def export_weights(written: str, local: str) -> None:
            from jtrainer.models import hf_io

            params = checkpoint.read_params(written)
            hf_io.write_weights(hf_io.hf_tensors_from_params(self.model, params), local)

        train_state = None if self.args.save_only_model else self._saved_part(state)
        hf_logger.info(f"Saving model checkpoint to {folder}")
        self._pending_checkpoint = checkpoint.save_checkpoint(
            folder,
            train_state,
            write_files,
            self.args.should_save,
            self.state.global_step,
            asynchronous=self.args.async_checkpointing,
            on_commit=on_commit,
            finish_files=export_weights if in_commit else None,
            write_process_files=write_process_files,
        )

    def _record_callback_states(self) -> None:
        """HF's TrainerState.stateful_callbacks as of this save: each ExportableState callback's (and the
        control's) state, a list for a class with several instances."""
        saved = _stateful_callbacks(self.state)
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(saved.get(name), list):
                saved[name].append(cb_state)
            else:
                saved[name] = cb_state

    def _export_in_commit(self, train_state: TrainState | None) -> bool:
        """Whether a checkpoint's HF weights can come from its saved train state: one of our models (an HF
        config and nnx parameters), the train state saved, and the model holding the trained parameters
        (not a schedule-free optimizer's evaluation ones)."""
        return (
            train_state is not None
            and not self.args.save_only_model
            and self._held.exports_from_train_state()
            and not self._optimizer_eval_mode
        )

    def _resume(self, folder: str, like: TrainState, updates_per_epoch: int, fresh=None) -> Resumed:
        """Restore `folder` into the state laid out like `like` (abstract or concrete; `fresh()` builds a real
        fresh state where part of the state must start afresh) and the loop's bookkeeping."""
        hf_rng_state = None
        if hf_checkpoint.written_by_hf_trainer(folder):
            train_state, hf_rng_state = self._restore_hf_checkpoint(folder, fresh)
        elif not storage.isdir(storage.join(folder, checkpoint.TRAIN_STATE_DIR)):
            raise ValueError(
                f"Can't find a valid checkpoint at {folder}: it has no train state (saved with save_only_model?)."
            )
        else:
            train_state = self._restore_train_state(folder, like, fresh)
        self.state = load_trainer_state(folder)
        if self.state.best_model_checkpoint is not None and not storage.isdir(self.state.best_model_checkpoint):
            logger.warning(
                f"The best checkpoint {self.state.best_model_checkpoint} recorded in the resumed state does not "
                "exist anymore. Ignoring it for this run."
            )
            self.state.best_model_checkpoint = None
        self._warn_changed_args(folder)
        scheduler_file = storage.join(folder, checkpoint.SCHEDULER_NAME)
        per_evaluation = self._per_evaluation_scheduler()
        optimizer_file = storage.join(folder, checkpoint.TRANSLATED_OPTIMIZER_NAME)
        if self._translated_optimizer is not None and storage.isfile(optimizer_file):
            with storage.open_file(optimizer_file, "rb") as f:
                self._translated_optimizer.load_state_bytes(f.read())
        elif per_evaluation is not None and storage.isfile(scheduler_file):
            per_evaluation.load_state_dict(json.loads(storage.read_text(scheduler_file)))
        if self.args.restore_callback_states_from_checkpoint:
            self._load_callback_state()
        loop_state = self._restore_loop_state(folder, hf_rng_state)
        epochs_trained = self.state.global_step // updates_per_epoch
        skip = 0
        if not self.args.ignore_data_skip:
            skip = (self.state.global_step % updates_per_epoch) * self.args.gradient_accumulation_steps
        return Resumed(train_state, epochs_trained, skip, loop_state)

    def _saved_part(self, state: TrainState | None) -> TrainState | None:
        """What a checkpoint keeps of a train state: all of it, but a peft model's frozen base model, which the
        model given holds (transformers.Trainer's peft checkpoints hold the adapters only, too)."""
        if state is None or not self._held.saves_trainable_part_only:
            return state
        _, kept = nnx.split_state(state.model_state, Frozen, ...)
        return state.replace(model_state=kept)

    def _restore_train_state(self, folder: str, like: TrainState, fresh=None) -> TrainState:
        """checkpoint.restore_train_state of `_saved_part`; a peft model's frozen base comes back from `like`
        (concrete) or from the model, placed on `like`'s shardings (abstract)."""
        saved_fresh = None if fresh is None else (lambda: self._saved_part(fresh()))
        restored = checkpoint.restore_train_state(folder, self._saved_part(like), saved_fresh)
        if not self._held.saves_trainable_part_only:
            return restored
        frozen, _ = nnx.split_state(like.model_state, Frozen, ...)
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(frozen)):
            _, _, rest = split_params(self.nnx_model)
            held, _ = nnx.split_state(rest, Frozen, ...)
            placed = sharding.place(held, jax.tree.map(lambda leaf: leaf.sharding, frozen))
            frozen = jax.tree.map(lambda value, leaf: value.astype(leaf.dtype), placed, frozen)
        return restored.replace(model_state=nnx.merge_state(frozen, restored.model_state))

    def _restore_hf_checkpoint(self, folder: str, fresh) -> tuple[TrainState, Any]:
        """A transformers.Trainer checkpoint: its weights, AdamW state and schedule step (hf_checkpoint), and
        the host generators it saved."""
        name = optim.check_optimizer_name(self.args.optim)
        if name not in hf_checkpoint.ADAMW_NAMES:
            raise hf_checkpoint.HFCheckpointError(
                f"resume_from_checkpoint={folder} (a transformers.Trainer checkpoint) with optim={name}: jtrainer "
                "resumes torch's AdamW state only; use optim='adamw_torch' (HF's default), as the checkpoint was "
                "trained."
            )
        if self._optimizer_recipe is None:
            raise hf_checkpoint.HFCheckpointError(
                f"resume_from_checkpoint={folder} (a transformers.Trainer checkpoint) needs the Trainer's own "
                "optimizer and HF's lr_scheduler_type schedule (not optimizers=, optimizer_cls_and_kwargs or a "
                "per-evaluation scheduler): torch's saved state is theirs."
            )
        params = nnx.to_pure_dict(nnx.state(self.nnx_model, nnx.Param))
        saved_state = load_trainer_state(folder)
        layout = self._held.checkpoint_layout()
        return hf_checkpoint.restore(
            folder,
            args=self.args,
            layout=layout,
            mesh=self.mesh,
            rules=self.axis_rules,
            decay_mask=self._decay_mask_tree(params),
            fresh=fresh,
            max_steps_saved=saved_state.max_steps,
        )

    def _restore_loop_state(self, folder: str, hf_rng_state=None) -> LoopState | None:
        """HF's _load_rng_state: the host generators as at the save; returns how the loop padded and drew."""
        if hf_rng_state is not None:  # HF's own collator draws from the restored generators
            host_rng.restore(hf_rng_state)
            return LoopState(hf_rng_state, None)
        saved = checkpoint.load_loop_state(folder, self.args.process_index)
        if saved is None:
            logger.info("%s has no loop state: a random collator will not draw as the saved run did.", folder)
            return None
        host_rng.restore(host_rng.HostRngState.from_json(saved["process_rng"]))
        collator, after_next = saved.get("collator_rng"), saved.get("collator_rng_after_next")
        return LoopState(
            None if collator is None else host_rng.HostRngState.from_json(collator),
            saved.get("padded_length"),
            None if after_next is None else host_rng.HostRngState.from_json(after_next),
        )

    def _warn_changed_args(self, folder: str) -> None:
        """HF's compare_trainer_and_checkpoint_args: warn when batch-shaping arguments changed."""
        for name in ("logging_steps", "eval_steps", "save_steps"):
            saved, now = getattr(self.state, name, None), getattr(self.args, name)
            if saved is not None and now is not None and saved != now and now >= 1:
                logger.warning(
                    f"You are resuming training from a checkpoint trained with {name}={saved} but your current "
                    f"args have {name}={now}. Using {now}."
                )
        if self.state.train_batch_size is not None:
            now = self.get_train_dataloader().batch_size // self.args.world_size
            if now != self.state.train_batch_size:
                logger.warning(
                    f"You are resuming training from a checkpoint trained with a batch size of "
                    f"{self.state.train_batch_size}, but your current batch size is {now}. Using {now}."
                )

    def _load_callback_state(self) -> None:
        """HF's restore_callback_states_from_checkpoint: each saved entry rebuilds one callback of its class (the
        n-th saved state goes to the n-th instance), from its saved args, with its saved attributes; the rebuilt
        ones replace the originals at the end of the list, as HF re-adds them; saved classes the Trainer does not
        hold are named in HF's warning."""
        present = self.callback_handler.callbacks + [self.control]
        rebuilt, not_found = [], []
        for name, entries in _stateful_callbacks(self.state).items():
            instances = [cb for cb in present if type(cb).__name__ == name]
            if not instances:
                not_found.append(name)
                continue
            for instance, entry in zip(instances, entries if isinstance(entries, list) else [entries]):
                restored = type(instance)(**entry.get("args", {}))
                for key, value in entry.get("attributes", {}).items():
                    setattr(restored, key, value)
                if isinstance(instance, TrainerControl):
                    self.control = restored
                else:
                    rebuilt.append(restored)
                self.callback_handler.remove_callback(type(restored))
            hf_logger.info("Continuing training from checkpoint, restoring any callbacks that were passed in")
        if not_found:
            hf_logger.warning(
                "Checkpoint included callbacks not included in current configuration. Ignoring. "
                f"({', '.join(not_found)})"
            )
        for callback in rebuilt:
            self.callback_handler.add_callback(callback)

    def _best_train_state(self, train_state: TrainState | None) -> TrainState | None:
        """load_best_model_at_end: the best checkpoint's train state, laid out like `train_state` (None where the
        checkpoint holds only the model's weights, which are loaded into the model here)."""
        best = self.state.best_model_checkpoint
        assert best is not None, "load_best_model_at_end found a best checkpoint"
        hf_logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        if train_state is not None and storage.isdir(storage.join(best, checkpoint.TRAIN_STATE_DIR)):
            return self._restore_train_state(best, train_state)
        from jtrainer.models import hf_io

        with storage.local_folder(best) as local:
            hf_io.load_weights(self.model, local)
        return None

    def _hf_tensors(self) -> dict[str, np.ndarray] | None:
        """The model's weights as HF-named host arrays (gathered from every process), if the model is ours. Only
        the process that writes keeps them (the others take part in the gathers and drop each tensor)."""
        self._sync_model()
        return self._held.hf_tensors(keep=self.args.should_save)

    def _write_model(self, output_dir: str, tensors, weights: bool = True) -> None:
        """The HF folder: config and weights (`weights=False`: the config only, its weights come later),
        tokenizer and training arguments."""
        from jtrainer.models import hf_io

        os.makedirs(output_dir, exist_ok=True)
        if not weights:
            self.model.config.save_pretrained(output_dir)
            hf_io.write_generation_config(self.model, output_dir)
        elif tensors is None:  # the model writes itself (a bridged torch model: as transformers.Trainer does)
            self.nnx_model.save_pretrained(output_dir)
        elif hasattr(self.model, "config"):
            hf_io.write_hf_folder(self.model.config, tensors, output_dir)
            hf_io.write_generation_config(self.model, output_dir)
        else:
            from safetensors.numpy import save_file

            save_file(tensors, os.path.join(output_dir, hf_io.WEIGHTS_NAME), metadata={"format": "pt"})
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(output_dir)
        with open(os.path.join(output_dir, checkpoint.TRAINING_ARGS_NAME), "w") as f:
            f.write(self.args.to_json_string())

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model in HF format (config.json + safetensors) and the tokenizer, as PyTorch transformers loads it."""
        tensors = self._hf_tensors()
        if self.args.should_save:
            hf_logger.info(f"Saving model checkpoint to {output_dir or self.args.output_dir}")
            with storage.staged_folder(output_dir or self.args.output_dir) as local:
                self._write_model(local, tensors)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def save_state(self) -> None:
        if self.args.should_save:
            storage.makedirs(self.args.output_dir)
            storage.write_text(
                storage.join(self.args.output_dir, checkpoint.TRAINER_STATE_NAME), trainer_state_json(self.state)
            )


def trainer_state_json(state: TrainerState) -> str:
    """HF's TrainerState.save_to_json text (so it can go to any storage)."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def load_trainer_state(folder: str) -> TrainerState:
    """HF's TrainerState.load_from_json, from a checkpoint folder on any storage."""
    return TrainerState(**json.loads(storage.read_text(storage.join(folder, checkpoint.TRAINER_STATE_NAME))))
