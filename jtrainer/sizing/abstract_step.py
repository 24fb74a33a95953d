"""The train and eval steps ahead of time, as free functions of the arguments, the held model and the mesh: the
run's mesh and the parameters' layout, the optimizer as the step applies it, the train state's shardings and
shapes, the jitted steps and their programs on a batch's shapes. The Trainer builds the steps it runs with these,
and `jtrainer check` calls the same functions without building a Trainer (as MaxText's train_compile calls its
trainer's own)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jtrainer import kinds
from jtrainer.core.state import TrainState, split_params
from jtrainer.kinds import loss_rules
from jtrainer.kinds.protocol import TrainedModel
from jtrainer.numerics import mixed_precision, optim, schedules
from jtrainer.numerics.step import (
    LossSpec,
    MicroBatching,
    PreprocessPlacement,
    StepBatch,
    cast_frozen,
    graphdef_in_mode,
    make_eval_step,
    make_train_step,
)
from jtrainer.parallel import sharding

logger = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]


def run_mesh(args: Any) -> jax.sharding.Mesh:
    """The run's device mesh, from the arguments' parallelism over every device."""
    mesh = sharding.make_mesh(sharding.resolve_mesh_shape(args, len(sharding.mesh_devices())))
    if not args.average_tokens_across_devices and sharding.data_parallel_size(mesh) > 1:
        raise ValueError(
            "average_tokens_across_devices=False normalises each data shard's loss by its own label count (HF's "
            "per-process rule), which one global step does not reproduce: leave it True (HF's default) on "
            f"{sharding.data_parallel_size(mesh)} data shards."
        )
    return mesh


def tracing(mesh: jax.sharding.Mesh, axis_rules: Any) -> contextlib.ExitStack:
    """The mesh and logical rules under which model code traces (activation constraints read them)."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(sharding.axis_rules(axis_rules))
    return stack


@dataclasses.dataclass(frozen=True)
class Layout:
    """The mesh the steps run over, the logical axis rules, and the parameters' partition specs by them."""

    mesh: jax.sharding.Mesh
    axis_rules: Any
    param_specs: Any

    @classmethod
    def of(cls, module: nnx.Module, mesh: jax.sharding.Mesh, axis_rules: Any) -> Layout:
        """Every sharding error (mesh vs heads, dimensions vs axis sizes) is raised here, before compiling."""
        if hasattr(module, "check_mesh"):
            module.check_mesh(mesh)
        return cls(mesh, axis_rules, sharding.param_specs(module, mesh, axis_rules))

    def tracing(self) -> contextlib.ExitStack:
        return tracing(self.mesh, self.axis_rules)


def use_chunked_loss(module: Any, args: Any, model_name: str) -> None:
    """The causal-LM loss in chunks of positions where nothing but the loss reads the logits (the model's
    `loss_chunk_positions`), and use_liger_kernel's skip_logits in every training call (HF patches in Liger's
    fused linear cross-entropy). A model without the chunked loss trains with whole logits; with
    use_liger_kernel it says so, as HF's Liger integration does for model types it has no kernels for."""
    positions = args.chunked_loss_positions()
    if not getattr(module, "chunks_causal_lm_loss", False):
        if args.use_liger_kernel and positions is not None:
            logger.warning(
                "use_liger_kernel: %s has no chunked loss (causal LMs of jtrainer's families and transformers' "
                "have); it trains with whole logits.",
                model_name,
            )
        return
    module.loss_chunk_positions = positions
    module.skip_logits_in_training = bool(args.use_liger_kernel and positions is not None)


def step_optimizer(tx: optax.GradientTransformation, args: Any) -> optax.GradientTransformation:
    """The optimizer as the step applies it: HF's gradient clipping in front (max_grad_norm > 0), under fp16's
    dynamic loss scaling (which skips non-finite updates itself), or skipping non-finite updates when
    nan_inf_policy='skip'."""
    if args.max_grad_norm and args.max_grad_norm > 0:
        tx = optim.clip_grad_norm(tx, float(args.max_grad_norm))
    if args.fp16:
        return mixed_precision.dynamic_loss_scaling(tx)
    if args.nan_inf_policy == "skip":
        return optim.skip_non_finite(tx)
    return tx


def state_shardings(tx: optax.GradientTransformation, params: Any, module: nnx.Module, layout: Layout) -> TrainState:
    """NamedShardings of the train state: parameters and their optimizer moments by the logical rules."""
    replicated = sharding.replicated(layout.mesh)
    param_shardings = sharding.named(layout.mesh, layout.param_specs)
    # Moments shaped like their parameter share its sharding; others (Adafactor's factored rows and
    # columns, scalars) are replicated.
    masked = lambda leaf: isinstance(leaf, optax.MaskedNode)  # noqa: E731  (multi_transform: other groups')
    opt_shardings = optax.tree_map_params(
        tx,
        lambda leaf, s, param: leaf if masked(leaf) else s if leaf.shape == param.shape else replicated,
        jax.eval_shape(tx.init, params),
        param_shardings,
        params,
        transform_non_params=lambda _: replicated,
        is_leaf=masked,
    )
    return TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=opt_shardings,
        model_state=sharding.model_state_shardings(module, layout.mesh, layout.axis_rules),
        rng=replicated,
    )


def train_state_init(tx: optax.GradientTransformation, args: Any) -> Callable[..., TrainState]:
    """The pure (params, model_state) -> fresh TrainState function: the step counter at 0, the optimizer's fresh
    state, frozen weights (peft's base) held as they compute, the run's seed."""
    seed = args.seed
    frozen_dtype = args.compute_dtype(True)

    def init(params, rest):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            model_state=cast_frozen(rest, frozen_dtype),
            rng=jax.random.key_data(jax.random.key(seed)),
        )

    return init


def abstract_train_state(
    module: nnx.Module, tx: optax.GradientTransformation, layout: Layout, args: Any
) -> tuple[TrainState, TrainState]:
    """(state shardings, the train state `tx` would start from as ShapeDtypeStructs on them): the state training
    would create, without creating it."""
    _, param_state, rest = split_params(module)
    params = nnx.to_pure_dict(param_state)
    shardings = state_shardings(tx, params, module, layout)
    shapes = jax.eval_shape(train_state_init(tx, args), params, rest)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    return shardings, state


def train_step(graphdef: Any, tx: optax.GradientTransformation, spec: LossSpec, shardings: TrainState, mesh):
    """The jitted train step (state, StepBatch) -> (state, metrics), its state donated and laid out on
    `shardings`."""
    return jax.jit(
        make_train_step(graphdef, tx, spec, grad_shardings=shardings.params),
        out_shardings=(shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
    )


def eval_micro_batching(args: Any, mesh: jax.sharding.Mesh) -> MicroBatching | None:
    """Eval batches larger than training's: micro-batches of per_device_train_batch_size rows a data shard, the
    rows training holds activations for (the eval step splits only a loss-only evaluation of the model's own
    chunked loss, which the parts add up to: `make_eval_step`)."""
    if args.per_device_eval_batch_size <= args.per_device_train_batch_size:
        return None
    return MicroBatching(args.per_device_train_batch_size, sharding.data_parallel_size(mesh))


def eval_step(
    graphdef: Any,
    spec: LossSpec,
    want_logits: bool,
    ignore_keys: tuple[str, ...],
    micro: MicroBatching | None,
    preprocess: Callable | None = None,
    preprocess_in_torch: Callable | None = None,
):
    """The jitted eval step (params, model_state, batch) -> loss, logits, labels (`make_eval_step`) of the model's
    graph in evaluation mode, and where it ran preprocess_logits_for_metrics (set when it traces)."""
    placement = PreprocessPlacement()
    step = make_eval_step(graphdef, spec, want_logits, preprocess, ignore_keys, placement, preprocess_in_torch, micro)
    return jax.jit(step), placement


def global_sample(example: Batch, rows_per_device: int, mesh: jax.sharding.Mesh) -> Batch:
    """`example`'s rows repeated to a global batch of `rows_per_device` rows a data shard."""
    rows = rows_per_device * sharding.data_parallel_size(mesh)
    return {k: np.concatenate([np.asarray(v)] * (rows // len(v))) for k, v in example.items()}


def abstract_batch(mesh: jax.sharding.Mesh, batch: Batch, row_dim: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch's shapes laid out as training places it (rows split over the data shards), with no data."""
    shardings = sharding.batch_shardings(mesh, batch, row_dim=row_dim)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in batch.items()}


def trace_train_step(step, state: TrainState, sample: Batch, accumulation: int, layout: Layout) -> jax.stages.Traced:
    """The train step's program on a global batch shaped like `sample`, `accumulation` micro-batches a window,
    traced (its jaxpr is what `jtrainer check` reads when XLA refuses it); nothing is allocated."""
    stacked = {k: np.broadcast_to(v, (accumulation, *v.shape)) for k, v in sample.items()}
    step_batch = StepBatch(
        inputs=abstract_batch(layout.mesh, stacked, row_dim=1),
        micro_weight=jax.ShapeDtypeStruct((accumulation,), np.float32, sharding=sharding.replicated(layout.mesh)),
    )
    sharding.check_length_divisible(sample["input_ids"].shape[1] if "input_ids" in sample else None, layout.mesh)
    with layout.tracing():
        return step.trace(state, step_batch)


def compile_traced(traced: jax.stages.Traced, layout: Layout) -> jax.stages.Compiled:
    """A traced step lowered and compiled on the layout's mesh."""
    with layout.tracing():
        return traced.lower().compile()


def compile_eval_step(step, state: TrainState, sample: Batch, layout: Layout) -> jax.stages.Compiled:
    """The eval step compiled ahead of time on the train state's parameters, for batches shaped like `sample`."""
    with layout.tracing():
        return step.lower(state.params, state.model_state, abstract_batch(layout.mesh, sample, row_dim=0)).compile()


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """What a training run of the config would compile, built as the Trainer builds it (its constructor's
    model preparation, HF's loss rules, the optimizer of the arguments) from free functions, with no Trainer,
    callbacks or TrainerState (what `jtrainer check` compiles). `custom_loss_spec`: a trainer's own loss rules
    (TRL's), else HF's."""

    held: TrainedModel
    args: Any
    layout: Layout
    context: loss_rules.LossContext
    custom_loss_spec: Callable[[loss_rules.LossContext, Batch, bool], LossSpec] | None = None

    @classmethod
    def of(cls, model: Any, args: Any, custom_loss_spec=None) -> AbstractRun:
        held = kinds.adopt(model)
        held.prepare_checkpointing(args)  # activation_checkpointing, as train() sets it
        mesh = run_mesh(args)
        layout = Layout.of(held.module, mesh, sharding.merged_rules(args.logical_axis_rules))
        use_chunked_loss(held.module, args, type(model).__name__)
        held.finish_trainer_init(args)
        context = loss_rules.LossContext.of(held, args, layout.tracing)
        return cls(held, args, layout, context, custom_loss_spec)

    def loss_spec(self, sample: Batch, training: bool) -> LossSpec:
        if self.custom_loss_spec is not None:
            return self.custom_loss_spec(self.context, sample, training)
        loss_rules.require_trainable(self.context, training)
        return loss_rules.default_spec(self.context, sample, training)

    def optimizer(self, num_training_steps: int):
        """HF's optimizer and schedule of the arguments (what create_optimizer_and_scheduler builds without a
        user's optimizer), as the step applies it."""
        rate = schedules.LearningRate.from_args(self.args, num_training_steps)
        params = nnx.to_pure_dict(nnx.state(self.held.module, nnx.Param))
        mask = kinds.decay_mask(self.held, params, kinds.decay_parameter_names(self.held.given))
        tx, _ = optim.hf_optimizer(self.args, mask, rate, rate.schedule)
        return step_optimizer(tx, self.args)

    def trace_train(self, example: Batch, num_training_steps: int):
        """The train step's program for global batches of `example`'s shapes, traced, and the abstract train
        state it starts from."""
        args, module = self.args, self.held.module
        sample = global_sample(example, args.per_device_train_batch_size, self.layout.mesh)
        spec = self.loss_spec(sample, training=True)
        tx = self.optimizer(num_training_steps)
        shardings, state = abstract_train_state(module, tx, self.layout, args)
        graphdef = graphdef_in_mode(module, training=True)
        step = train_step(graphdef, tx, spec, shardings, self.layout.mesh)
        traced = trace_train_step(step, state, sample, args.gradient_accumulation_steps, self.layout)
        return traced, state

    def compile_eval(self, example: Batch, state, with_metrics: bool):
        """The eval step evaluate() runs during training, compiled for batches of `example`'s shapes: logits
        returned where metrics are computed from them (HF's prediction_loss_only otherwise)."""
        args, module = self.args, self.held.module
        sample = global_sample(example, args.per_device_eval_batch_size, self.layout.mesh)
        spec = self.loss_spec(sample, training=False)
        want_logits = with_metrics and not args.prediction_loss_only
        step, _ = eval_step(
            graphdef_in_mode(module, training=False),
            spec,
            want_logits,
            loss_rules.ignore_keys_at_inference(self.held.given),
            eval_micro_batching(args, self.layout.mesh),
        )
        return compile_eval_step(step, state, sample, self.layout)
