"""Trainer: HF's host loop over one compiled JAX train step.

Reads like HF's `_inner_training_loop`; the numerics live in `jtrainer.numerics` (the step, losses, optimizers,
the run's `LearningRate`), the data pipeline in `data.py`, evaluation in `evaluation.py`, checkpoints in `saving.py`
(when and what) and `jtrainer.checkpointing` (how). HF's other methods come as mixins: optimizer and scheduler
(`optimizer_setup.py`), hyperparameter search (`hpsearch.py`), the Hub (`hub.py`), metric files (`metrics_io.py`).
The host only dispatches steps, reads metrics when it logs, and runs HF's callbacks.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

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
from transformers.trainer_utils import IntervalStrategy, SaveStrategy, TrainOutput, speed_metrics

from jtrainer import kinds
from jtrainer.checkpointing import checkpoint, run_lock
from jtrainer.core import host_rng, storage
from jtrainer.core.callbacks import JITCheckpointCallback
from jtrainer.core.state import Frozen, LoopState, TrainState, split_params
from jtrainer.kinds import loss_rules
from jtrainer.numerics import optim
from jtrainer.numerics.losses import check_class_labels
from jtrainer.numerics.step import (
    LossSpec,
    StepBatch,
    active_base_spec,
    graphdef_in_mode,
)
from jtrainer.numerics.step import compute_loss as step_compute_loss
from jtrainer.parallel import distributed, sharding
from jtrainer.runtime import compiled_steps, startup
from jtrainer.sizing import abstract_step, batch_size
from jtrainer.trainer import data, saving
from jtrainer.trainer.args import TrainingArguments
from jtrainer.trainer.evaluation import EvaluationMixin
from jtrainer.trainer.hpsearch import HyperparameterSearchMixin
from jtrainer.trainer.hub import HubMixin
from jtrainer.trainer.metrics_io import MetricsMixin
from jtrainer.trainer.optimizer_setup import OptimizerMixin
from jtrainer.trainer.overrides import (
    RefusedMethods,
    check_loader,
    check_optimizer_override,
    check_overrides,
)
from jtrainer.trainer.saving import SavingMixin
from jtrainer.trainer.training_run import LossLog, PreemptionNotice, Throughput, TrainingRun, sigterm_notice

logger = logging.getLogger(__name__)
# HF's own messages (banners, "Training completed"), through transformers' logger, so a script's
# transformers.utils.logging.set_verbosity_info() shows them as under transformers.Trainer.
hf_logger = logging.getLogger("transformers.trainer")


def _continue_generators_after(run: TrainingRun) -> None:
    """After training, the process's host generators go on from where HF's one generator stands then: after the
    last step's batches and the one its loader read ahead (a random collator's or transform's draws; the prefetch
    may have drawn further on the training stream), or after the loader's own draws. Evaluations and collators
    after train() then draw as in HF."""
    stream = run.loader.rng_stream
    if stream is None:
        return
    # Step by step (or without draws of the collator) the stream stands exactly there, evaluations included.
    state = run.generators_after_step if stream.drawn and not run.step_by_step else stream.state
    if state is not None:
        with host_rng.collators_paused():
            host_rng.restore(state)


def _check_deterministic_backend() -> None:
    """full_determinism: XLA is deterministic on CPU and TPU; on GPU only with its deterministic-ops flag, which
    must be set before jax starts."""
    if jax.default_backend() == "gpu" and "xla_gpu_deterministic_ops=true" not in os.environ.get("XLA_FLAGS", ""):
        raise ValueError(
            "full_determinism=True on GPU needs XLA's deterministic kernels: start the script with "
            "XLA_FLAGS=--xla_gpu_deterministic_ops=true (it is read when jax starts)."
        )


class PreparedWindow(NamedTuple):
    batches: list[data.Batch]  # this process's micro-batches, as collated
    step_batch: StepBatch  # the same, padded and placed on the mesh
    loop_state: LoopState
    # HF's one generator after this step: its loader (accelerate's) has read one batch ahead, so the next
    # window's first batch has drawn already (None without a training stream)
    generators_after: host_rng.HostRngState | None = None
    read_ahead: bool = False  # whether the epoch had a next batch to read ahead


def _same_folder(a: str, b: str) -> bool:
    """Whether two checkpoint paths name one folder (object stores: the same normalized URL)."""
    if storage.is_url(a) or storage.is_url(b):
        return storage.normalize(a) == storage.normalize(b)
    return os.path.samefile(a, b)


def _stateful(callbacks: list[Any]) -> list[Any]:
    """HF's TrainerState.stateful_callbacks: the callbacks (and control) whose state checkpoints keep."""
    return [cb for cb in callbacks if isinstance(cb, ExportableState)]


def _check_constructor_arguments(args, model, model_init, optimizers, optimizer_cls_and_kwargs, eval_dataset) -> None:
    """HF's constructor checks, with HF's messages, before the model is built."""
    if model_init is not None and optimizers[0] is not None:
        raise RuntimeError(
            "Passing a `model_init` is incompatible with providing the `optimizers` argument. "
            "You should subclass `Trainer` and override the `create_optimizer_and_scheduler` method."
        )
    if optimizers[0] is not None and optimizer_cls_and_kwargs is not None:
        raise RuntimeError("Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible.")
    if optimizers[0] is None and optimizer_cls_and_kwargs is None:
        optim.check_optimizer(args)
    if args.eval_strategy != IntervalStrategy.NO and eval_dataset is None:
        raise ValueError(
            f"You have set `args.eval_strategy` to {args.eval_strategy} but you didn't pass an `eval_dataset` "
            "to `Trainer`. Either set `args.eval_strategy` to `no` or pass an `eval_dataset`. "
        )
    if model is None and model_init is None:
        raise RuntimeError("`Trainer` requires either a `model` or `model_init` argument")


class Trainer(
    OptimizerMixin,
    EvaluationMixin,
    SavingMixin,
    HyperparameterSearchMixin,
    HubMixin,
    MetricsMixin,
    RefusedMethods,
):
    """HF's `transformers.Trainer`, with one jit-compiled train step over a sharding mesh instead of torch."""

    # HF's switches for torch's distributed back ends, which one compiled step over a mesh replaces: none is in use
    # (scripts that branch on them take the plain path).
    is_deepspeed_enabled = is_fsdp_enabled = is_fsdp_xla_enabled = False
    is_fsdp_xla_v1_enabled = is_fsdp_xla_v2_enabled = is_model_parallel = False
    is_distributed_loading_by_transformers = False
    deepspeed = None
    place_model_on_device = False  # the step's shardings place the parameters, not model.to(device)

    @property
    def model_wrapped(self) -> Any:
        """HF's DDP/FSDP-wrapped model; nothing wraps the model here."""
        return self.model

    @property
    def can_return_loss(self) -> bool:
        """HF's: whether the model's forward (a native model's call) takes `return_loss`, default True."""
        parameter = loss_rules.call_signature(self._inspected_model).parameters.get("return_loss")
        return parameter is not None and parameter.default is True

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
        startup.initialize()  # usually done already by the TrainingArguments
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        self.args = args
        # HF seeds python, numpy and torch first thing (a random collator or model_init draws from them).
        host_rng.set_seed(args.seed, deterministic=args.full_determinism)
        _check_constructor_arguments(args, model, model_init, optimizers, optimizer_cls_and_kwargs, eval_dataset)
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
        inspected = self._inspected_model
        names = args.label_names if args.label_names is not None else loss_rules.default_label_names(inspected)
        self.label_names = list(names)
        self.model_accepts_loss_kwargs = loss_rules.accepts_loss_kwargs(inspected)
        self.label_smoother = loss_rules.label_smoother(args, model)
        self.loss_is_scaled_for_ga: bool | None = None  # HF 5.x: set by a compute_loss override that normalises
        check_overrides(self)
        if args.full_determinism:
            _check_deterministic_backend()
        self.mesh = abstract_step.run_mesh(args)
        self.axis_rules = sharding.merged_rules(args.logical_axis_rules)
        self._check_layout()
        self._apply_chunked_loss()
        self.neftune_noise_alpha = None
        self._train_state: TrainState | None = None
        self._run: TrainingRun | None = None  # the last train() loop's state (training_run.py)
        self.current_flos = 0.0
        self.callback_handler = CallbackHandler(
            self._default_callbacks() + list(callbacks or []),
            self.model,
            processing_class,
            self.optimizer,
            self.lr_scheduler,
        )
        self.add_callback(PrinterCallback if args.disable_tqdm else ProgressCallback)
        self.state = TrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=_stateful([*self.callback_handler.callbacks, TrainerControl()]),
        )
        self.control = TrainerControl()
        if args.push_to_hub:
            self.init_hf_repo()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)
        self._held.finish_trainer_init(args)

    def _default_callbacks(self) -> list[Any]:
        """HF's flow callback, its integration callbacks (tensorboard, wandb, mlflow, ...: they only read logs, args
        and config) and, with enable_jit_checkpoint, the one that checkpoints on SIGTERM."""
        callbacks: list[Any] = [DefaultFlowCallback]
        if self.args.report_to:  # imported only when used: transformers.integrations costs ~0.8 s of import time
            from transformers.integrations import get_reporting_integration_callbacks

            callbacks += get_reporting_integration_callbacks(self.args.report_to)
        if self.args.enable_jit_checkpoint:  # HF's switch: SIGTERM's checkpoint, then train() returns
            jit_callback = JITCheckpointCallback()
            jit_callback.set_trainer(self)
            callbacks.append(jit_callback)
        return callbacks

    @property
    def model(self) -> Any:
        """The model given (HF's `trainer.model`): after `train()` it holds the trained weights."""
        return self._held.given

    @model.setter
    def model(self, model: Any) -> None:
        self._held = kinds.adopt(model)

    @property
    def nnx_model(self) -> Any:
        """The nnx module the steps run: the model given, or the bridge's module of a torch model."""
        return self._held.module

    @property
    def _inspected_model(self) -> Any:
        """The model whose class and call HF inspects (labels, columns, loss kwargs): a peft model's base model."""
        return self._held.inspected

    def _set_neftune(self, alpha: float | None) -> None:
        """NEFTune noise on the input embeddings in training steps (None: off): transformers' own forward hook on
        a torch model (its noise drawn from the step's JAX key), jtrainer's Embed on a native one."""
        self._held.set_neftune(alpha)

    def _check_layout(self) -> None:
        """Every sharding error (mesh vs heads, dimensions vs axis sizes) is raised here, before compiling."""
        self._param_specs = self._layout().param_specs

    def _layout(self) -> abstract_step.Layout:
        return abstract_step.Layout.of(self.nnx_model, self.mesh, self.axis_rules)

    def _mesh_context(self):
        """The mesh and logical rules under which model code traces (activation constraints read them)."""
        return abstract_step.tracing(self.mesh, self.axis_rules)

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

    def _apply_chunked_loss(self) -> None:
        """The model's chunked causal-LM loss where nothing else reads the logits (`abstract_step.use_chunked_loss`)."""
        abstract_step.use_chunked_loss(self.nnx_model, self.args, type(self.model).__name__)

    def call_model_init(self, trial=None) -> nnx.Module:
        model_init = self.model_init
        if model_init is None:
            raise RuntimeError("`model_init` has to be passed to the Trainer to call it.")
        params = inspect.signature(model_init).parameters
        model = model_init(trial) if len(params) == 1 else model_init()
        if model is None:
            raise RuntimeError("model_init should not return None.")
        return model

    # -------------------------------------------------------------------------------------------------- data
    def _signature_columns(self) -> list[str]:
        return data.model_signature_columns(self._inspected_model) + self.label_names

    def _prepare_dataset(self, dataset: Any) -> Any:
        if self.args.remove_unused_columns:
            dataset = data.remove_unused_columns(dataset, self._signature_columns())
        # Python lists read as numpy arrays (faster, the same values); a format or transform the user set
        # (with_transform, set_format("torch")) stays, as HF's DataLoader reads the dataset as given.
        unformatted = (getattr(dataset, "format", None) or {}).get("type") is None
        if data.is_hf_dataset(dataset) and hasattr(dataset, "with_format") and unformatted:
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
            complete_last=sharding.data_parallel_size(self.mesh) > 1,  # HF's DistributedSampler / even_batches
            group_rows=self.args.train_batch_size * self.args.gradient_accumulation_steps,
        )

    def get_eval_dataloader(self, eval_dataset: Any = None) -> data.BatchLoader:
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        rows = self.args.per_device_eval_batch_size * sharding.data_parallel_size(self.mesh)
        # HF's evaluation sampler groups by length too, with a generator seeded by data_seed or seed.
        grouped = self.args.train_sampling_strategy == "group_by_length" and data.has_length(dataset)
        return data.BatchLoader(
            self._prepare_dataset(dataset),
            rows,
            self._collator(),
            strategy="group_by_length" if grouped else "sequential",
            length_column=self.args.length_column_name,
            group_rows=self.args.eval_batch_size,
            group_seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            drop_last=self.args.dataloader_drop_last,
            row_range=sharding.process_row_range(self.mesh, rows),
            complete_last=sharding.data_parallel_size(self.mesh) > 1,  # HF's even_batches; dropped before metrics
        )

    def get_test_dataloader(self, test_dataset: Any) -> data.BatchLoader:
        return self.get_eval_dataloader(test_dataset)

    # ---------------------------------------------------------------------------------------------- the step
    def _loss_context(self) -> loss_rules.LossContext:
        """What HF's loss rules read: the held model, the arguments and HF's loss attributes as they stand now."""
        return loss_rules.LossContext(
            held=self._held,
            args=self.args,
            label_names=tuple(self.label_names),
            accepts_loss_kwargs=self.model_accepts_loss_kwargs,
            label_smoother=self.label_smoother,
            compute_loss_func=self.compute_loss_func,
            tracing=self._mesh_context,
        )

    def _loss_spec(self, sample: data.Batch, training: bool = True) -> LossSpec:
        """Decide, before compiling, how the loss is computed and normalised (HF's rules: `loss_rules`); a
        subclass's compute_loss override runs inside the step, its super() with the Trainer's own rules."""
        context = self._loss_context()
        loss_rules.require_trainable(context, training)
        base = self._default_loss_spec(sample, training)
        if type(self).compute_loss is Trainer.compute_loss:  # (a jtrainer subclass's own loss counts too: TRL's)
            return base
        name = f"{type(self).__name__}.compute_loss"
        return loss_rules.override_spec(
            context, base, self.compute_loss, sample, training, self.loss_is_scaled_for_ga, name
        )

    def _default_loss_spec(self, sample: data.Batch, training: bool) -> LossSpec:
        """The Trainer's own loss (`loss_rules.default_spec`; TRL's trainers have their own)."""
        return loss_rules.default_spec(self._loss_context(), sample, training)

    def _label_classes(self, spec: LossSpec) -> int | None:
        """The class count labels are checked against: the logits' where the Trainer computes the loss, else the
        model's config (`_num_classes`)."""
        return spec.num_classes if spec.num_classes is not None else self._num_classes()

    def _evaluation_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """An evaluation batch as placed on the mesh, before the eval step; a Trainer whose loss reads values
        computed from the batch by another model (jtrainer.trl's DPO reference) adds them here."""
        return inputs

    def _on_recorded(self, recorded: dict[str, Any], micro_batches: int, training: bool) -> None:
        """What the loss recorded in a step (`step_metrics.record`: arrays over the window's micro-batches, the
        first `micro_batches` real) or an evaluation batch (scalars). A Trainer whose loss records (jtrainer.trl's)
        keeps them for its logs; arrays stay on the device until read."""

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """HF's compute_loss: the loss of `model` (a bound nnx model) on `inputs` (jax arrays), with its outputs
        when `return_outputs`. Subclass and override it, as with HF: the override runs inside the compiled step
        (use `model`, not `self.model`, and jax.numpy). If the loss you return is a per-batch mean, leave
        `loss_is_scaled_for_ga` as None or False; if it is already normalised by num_items_in_batch, set True."""
        spec = active_base_spec()
        if spec is None:  # called by hand, outside a step
            spec = self._default_loss_spec({k: np.asarray(v) for k, v in inputs.items()}, training=True)
        return step_compute_loss(model, inputs, spec, num_items_in_batch, return_outputs)

    def _state_layout(self) -> abstract_step.Layout:
        """The layout the train state takes (the parameters' specs as `_check_layout` found them)."""
        return abstract_step.Layout(self.mesh, self.axis_rules, self._param_specs)

    def _initial_train_state(self, tx: optax.GradientTransformation) -> tuple[TrainState, TrainState]:
        """The state placed on its shardings (so the second step does not recompile), built by one jit, and
        those shardings (the step's output shardings)."""
        _, param_state, rest = split_params(self.nnx_model)
        params = nnx.to_pure_dict(param_state)
        shardings = abstract_step.state_shardings(tx, params, self.nnx_model, self._state_layout())
        # Copies: the step donates its buffers and the user's model keeps its own.
        params = sharding.place(params, shardings.params)
        rest = sharding.place(rest, shardings.model_state)
        init = abstract_step.train_state_init(tx, self.args)
        return jax.jit(init, out_shardings=shardings)(params, rest), shardings

    def _compiled_train_step(self, tx: optax.GradientTransformation, spec: LossSpec, state_shardings: TrainState):
        """The jitted train step. When the Trainer built the optimizer, the step depends only on structure (the
        model's graph, the loss spec, the optimizer recipe, the layout), so it is shared process-wide: later
        trials of a hyperparameter search, whose numbers live in the state, reuse the compiled executable."""
        graphdef = graphdef_in_mode(self.nnx_model, training=True)
        clip = bool(self.args.max_grad_norm and self.args.max_grad_norm > 0)
        key = None
        if self._optimizer_recipe is not None and self.optimizer is not None:
            leaves, treedef = jax.tree.flatten(state_shardings)
            key = (
                graphdef,
                spec,
                self._optimizer_recipe,
                self.args.nan_inf_policy,
                self.args.fp16,
                clip,
                tuple(leaves),
                treedef,
            )
            if key in compiled_steps.TRAIN_STEPS:
                return compiled_steps.TRAIN_STEPS[key]
        train_step = abstract_step.train_step(graphdef, tx, spec, state_shardings, self.mesh)
        if key is not None:
            compiled_steps.TRAIN_STEPS[key] = train_step
        return train_step

    def compile_train_step(self, example: data.Batch, num_training_steps: int) -> jax.stages.Compiled:
        """The train step this trainer runs, compiled ahead of time on its mesh for global batches shaped like
        `example` (one device's `per_device_train_batch_size` collated rows, repeated over the data shards and
        the accumulated micro-batches), without allocating parameters or reading data: for the local devices
        or, built under `sharding.use_devices`, a compile-only target (`jtrainer check` calls the same
        `sizing.abstract_step` functions without a Trainer)."""
        return self.compile_traced(self.trace_train_step(example, num_training_steps))

    def trace_train_step(self, example: data.Batch, num_training_steps: int) -> jax.stages.Traced:
        """`compile_train_step`'s program, traced."""
        sample = abstract_step.global_sample(example, self.args.per_device_train_batch_size, self.mesh)
        spec = self._loss_spec(sample)
        tx, shardings, state = self._abstract_train_state(num_training_steps)
        step = self._compiled_train_step(tx, spec, shardings)
        return abstract_step.trace_train_step(
            step, state, sample, self.args.gradient_accumulation_steps, self._state_layout()
        )

    def compile_traced(self, traced: jax.stages.Traced) -> jax.stages.Compiled:
        """A traced step lowered and compiled on this trainer's mesh."""
        return abstract_step.compile_traced(traced, self._state_layout())

    def compile_eval_step(self, example: data.Batch, num_training_steps: int) -> jax.stages.Compiled:
        """The eval step `evaluate()` runs during training (on the train state's parameters; returning logits
        when there are metrics to compute from them, as HF), compiled ahead of time for batches of
        `per_device_eval_batch_size` rows shaped like `example` per data shard. Like `compile_train_step`,
        nothing is allocated."""
        sample = abstract_step.global_sample(example, self.args.per_device_eval_batch_size, self.mesh)
        spec = self._loss_spec(sample, training=False)
        _, _, state = self._abstract_train_state(num_training_steps)
        loss_only = self._evaluate_loss_only()
        want_logits = not (self.args.prediction_loss_only if loss_only is None else loss_only) and not self._generates()
        step = self._eval_step(spec, want_logits, self._ignore_keys(None))
        return abstract_step.compile_eval_step(step, state, sample, self._state_layout())

    def _abstract_train_state(self, num_training_steps: int):
        """(optimizer, state shardings, the train state as ShapeDtypeStructs laid out by them): the state training
        would create, without creating it."""
        self.create_optimizer_and_scheduler(num_training_steps)
        tx = self._step_optimizer()
        return (tx, *self._abstract_train_state_of(tx))

    def _abstract_train_state_of(self, tx: optax.GradientTransformation) -> tuple[TrainState, TrainState]:
        """(state shardings, the train state `tx` would start from as ShapeDtypeStructs on them)."""
        return abstract_step.abstract_train_state(self.nnx_model, tx, self._state_layout(), self.args)

    def _step_optimizer(self) -> optax.GradientTransformation:
        """The optimizer as the step applies it (`abstract_step.step_optimizer`)."""
        return abstract_step.step_optimizer(self._optax_optimizer(), self.args)

    def _model_params(self):
        """The parameters HF's model holds now: the trained ones, or, for a schedule-free optimizer after an
        evaluation (HF's `optimizer.eval()`), its x parameters."""
        train_state = self._train_state
        assert train_state is not None, "no train state yet: nothing trained to read"
        params = train_state.params
        if self._optimizer_eval_mode:
            evaluated = optim.schedule_free_eval_params(train_state.opt_state, params)
            params = params if evaluated is None else evaluated
        return params

    def _sync_model(self) -> None:
        """Write (copies of) the trained parameters into `self.model`, in place, as HF trains the model given."""
        if self._train_state is not None:
            _, params, _ = split_params(self.nnx_model)
            nnx.replace_by_pure_dict(params, jax.tree.map(jnp.copy, self._model_params()))
            # Frozen weights (peft's base) never change, and the model keeps its own (full-precision) ones.
            _, changing = nnx.split_state(self._train_state.model_state, Frozen, ...)
            nnx.update(self.nnx_model, params, jax.tree.map(jnp.copy, changing))
            self._held.publish((self._train_state, self._optimizer_eval_mode))

    def _release_train_state(self) -> None:
        """Let the train state's device memory go (a finished trial of a search); the model keeps its weights."""
        self._train_state = None

    # ---------------------------------------------------------------------------------------------- training
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {', '.join(kwargs)}.")
        self._hp_search_setup(trial)
        args = self.args
        if self.model_init is not None:
            host_rng.set_seed(args.seed, args.full_determinism)  # HF seeds again before model_init
            self.model = self.call_model_init(trial)
            self._apply_chunked_loss()
            self.callback_handler.model = self.model
            self.model_accepts_loss_kwargs = loss_rules.accepts_loss_kwargs(self._inspected_model)
            self._forget_optimizer()
            self._train_state = None
            self._check_layout()
        self._held.prepare_checkpointing(args)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = checkpoint.get_last_checkpoint(args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({args.output_dir})")
        if resume_from_checkpoint and not storage.isfile(
            storage.join(resume_from_checkpoint, checkpoint.TRAINER_STATE_NAME)
        ):
            raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")
        # One run per output_dir: nothing is written there before the lock is taken (see run_lock.py).
        with run_lock.hold(args.output_dir, is_main=args.process_index == 0):
            if self.args.should_save:
                for path in checkpoint.remove_uncommitted(args.output_dir):
                    logger.warning("Removed %s, a checkpoint that was never committed.", path)
            startup.enable_compilation_cache(startup.run_cache_dir(args))
            self.neftune_noise_alpha = args.neftune_noise_alpha
            if self.neftune_noise_alpha is not None:
                self._set_neftune(self.neftune_noise_alpha)
            try:
                with sigterm_notice() as preemption:
                    if args.auto_find_batch_size:
                        return self._train_with_batch_size_search(
                            resume_from_checkpoint or None, trial, ignore_keys_for_eval, preemption
                        )
                    return self._inner_training_loop(
                        resume_from_checkpoint or None, trial, ignore_keys_for_eval, preemption
                    )
            except BaseException:  # an exception in user code, Ctrl-C, a failed step: keep the finished checkpoint
                self._finish_checkpoint_after_error()
                raise
            finally:
                if self.neftune_noise_alpha is not None:  # as HF, the noise is for training only
                    self._set_neftune(None)

    def _train_with_batch_size_search(
        self, resume_from_checkpoint, trial, ignore_keys_for_eval, preemption: PreemptionNotice
    ) -> TrainOutput:
        """auto_find_batch_size: on out of memory, retry with a smaller per-device batch and more accumulation
        (the effective batch stays the same; see batch_size.py). The run's arguments become a copy with the batch
        found (HF's trainer.args shows it too); the arguments given are not changed."""
        given = self.args
        start = self._found_batch_size(resume_from_checkpoint) if resume_from_checkpoint else None

        def attempt(args):
            if args is not self.args:  # another batch: the train state is built again
                self.args, self._train_state = args, None
            return self._inner_training_loop(resume_from_checkpoint, trial, ignore_keys_for_eval, preemption)

        def on_retry(args, smaller: int, error: BaseException) -> None:
            logger.warning(
                "auto_find_batch_size: out of memory with per_device_train_batch_size=%d (%s); retrying with "
                "per_device_train_batch_size=%d and gradient_accumulation_steps=%d.",
                args.per_device_train_batch_size,
                str(error).splitlines()[0][:200],
                smaller,
                args.per_device_train_batch_size * args.gradient_accumulation_steps // smaller,
            )

        return batch_size.search(attempt, given, start=start, on_retry=on_retry)

    def _found_batch_size(self, folder: str) -> TrainingArguments | None:
        """HF: resuming under auto_find_batch_size starts from the batch the search had found (the checkpoint's
        `train_batch_size`) instead of searching again; here with the accumulation that keeps the effective batch.
        None: start from the arguments' batch."""
        saved = saving.load_trainer_state(folder).train_batch_size
        if not saved:
            return None
        args = self.args
        effective = args.per_device_train_batch_size * args.gradient_accumulation_steps
        per_device = batch_size.per_device_from_state(saved, args.world_size, sharding.data_parallel_size(self.mesh))
        if effective % per_device:
            logger.warning(
                "auto_find_batch_size: the checkpoint's train_batch_size=%d does not divide the effective "
                "batch (%d per device); searching again.",
                saved,
                effective,
            )
            return None
        if per_device == args.per_device_train_batch_size:
            return None
        logger.info(
            "auto_find_batch_size: resuming with the checkpoint's per_device_train_batch_size=%d and "
            "gradient_accumulation_steps=%d.",
            per_device,
            effective // per_device,
        )
        return batch_size.with_batch(args, per_device, effective // per_device)

    def _exit_if_preempted(self, run: TrainingRun, trial) -> None:
        """After a step: if any process got SIGTERM, all save this step's checkpoint and exit with code 0 — or,
        with HF's JITCheckpointCallback (enable_jit_checkpoint), stop training as HF does: train() returns. If
        any process of several got Ctrl-C, all raise KeyboardInterrupt here, at the same step."""
        agreed = distributed.agree_max(run.preemption.agreed_code())
        if agreed == 2:
            raise KeyboardInterrupt
        if not agreed:
            return
        graceful = [cb for cb in self.callback_handler.callbacks if isinstance(cb, JITCheckpointCallback)]
        if graceful and graceful[0].checkpoint_saved:
            return
        folder = checkpoint.checkpoint_folder(self._get_output_dir(trial), self.state.global_step)
        pending = self._pending_checkpoint is not None and self._pending_checkpoint.folder == folder
        if not pending and not storage.isdir(folder):
            self._save_checkpoint(trial)
            self._announce_save()
        self._commit_pending_checkpoint()
        if graceful:
            graceful[0].checkpoint_saved = True
            self.control.should_save, self.control.should_training_stop = False, True
            logger.warning("Immediate JIT checkpoint completed successfully: %s; training stops here.", folder)
            return
        logger.warning("Preempted: saved %s; resume with train(resume_from_checkpoint=True).", folder)
        raise SystemExit(0)

    def num_examples(self, dataloader) -> int:
        """HF's: the rows of the loader's dataset, or its batches times the per-device batch size without one."""
        try:
            return len(dataloader.dataset)
        except (AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """HF's: rows per optimizer step over every data-parallel device (the step's global batch times the
        accumulation)."""
        rows = args.per_device_train_batch_size * sharding.data_parallel_size(self.mesh)
        return rows * args.gradient_accumulation_steps

    def get_tp_size(self) -> int:
        """HF's tensor-parallel size: the mesh's `tensor` axis."""
        return int(self.mesh.shape[sharding.TENSOR])

    def get_cp_size(self) -> int:
        """HF's context-parallel size (sequences split across devices): the mesh's `sequence` axis."""
        return int(self.mesh.shape[sharding.SEQUENCE])

    def get_sp_size(self) -> int:
        """HF's DeepSpeed (Ulysses) sequence-parallel size: 1, jtrainer's sequence axis is get_cp_size's."""
        return 1

    def end(self) -> None:
        """HF's end of a script: the processes' group is shut down (jtrainer has no accelerate trackers; the
        report_to integrations finish their runs at the end of train(), as in HF). Call it once, after
        everything that needs the other processes."""
        if jax.process_count() > 1:
            jax.distributed.shutdown()

    def set_initial_training_values(
        self, args: TrainingArguments, loader: data.BatchLoader
    ) -> tuple[int, int, int, int, float]:
        """HF's set_initial_training_values: (epochs, updates/epoch, micro-batches/epoch, max_steps, samples)."""
        ga = args.gradient_accumulation_steps
        total_batch = loader.batch_size * ga
        if loader.sized:
            n_batches = len(loader)
            if n_batches == 0:
                raise ValueError(
                    f"The train dataset has {self.num_examples(loader)} rows, fewer than one batch of "
                    f"{loader.batch_size} with dataloader_drop_last=True: lower the batch size or keep the last batch."
                )
            updates_per_epoch = max(n_batches // ga + int(n_batches % ga > 0), 1)
            if args.max_steps > 0:
                max_steps = args.max_steps
                epochs = max_steps // updates_per_epoch + int(max_steps % updates_per_epoch > 0)
                num_samples: float = max_steps * total_batch
            else:
                max_steps = math.ceil(args.num_train_epochs * updates_per_epoch)
                epochs = math.ceil(args.num_train_epochs)
                num_samples = self.num_examples(loader) * args.num_train_epochs  # HF's: a float for fractional epochs
            return epochs, updates_per_epoch, n_batches, max_steps, num_samples
        max_steps = args.max_steps
        return sys.maxsize, max_steps, max_steps * ga, max_steps, max_steps * total_batch

    def _inner_training_loop(
        self, resume_from_checkpoint, trial, ignore_keys_for_eval, preemption: PreemptionNotice | None = None
    ) -> TrainOutput:
        """HF 5.x's loop, by the same named steps: set_initial_training_values, _init_training_state,
        _prepare_for_training, _run_epoch per epoch, _finalize_training. Its state is one TrainingRun."""
        args = self.args
        loader = check_loader(self, self.get_train_dataloader(), "get_train_dataloader")
        epochs, updates_per_epoch, steps_in_epoch, max_steps, num_train_samples = self.set_initial_training_values(
            args, loader
        )
        self._init_training_state(max_steps, loader, trial)
        run = self._prepare_for_training(max_steps, loader, resume_from_checkpoint, updates_per_epoch)
        run.epochs, run.steps_in_epoch = epochs, steps_in_epoch
        run.preemption = preemption or PreemptionNotice()

        self.callback_handler.train_dataloader = loader
        self.state.init_training_references(self, max_steps, epochs, trial)
        self._log_training_banner(run, resume_from_checkpoint)
        run.start_time = time.time()
        run.initial_num_input_tokens_seen = self.state.num_input_tokens_seen
        run.initial_global_step = self.state.global_step
        run.losses, run.throughput = LossLog(self.state.global_step), Throughput()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start:
            self._evaluate(trial, ignore_keys_for_eval, skip_scheduler=True)
            run.loader.draw_from(host_rng.capture())  # HF's training loader draws after this evaluation's

        for epoch in range(run.epochs_trained, epochs):
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            self._run_epoch(run, epoch, trial, ignore_keys_for_eval)
            if self.control.should_training_stop:
                break
        loop_state = run.saved_loop_state()
        if loop_state is not None and loop_state.collator_rng is not None:
            # HF's collator draws from the process's generators: later draws (evaluation) follow the training ones.
            host_rng.restore(loop_state.collator_rng)
        return self._finalize_training(run, trial, num_train_samples)

    def _init_training_state(self, max_steps: int, loader: data.BatchLoader, trial) -> None:
        """A fresh TrainerState for this run (a resume replaces it in _prepare_for_training)."""
        self.state = TrainerState(stateful_callbacks=_stateful([*self.callback_handler.callbacks, self.control]))
        self.state.is_hyper_param_search = trial is not None
        self.state.train_batch_size = loader.batch_size // self.args.world_size
        self.state.compute_steps(self.args, max_steps)
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()

    def _prepare_for_training(self, max_steps, loader, resume_from_checkpoint, updates_per_epoch) -> TrainingRun:
        """Probe the first batch for the loss rules, build the optimizer and the train state (restored when
        resuming) and the compiled step."""
        args = self.args
        # The training collator draws from its own stream of host randomness, so its draws do not depend on how
        # far ahead the prefetch thread runs; each step remembers the stream's state after its batches.
        loader.rng_stream = host_rng.RngStream(host_rng.capture())
        self._run = None  # a checkpoint saved before this run's first step keeps no loop state
        pad_id = getattr(self.processing_class, "pad_token_id", None) or 0
        bucketed = args.train_sampling_strategy == "group_by_length"
        shapes = data.ShapeKeeper(loader.local_rows, pad_id, agree=distributed.agree_max, buckets=bucketed)
        first = loader.peek()  # the next iteration yields it: no batch is lost to the probe
        # A random collator (or transform) and evaluations during training: HF's one generator interleaves their
        # draws, which jtrainer follows by preparing each step's batches when the step needs them (no prefetch).
        step_by_step = loader.rng_stream.drawn and (
            args.eval_strategy != IntervalStrategy.NO or bool(getattr(args, "eval_on_start", False))
        )
        if loader.rng_stream.drawn:
            logger.warning(
                "The data collator draws from the host's random generators (random masking): its draws are "
                "transformers.Trainer's where the model draws nothing from torch's generator (no torch dropout)%s. "
                "See docs/training.md.",
                "; with evaluations during training, each step's batches are prepared when it runs (no prefetch)"
                if step_by_step
                else "",
            )
        spec = self._loss_spec(shapes.pad(first, shapes.sequence_length([first])))
        shapes.length = None  # the probe must not fix the sequence length

        self.create_optimizer_and_scheduler(max_steps)
        check_optimizer_override(self)
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = self.optimizer, self.lr_scheduler
        tx = self._step_optimizer()
        epochs_trained, skip, resumed_loop_state = 0, 0, None
        if resume_from_checkpoint is not None:
            # Restored straight onto the state's shardings: no fresh state is built only to be overwritten (at
            # 8B that would hold two train states at once), except when the optimizer's wrappers changed.
            state_shardings, like = self._abstract_train_state_of(tx)
            train_state, epochs_trained, skip, resumed_loop_state = self._resume(
                resume_from_checkpoint, like, updates_per_epoch, fresh=lambda: self._initial_train_state(tx)[0]
            )
            train_state = train_state.replace(opt_state=self._resumed_optimizer_state(train_state.opt_state))
        else:
            train_state, state_shardings = self._initial_train_state(tx)
        self._train_state = train_state
        self._run = TrainingRun(
            loader,
            shapes,
            self._compiled_train_step(tx, spec, state_shardings),
            updates_per_epoch,
            ragged_tail=self._keeps_ragged_rows(spec),
            label_classes=self._label_classes(spec),
            epochs_trained=epochs_trained,
            skip=skip,
            resumed_loop_state=resumed_loop_state,
            step_by_step=step_by_step,
        )
        return self._run

    def _log_training_banner(self, run: TrainingRun, resume_from_checkpoint) -> None:
        """HF's "***** Running training *****" summary."""
        args, loader = self.args, run.loader
        hf_logger.info("***** Running training *****")
        if loader.sized:
            hf_logger.info(f"  Num examples = {self.num_examples(loader):,}")
        hf_logger.info(f"  Num Epochs = {run.epochs:,}")
        hf_logger.info(f"  Num update steps per epoch = {run.updates_per_epoch:,}")
        hf_logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
        total = loader.batch_size * args.gradient_accumulation_steps
        hf_logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total:,}")
        hf_logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
        hf_logger.info(f"  Total optimization steps = {self.state.max_steps:,}")
        assert self._train_state is not None, "built by _prepare_for_training"
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self._train_state.params))
        hf_logger.info(f"  Number of trainable parameters = {count:,}")
        if resume_from_checkpoint is not None:
            hf_logger.info(
                f"  Resuming training from checkpoint with epoch {run.epochs_trained} and global step "
                f"{self.state.global_step}"
            )

    def _run_epoch(self, run: TrainingRun, epoch: int, trial, ignore_keys_for_eval) -> None:
        """One pass over the train dataloader (HF's _run_epoch): a compiled step per accumulation window."""
        args, loader, shapes = self.args, run.loader, run.shapes
        loader.set_epoch(epoch)
        skip = run.skip if epoch == run.epochs_trained else 0
        resumed = run.resumed_loop_state if epoch == run.epochs_trained else None
        windows = self._windows(loader, shapes, run.updates_per_epoch, run.steps_in_epoch, skip, resumed)
        # With many processes, agreeing on shapes is a collective: it must run on the main thread, in step
        # order with the train steps. On one process the background thread also pads and places batches.
        in_background = jax.process_count() == 1
        if in_background:
            windows = (self._prepare_window(run, *item) for item in windows)
        step = skip - 1
        metrics = None
        main_input = getattr(self.model, "main_input_name", "input_ids")
        prefetch = data.Prefetcher(windows, 0 if run.step_by_step else args.prefetch_batches)
        try:
            for item in prefetch:
                window = item if in_background else self._prepare_window(run, *item)
                batches, step_batch = window.batches, window.step_batch
                run.loop_state = window.loop_state  # as of this step: what its checkpoint saves
                run.generators_after_step, run.read_ahead = window.generators_after, window.read_ahead
                for i, batch in enumerate(batches):
                    step += 1
                    if i == 0:
                        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                    self.current_flos += float(self.floating_point_ops(batch))
                    self._track_num_input_tokens(batch)
                    run.throughput.count(batch, main_input, jax.process_count())
                    if i < len(batches) - 1:
                        self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
                with self._mesh_context():
                    if args.auto_find_batch_size and self.state.global_step == run.initial_global_step:
                        compiled = run.train_step.lower(self._train_state, step_batch).compile()
                        batch_size.check_fits(compiled, args.per_device_train_batch_size)
                    self._optimizer_train()  # HF's training_step: optimizer.train()
                    self._train_state = self._before_update(self._train_state)
                    self._train_state, metrics = run.train_step(self._train_state, step_batch)
                self._after_update()
                run.last_step_batch = step_batch
                run.losses.add(metrics["micro_losses"], len(batches))
                if "recorded" in metrics:
                    self._on_recorded(metrics["recorded"], len(batches), training=True)
                run.follow_device(metrics["micro_losses"])
                self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
                self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
                self.state.global_step += 1
                self.state.epoch = epoch + (step + 1) / run.steps_in_epoch
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                self._maybe_log_save_evaluate(run, metrics, trial, epoch, ignore_keys_for_eval)
                self._poll_pending_checkpoint()
                self._exit_if_preempted(run, trial)
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
        self._maybe_log_save_evaluate(run, metrics, trial, epoch, ignore_keys_for_eval)

    def _prepare_window(
        self, run: TrainingRun, batches, collator_rng, generators_after=None, read_ahead=False
    ) -> "PreparedWindow":
        step_batch = self._step_batch(run, batches)
        loop_state = LoopState(collator_rng, run.shapes.length)
        return PreparedWindow(batches, step_batch, loop_state, generators_after, read_ahead)

    def _windows(self, loader, shapes, updates_per_epoch, steps_in_epoch, skip, resumed: LoopState | None = None):
        """Yield each optimizer step's micro-batches (this process's rows) for one epoch, HF's get_batch_samples,
        with the collator's host generator state after them; `resumed`: the checkpoint's loop state (the resumed
        epoch only)."""
        ga = self.args.gradient_accumulation_steps
        iterator = iter(loader)
        for _ in range(skip):
            next(iterator, None)
        if resumed is not None:  # resumed: draw on from where the checkpoint's step left off
            if resumed.collator_rng is not None:
                loader.rng_stream.state = resumed.collator_rng
            shapes.length = resumed.padded_length  # pad as the run did (shapes change XLA's summation order)
        remainder = steps_in_epoch % ga or ga
        stream = loader.rng_stream
        state = lambda: stream.state if stream is not None else None  # noqa: E731
        ahead = next(iterator, None)  # HF's loader reads one batch ahead of the loop (accelerate's DataLoaderShard)
        if resumed is not None and resumed.collator_rng_after_next is not None:
            loader.rng_stream.state = resumed.collator_rng_after_next  # the saved run's evaluation drew next
        for update_step in range(skip // ga, updates_per_epoch):
            wanted = ga if update_step != updates_per_epoch - 1 else remainder
            batches: list[data.Batch] = []
            after = None
            while len(batches) < wanted and ahead is not None:
                batches.append(ahead[0])
                after = state()  # the stream after this window's batches: what a checkpoint resumes from
                ahead = next(iterator, None)
            if not batches:
                return
            yield batches, after, state(), ahead is not None

    def _num_classes(self) -> int | None:
        """How many classes the model's logits score, for label checks (None: not a classifier, or regression /
        multi-label targets, whose labels are floats)."""
        config = getattr(self.model, "config", None)
        if config is None:
            return None
        if "Classification" in type(self._inspected_model).__name__:
            regression = config.num_labels == 1 or config.problem_type in ("regression", "multi_label_classification")
            return None if regression else config.num_labels
        return getattr(config, "vocab_size", None)

    def _check_labels(self, batch: data.Batch, num_classes: int | None) -> None:
        """Class labels must lie in [0, num_classes) (the loop computes `_label_classes(spec)` once)."""
        if num_classes is not None:
            for name in self.label_names:
                if name in batch:
                    check_class_labels(batch[name], num_classes, name)

    def _keeps_ragged_rows(self, spec: LossSpec) -> bool:
        """HF on one device sees a ragged last batch at its own rows. Padding rows is exact only for a loss
        that ignores them; otherwise, on one data shard, that batch runs at its own rows (one more compilation,
        kept by the persistent cache). Several data shards complete it with the epoch's first rows instead, as
        HF's distributed sampler does (`BatchLoader.complete_last`)."""
        return not spec.padding_neutral and sharding.data_parallel_size(self.mesh) == 1

    def _step_batch(self, run: TrainingRun, batches) -> StepBatch:
        """Pad and stack one window, then place it on the mesh as global arrays."""
        shapes, global_rows = run.shapes, run.loader.batch_size
        for batch in batches:
            self._check_labels(batch, run.label_classes)
        window = data.assemble_window(batches, self.args.gradient_accumulation_steps, shapes, run.ragged_tail)
        sharding.check_length_divisible(shapes.length, self.mesh)
        replicated = sharding.replicated(self.mesh)
        tail = None
        if window.tail is not None:
            rows = next(iter(window.tail.values())).shape[0]
            tail = sharding.put_global(window.tail, self.mesh, row_dim=0, global_rows=rows)
        return StepBatch(
            inputs=sharding.put_global(window.stacked, self.mesh, row_dim=1, global_rows=global_rows),
            micro_weight=jax.make_array_from_process_local_data(replicated, window.weights, window.weights.shape),
            tail=tail,
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

    def _take_losses(self, losses: LossLog) -> float:
        """The summed losses since the last log (HF's NaN/Inf filter, training_run.summed_step_losses)."""
        seen = losses.non_finite
        summed = losses.take(self.args.logging_nan_inf_filter, self.args.nan_inf_policy)
        shards = sharding.data_parallel_size(self.mesh)
        if self.args.logging_nan_inf_filter and not seen and losses.non_finite and shards > 1:
            logger.warning(
                "A NaN/Inf loss was left out of the logged loss for the whole global micro-batch: HF, with one "
                "process per shard, leaves out only the shards whose own loss is non-finite, so on %d data shards "
                "the logged loss can differ from HF's after such a step (the update and the parameters do not).",
                shards,
            )
        return summed

    def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler: bool = False) -> dict[str, float]:
        """HF's evaluation during training: evaluate(), a per-evaluation scheduler's step on its metric (its
        rate goes into the train state), the hyperparameter search's report."""
        metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
        if self._per_evaluation_scheduler() is not None and not skip_scheduler:
            assert self._train_state is not None, "evaluations during training follow the first step"
            self._train_state = self._plateau_stepped(self._plateau_metric(metrics), self._train_state)
        self._report_to_hp_search(trial, self.state.global_step, metrics)
        return metrics

    def _maybe_log_save_evaluate(self, run: TrainingRun, metrics, trial, epoch, ignore_keys_for_eval) -> None:
        losses = run.losses
        if self.control.should_log and self.state.global_step > losses.last_logged_step:
            host = jax.device_get(metrics)
            tr_loss = self._take_losses(losses)
            logs = {"loss": tr_loss / (self.state.global_step - losses.last_logged_step)}
            logs["grad_norm"] = float(host["grad_norm"])
            if "learning_rate" in host:
                logs["learning_rate"] = self._host_learning_rate(host["learning_rate"], host["schedule_count"])
            if "skipped_updates" in host:
                logs["skipped_updates"] = int(host["skipped_updates"])
            if self.args.log_throughput:
                logs.update(run.throughput.take(self.model))
            losses.total += tr_loss
            losses.last_logged_step = self.state.global_step
            self.store_flos()
            self.log(logs, run.start_time)
        if self.control.should_evaluate:
            with host_rng.continued_by_process(run.loader.rng_stream, run.step_by_step):
                eval_metrics = self._evaluate(trial, ignore_keys_for_eval)
            is_new_best = self._determine_best_metric(eval_metrics)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = is_new_best
        if self.control.should_save:
            self._save_checkpoint(trial)
            self._announce_save()

    def _finalize_training(self, run: TrainingRun, trial, num_train_samples) -> TrainOutput:
        run.losses.total += self._take_losses(run.losses)
        hf_logger.info("\n\nTraining completed. Do not forget to share your model on huggingface.co/models =)\n\n")
        steps_trained = self.state.global_step - run.initial_global_step
        train_loss = run.losses.total / max(steps_trained, 0.001)
        metrics = speed_metrics(
            "train",
            run.start_time,
            num_samples=num_train_samples * steps_trained / max(self.state.max_steps, 1),
            num_steps=steps_trained,
        )
        self.store_flos()
        _continue_generators_after(run)
        metrics["total_flos"] = self.state.total_flos
        metrics["train_loss"] = train_loss
        if not self.args.skip_memory_metrics:
            metrics.update(self.memory_report())
        self._sync_model()
        self._commit_pending_checkpoint()
        self.log(metrics)
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            best = self._best_train_state(self._train_state)
            if best is not None:
                self._train_state = best
                self._sync_model()
        run_dir = self._get_output_dir(trial)
        if self.args.should_save and self.state.best_model_checkpoint is not None and self.args.save_total_limit == 1:
            for folder in checkpoint.checkpoint_folders(run_dir):  # HF: only the best is left
                if not _same_folder(folder, self.state.best_model_checkpoint):
                    checkpoint.remove_checkpoint(folder)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def memory_report(self, prefix: str = "train") -> dict[str, int]:
        """Bytes per device of parameters and optimizer state (from their shards), the step's temporaries
        (activations, from XLA's memory analysis of the compiled step) and this host's peak resident memory."""
        import resource

        state = self._train_state
        assert state is not None and self._run is not None, "after a training step"
        report = {
            f"{prefix}_mem_params_bytes_per_device": max(sharding.per_device_bytes(state.params).values()),
            f"{prefix}_mem_optimizer_bytes_per_device": max(
                sharding.per_device_bytes(state.opt_state).values(), default=0
            ),
        }
        run = self._run
        if run is not None and run.last_step_batch is not None:
            with self._mesh_context():
                analysis = run.train_step.lower(state, run.last_step_batch).compile().memory_analysis()
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
                initial = self._run.initial_num_input_tokens_seen if self._run is not None else 0
                seen = self.state.num_input_tokens_seen - initial
                logs.update(speed_metrics("train", start_time, num_tokens=seen))
        output = {**logs, "step": self.state.global_step}
        self.state.log_history.append(output)
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)


__all__ = ["Trainer"]
