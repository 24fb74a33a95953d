"""TRL's losses and logged statistics as pure JAX functions of the logits, run inside jtrainer's step.

TRL 1.16 computes them from a fused LM head (`trl.trainer.utils.add_fused_lm_head`): per next-token position whose
label is not -100, the log-probability of the label, the entropy of the distribution and whether the label is its
first argmax. Here they come from the model's logits, in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jtrainer.numerics.losses import IGNORE_INDEX, shift_labels


class TokenStats(NamedTuple):
    """Per next-token position [B, L] (0 where the label is -100)."""

    log_probs: jax.Array  # log p(label): differentiable
    entropy: jax.Array  # no gradient (logged only)
    is_top1: jax.Array  # bool: the label is the first argmax
    mask: jax.Array  # bool: the label is not -100


def next_token_stats(logits_BxLxV: jax.Array, labels_BxL: jax.Array) -> TokenStats:
    """TRL's fused-head outputs for a causal LM: position t scores label t + 1."""
    targets = shift_labels(labels_BxL)
    return token_stats(logits_BxLxV, targets)


def token_stats(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> TokenStats:
    """Statistics of already-aligned targets (position t scores target t)."""
    logits = logits_BxLxV.astype(jnp.float32)
    mask = targets_BxL != IGNORE_INDEX
    safe = jnp.where(mask, targets_BxL, 0)
    log_probs = jnp.where(mask, _label_log_probs(logits, safe), 0.0)
    detached = jax.lax.stop_gradient(logits)
    log_p = jax.nn.log_softmax(detached, axis=-1)
    entropy = jnp.where(mask, -jnp.sum(jnp.exp(log_p) * log_p, axis=-1), 0.0)
    is_top1 = mask & (jnp.argmax(detached, axis=-1) == safe)
    return TokenStats(log_probs, entropy, is_top1, mask)


@jax.custom_vjp
def _label_log_probs(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return _label_log_probs_fwd(logits, labels)[0]


def _label_log_probs_fwd(logits, labels):
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_normaliser = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    picked = jnp.take_along_axis(shifted, labels[..., None], axis=-1)
    return (picked - log_normaliser)[..., 0], (shifted, log_normaliser, labels)


def _label_log_probs_bwd(residuals, g):
    """d log p(label) / d logits = one_hot(label) - softmax: an elementwise compare, not a scatter (see
    numerics.losses._cross_entropy_bwd)."""
    shifted, log_normaliser, labels = residuals
    one_hot = jax.lax.broadcasted_iota(labels.dtype, shifted.shape, shifted.ndim - 1) == labels[..., None]
    return (one_hot.astype(shifted.dtype) - jnp.exp(shifted - log_normaliser)) * g[..., None], None


_label_log_probs.defvjp(_label_log_probs_fwd, _label_log_probs_bwd)


def sft_loss(stats: TokenStats, num_items_in_batch, loss_type: str = "nll") -> jax.Array:
    """TRL's SFT loss: -sum(log p) / num_items_in_batch (the micro-batch's label count when None), each token's
    term weighted by its own detached probability under DFT."""
    per_token = -stats.log_probs
    if loss_type == "dft":  # https://huggingface.co/papers/2508.05629
        per_token = per_token * jnp.exp(jax.lax.stop_gradient(stats.log_probs))
    count = jnp.sum(stats.mask) if num_items_in_batch is None else num_items_in_batch
    return jnp.sum(per_token) / jnp.maximum(jnp.asarray(count, jnp.float32), 1.0)


def mean_over_tokens(values: jax.Array, stats: TokenStats) -> jax.Array:
    """TRL's per-batch metric: the sum over scored tokens over their count (0 without any)."""
    valid = jnp.sum(stats.mask)
    return jnp.where(valid > 0, jnp.sum(values) / jnp.maximum(valid, 1), 0.0)
