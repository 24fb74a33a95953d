"""Trainer: HF's host loop over one compiled JAX train step.

Reads like HF's `_inner_training_loop`; the numerics live in `step.py`, `losses.py` and `optim.py`, the data
pipeline in `data.py`, checkpoints in `checkpoint.py`. The host only dispatches steps, reads metrics when it
logs, and runs HF's callbacks.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    ExportableState,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_utils import (
    EvalLoopOutput,
    EvalPrediction,
    IntervalStrategy,
    PredictionOutput,
    SaveStrategy,
    SchedulerType,
    TrainOutput,
    denumpify_detensorize,
    speed_metrics,
)

from jtrainer import checkpoint, data, distributed, optim, sharding
from jtrainer.args import TrainingArguments
from jtrainer.losses import IGNORE_INDEX
from jtrainer.state import TrainState
from jtrainer.step import (
    EvalOutputs,
    LossMode,
    LossSpec,
    StepBatch,
    apply_model,
    make_eval_step,
    make_train_step,
    split_outputs,
)

logger = logging.getLogger(__name__)


def _dotted(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _is_causal_lm(model: Any) -> bool:
    if hasattr(model, "loss_shifts_labels"):
        return bool(model.loss_shifts_labels)
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def _accepts_loss_kwargs(model: Any) -> bool:
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return "num_items_in_batch" in inspect.signature(model.__call__).parameters


def _takes_labels(model: Any, label_names: list[str]) -> bool:
    params = inspect.signature(model.__call__).parameters
    return label_names[0] in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def concat_padded(arrays: list[np.ndarray], pad: int = IGNORE_INDEX) -> np.ndarray:
    """Concatenate along rows, padding dimension 1 with `pad` where batches differ (HF's nested_concat)."""
    if not arrays:
        return np.zeros((0,))
    if arrays[0].ndim < 2 or all(a.shape[1:] == arrays[0].shape[1:] for a in arrays):
        return np.concatenate(arrays, axis=0)
    width = max(a.shape[1] for a in arrays)
    padded = [np.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2), constant_values=pad) for a in arrays]
    return np.concatenate(padded, axis=0)


def _gather_tree(trees: list[Any]) -> Any:
    if not trees:
        return None
    if isinstance(trees[0], (tuple, list)):
        return type(trees[0])(_gather_tree([t[i] for t in trees]) for i in range(len(trees[0])))
    if isinstance(trees[0], dict):
        return {k: _gather_tree([t[k] for t in trees]) for k in trees[0]}
    return concat_padded([np.asarray(t) for t in trees])


def _slice_tree(tree: Any, rows: int, length: int | None) -> Any:
    """Drop padded rows (and padded positions past the collated length) of a host pytree of arrays."""

    def cut(x):
        x = np.asarray(x)[:rows]
        return x[:, :length] if (length is not None and x.ndim >= 2) else x

    return jax.tree.map(cut, tree)


class Trainer:
    """HF's `transformers.Trainer`, with one jit-compiled train step over a sharding mesh instead of torch."""

    def __init__(
        self,
        model: nnx.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[optax.GradientTransformation | None, Callable | None] = (None, None),
        optimizer_cls_and_kwargs: tuple[Callable, dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
    ):
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        self.args = args
        if model_init is not None and optimizers[0] is not None:
            raise RuntimeError(
                "Passing a `model_init` is incompatible with providing the `optimizers` argument. "
                "You should subclass `Trainer` and override the `create_optimizer_and_scheduler` method."
            )
        if optimizers[0] is not None and optimizer_cls_and_kwargs is not None:
            raise RuntimeError("Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible.")
        if optimizers[0] is None and optimizer_cls_and_kwargs is None:
            optim.check_optimizer_name(args.optim)
        if args.lr_scheduler_type == SchedulerType.GREEDY:
            raise ValueError("--lr_scheduler_type greedy is not supported yet; use reduce_lr_on_plateau.")
        if args.eval_strategy != IntervalStrategy.NO and eval_dataset is None:
            raise ValueError(
                f"You have set `args.eval_strategy` to {args.eval_strategy} but you didn't pass an `eval_dataset` "
                "to `Trainer`. Either set `args.eval_strategy` to `no` or pass an `eval_dataset`. "
            )
        if model is None and model_init is None:
            raise RuntimeError("`Trainer` requires either a `model` or `model_init` argument")
        self.model_init = model_init
        if model is None:
            model = self.call_model_init()
        self.model = model
        self.data_collator = data_collator
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.label_names = list(args.label_names) if args.label_names else ["labels"]
        self.mesh = sharding.make_mesh(sharding.resolve_mesh_shape(args, jax.device_count()))
        self.axis_rules = sharding.merged_rules(args.logical_axis_rules)
        self._check_layout()
        self.neftune_noise_alpha = None
        self.hp_search_backend = None
        self.hp_name = None
        self._trial = None
        self._train_state: TrainState | None = None
        self._last_step_batch: StepBatch | None = None
        self._pending_checkpoint: checkpoint.PendingCheckpoint | None = None
        self._plateau: optim.PlateauScheduler | None = None
        self._compiled: dict[Any, Callable] = {}
        self.current_flos = 0.0

        default_callbacks = [DefaultFlowCallback, PrinterCallback if args.disable_tqdm else ProgressCallback]
        self.callback_handler = CallbackHandler(
            default_callbacks + list(callbacks or []), self.model, processing_class, self.optimizer, self.lr_scheduler
        )
        self.state = TrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [TrainerControl()] if isinstance(cb, ExportableState)
            ],
        )
        self.control = TrainerControl()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def _check_layout(self) -> None:
        """Every sharding error (mesh vs heads, dimensions vs axis sizes) is raised here, before compiling."""
        if hasattr(self.model, "check_mesh"):
            self.model.check_mesh(self.mesh)
        self._param_specs = sharding.param_specs(self.model, self.mesh, self.axis_rules)

    def _mesh_context(self):
        """The mesh and logical rules under which model code traces (activation constraints read them)."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(sharding.axis_rules(self.axis_rules))
        return stack

    # ----------------------------------------------------------------------------------------------- callbacks
    def add_callback(self, callback):
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback):
        self.callback_handler.remove_callback(callback)

    def is_local_process_zero(self) -> bool:
        return self.args.local_process_index == 0

    def is_world_process_zero(self) -> bool:
        return self.args.process_index == 0

    def call_model_init(self, trial=None) -> nnx.Module:
        params = inspect.signature(self.model_init).parameters
        model = self.model_init(trial) if len(params) == 1 else self.model_init()
        if model is None:
            raise RuntimeError("model_init should not return None.")
        return model

    # -------------------------------------------------------------------------------------------------- data
    def _signature_columns(self) -> list[str]:
        return data.model_signature_columns(self.model) + self.label_names

    def _prepare_dataset(self, dataset: Any) -> Any:
        if self.args.remove_unused_columns:
            dataset = data.remove_unused_columns(dataset, self._signature_columns())
        if data.is_hf_dataset(dataset) and hasattr(dataset, "with_format"):
            dataset = dataset.with_format("numpy") if data.has_length(dataset) else dataset
        return dataset

    def _collator(self) -> Callable:
        return self.data_collator or data.default_collator(self.processing_class)

    def get_train_dataloader(self) -> data.BatchLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        sized = data.has_length(self.train_dataset)
        if not sized and self.args.max_steps <= 0:
            raise ValueError(
                "args.max_steps must be set to a positive value if dataloader does not have a length, was "
                f"{self.args.max_steps}"
            )
        strategy = self.args.train_sampling_strategy if sized else "sequential"
        rows = self.args.per_device_train_batch_size * sharding.data_parallel_size(self.mesh)
        return data.BatchLoader(
            self._prepare_dataset(self.train_dataset),
            rows,
            self._collator(),
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            strategy=strategy,
            drop_last=self.args.dataloader_drop_last,
            length_column=self.args.length_column_name,
            row_range=sharding.process_row_range(self.mesh, rows),
        )

    def get_eval_dataloader(self, eval_dataset: Any = None) -> data.BatchLoader:
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        rows = self.args.per_device_eval_batch_size * sharding.data_parallel_size(self.mesh)
        return data.BatchLoader(
            self._prepare_dataset(dataset),
            rows,
            self._collator(),
            drop_last=self.args.dataloader_drop_last,
            row_range=sharding.process_row_range(self.mesh, rows),
        )

    def get_test_dataloader(self, test_dataset: Any) -> data.BatchLoader:
        return self.get_eval_dataloader(test_dataset)

    # ------------------------------------------------------------------------------------ optimizer/schedule
    def _norm_module_paths(self) -> set[str]:
        norms = set()
        for path, node in nnx.iter_graph(self.model):
            if isinstance(node, nnx.Module) and "norm" in type(node).__name__.lower():
                norms.add(".".join(map(str, path)))
        return norms

    def get_decay_parameter_names(self, model=None) -> list[str]:
        params = nnx.to_pure_dict(nnx.state(model or self.model, nnx.Param))
        paths = {_dotted(p): None for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
        return [p for p, decays in optim.decay_mask(paths, self._norm_module_paths()).items() if decays]

    def _decay_mask_tree(self, params):
        decayed = set(self.get_decay_parameter_names())
        return jax.tree_util.tree_map_with_path(lambda p, _: _dotted(p) in decayed, params)

    def create_scheduler(self, num_training_steps: int, optimizer=None) -> optim.Schedule:
        """HF's scheduler, as a step -> rate function (or the user's schedule from `optimizers`)."""
        if self.lr_scheduler is None:
            args = self.args
            self.lr_scheduler = optim.make_schedule(
                args.lr_scheduler_type,
                args.learning_rate,
                args.get_warmup_steps(num_training_steps),
                num_training_steps,
                args.lr_scheduler_kwargs,
            )
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def create_optimizer(self, params=None) -> optax.GradientTransformation:
        if self.optimizer is not None:
            return self.optimizer
        params = params if params is not None else nnx.to_pure_dict(nnx.state(self.model, nnx.Param))
        mask = self._decay_mask_tree(params)
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
            factory = lambda learning_rate: cls(learning_rate=learning_rate, **kwargs)  # noqa: E731
            self.optimizer = optax.inject_hyperparams(factory)(learning_rate=self.lr_scheduler)
            return self.optimizer
        plateau = self.args.lr_scheduler_type == SchedulerType.REDUCE_ON_PLATEAU
        rate = self.args.learning_rate if plateau else self.lr_scheduler
        self.optimizer = optim.make_optimizer(self.args, rate, mask)
        if plateau:
            self._plateau = optim.PlateauScheduler(
                mode="max" if self.args.greater_is_better else "min", **(self.args.lr_scheduler_kwargs or {})
            )
        return self.optimizer

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_scheduler(num_training_steps)
        self.create_optimizer()

    def get_learning_rates(self) -> list[float]:
        if self._train_state is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the optimizer before.")
        lr = optim.current_learning_rate(self._train_state.opt_state)
        return [float(lr)] if lr is not None else []

    def get_optimizer_group(self, param=None):
        params = nnx.to_pure_dict(nnx.state(self.model, nnx.Param))
        names = [_dotted(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        decayed = set(self.get_decay_parameter_names())
        groups = [
            {"params": [n for n in names if n in decayed], "weight_decay": self.args.weight_decay},
            {"params": [n for n in names if n not in decayed], "weight_decay": 0.0},
        ]
        if param is None:
            return groups
        return next(g for g in groups if param in g["params"])

    def get_num_trainable_parameters(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(self.model, nnx.Param)))

    def _num_non_embedding_parameters(self) -> int:
        total = 0
        for path, var in nnx.to_flat_state(nnx.state(self.model, nnx.Param)):
            if path[-1] != "embedding":
                total += int(np.prod(var[...].shape))
        return total

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """HF's estimate: 6 x tokens x non-embedding parameters, for models whose main input is in the batch."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if main in inputs:
            return 6 * int(np.asarray(inputs[main]).size) * self._num_non_embedding_parameters()
        return 0

    # ---------------------------------------------------------------------------------------------- the step
    def _loss_spec(self, sample: data.Batch, training: bool = True) -> LossSpec:
        """Decide, before compiling, how the loss is computed and normalised (HF's rules).

        Without labels, evaluation and prediction still run (no loss), as in HF; training fails here, named.
        """
        causal = _is_causal_lm(self.model)
        has_labels = any(name in sample for name in self.label_names)
        smoothing = self.args.label_smoothing_factor
        compute_dtype = jnp.bfloat16 if self.args.bf16 else None
        common = dict(label_names=tuple(self.label_names), causal=causal, compute_dtype=compute_dtype)
        if has_labels and self.compute_loss_func is not None:
            return LossSpec(LossMode.CUSTOM, compute_loss_func=self.compute_loss_func, **common)
        if has_labels and smoothing > 0:
            return LossSpec(LossMode.TRAINER, label_smoothing=smoothing, **common)
        if has_labels and not _takes_labels(self.model, self.label_names):
            return LossSpec(LossMode.TRAINER, **common)
        graphdef, params, rest = nnx.split(self.model, nnx.Param, ...)
        probe = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in sample.items()}
        with self._mesh_context():
            out_shape = jax.eval_shape(lambda p, s, x: apply_model(graphdef, p, s, x)[0], params, rest, probe)
        loss, _ = split_outputs(out_shape)
        if loss is not None:
            mode = LossMode.MODEL_SUM if (has_labels and _accepts_loss_kwargs(self.model)) else LossMode.MODEL_MEAN
            return LossSpec(mode, **common)
        if has_labels or not training:
            return LossSpec(LossMode.TRAINER, **common)
        raise ValueError(
            f"The model did not return a loss from the inputs, and the batch has no label column "
            f"{self.label_names}: its columns are {sorted(sample)}. Add a 'labels' column (or set "
            "--label_names), or pass compute_loss_func."
        )

    def _state_shardings(self, tx: optax.GradientTransformation, params) -> TrainState:
        """NamedShardings of the train state: parameters and their optimizer moments by the logical rules."""
        replicated = sharding.replicated(self.mesh)
        param_shardings = sharding.named(self.mesh, self._param_specs)
        opt_shardings = optax.tree_map_params(
            tx,
            lambda _, s: s,
            jax.eval_shape(tx.init, params),
            param_shardings,
            transform_non_params=lambda _: replicated,
        )
        _, _, rest = nnx.split(self.model, nnx.Param, ...)
        return TrainState(
            step=replicated,
            params=param_shardings,
            opt_state=opt_shardings,
            model_state=jax.tree.map(lambda _: replicated, rest),
            rng=replicated,
        )

    def _initial_train_state(self, tx: optax.GradientTransformation) -> TrainState:
        """The state placed on its shardings (so the second step does not recompile), built by one jit."""
        _, params, rest = nnx.split(self.model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        shardings = self._state_shardings(tx, params)
        # Copies: the step donates its buffers and the user's model keeps its own.
        params = jax.device_put(params, shardings.params, may_alias=False)
        rest = jax.device_put(rest, shardings.model_state, may_alias=False)
        seed = self.args.seed

        def init(params, rest):
            return TrainState(
                step=jnp.zeros((), jnp.int32),
                params=params,
                opt_state=tx.init(params),
                model_state=rest,
                rng=jax.random.key_data(jax.random.key(seed)),
            )

        return jax.jit(init, out_shardings=shardings)(params, rest)

    def _sync_model(self) -> None:
        """Write (copies of) the trained parameters into `self.model`, in place, as HF trains the model given."""
        if self._train_state is not None:
            _, params, _ = nnx.split(self.model, nnx.Param, ...)
            nnx.replace_by_pure_dict(params, jax.tree.map(jnp.copy, self._train_state.params))
            nnx.update(self.model, params, jax.tree.map(jnp.copy, self._train_state.model_state))

    # ---------------------------------------------------------------------------------------------- training
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {', '.join(kwargs)}.")
        args = self.args
        if self.model_init is not None:
            np.random.seed(args.seed)  # HF seeds before model_init; nnx models take their seed from nnx.Rngs
            self.model = self.call_model_init(trial)
            self.callback_handler.model = self.model
            self.optimizer = self.lr_scheduler = None
            self._train_state = None
            self._check_layout()
        if args.activation_checkpointing and hasattr(self.model, "gradient_checkpointing_enable"):
            self.model.gradient_checkpointing_enable(args.activation_checkpointing_kwargs)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = checkpoint.get_last_checkpoint(args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({args.output_dir})")
        if resume_from_checkpoint and not os.path.isfile(
            os.path.join(resume_from_checkpoint, checkpoint.TRAINER_STATE_NAME)
        ):
            raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")
        if self.args.should_save:
            for path in checkpoint.remove_uncommitted(args.output_dir):
                logger.warning("Removed %s, a checkpoint that was never committed.", path)
        if args.jax_compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", args.jax_compilation_cache_dir)
        with self._preemption_handler():
            return self._inner_training_loop(resume_from_checkpoint or None, trial, ignore_keys_for_eval)

    @contextlib.contextmanager
    def _preemption_handler(self):
        """SIGTERM (the preemption notice of TPU VMs and schedulers) asks for a checkpoint and a clean exit."""
        self._sigterm = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_sigterm(signum, frame):
            logger.warning("SIGTERM received: saving a checkpoint after the current step, then exiting.")
            self._sigterm = True

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _exit_if_preempted(self, trial) -> None:
        """After a step: if any process got SIGTERM, all save this step's checkpoint and exit with code 0."""
        if not distributed.agree_max(int(self._sigterm)):
            return
        folder = checkpoint.checkpoint_folder(self._get_output_dir(trial), self.state.global_step)
        pending = self._pending_checkpoint is not None and self._pending_checkpoint.folder == folder
        if not pending and not os.path.isdir(folder):
            self._save_checkpoint(trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        self._commit_pending_checkpoint()
        logger.warning("Preempted: saved %s; resume with train(resume_from_checkpoint=True).", folder)
        raise SystemExit(0)

    def _training_values(self, loader: data.BatchLoader) -> tuple[int, int, int, int, int]:
        """HF's set_initial_training_values: (epochs, updates/epoch, micro-batches/epoch, max_steps, samples)."""
        args, ga = self.args, self.args.gradient_accumulation_steps
        total_batch = loader.batch_size * ga
        if loader.sized:
            n_batches = len(loader)
            if n_batches == 0:
                raise ValueError(
                    f"The train dataset has {len(loader.dataset)} rows, fewer than one batch of "
                    f"{loader.batch_size} with dataloader_drop_last=True: lower the batch size or keep the last batch."
                )
            updates_per_epoch = max(n_batches // ga + int(n_batches % ga > 0), 1)
            if args.max_steps > 0:
                max_steps = args.max_steps
                epochs = max_steps // updates_per_epoch + int(max_steps % updates_per_epoch > 0)
                num_samples = max_steps * total_batch
            else:
                max_steps = math.ceil(args.num_train_epochs * updates_per_epoch)
                epochs = math.ceil(args.num_train_epochs)
                num_samples = len(loader.dataset) * args.num_train_epochs
            return epochs, updates_per_epoch, n_batches, max_steps, num_samples
        max_steps = args.max_steps
        return sys.maxsize, max_steps, max_steps * ga, max_steps, max_steps * total_batch

    def _inner_training_loop(self, resume_from_checkpoint, trial, ignore_keys_for_eval) -> TrainOutput:
        args = self.args
        loader = self.get_train_dataloader()
        epochs, updates_per_epoch, steps_in_epoch, max_steps, num_train_samples = self._training_values(loader)

        self.state = TrainerState(
            stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)
            ]
        )
        self.state.is_hyper_param_search = trial is not None
        self.state.train_batch_size = loader.batch_size // args.world_size
        self.state.compute_steps(args, max_steps)
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()

        pad_id = getattr(self.processing_class, "pad_token_id", None) or 0
        shapes = data.ShapeKeeper(loader.local_rows, pad_id, agree=distributed.agree_max)
        first, _ = next(iter(loader))
        spec = self._loss_spec(shapes.pad(first, shapes.sequence_length([first])))
        shapes.length = None  # the probe must not fix the sequence length

        self.create_optimizer_and_scheduler(max_steps)
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = self.optimizer, self.lr_scheduler
        tx = optim.skip_non_finite(self.optimizer) if args.nan_inf_policy == "skip" else self.optimizer
        train_state = self._initial_train_state(tx)
        epochs_trained, micro_steps_to_skip = 0, 0
        if resume_from_checkpoint is not None:
            train_state, epochs_trained, micro_steps_to_skip = self._resume(
                resume_from_checkpoint, train_state, updates_per_epoch
            )
        self._train_state = train_state
        graphdef = nnx.split(self.model, nnx.Param, ...)[0]
        train_step = jax.jit(
            make_train_step(graphdef, tx, spec, args.max_grad_norm),
            out_shardings=(self._state_shardings(tx, train_state.params), sharding.replicated(self.mesh)),
            donate_argnums=(0,),
        )
        self._train_step = train_step

        self.callback_handler.train_dataloader = loader
        self.state.init_training_references(self, max_steps, epochs, trial)
        start_time = time.time()
        self._initial_num_input_tokens_seen = self.state.num_input_tokens_seen
        self._initial_global_step = self.state.global_step
        self._pending_losses: list[jax.Array] = []
        self._total_loss_scalar = 0.0
        self._globalstep_last_logged = self.state.global_step
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start:
            self._evaluate(trial, ignore_keys_for_eval, skip_scheduler=True)

        metrics = None
        for epoch in range(epochs_trained, epochs):
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            loader.set_epoch(epoch)
            skip = micro_steps_to_skip if epoch == epochs_trained else 0
            windows = self._windows(loader, updates_per_epoch, steps_in_epoch, skip, shapes, spec)
            # With many processes, agreeing on shapes is a collective: it must run on the main thread, in step
            # order with the train steps. On one process the background thread also pads and places batches.
            in_background = jax.process_count() == 1
            if in_background:
                windows = ((b, self._step_batch(b, shapes, loader.batch_size)) for b in windows)
            step = skip - 1
            prefetch = data.Prefetcher(windows, args.prefetch_batches)
            try:
                for item in prefetch:
                    batches, step_batch = item if in_background else (item, self._step_batch(item, shapes, loader.batch_size))
                    for i, batch in enumerate(batches):
                        step += 1
                        if i == 0:
                            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                        self.current_flos += float(self.floating_point_ops(batch))
                        self._track_num_input_tokens(batch)
                        if i < len(batches) - 1:
                            self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
                    with self._mesh_context():
                        self._train_state, metrics = train_step(self._train_state, step_batch)
                    self._last_step_batch = step_batch
                    self._pending_losses.append(metrics["loss"])
                    self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
                    self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
                    self.state.global_step += 1
                    self.state.epoch = epoch + (step + 1) / steps_in_epoch
                    self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                    self._maybe_log_save_evaluate(metrics, trial, epoch, ignore_keys_for_eval, start_time)
                    self._exit_if_preempted(trial)
                    if self.control.should_epoch_stop or self.control.should_training_stop:
                        break
            finally:
                prefetch.close()
            if step < 0:
                logger.warning(
                    "There seems not to be a single sample in your epoch_iterator, stopping training at step "
                    f"{self.state.global_step}! This is expected if you're using an IterableDataset and set "
                    f"num_steps ({self.state.max_steps}) higher than the number of available samples."
                )
                self.control.should_training_stop = True
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._maybe_log_save_evaluate(metrics, trial, epoch, ignore_keys_for_eval, start_time)
            if self.control.should_training_stop:
                break
        return self._finalize_training(trial, num_train_samples, start_time)

    def _windows(self, loader, updates_per_epoch, steps_in_epoch, skip, shapes, spec):
        """Yield each optimizer step's micro-batches (this process's rows) for one epoch: HF's get_batch_samples."""
        ga = self.args.gradient_accumulation_steps
        iterator = iter(loader)
        for _ in range(skip):
            next(iterator, None)
        remainder = steps_in_epoch % ga or ga
        for update_step in range(skip // ga, updates_per_epoch):
            wanted = ga if update_step != updates_per_epoch - 1 else remainder
            batches = []
            for _ in range(wanted):
                item = next(iterator, None)
                if item is None:
                    break
                batches.append(item[0])
            if not batches:
                return
            yield batches

    def _step_batch(self, batches, shapes: data.ShapeKeeper, global_rows: int) -> StepBatch:
        """Pad and stack one window, then place it on the mesh as global arrays."""
        stacked, weights = data.assemble_window(batches, self.args.gradient_accumulation_steps, shapes)
        sharding.check_length_divisible(shapes.length, self.mesh)
        replicated = sharding.replicated(self.mesh)
        return StepBatch(
            inputs=sharding.put_global(stacked, self.mesh, row_dim=1, global_rows=global_rows),
            micro_weight=jax.make_array_from_process_local_data(replicated, weights, weights.shape),
        )

    def _track_num_input_tokens(self, batch: data.Batch) -> None:
        mode = self.args.include_num_input_tokens_seen
        if mode in ("no", False):
            return
        main = getattr(self.model, "main_input_name", "input_ids")
        if mode == "non_padding" and "attention_mask" in batch:
            self.state.num_input_tokens_seen += int(np.sum(batch["attention_mask"]))
        elif main in batch:
            self.state.num_input_tokens_seen += int(np.asarray(batch[main]).size)

    def _logged_loss(self) -> float:
        """Sum of the step losses since the last log, with HF's NaN/Inf filter (reads the device once)."""
        total = 0.0
        steps_before = self._globalstep_last_logged
        for i, value in enumerate(jax.device_get(self._pending_losses)):
            value = float(value)
            if self.args.nan_inf_policy == "error" and not math.isfinite(value):
                raise FloatingPointError(
                    f"The loss of step {steps_before + i + 1} is {value} (nan_inf_policy='error'). Lower the "
                    "learning rate, clip gradients (max_grad_norm) or use nan_inf_policy='skip'."
                )
            if self.args.logging_nan_inf_filter and not math.isfinite(value):
                total += total / (1 + (steps_before + i) - self._globalstep_last_logged)
            else:
                total += value
        self._pending_losses = []
        return total

    def _maybe_log_save_evaluate(self, metrics, trial, epoch, ignore_keys_for_eval, start_time) -> None:
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            host = jax.device_get(metrics)
            tr_loss = self._logged_loss()
            logs = {"loss": tr_loss / (self.state.global_step - self._globalstep_last_logged)}
            logs["grad_norm"] = float(host["grad_norm"])
            if "learning_rate" in host:
                logs["learning_rate"] = float(host["learning_rate"])
            if "skipped_updates" in host:
                logs["skipped_updates"] = int(host["skipped_updates"])
            self._total_loss_scalar += tr_loss
            self._globalstep_last_logged = self.state.global_step
            self.store_flos()
            self.log(logs, start_time)
        if self.control.should_evaluate:
            eval_metrics = self._evaluate(trial, ignore_keys_for_eval)
            is_new_best = self._determine_best_metric(eval_metrics)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = is_new_best
        if self.control.should_save:
            self._save_checkpoint(trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _finalize_training(self, trial, num_train_samples, start_time) -> TrainOutput:
        self._total_loss_scalar += self._logged_loss()
        steps_trained = self.state.global_step - self._initial_global_step
        train_loss = self._total_loss_scalar / max(steps_trained, 0.001)
        metrics = speed_metrics(
            "train",
            start_time,
            num_samples=num_train_samples * steps_trained / max(self.state.max_steps, 1),
            num_steps=steps_trained,
        )
        self.store_flos()
        metrics["total_flos"] = self.state.total_flos
        metrics["train_loss"] = train_loss
        if not self.args.skip_memory_metrics:
            metrics.update(self.memory_report())
        self._sync_model()
        self._commit_pending_checkpoint()
        self.log(metrics)
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
        run_dir = self._get_output_dir(trial)
        if self.args.should_save and self.state.best_model_checkpoint is not None and self.args.save_total_limit == 1:
            import shutil

            from transformers.trainer_utils import sort_checkpoints

            for folder in sort_checkpoints(run_dir, best_model_checkpoint=self.state.best_model_checkpoint):
                if not os.path.samefile(folder, self.state.best_model_checkpoint):
                    shutil.rmtree(folder, ignore_errors=True)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def memory_report(self, prefix: str = "train") -> dict[str, int]:
        """Bytes per device of parameters and optimizer state (from their shards), the step's temporaries
        (activations, from XLA's memory analysis of the compiled step) and this host's peak resident memory."""
        import resource

        state = self._train_state
        report = {
            f"{prefix}_mem_params_bytes_per_device": max(sharding.per_device_bytes(state.params).values()),
            f"{prefix}_mem_optimizer_bytes_per_device": max(sharding.per_device_bytes(state.opt_state).values(), default=0),
        }
        if self._last_step_batch is not None:
            with self._mesh_context():
                analysis = self._train_step.lower(state, self._last_step_batch).compile().memory_analysis()
            if analysis is not None:
                report[f"{prefix}_mem_activations_bytes_per_device"] = int(analysis.temp_size_in_bytes)
        report[f"{prefix}_mem_host_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return report

    def store_flos(self) -> None:
        self.state.total_flos += distributed.agree_sum(self.current_flos)
        self.current_flos = 0.0

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if self.args.include_num_input_tokens_seen not in ("no", False):
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None:
                seen = self.state.num_input_tokens_seen - getattr(self, "_initial_num_input_tokens_seen", 0)
                logs.update(speed_metrics("train", start_time, num_tokens=seen))
        output = {**logs, "step": self.state.global_step}
        self.state.log_history.append(output)
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    # -------------------------------------------------------------------------------------------- evaluation
    def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler: bool = False) -> dict[str, float]:
        metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
        if self._plateau is not None and not skip_scheduler:
            name = self.args.metric_for_best_model
            key = name if name.startswith("eval_") else f"eval_{name}"
            if key not in metrics:
                raise KeyError(
                    f"The lr scheduler reduce_lr_on_plateau needs metric {key!r}, which evaluation did not return; "
                    f"it returned {sorted(metrics)}. Set --metric_for_best_model."
                )
            self._step_plateau(float(metrics[key]))
        return metrics

    def _step_plateau(self, metric: float) -> None:
        opt_state = self._train_state.opt_state
        current = optim.current_learning_rate(opt_state)
        lr = float(current)
        new_lr = self._plateau.step(metric, lr)
        if new_lr != lr:
            value = jax.device_put(jnp.asarray(new_lr, current.dtype), current.sharding)
            opt_state = optim.replace_hyperparam(opt_state, "learning_rate", value)
            self._train_state = self._train_state.replace(opt_state=opt_state)

    def _current_params(self):
        if self._train_state is not None:
            return self._train_state.params, self._train_state.model_state
        _, params, rest = nnx.split(self.model, nnx.Param, ...)
        return (
            jax.device_put(nnx.to_pure_dict(params), sharding.named(self.mesh, self._param_specs)),
            jax.device_put(rest, sharding.replicated(self.mesh)),
        )

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        override = eval_dataset is not None
        eval_dataset = eval_dataset if override else self.eval_dataset
        if isinstance(eval_dataset, dict):
            metrics = {}
            for name, dataset in eval_dataset.items():
                metrics.update(
                    self.evaluate(dataset if override else name, ignore_keys, f"{metric_key_prefix}_{name}")
                )
            return metrics
        output = self._timed_loop(self.get_eval_dataloader(eval_dataset), "Evaluation", ignore_keys, metric_key_prefix)
        self.log(output.metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, output.metrics)
        return output.metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        output = self._timed_loop(self.get_test_dataloader(test_dataset), "Prediction", ignore_keys, metric_key_prefix)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, output.metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)

    def _timed_loop(self, loader, description, ignore_keys, prefix) -> EvalLoopOutput:
        """evaluation_loop plus HF's speed metrics (runtime, samples/s, steps/s) under the prefix."""
        start_time = time.time()
        output = self.evaluation_loop(loader, description, None, ignore_keys, prefix)
        total_batch = self.args.eval_batch_size * self.args.world_size
        output.metrics.update(
            speed_metrics(
                prefix,
                start_time,
                num_samples=output.num_samples,
                num_steps=math.ceil(output.num_samples / total_batch),
            )
        )
        return output

    def _eval_step(self, spec: LossSpec, want_logits: bool):
        key = (spec, want_logits)
        if key not in self._compiled:
            self.model.eval()
            graphdef = nnx.split(self.model, nnx.Param, ...)[0]
            self.model.train()
            self._compiled[key] = jax.jit(
                make_eval_step(graphdef, spec, want_logits, self.preprocess_logits_for_metrics)
            )
        return self._compiled[key]

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ) -> EvalLoopOutput:
        args = self.args
        loss_only = prediction_loss_only if prediction_loss_only is not None else args.prediction_loss_only
        want_logits = not loss_only
        self.callback_handler.eval_dataloader = dataloader
        params, model_state = self._current_params()
        pad_id = getattr(self.processing_class, "pad_token_id", None) or 0
        shapes = data.ShapeKeeper(dataloader.local_rows, pad_id, agree=distributed.agree_max)
        spec, step = None, None
        losses, preds, labels, inputs_seen = [], [], [], []
        num_samples = 0
        include = set(args.include_for_metrics or [])
        label_name = self.label_names[0]
        for batch, rows in dataloader:
            length = shapes.sequence_length([batch])
            sharding.check_length_divisible(length, self.mesh)
            padded = shapes.pad(batch, length)
            if spec is None:
                spec = self._loss_spec(padded, training=False)
                step = self._eval_step(spec, want_logits)
            inputs = sharding.put_global(padded, self.mesh, row_dim=0, global_rows=dataloader.batch_size)
            with self._mesh_context():
                out: EvalOutputs = step(params, model_state, inputs)
            collated_len = distributed.agree_max(max((v.shape[1] for v in batch.values() if v.ndim >= 2), default=0))
            collated_len = collated_len or None
            if out.loss is not None:
                losses.append(np.full(rows, float(out.loss), np.float64))
            batch_labels = padded.get(label_name)
            if batch_labels is not None:
                batch_labels = _slice_tree(distributed.gather_rows(batch_labels), rows, collated_len)
            if want_logits and out.logits is not None:
                logits = _slice_tree(jax.tree.map(distributed.gather_rows, out.logits), rows, collated_len)
                if ignore_keys and isinstance(logits, dict):
                    logits = {k: v for k, v in logits.items() if k not in ignore_keys}
                if isinstance(logits, (tuple, list)) and len(logits) == 1:
                    logits = logits[0]
                if args.batch_eval_metrics and self.compute_metrics is not None:
                    self._batch_metrics = self.compute_metrics(
                        EvalPrediction(predictions=logits, label_ids=batch_labels), compute_result=False
                    )
                else:
                    preds.append(logits)
            if batch_labels is not None:
                labels.append(batch_labels)
            if "inputs" in include:
                main = padded[getattr(self.model, "main_input_name", "input_ids")]
                inputs_seen.append(_slice_tree(distributed.gather_rows(main), rows, collated_len))
            num_samples += rows
            self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)

        all_losses = np.concatenate(losses) if losses else None
        all_preds = _gather_tree(preds) if preds else None
        all_labels = _gather_tree(labels) if labels else None
        metrics: dict[str, Any] = {}
        if self.compute_metrics is not None and (all_preds is not None or args.batch_eval_metrics):
            extra = {}
            if "inputs" in include:
                extra["inputs"] = _gather_tree(inputs_seen)
            if "loss" in include:
                extra["losses"] = all_losses
            if args.batch_eval_metrics:
                metrics = self.compute_metrics(
                    EvalPrediction(predictions=None, label_ids=None, **extra), compute_result=True
                )
            elif all_labels is not None:
                metrics = self.compute_metrics(EvalPrediction(predictions=all_preds, label_ids=all_labels, **extra))
        metrics = denumpify_detensorize(metrics or {})
        if all_losses is not None:
            metrics[f"{metric_key_prefix}_loss"] = float(np.mean(all_losses))
        for key in list(metrics):
            if not key.startswith(f"{metric_key_prefix}_"):
                metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
        return EvalLoopOutput(predictions=all_preds, label_ids=all_labels, metrics=metrics, num_samples=num_samples)

    # -------------------------------------------------------------------------------------------- checkpoints
    def _get_output_dir(self, trial) -> str:
        if trial is not None and self.hp_search_backend is not None:
            return os.path.join(self.args.output_dir, f"run-{getattr(trial, 'number', trial)}")
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

    def _commit_pending_checkpoint(self) -> None:
        """Wait for the checkpoint being written in the background, then commit (and rotate)."""
        if self._pending_checkpoint is not None:
            pending, self._pending_checkpoint = self._pending_checkpoint, None
            pending.commit()

    def _save_checkpoint(self, trial) -> None:
        self._commit_pending_checkpoint()
        run_dir = self._get_output_dir(trial)
        folder = checkpoint.checkpoint_folder(run_dir, self.state.global_step)
        self.store_flos()
        if not self._params_finite():
            logger.error(
                "Parameters are not finite at step %d: not writing %s (earlier checkpoints are kept).",
                self.state.global_step,
                folder,
            )
            return
        tensors = self._hf_tensors()  # on many hosts a collective: every process takes part
        if self.state.best_global_step:
            best = checkpoint.checkpoint_folder(run_dir, self.state.best_global_step)
            if best == folder or os.path.exists(best):  # saves are committed in order: an earlier one exists
                self.state.best_model_checkpoint = best
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state

        def write_files(tmp: str) -> None:
            self._write_model(tmp, tensors)
            self.state.save_to_json(os.path.join(tmp, checkpoint.TRAINER_STATE_NAME))

        def rotate() -> None:
            if self.args.should_save:
                checkpoint.rotate_checkpoints(
                    run_dir, self.args.save_total_limit, best_model_checkpoint=self.state.best_model_checkpoint
                )

        train_state = None if self.args.save_only_model else self._train_state
        self._pending_checkpoint = checkpoint.save_checkpoint(
            folder,
            train_state,
            write_files,
            self.args.should_save,
            self.state.global_step,
            asynchronous=self.args.async_checkpointing,
            on_commit=rotate,
        )

    def _params_finite(self) -> bool:
        if self._train_state is None:
            return True
        leaves = jax.tree.leaves(self._train_state.params)
        return bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))(leaves))

    def _resume(self, folder: str, train_state: TrainState, updates_per_epoch: int):
        if not os.path.isdir(os.path.join(folder, checkpoint.TRAIN_STATE_DIR)):
            raise ValueError(
                f"Can't find a valid checkpoint at {folder}: it has no train state (saved with save_only_model?)."
            )
        train_state = checkpoint.restore_train_state(folder, train_state)
        self.state = TrainerState.load_from_json(os.path.join(folder, checkpoint.TRAINER_STATE_NAME))
        if self.state.best_model_checkpoint is not None and not os.path.isdir(self.state.best_model_checkpoint):
            logger.warning(
                f"The best checkpoint {self.state.best_model_checkpoint} recorded in the resumed state does not "
                "exist anymore. Ignoring it for this run."
            )
            self.state.best_model_checkpoint = None
        self._warn_changed_args(folder)
        if self.args.restore_callback_states_from_checkpoint:
            self._load_callback_state()
        epochs_trained = self.state.global_step // updates_per_epoch
        skip = 0
        if not self.args.ignore_data_skip:
            skip = (self.state.global_step % updates_per_epoch) * self.args.gradient_accumulation_steps
        return train_state, epochs_trained, skip

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
        """HF's restore_callback_states_from_checkpoint: restore ExportableState callbacks by class name."""
        saved = self.state.stateful_callbacks or {}
        for cb in self.callback_handler.callbacks + [self.control]:
            if not isinstance(cb, ExportableState):
                continue
            entry = saved.get(cb.__class__.__name__)
            entry = entry[-1] if isinstance(entry, list) and entry else entry
            if isinstance(entry, dict):
                for key, value in entry.get("args", {}).items():
                    setattr(cb, key, value)
                for key, value in entry.get("attributes", {}).items():
                    setattr(cb, key, value)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if self._train_state is not None and os.path.isdir(os.path.join(best, checkpoint.TRAIN_STATE_DIR)):
            self._train_state = checkpoint.restore_train_state(best, self._train_state)
            self._sync_model()
        else:
            from jtrainer.models import hf_io

            hf_io.load_weights(self.model, best)

    def _hf_tensors(self) -> dict[str, np.ndarray] | None:
        """The model's weights as HF-named host arrays (gathered from every process), if the model is ours."""
        self._sync_model()
        if getattr(self.model, "save_pretrained", None) is not None and not hasattr(self.model, "config"):
            return None
        from jtrainer.models import hf_io

        return hf_io.to_hf_state_dict(self.model)

    def _write_model(self, output_dir: str, tensors) -> None:
        from jtrainer.models import hf_io

        os.makedirs(output_dir, exist_ok=True)
        if tensors is None:
            self.model.save_pretrained(output_dir)
        elif hasattr(self.model, "config"):
            hf_io.write_hf_folder(self.model.config, tensors, output_dir)
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
            self._write_model(output_dir or self.args.output_dir, tensors)

    def save_state(self) -> None:
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.state.save_to_json(os.path.join(self.args.output_dir, checkpoint.TRAINER_STATE_NAME))

    # ------------------------------------------------------------------------------------- metrics utilities
    def metrics_format(self, metrics: dict[str, float]) -> dict[str, Any]:
        """HF's format: runtimes as h:mm:ss, total_flos in GF, floats rounded to 4 places."""
        out = {}
        for key, value in metrics.items():
            if "_mem_" in key:
                out[key] = f"{value >> 20}MB"
            elif "_runtime" in key:
                out[key] = str(datetime.timedelta(seconds=int(value)))
            elif key == "total_flos":
                out[key] = f"{int(value) >> 30}GF"
            elif isinstance(value, float):
                out[key] = round(value, 4)
            else:
                out[key] = value
        return out

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        if not self.is_world_process_zero():
            return
        formatted = self.metrics_format(metrics)
        width = max((len(k) for k in formatted), default=0)
        print(f"***** {split} metrics *****")
        for key in sorted(formatted):
            print(f"  {key: <{width}} = {formatted[key]:>9}")

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        if not self.is_world_process_zero():
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, f"{split}_results.json"), "w") as f:
            json.dump(metrics, f, indent=4, sort_keys=True)
        if combined:
            path = os.path.join(self.args.output_dir, "all_results.json")
            all_metrics = json.load(open(path)) if os.path.exists(path) else {}
            all_metrics.update(metrics)
            with open(path, "w") as f:
                json.dump(all_metrics, f, indent=4, sort_keys=True)


__all__ = ["Trainer"]
