"""Pure step builders: `train_step(state, batch) -> (state, metrics)` and `eval_step(state, batch) -> outputs`.

Nothing here knows the Trainer. The model enters as an nnx graphdef (static) plus a pure-dict parameter tree;
how the loss is normalised is decided once on the host (`LossMode`) so the compiled step has no branches.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jtrainer.losses import IGNORE_INDEX, count_label_tokens, shift_labels, token_cross_entropy_sum
from jtrainer.mixed_precision import loss_scale
from jtrainer.optim import current_learning_rate, hyperparameter, schedule_count
from jtrainer.state import TrainState


class LossMode(enum.Enum):
    """How a micro-batch's loss becomes its share of the step loss (HF's rules, see HF_COMPAT.md)."""

    MODEL_SUM = "model_sum"  # model takes num_items_in_batch and returns sum(token losses) / num_items
    CUSTOM = "custom"  # compute_loss_func(outputs, labels, num_items_in_batch)
    TRAINER = "trainer"  # the model returns logits only (or label smoothing): token CE sum / num_items
    MODEL_MEAN = "model_mean"  # the model returns its own mean loss: averaged over the window's micro-batches


class StepBatch(NamedTuple):
    """One optimizer step's data: inputs shaped [micro_batches, rows, ...] and the micro-batch weights."""

    inputs: dict[str, jax.Array]
    micro_weight: jax.Array  # [micro_batches]: 1 for real micro-batches, 0 for padding of a short window


@dataclass(frozen=True)
class LossSpec:
    mode: LossMode
    label_names: tuple[str, ...] = ("labels",)
    causal: bool = False
    label_smoothing: float = 0.0
    compute_loss_func: Callable | None = None
    compute_dtype: Any = None  # jnp.bfloat16 / float16: parameters are cast for compute, master weights stay fp32


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


def _cast_floats(tree, dtype):
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


def apply_model(graphdef, params, model_state, inputs: dict[str, jax.Array], compute_dtype=None, rng=None):
    """Run the model on keyword inputs; returns (outputs, new non-parameter state)."""
    if rng is not None:
        model_state = reseed_streams(model_state, rng)
    model = nnx.merge(graphdef, _cast_floats(params, compute_dtype), model_state)
    noisy = [] if rng is None else [m for _, m in nnx.iter_graph(model) if getattr(m, "neftune_noise_alpha", None)]
    for i, module in enumerate(noisy):  # NEFTune: the step's key, handed over for this call only
        object.__setattr__(module, "_neftune_key", jax.random.fold_in(rng, i))
    outputs = model(**inputs)
    for module in noisy:
        object.__delattr__(module, "_neftune_key")
    _, _, new_state = nnx.split(model, nnx.Param, ...)
    return outputs, new_state


def _trainer_loss(logits, labels, spec: LossSpec) -> jax.Array:
    targets = shift_labels(labels) if spec.causal else labels
    return token_cross_entropy_sum(logits, targets, spec.label_smoothing)


def micro_batch_loss(graphdef, params, model_state, inputs, num_items, micro_weight, n_micro, spec: LossSpec, rng):
    """This micro-batch's share of the step loss; summing the shares over a window gives the step's loss."""
    labels = inputs.get(spec.label_names[0]) if spec.label_names else None
    model_inputs = dict(inputs)
    if spec.mode in (LossMode.TRAINER, LossMode.CUSTOM):
        for name in spec.label_names:
            model_inputs.pop(name, None)
    if spec.mode == LossMode.MODEL_SUM:
        model_inputs["num_items_in_batch"] = num_items
    outputs, new_state = apply_model(graphdef, params, model_state, model_inputs, spec.compute_dtype, rng)
    loss, logits = split_outputs(outputs)
    if spec.mode == LossMode.TRAINER:
        loss = _trainer_loss(logits, labels, spec) / num_items
    elif spec.mode == LossMode.CUSTOM:
        loss = spec.compute_loss_func(outputs, labels, num_items_in_batch=num_items)
    elif spec.mode == LossMode.MODEL_MEAN:
        loss = loss / n_micro
    return loss.astype(jnp.float32) * micro_weight, new_state


def window_label_count(inputs: dict[str, jax.Array], spec: LossSpec) -> jax.Array:
    """HF's num_items_in_batch over the whole window [micro_batches, rows, ...] (1 without labels)."""
    labels = inputs.get(spec.label_names[0]) if spec.label_names else None
    if labels is None:
        return jnp.ones((), jnp.int32)
    per_micro = jax.vmap(lambda lab: count_label_tokens(lab, spec.causal))(labels)
    return jnp.sum(per_micro)


def clip_by_global_norm(grads, max_norm):
    """torch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1; returns (grads, norm).

    `max_norm` may be traced; a Python number <= 0 turns clipping off (the norm is still returned)."""
    norm = optax.tree.norm(grads)
    if isinstance(max_norm, (int, float)) and max_norm <= 0:
        return grads, norm
    coef = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * coef.astype(g.dtype), grads), norm


def make_train_step(graphdef, tx: optax.GradientTransformation, spec: LossSpec, max_grad_norm: float):
    """A pure train step: scan over micro-batches summing loss shares and gradients, clip, update.

    `max_grad_norm` > 0 turns clipping on; the norm used is the optimizer state's `max_grad_norm`
    hyperparameter when it has one (data, so it can change without a recompile), else this number.
    With fp16's loss scaling (a `mixed_precision.LossScaleState` in the optimizer state), the gradients are those
    of the scaled loss, divided by the scale before clipping; the logged loss is unscaled.
    """

    def train_step(state: TrainState, batch: StepBatch) -> tuple[TrainState, dict[str, jax.Array]]:
        num_items = jnp.maximum(window_label_count(batch.inputs, spec), 1).astype(jnp.float32)
        n_micro = jnp.maximum(jnp.sum(batch.micro_weight), 1.0)
        scale = loss_scale(state.opt_state)

        def objective(*args):
            loss, model_state = micro_batch_loss(*args)
            return (loss if scale is None else loss * scale), (loss, model_state)

        grad_fn = jax.value_and_grad(objective, argnums=1, has_aux=True)

        # Step randomness is derived: fold the step, then the micro-batch index, into the run's key.
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        micro_keys = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(step_key, i)))(
            jnp.arange(batch.micro_weight.shape[0])
        )

        def accumulate(carry, xs):
            grads_sum, loss_sum, model_state = carry
            inputs, weight, key_data = xs
            (_, (loss, model_state)), grads = grad_fn(
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
            grads_sum = jax.tree.map(jnp.add, grads_sum, grads)
            return (grads_sum, loss_sum + loss, model_state), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        carry = (zeros, jnp.zeros((), jnp.float32), state.model_state)
        xs = (batch.inputs, batch.micro_weight, micro_keys)
        (grads, loss, model_state), _ = jax.lax.scan(accumulate, carry, xs)
        if scale is not None:
            grads = jax.tree.map(lambda g: g / scale, grads)
        if max_grad_norm > 0:
            injected = hyperparameter(state.opt_state, "max_grad_norm")
            grads, grad_norm = clip_by_global_norm(grads, max_grad_norm if injected is None else injected)
        else:
            grads, grad_norm = clip_by_global_norm(grads, 0.0)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm}
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
    logits: Any


def make_eval_step(graphdef, spec: LossSpec, want_logits: bool, preprocess_logits: Callable | None = None):
    """A pure evaluation step on one batch [rows, ...]: the batch's mean loss and (optionally) its logits."""

    def eval_step(params, model_state, inputs: dict[str, jax.Array]) -> EvalOutputs:
        labels = inputs.get(spec.label_names[0]) if spec.label_names else None
        model_inputs = dict(inputs)
        if spec.mode in (LossMode.TRAINER, LossMode.CUSTOM):
            for name in spec.label_names:
                model_inputs.pop(name, None)
        outputs, _ = apply_model(graphdef, params, model_state, model_inputs, spec.compute_dtype)
        loss, logits = split_outputs(outputs)
        if labels is not None and spec.mode == LossMode.TRAINER:
            targets = shift_labels(labels) if spec.causal else labels
            count = jnp.maximum(jnp.sum(targets != IGNORE_INDEX), 1)
            loss = token_cross_entropy_sum(logits, targets, spec.label_smoothing) / count
        elif labels is not None and spec.mode == LossMode.CUSTOM:
            loss = spec.compute_loss_func(outputs, labels, num_items_in_batch=None)
        if labels is None:
            loss = None
        if not want_logits:
            logits = None
        elif preprocess_logits is not None:
            logits = preprocess_logits(logits, labels)
        return EvalOutputs(None if loss is None else loss.astype(jnp.float32), logits)

    return eval_step
