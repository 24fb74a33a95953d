"""The state the Trainer's parts share, declared in one place.

`jtrainer.Trainer` is one class assembled from parts, each a module: the constructor and the loop
(`trainer`), the optimizer and its schedule (`optimizer_setup`), evaluation and prediction (`evaluation`),
checkpoints, resume and export (`saving`), hyperparameter search (`hpsearch`), the Hub (`hub`) and the metrics
files (`metrics_io`). Every part derives from `TrainerParts`, which declares each attribute an instance holds,
with its default where it has one. `OWNER` names the one part that assigns each attribute; the others only read
it, except the few in `SHARED` (HF's own pattern: every part hands `control` to the callbacks and takes it back).
`tests/test_trainer_parts.py` checks both against the code.
"""

from __future__ import annotations

from typing import Any

OWNER: dict[str, str] = {
    **dict.fromkeys(
        (
            "args",
            "model",
            "_model",
            "nnx_model",
            "model_init",
            "data_collator",
            "train_dataset",
            "eval_dataset",
            "processing_class",
            "compute_loss_func",
            "compute_metrics",
            "preprocess_logits_for_metrics",
            "optimizer_cls_and_kwargs",
            "label_names",
            "model_accepts_loss_kwargs",
            "label_smoother",
            "loss_is_scaled_for_ga",
            "mesh",
            "axis_rules",
            "neftune_noise_alpha",
            "callback_handler",
            "control",
            "current_flos",
            "_param_specs",
            "_train_state",
            "_torch_holds",
            "_run",
        ),
        "trainer",
    ),
    **dict.fromkeys(
        (
            "optimizer",
            "lr_scheduler",
            "_learning_rate",
            "_optimizer_recipe",
            "_optimizer_eval_mode",
            "_non_embedding_count",
        ),
        "optimizer_setup",
    ),
    "_preprocess_placement": "evaluation",
    **dict.fromkeys(("state", "_pending_checkpoint", "_on_save_state"), "saving"),
    **dict.fromkeys(
        ("hp_search_backend", "hp_name", "hp_space", "compute_objective", "objective", "_trial"), "hpsearch"
    ),
    **dict.fromkeys(("hub_model_id", "_push_jobs"), "hub"),
}

# Attributes more than one part assigns, and why.
SHARED: dict[str, tuple[str, ...]] = {
    # Each callback event returns the control the next step obeys (HF: self.control = callback_handler.on_...).
    "control": ("trainer", "evaluation", "saving"),
    # The loop builds the train state; loading the best model at the end restores one (HF: load_state_dict); a
    # per-evaluation scheduler (reduce_lr_on_plateau) sets the rate in it.
    "_train_state": ("trainer", "saving", "optimizer_setup"),
    # The constructor takes HF's optimizers=(optimizer, lr_scheduler); create_optimizer builds them otherwise.
    "optimizer": ("trainer", "optimizer_setup"),
    "lr_scheduler": ("trainer", "optimizer_setup"),
    # The constructor builds HF's TrainerState; a resume replaces it with the checkpoint's.
    "state": ("trainer", "saving"),
}


class TrainerParts:
    """What every part of the Trainer may read (see the module's docstring for who writes what)."""

    # trainer: the constructor's arguments, as HF names them, and what it derives from them
    args: Any  # TrainingArguments
    model: Any  # the user's model: a flax.nnx module or a torch one (HF's `trainer.model`)
    _model: Any  # what `model` (a property of the Trainer) holds
    nnx_model: Any  # the nnx module the steps run: `model`, or the bridge's TorchModel of a torch model
    model_init: Any
    data_collator: Any
    train_dataset: Any
    eval_dataset: Any
    processing_class: Any
    compute_loss_func: Any
    compute_metrics: Any
    preprocess_logits_for_metrics: Any
    optimizer_cls_and_kwargs: Any
    label_names: list[str]
    model_accepts_loss_kwargs: bool
    label_smoother: Any
    loss_is_scaled_for_ga: bool | None
    mesh: Any  # jax.sharding.Mesh
    axis_rules: dict[str, Any]
    neftune_noise_alpha: float | None
    callback_handler: Any
    control: Any  # HF's TrainerControl
    current_flos: float
    # trainer: what outlives one train() loop, and the loop itself
    _param_specs: Any
    _train_state: Any = None  # jtrainer.state.TrainState
    _torch_holds: Any = None  # a torch model's weights came from this (train state, optimizer eval mode)
    _run: Any = None  # jtrainer.training_run.TrainingRun: the last loop's state (log accumulators, last step, ...)
    # optimizer_setup
    optimizer: Any = None
    lr_scheduler: Any = None
    _learning_rate: Any = None  # jtrainer.schedules.LearningRate: the schedule the Trainer built, in all its forms
    _optimizer_recipe: tuple | None = None  # what the built optimizer depends on besides numbers
    _optimizer_eval_mode: bool = False  # HF's optimizer.eval() (schedule-free optimizers) until the next step
    _non_embedding_count: Any = None
    # evaluation
    _preprocess_placement: Any = None
    # saving
    state: Any  # HF's TrainerState
    _pending_checkpoint: Any = None  # the checkpoint being written in the background
    _on_save_state: Any = None  # a save whose on_save waits for its commit
    # hpsearch
    hp_search_backend: Any = None
    hp_name: Any = None
    hp_space: Any = None
    compute_objective: Any = None
    objective: float | None = None
    _trial: Any = None
    # hub
    hub_model_id: str | None = None  # set by init_hf_repo()
    _push_jobs: tuple | list = ()  # uploads in flight (hub_strategy checkpoints)
