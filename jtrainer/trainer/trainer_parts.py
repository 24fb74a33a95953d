"""The state the Trainer's parts share, declared in one place.

`jtrainer.Trainer` is one class assembled from parts, each a module: the constructor and the loop
(`trainer`), the optimizer and its schedule (`optimizer_setup`), evaluation and prediction (`evaluation`),
checkpoints, resume and export (`saving`), hyperparameter search (`hpsearch`), the Hub (`hub`), the metrics
files (`metrics_io`) and Seq2SeqTrainer's generation (`seq2seq`). Every part derives from `TrainerParts`, which
declares each attribute an instance holds, with its default where it has one. `OWNER` names the one part that
assigns each attribute (in a method or a module-level function); the others only read it, except the few in
`SHARED` (HF's own pattern: every part hands `control` to the callbacks and takes it back). Every method one
part calls on another is declared here too (for type checkers, with its signature), and `CALLS` names the part
that defines it. `tests/test_trainer_parts.py` checks all three against the code; the type checker checks the
declarations against the definitions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from jax.sharding import Mesh
    from transformers import GenerationConfig

    from jtrainer.checkpointing import checkpoint
    from jtrainer.core.callbacks import CallbackHandler, TrainerControl, TrainerState
    from jtrainer.core.state import TrainState
    from jtrainer.kinds import user_code
    from jtrainer.kinds.protocol import TrainedModel
    from jtrainer.numerics import schedules
    from jtrainer.numerics.losses import LabelSmoother
    from jtrainer.numerics.step import LossSpec, PreprocessPlacement
    from jtrainer.trainer import data
    from jtrainer.trainer.args import TrainingArguments
    from jtrainer.trainer.saving import Resumed
    from jtrainer.trainer.training_run import TrainingRun

OWNER: dict[str, str] = {
    **dict.fromkeys(
        (
            "args",
            "model",
            "_held",
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
            "_run",
        ),
        "trainer",
    ),
    **dict.fromkeys(
        (
            "optimizer",
            "lr_scheduler",
            "_learning_rate",
            "_given_lr_scheduler",
            "_plateau_scheduler",
            "_optimizer_recipe",
            "_optimizer_eval_mode",
            "_translated_optimizer",
        ),
        "optimizer_setup",
    ),
    "_preprocess_placement": "evaluation",
    **dict.fromkeys(("state", "_pending_checkpoint", "_on_save_state"), "saving"),
    **dict.fromkeys(
        ("hp_search_backend", "hp_name", "hp_space", "compute_objective", "objective", "_trial"), "hpsearch"
    ),
    **dict.fromkeys(("hub_model_id", "_push_jobs"), "hub"),
    **dict.fromkeys(("generation_config", "_gen_kwargs"), "seq2seq"),
}

# Attributes more than one part assigns, and why.
SHARED: dict[str, tuple[str, ...]] = {
    # Each callback event returns the control the next step obeys (HF: self.control = callback_handler.on_...).
    "control": ("trainer", "evaluation", "saving"),
    # The constructor takes HF's optimizers=(optimizer, lr_scheduler); create_optimizer builds them otherwise
    # (`lr_scheduler` is a view: what is assigned is the user's scheduler).
    "optimizer": ("trainer", "optimizer_setup"),
    "lr_scheduler": ("trainer", "optimizer_setup"),
    # The constructor builds HF's TrainerState; a resume replaces it with the checkpoint's.
    "state": ("trainer", "saving"),
}


# Every method a part calls on another part -> the part that defines it (declared in TrainerParts below).
CALLS: dict[str, str] = {
    "_check_labels": "trainer",
    "_label_classes": "trainer",
    "_loss_spec": "trainer",
    "_mesh_context": "trainer",
    "_on_recorded": "trainer",
    "_evaluation_inputs": "trainer",
    "_model_params": "trainer",
    "_sync_model": "trainer",
    "_release_train_state": "trainer",
    "train": "trainer",
    "evaluate": "evaluation",
    "get_eval_dataloader": "trainer",
    "get_test_dataloader": "trainer",
    "get_train_dataloader": "trainer",
    "is_world_process_zero": "trainer",
    "log": "trainer",
    "num_examples": "trainer",
    "store_flos": "trainer",
    "_decay_mask_tree": "optimizer_setup",
    "_forget_optimizer": "optimizer_setup",
    "_host_learning_rate": "optimizer_setup",
    "_optimizer_eval": "optimizer_setup",
    "_optimizer_train": "optimizer_setup",
    "_per_evaluation_scheduler": "optimizer_setup",
    "_resumed_optimizer_state": "optimizer_setup",
    "_plateau_metric": "optimizer_setup",
    "_plateau_stepped": "optimizer_setup",
    "_optax_optimizer": "optimizer_setup",
    "_before_update": "optimizer_setup",
    "_after_update": "optimizer_setup",
    "create_optimizer_and_scheduler": "optimizer_setup",
    "floating_point_ops": "optimizer_setup",
    "_eval_step": "evaluation",
    "_evaluate_loss_only": "evaluation",
    "_generates": "evaluation",
    "_ignore_keys": "evaluation",
    "_announce_save": "saving",
    "_commit_pending_checkpoint": "saving",
    "_determine_best_metric": "saving",
    "_finish_checkpoint_after_error": "saving",
    "_get_output_dir": "saving",
    "_best_train_state": "saving",
    "_poll_pending_checkpoint": "saving",
    "_resume": "saving",
    "_save_checkpoint": "saving",
    "save_model": "saving",
    "_hp_search_setup": "hpsearch",
    "_report_to_hp_search": "hpsearch",
    "_push_from_checkpoint": "hub",
    "init_hf_repo": "hub",
    "push_to_hub": "hub",
    "_generate_batch": "seq2seq",
    "_prediction_labels": "seq2seq",
}


class TrainerParts:
    """What every part of the Trainer may read (see the module's docstring for who writes what)."""

    # trainer: the constructor's arguments, as HF names them, and what it derives from them
    args: TrainingArguments
    model: Any  # the user's model: a flax.nnx module or a torch one (HF's `trainer.model`)
    _held: TrainedModel  # the model, held once: `model` and `nnx_model` (properties of the Trainer) read it
    nnx_model: Any  # the nnx module the steps run: `model`, or the bridge's TorchModel of a torch model
    model_init: Callable[..., Any] | None
    data_collator: Any
    train_dataset: Any
    eval_dataset: Any
    processing_class: Any
    compute_loss_func: Callable[..., Any] | None
    compute_metrics: Callable[..., dict[str, Any]] | None
    preprocess_logits_for_metrics: Callable[..., Any] | None
    optimizer_cls_and_kwargs: tuple[Any, dict[str, Any]] | None  # (optax factory or torch class, kwargs)
    label_names: list[str]
    model_accepts_loss_kwargs: bool
    label_smoother: LabelSmoother | None
    loss_is_scaled_for_ga: bool | None
    mesh: Mesh
    axis_rules: dict[str, Any]
    neftune_noise_alpha: float | None
    callback_handler: CallbackHandler
    control: TrainerControl
    current_flos: float
    # trainer: what outlives one train() loop, and the loop itself
    _param_specs: Any  # the parameters' PartitionSpecs: a pytree shaped like the model's parameters
    _train_state: TrainState | None = None
    _run: TrainingRun | None = None  # the last loop's state (log accumulators, last step, ...)
    # optimizer_setup
    optimizer: Any = None
    lr_scheduler: Any  # HF's: a view of `_learning_rate`'s schedule, or the scheduler the user gave
    _given_lr_scheduler: Any = None  # optimizers=(..., scheduler), or HF's torch scheduler on a user's torch optimizer
    _learning_rate: schedules.LearningRate | None = None  # the schedule the Trainer built, in all its forms
    _plateau_scheduler: schedules.PlateauScheduler | schedules.GreedyScheduler | None = None  # per-evaluation
    _optimizer_recipe: tuple | None = None  # what the built optimizer depends on besides numbers
    _optimizer_eval_mode: bool = False  # HF's optimizer.eval() (schedule-free optimizers) until the next step
    _translated_optimizer: user_code.TranslatedOptimizer | None = None  # a user's torch optimizer, run as optax
    # evaluation
    _preprocess_placement: PreprocessPlacement | None = None
    # saving
    state: TrainerState
    _pending_checkpoint: checkpoint.PendingCheckpoint | None = None  # the checkpoint written in the background
    _on_save_state: TrainerState | None = None  # a save whose on_save waits for its commit
    # hpsearch
    hp_search_backend: Any = None  # HF's HPSearchBackend (or its name), as hyperparameter_search is given it
    hp_name: Callable[[Any], str] | None = None
    hp_space: Callable[[Any], dict[str, Any]] | None = None
    compute_objective: Callable[[dict[str, float]], float] | None = None
    objective: float | None = None
    _trial: Any = None
    # hub
    hub_model_id: str | None = None  # set by init_hf_repo()
    _push_jobs: tuple | list = ()  # uploads in flight (hub_strategy checkpoints)
    # seq2seq (Seq2SeqTrainer only)
    generation_config: GenerationConfig  # the model's, or Seq2SeqTrainingArguments.generation_config
    _gen_kwargs: dict[str, Any]  # this evaluate/predict call's generation keywords, over HF's defaults

    # The methods one part calls on another, declared for type checkers (the code is the owner's; `CALLS` names it
    # and tests/test_trainer_parts.py checks both). Bodies are `...`: they exist only while type checking.
    if TYPE_CHECKING:
        # trainer
        def _check_labels(self, batch: data.Batch, num_classes: int | None) -> None: ...

        def _label_classes(self, spec: LossSpec) -> int | None: ...

        def _loss_spec(self, sample: data.Batch, training: bool = True) -> LossSpec: ...

        def _mesh_context(self): ...

        def _on_recorded(self, recorded: dict[str, Any], micro_batches: int, training: bool) -> None: ...

        def _evaluation_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]: ...

        def _model_params(self): ...

        def _sync_model(self) -> None: ...

        def _release_train_state(self) -> None: ...

        def train(
            self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs
        ): ...
        def num_examples(self, dataloader: Any) -> int: ...

        def get_eval_dataloader(self, eval_dataset: Any = None) -> data.BatchLoader: ...

        def get_test_dataloader(self, test_dataset: Any) -> data.BatchLoader: ...

        def get_train_dataloader(self) -> data.BatchLoader: ...

        def is_world_process_zero(self) -> bool: ...

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...

        def store_flos(self) -> None: ...

        # optimizer_setup
        def _decay_mask_tree(self, params): ...

        def _forget_optimizer(self) -> None: ...

        def _host_learning_rate(self, device_lr, count) -> float: ...

        def _optimizer_eval(self) -> None: ...

        def _optimizer_train(self) -> None: ...

        def _per_evaluation_scheduler(self) -> schedules.PlateauScheduler | schedules.GreedyScheduler | None: ...

        def _resumed_optimizer_state(self, opt_state): ...

        def _plateau_metric(self, metrics: dict[str, float]) -> float: ...

        def _plateau_stepped(self, metric: float, train_state: TrainState) -> TrainState: ...

        def _optax_optimizer(self) -> Any: ...
        def _before_update(self, train_state: TrainState) -> TrainState: ...
        def _after_update(self) -> None: ...

        def create_optimizer_and_scheduler(self, num_training_steps: int) -> None: ...

        def floating_point_ops(self, inputs: dict[str, Any]) -> int: ...

        # evaluation
        def evaluate(
            self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
        ) -> dict[str, float]: ...

        def _eval_step(self, spec: LossSpec, want_logits: bool, ignore_keys: tuple[str, ...]): ...

        def _evaluate_loss_only(self) -> bool | None: ...

        def _generates(self) -> bool: ...

        def _ignore_keys(self, ignore_keys) -> tuple[str, ...]: ...

        # saving
        def _announce_save(self) -> None: ...

        def _commit_pending_checkpoint(self, timeout: float | None = None) -> None: ...

        def _determine_best_metric(self, metrics: dict[str, float]) -> bool: ...

        def _finish_checkpoint_after_error(self, timeout: float = 600.0) -> None: ...

        def _get_output_dir(self, trial) -> str: ...

        def _best_train_state(self, train_state: TrainState | None) -> TrainState | None: ...

        def _poll_pending_checkpoint(self) -> None: ...

        def _resume(self, folder: str, like: TrainState, updates_per_epoch: int, fresh=None) -> Resumed: ...

        def _save_checkpoint(self, trial) -> None: ...

        def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None: ...

        # hpsearch
        def _hp_search_setup(self, trial) -> None: ...

        def _report_to_hp_search(self, trial, step: int, metrics: dict[str, float]) -> None: ...

        # hub
        def _push_from_checkpoint(self, folder: str) -> None: ...

        def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None: ...

        def push_to_hub(
            self,
            commit_message: str | None = "End of training",
            blocking: bool = True,
            token: str | None = None,
            revision: str | None = None,
            private: bool | None = None,
            **kwargs,
        ): ...

        # seq2seq
        def _generate_batch(self, batch: dict[str, np.ndarray], rows: int) -> np.ndarray: ...

        def _prediction_labels(self, labels: np.ndarray) -> np.ndarray: ...
