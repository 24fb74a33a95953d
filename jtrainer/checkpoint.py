"""`checkpoint-N/` folders: orbax train state + HF's JSON files + an HF-format model export.

Layout of `output_dir/checkpoint-{global_step}/`:
  train_state/          orbax: params, optimizer state, step, model state (omitted with save_only_model)
  config.json, model.safetensors   the model in HF format (what `from_pretrained` reads)
  trainer_state.json    HF's TrainerState
  training_args.json    the TrainingArguments (HF writes a torch pickle, training_args.bin, instead)

Orbax writes each state to a temporary folder and renames it when complete, so a reader never sees half a
state; older checkpoints are only rotated away after the new one exists.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

TRAIN_STATE_DIR = "train_state"
TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.json"

__all__ = [
    "PREFIX_CHECKPOINT_DIR",
    "TRAINER_STATE_NAME",
    "checkpoint_folder",
    "get_last_checkpoint",
    "restore_train_state",
    "rotate_checkpoints",
    "save_train_state",
]


def checkpoint_folder(run_dir: str, global_step: int) -> str:
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")


def save_train_state(directory: str, train_state) -> None:
    """Write the train state with orbax (every process writes its own shards) and wait for the commit."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(directory, TRAIN_STATE_DIR)), train_state, force=True)
    checkpointer.wait_until_finished()


def restore_train_state(directory: str, like):
    """Read a train state saved by `save_train_state`, placed like the abstract or concrete pytree `like`."""
    path = os.path.abspath(os.path.join(directory, TRAIN_STATE_DIR))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Can't find a valid checkpoint at {directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return ocp.StandardCheckpointer().restore(path, abstract)
