"""Pure step builders: `train_step(state, batch) -> (state, metrics)` and `eval_step(state, batch) -> outputs`.

Nothing here knows the Trainer. The model enters as an nnx graphdef (static) plus a pure-dict parameter tree;
how the loss is normalised is decided once on the host (`LossMode`) so the compiled step has no branches.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jtrainer.core.state import Frozen, TrainState, split_params
from jtrainer.numerics.losses import IGNORE_INDEX, count_label_tokens, shift_labels, token_cross_entropy_sum
from jtrainer.numerics.mixed_precision import loss_scale
from jtrainer.numerics.opt_state import current_learning_rate, schedule_count
from jtrainer.numerics.step_metrics import recording

# What JAX raises for code written for torch or the host (a torch method or function on a traced array, a numpy
# conversion, float() or a Python branch on a traced value: jax's tracer errors are TypeErrors). Only these move a
# user function out of a compiled step; anything else it raises is its own error and propagates.
UNTRACEABLE = (TypeError, AttributeError)


class LossMode(enum.Enum):
    """How a micro-batch's loss becomes its share of the step loss (HF's rules: training_step and compute_loss)."""

    MODEL_SUM = "model_sum"  # model takes num_items_in_batch and returns sum(token losses) / num_items
    CUSTOM = "custom"  # compute_loss_func(outputs, labels, num_items_in_batch)
    TRAINER = "trainer"  # the model returns logits only (or label smoothing): token CE sum / num_items
    MODEL_MEAN = "model_mean"  # the model returns its own mean loss: averaged over the window's micro-batches
    OVERRIDE = "override"  # a Trainer subclass's compute_loss(model, inputs, return_outputs, num_items_in_batch)


class StepBatch(NamedTuple):
    """One optimizer step's data: inputs shaped [micro_batches, rows, ...] and the micro-batch weights."""

    inputs: dict[str, jax.Array] | dict[str, jax.ShapeDtypeStruct]  # (ShapeDtypeStructs: to compile ahead)
    micro_weight: (
        jax.Array | jax.ShapeDtypeStruct
    )  # [micro_batches]: 1 for real micro-batches, 0 for padding of a short window
    # A ragged last micro-batch at its own rows [rows', ...], run after the others (its own compilation), when
    # padding rows would enter the loss (see LossSpec.padding_neutral).
    tail: dict[str, jax.Array] | None = None


@dataclass(frozen=True)
class LossSpec:
    mode: LossMode
    label_names: tuple[str, ...] = ("labels",)
    causal: bool = False  # the Trainer's own loss shifts labels (HF's causal-LM check of the label smoother)
    # HF's _loss_shifts_labels: num_items_in_batch counts labels[..., 1:] (the model's loss_type is the causal-LM
    # loss); not the same as `causal`: HF's GPT2LMHeadModel shifts in its loss but counts every label.
    count_shifted: bool = False
    label_smoothing: float = 0.0
    compute_loss_func: Callable | None = None
    compute_dtype: Any = None  # jnp.bfloat16 / float16: parameters are cast for compute, master weights stay fp32
    # HF's _get_num_items_in_batch condition: the loss is handed the window's label count (else None).
    pass_num_items: bool = True
    # HF's loss_is_scaled_for_ga: the loss is already normalised over the window; else divided by its micro-batches.
    scaled_for_ga: bool = True
    accepts_loss_kwargs: bool = False  # HF's model_accepts_loss_kwargs
    # HF's use_liger_kernel: a loss-only evaluation hands the model skip_logits=True (whatever the model).
    skip_logits_in_loss_only: bool = False
    # The model's own causal-LM loss, which it computes without whole logits when handed skip_logits=True
    # (models.lm_head): the train step and loss-only evaluation ask for it, as nothing else reads the logits.
    chunked_model_loss: bool = False
    compute_loss: Callable | None = None  # OVERRIDE: the subclass's bound compute_loss
    base: "LossSpec | None" = None  # OVERRIDE: the rules its super().compute_loss follows

    # TRAINER: the classes the model's logits score (their last dimension), which the labels are checked against.
    num_classes: int | None = None

    # Whether padding (rows whose labels are all -100) adds exactly 0 to the loss and its gradient: true of the
    # token losses jtrainer computes and of its models' own (sum / num_items_in_batch), decided by the Trainer.
    padding_neutral: bool = False

    # Evaluation computes the loss of batches without a label column (HF's loss_without_labels): a loss that reads
    # other columns (TRL's DPO: chosen and rejected completions).
    loss_without_labels: bool = False
    # The names the loss records (step_metrics.record: a float32 scalar each), found when the Trainer probes an
    # override: a skipped padding micro-batch records zeros under them.
    recorded: tuple[str, ...] = ()


def split_outputs(outputs: Any) -> tuple[jax.Array | None, Any]:
    """(loss, logits) from a tuple, dict or dataclass output, as HF's contract allows."""
    if isinstance(outputs, dict):
        return outputs.get("loss"), outputs.get("logits")
    if isinstance(outputs, (tuple, list)):
        if len(outputs) > 1 and jnp.ndim(outputs[0]) == 0:
            return outputs[0], outputs[1]
        return None, outputs[0]
    if hasattr(outputs, "logits") or hasattr(outputs, "loss"):
        return getattr(outputs, "loss", None), getattr(outputs, "logits", None)
    return None, outputs


def cast_floats(tree, dtype):
    """The tree with its floating-point leaves in `dtype` (None: as they are)."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def reseed_streams(model_state, key: jax.Array):
    """Replace every rng stream key of the model (dropout, ...) with one derived from `key` and the stream's
    path: randomness is a function of (seed, step, micro-batch), never carried state."""

    def reseed(path, leaf):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()))
        return leaf

    return jax.tree_util.tree_map_with_path(reseed, model_state)


def cast_frozen(model_state, dtype):
    """The model state with its frozen weights (`state.Frozen`: a peft model's base) in `dtype` (None: as they
    are), as parameters are cast for compute; the rest (buffers, keys) as it is."""
    if dtype is None:
        return model_state
    frozen, rest = nnx.split_state(model_state, Frozen, ...)
    if not jax.tree.leaves(frozen):
        return model_state
    return nnx.merge_state(cast_floats(frozen, dtype), rest)


@contextlib.contextmanager
def bound_model(graphdef, params, model_state, compute_dtype=None, rng=None):
    """The nnx model with these parameters, for one traced call (NEFTune's key set for its duration)."""
    if rng is not None:
        model_state = reseed_streams(model_state, rng)
    model_state = cast_frozen(model_state, compute_dtype)
    model = nnx.merge(graphdef, cast_floats(params, compute_dtype), model_state)
    noisy = [] if rng is None else [m for _, m in nnx.iter_graph(model) if getattr(m, "neftune_noise_alpha", None)]
    for i, module in enumerate(noisy):  # NEFTune: the step's key, handed over for this call only
        object.__setattr__(module, "_neftune_key", jax.random.fold_in(rng, i))
    try:
        yield model
    finally:
        for module in noisy:
            object.__delattr__(module, "_neftune_key")


# The attributes nnx's Module.train() / .eval() set on the modules that have them (Dropout, BatchNorm, ...).
_MODE_ATTRIBUTES = ("deterministic", "use_running_average")


def graphdef_in_mode(model: nnx.Module, training: bool):
    """The model's graph definition with its modules in train (HF's training_step: model.train()) or eval mode
    (evaluation_loop: model.eval()); the model itself keeps the mode it was in."""
    saved = [
        (module, name, getattr(module, name))
        for _, module in nnx.iter_graph(model)
        if isinstance(module, nnx.Module)
        for name in _MODE_ATTRIBUTES
        if hasattr(module, name)
    ]
    model.train() if training else model.eval()
    try:
        return split_params(model)[0]
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def model_state_of(model):
    return split_params(model)[2]


def apply_model(graphdef, params, model_state, inputs: dict[str, jax.Array], compute_dtype=None, rng=None):
    """Run the model on keyword inputs; returns (outputs, new non-parameter state)."""
    with bound_model(graphdef, params, model_state, compute_dtype, rng) as model:
        outputs = model(**inputs)
        return outputs, model_state_of(model)


_BASE_SPEC: contextvars.ContextVar[LossSpec | None] = contextvars.ContextVar("jtrainer_base_loss_spec", default=None)


# HF's compute_loss multiplies a loss normalised by the all-process num_items_in_batch by the process count
# (average_tokens_across_devices); 1 except while shard_losses traces one data shard's loss.
_PROCESS_SCALE: contextvars.ContextVar[int] = contextvars.ContextVar("jtrainer_process_scale", default=1)


# HF's current_gradient_accumulation_steps: the micro-batches of the window a loss is traced in (1 outside a train
# step). A traced count: a window cut short at the end of an epoch has fewer.
_WINDOW_MICRO_BATCHES: contextvars.ContextVar[Any] = contextvars.ContextVar("jtrainer_window_micro_batches", default=1)


def window_micro_batches():
    """While a loss is traced in a train step: the micro-batches of its window (HF's
    current_gradient_accumulation_steps); 1 elsewhere."""
    return _WINDOW_MICRO_BATCHES.get()


def active_base_spec() -> LossSpec | None:
    """While a compute_loss override is traced: the rules of the Trainer's own compute_loss (its super())."""
    return _BASE_SPEC.get()


def default_compute_loss(model, inputs: dict[str, jax.Array], spec: LossSpec, num_items_in_batch=None):
    """HF's Trainer.compute_loss on a bound nnx model: (loss, outputs).

    Labels leave the inputs when the Trainer computes the loss (label smoothing, compute_loss_func, a model that
    returns logits only); a model that takes loss kwargs gets num_items_in_batch and returns sum / num_items."""
    labels = inputs.get(spec.label_names[0]) if spec.label_names else None
    model_inputs = dict(inputs)
    if spec.mode in (LossMode.TRAINER, LossMode.CUSTOM):
        for name in spec.label_names:
            model_inputs.pop(name, None)
    if spec.mode == LossMode.MODEL_SUM and num_items_in_batch is not None:
        model_inputs["num_items_in_batch"] = num_items_in_batch
    outputs = model(**model_inputs)
    loss, logits = split_outputs(outputs)
    if labels is not None and spec.mode == LossMode.TRAINER:
        targets = shift_labels(labels) if spec.causal else labels
        count = jnp.maximum(jnp.sum(targets != IGNORE_INDEX), 1) if num_items_in_batch is None else num_items_in_batch
        loss = token_cross_entropy_sum(logits, targets, spec.label_smoothing) / count
    elif spec.mode == LossMode.CUSTOM:
        assert spec.compute_loss_func is not None
        loss = spec.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
    if num_items_in_batch is not None and (spec.accepts_loss_kwargs or spec.compute_loss_func is not None):
        assert loss is not None, "the model, or compute_loss_func, returned a loss"
        loss = loss * _PROCESS_SCALE.get()
    return loss, outputs


def compute_loss(model, inputs, spec: LossSpec, num_items_in_batch=None, return_outputs=False):
    """The loss by `spec`: the Trainer's own rules, or a subclass's compute_loss override (HF's signature)."""
    if spec.mode != LossMode.OVERRIDE:
        loss, outputs = default_compute_loss(model, inputs, spec, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss
    assert spec.compute_loss is not None
    token = _BASE_SPEC.set(spec.base)
    try:
        return spec.compute_loss(
            model, dict(inputs), return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
    finally:
        _BASE_SPEC.reset(token)


def micro_batch_loss(graphdef, params, model_state, inputs, num_items, micro_weight, n_micro, spec: LossSpec, rng):
    """This micro-batch's share of the step loss (summing the shares over a window gives the step's loss), the
    model's new state and the values the loss recorded (`step_metrics.record`)."""
    token = _WINDOW_MICRO_BATCHES.set(n_micro)
    try:
        if spec.chunked_model_loss:
            inputs = {**inputs, "skip_logits": True}
        with bound_model(graphdef, params, model_state, spec.compute_dtype, rng) as model, recording() as recorded:
            loss = compute_loss(model, inputs, spec, num_items if spec.pass_num_items else None)
            new_state = model_state_of(model)
    finally:
        _WINDOW_MICRO_BATCHES.reset(token)
    loss = jnp.asarray(loss, jnp.float32)
    if not spec.scaled_for_ga:  # HF's training_step: a per-batch mean is divided by the window's micro-batches
        loss = loss / n_micro
    return loss * micro_weight, new_state, dict(recorded)


def window_label_count(inputs: dict[str, jax.Array], spec: LossSpec, tail: dict[str, jax.Array] | None = None):
    """HF's num_items_in_batch over the whole window [micro_batches, rows, ...] and its ragged tail (1 without
    labels)."""
    name = spec.label_names[0] if spec.label_names else None
    if name is None or name not in inputs:
        return jnp.ones((), jnp.int32)
    count = jnp.sum(jax.vmap(lambda lab: count_label_tokens(lab, spec.count_shifted))(inputs[name]))
    return count if tail is None else count + count_label_tokens(tail[name], spec.count_shifted)


def make_train_step(graphdef, tx: optax.GradientTransformation, spec: LossSpec, grad_shardings: Any = None):
    """A pure train step: scan over micro-batches summing loss shares and gradients, then `tx`'s update.

    `grad_shardings` (the parameters' shardings) lay out the summed gradients in the scan's carry as the
    parameters are: left to propagation, XLA may keep a whole copy of the gradients on every device.

    Clipping (HF's max_grad_norm) is part of `tx` (`optim.clip_grad_norm` in front of the optimizer); the step
    logs the norm of the gradients it hands to `tx`. With fp16's loss scaling (a `mixed_precision.LossScaleState`
    in the optimizer state), the gradients are those of the scaled loss, divided by the scale before `tx`; the
    logged loss is unscaled.
    """

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:  # a StepBatch
        num_items = jnp.maximum(window_label_count(batch.inputs, spec, batch.tail), 1).astype(jnp.float32)
        n_micro = jnp.maximum(jnp.sum(batch.micro_weight) + (batch.tail is not None), 1.0)
        scale = loss_scale(state.opt_state)

        def objective(*args):
            loss, model_state, recorded = micro_batch_loss(*args)
            return (loss if scale is None else loss * scale), (loss, model_state, recorded)

        grad_fn = jax.value_and_grad(objective, argnums=1, has_aux=True)

        # Step randomness is derived: fold the step, then the micro-batch index, into the run's key.
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        n_stacked = batch.micro_weight.shape[0]
        micro_keys = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(step_key, i)))(jnp.arange(n_stacked))

        def laid_out(grads):
            return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)

        zeros = laid_out(jax.tree.map(jnp.zeros_like, state.params))

        def micro_batch(model_state, inputs, weight, key_data):
            (_, (loss, model_state, recorded)), grads = grad_fn(
                graphdef,
                state.params,
                model_state,
                inputs,
                num_items,
                weight,
                n_micro,
                spec,
                jax.random.wrap_key_data(key_data),
            )
            return grads, loss, model_state, recorded

        def skipped(model_state, inputs, weight, key_data):
            nothing = {name: jnp.zeros((), jnp.float32) for name in spec.recorded}  # what a run one records
            return zeros, jnp.zeros((), jnp.float32), model_state, nothing

        def accumulate(carry, xs):
            grads_sum, loss_sum, model_state = carry
            if spec.padding_neutral:
                grads, loss, model_state, recorded = micro_batch(model_state, *xs)
            else:  # a user's loss may be NaN on a padding micro-batch (a mean over no labels): never run it
                grads, loss, model_state, recorded = jax.lax.cond(xs[1] > 0, micro_batch, skipped, model_state, *xs)
            grads_sum = laid_out(jax.tree.map(jnp.add, grads_sum, grads))
            return (grads_sum, loss_sum + loss, model_state), (loss, recorded)

        carry = (zeros, jnp.zeros((), jnp.float32), state.model_state)
        xs = (batch.inputs, batch.micro_weight, micro_keys)
        (grads, loss, model_state), (micro_losses, recorded) = jax.lax.scan(accumulate, carry, xs)
        if batch.tail is not None:  # the ragged last micro-batch, at its own rows, keyed as the next one
            index = jnp.sum(batch.micro_weight).astype(jnp.int32)  # after the real micro-batches before it
            tail_key = jax.random.key_data(jax.random.fold_in(step_key, index))
            tail = micro_batch(model_state, batch.tail, jnp.ones(()), tail_key)
            tail_grads, tail_loss, model_state, tail_recorded = tail
            grads, loss = jax.tree.map(jnp.add, grads, tail_grads), loss + tail_loss
            micro_losses = jnp.append(micro_losses, 0.0).at[index].set(tail_loss)  # the real ones come first
            recorded = jax.tree.map(lambda v, t: jnp.append(v, 0.0).at[index].set(t), recorded, tail_recorded)
        if scale is not None:
            grads = jax.tree.map(lambda g: g / scale, grads)
        grad_norm = optax.tree.norm(grads)  # HF logs the norm before clipping
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # The micro-batches' shares in window order (HF's tr_loss_step each; its logging NaN filter reads them).
        metrics = {"loss": loss, "micro_losses": micro_losses, "grad_norm": grad_norm}
        if recorded:  # what the loss recorded, per micro-batch in window order (as micro_losses)
            metrics["recorded"] = recorded
        lr = current_learning_rate(opt_state)
        if lr is not None:
            metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
            metrics["schedule_count"] = schedule_count(opt_state)  # the host logs HF's float64 rate of count - 1
        if hasattr(opt_state, "total_notfinite"):
            metrics["skipped_updates"] = opt_state.total_notfinite
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)
        return new_state, metrics

    return train_step


class EvalOutputs(NamedTuple):
    loss: jax.Array | None  # this batch's mean loss (HF's per-batch loss)
    logits: Any  # HF's predictions: an array, or a tuple of them
    recorded: dict[str, jax.Array] | None = None  # what the loss recorded (step_metrics.record)


def _output_items(outputs: Any) -> list[tuple[str, Any]] | None:
    """(key, value) pairs of a dict or ModelOutput-like output, None-valued fields left out (as HF's ModelOutput)."""
    if isinstance(outputs, dict):
        return [(k, v) for k, v in outputs.items() if v is not None]
    if hasattr(outputs, "keys") and hasattr(outputs, "__getitem__"):
        return [(k, outputs[k]) for k in outputs.keys()]
    return None


def prediction_values(outputs: Any, labelled: bool, ignore_keys: tuple[str, ...]) -> Any:
    """HF's prediction_step: the model's outputs that are predictions.

    A dict or ModelOutput gives every value whose key is not in `ignore_keys` (nor "loss" when the batch had
    labels); a tuple gives `outputs[1:]` when the batch had labels (its first element is the loss), else all of
    it. One prediction is returned bare, several as a tuple (EvalPrediction.predictions)."""
    items = _output_items(outputs)
    if items is not None:
        skip = set(ignore_keys) | ({"loss"} if labelled else set())
        values = tuple(v for k, v in items if k not in skip)
    elif isinstance(outputs, (tuple, list)):
        # A jtrainer model may return logits only and leave the loss to the Trainer: nothing to drop then.
        carries_loss = labelled and len(outputs) > 1 and jnp.ndim(outputs[0]) == 0
        values = tuple(outputs[1:] if carries_loss else outputs)
    else:
        values = (outputs,)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def batch_label_values(inputs: dict[str, Any], label_names: tuple[str, ...]) -> Any:
    """HF's labels of a batch: the one label column, a tuple of several, None unless every one is present."""
    if not label_names or any(inputs.get(name) is None for name in label_names):
        return None
    values = tuple(inputs[name] for name in label_names)
    return values[0] if len(values) == 1 else values


@dataclasses.dataclass
class PreprocessPlacement:
    """Where `preprocess_logits_for_metrics` runs: in the step while JAX can trace it; `on_host` once it could
    not (a torch-style function: `logits.argmax(dim=-1)`), with the error that said so."""

    on_host: bool = False
    reason: BaseException | None = None
    warned: bool = False  # the host fallback's cost was told once


@dataclass(frozen=True)
class MicroBatching:
    """Rows of a loss-only evaluation batch run at once: `rows` a data shard, the batch split over `shards` data
    shards (HF evaluates per_device_eval_batch_size rows at once; their activations at long rows may not fit
    where training's micro-batches do)."""

    rows: int
    shards: int

    def parts(self, inputs: dict[str, Any]) -> int | None:
        """How many micro-batches this batch runs in (None: at once)."""
        total = next(iter(inputs.values())).shape[0]
        if total % self.shards or (total // self.shards) % self.rows or total // self.shards <= self.rows:
            return None
        return total // self.shards // self.rows

    def split(self, x: jax.Array, parts: int) -> jax.Array:
        """[rows, ...] -> [parts, shards x rows, ...]: micro-batch j holds rows j*rows..(j+1)*rows of every data
        shard's block, so each stays spread over the data shards as the batch is."""
        x = x.reshape(self.shards, parts, self.rows, *x.shape[1:]).swapaxes(0, 1)
        return x.reshape(parts, self.shards * self.rows, *x.shape[3:])


def _loss_in_micro_batches(graphdef, params, model_state, inputs, spec: LossSpec, micro: MicroBatching, parts: int):
    """The batch's loss as the sum over its micro-batches of each one's label sum / the batch's label count."""
    num_items = count_label_tokens(inputs[spec.label_names[0]], spec.count_shifted)
    stacked = {k: micro.split(v, parts) for k, v in inputs.items()}

    def add(total, part):
        with bound_model(graphdef, params, model_state, spec.compute_dtype) as model:
            loss, _ = compute_loss(model, {**part, "skip_logits": True}, spec, num_items, return_outputs=True)
        return total + jnp.asarray(loss, jnp.float32), None

    total, _ = jax.lax.scan(add, jnp.zeros((), jnp.float32), stacked)
    return total


def make_eval_step(
    graphdef,
    spec: LossSpec,
    want_logits: bool,
    preprocess_logits: Callable | None = None,
    ignore_keys: tuple[str, ...] = (),
    placement: PreprocessPlacement | None = None,
    preprocess_in_torch: Callable | None = None,
    micro_batch: MicroBatching | None = None,
):
    """A pure evaluation step on one batch [rows, ...]: the batch's mean loss and (optionally) its predictions,
    chosen from the outputs by HF's prediction_step rules (`prediction_values`). `preprocess_logits` is traced
    into the step; when tracing it fails, the step returns the predictions as they are and marks `placement`
    so the caller runs the function on the host, as HF calls it. `preprocess_in_torch` (the function called
    with torchax tensors) is tried in the step before that. `micro_batch`: a loss-only evaluation of the model's own
    causal-LM loss runs the batch in micro-batches of that many rows a data shard (the same loss: each part's
    label sum over the whole batch's count)."""
    placement = placement if placement is not None else PreprocessPlacement()

    def eval_step(params, model_state, inputs: dict[str, Any]) -> EvalOutputs:
        labels = inputs.get(spec.label_names[0]) if spec.label_names else None
        all_labels = batch_label_values(inputs, spec.label_names)
        recorded: dict[str, jax.Array] = {}
        # Only a loss the parts add up to (the chunked model loss over the batch's label count) is split.
        splits = labels is not None and not want_logits and spec.chunked_model_loss and spec.pass_num_items
        parts = micro_batch.parts(inputs) if micro_batch is not None and splits else None
        if micro_batch is not None and parts:
            loss = _loss_in_micro_batches(graphdef, params, model_state, inputs, spec, micro_batch, parts)
            return EvalOutputs(loss, None, {})
        with bound_model(graphdef, params, model_state, spec.compute_dtype) as model:
            if labels is None and not spec.loss_without_labels:  # HF: no loss, the model alone
                loss, outputs = None, model(**{k: v for k, v in inputs.items() if k not in spec.label_names})
            else:  # HF 5.x counts the batch's items in evaluation too
                num_items = None
                if spec.pass_num_items and labels is not None:
                    num_items = count_label_tokens(labels, spec.count_shifted)
                if not want_logits and (spec.skip_logits_in_loss_only or spec.chunked_model_loss):
                    inputs = {**inputs, "skip_logits": True}  # HF's use_liger_kernel with prediction_loss_only
                with recording() as recorded:
                    loss, outputs = compute_loss(model, inputs, spec, num_items, return_outputs=True)
        predictions = None
        if want_logits:
            predictions = prediction_values(outputs, all_labels is not None, ignore_keys)
            if preprocess_logits is not None and predictions is not None and not placement.on_host:
                try:
                    predictions = preprocess_logits(predictions, all_labels)
                except UNTRACEABLE as error:  # torch methods, numpy conversions, float(): the host's; any
                    if preprocess_in_torch is None:  # other error is the function's own bug
                        placement.on_host, placement.reason = True, error
                    else:
                        predictions = _preprocess_in_torch(preprocess_in_torch, predictions, all_labels, placement)
        mean_loss = None if loss is None else jnp.mean(loss).astype(jnp.float32)
        return EvalOutputs(mean_loss, predictions, dict(recorded))

    return eval_step


def _preprocess_in_torch(preprocess, predictions, labels, placement: PreprocessPlacement):
    """A torch-written preprocess_logits_for_metrics in the step; on the host (HF's torch call) if torchax cannot
    run it either (a .cpu().numpy() inside, ...)."""
    try:
        return preprocess(predictions, labels)
    except Exception as error:  # noqa: BLE001  (the host runs it as HF does, and raises its own errors there)
        placement.on_host, placement.reason = True, error
        return predictions


def make_shard_loss_step(graphdef, spec: LossSpec, shards: int):
    """HF's per-process losses of one evaluation batch [shards * rows, ...] on `shards` processes: each data
    shard's compute_loss on its own rows, with num_items_in_batch counted over every shard and a default loss
    scaled by the shard count (average_tokens_across_devices), as each of HF's processes computes it."""

    def shard_losses(params, model_state, inputs: dict[str, jax.Array]) -> jax.Array:
        labels = inputs[spec.label_names[0]]
        num_items = count_label_tokens(labels, spec.count_shifted) if spec.pass_num_items else None
        split = jax.tree.map(lambda v: v.reshape(shards, v.shape[0] // shards, *v.shape[1:]), inputs)
        with bound_model(graphdef, params, model_state, spec.compute_dtype) as model:
            token = _PROCESS_SCALE.set(shards)
            try:
                losses = jax.vmap(lambda x: jnp.mean(compute_loss(model, x, spec, num_items)))(split)
            finally:
                _PROCESS_SCALE.reset(token)
        return losses.astype(jnp.float32)

    return shard_losses
