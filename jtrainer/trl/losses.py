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


# ---------------------------------------------------------------------------------------------------------- DPO
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCE_LOSS_TYPES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}


class DPOSettings(NamedTuple):
    """DPOConfig's numbers the loss reads (static in the compiled step)."""

    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    beta: float
    label_smoothing: float
    f_divergence_type: str
    f_alpha_divergence_coef: float
    discopop_tau: float
    ld_alpha: float | None
    use_weighting: bool


def sequence_log_probs(per_token: jax.Array, mask: jax.Array, ld_alpha: float | None) -> jax.Array:
    """Each sequence's summed log-probability over its completion [2B]; LD-DPO weights the tokens past the
    shorter of its chosen / rejected completions by ld_alpha."""
    if ld_alpha is None:
        return jnp.sum(per_token, axis=1)
    shared, tail = _length_desensitised_masks(mask)
    return jnp.sum(per_token * shared, axis=1) + ld_alpha * jnp.sum(per_token * tail, axis=1)


def _length_desensitised_masks(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    position = jnp.cumsum(mask, axis=1)
    lengths = jnp.sum(mask, axis=1)
    chosen, rejected = jnp.split(lengths, 2)
    shared_lengths = jnp.tile(jnp.minimum(chosen, rejected), 2)[:, None]
    return (position > 0) & (position <= shared_lengths), position > shared_lengths


def _scores(logratios: jax.Array, settings: DPOSettings) -> jax.Array:
    kind = settings.f_divergence_type
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":
        return 1 - jnp.exp(-logratios)
    if kind == "js_divergence":
        return jnp.log(2.0) + jax.nn.log_sigmoid(logratios)
    if kind == "alpha_divergence":
        alpha = settings.f_alpha_divergence_coef
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        t = jnp.minimum((alpha - 1.0) * logratios.astype(jnp.float32), 80.0)
        return (jnp.exp(t) - 1.0) / (alpha - 1.0)
    raise ValueError(f"Unknown f_divergence_type: {kind}")


def dpo_loss(
    settings: DPOSettings,
    logps: jax.Array,  # [2B]: chosen rows then rejected rows
    ref_logps: jax.Array,  # [2B]
    per_token: jax.Array,  # [2B, L] log p of each completion token (0 elsewhere)
    mask: jax.Array,  # [2B, L] completion tokens scored
    completion_mask: jax.Array,  # [2B, L] the collator's completion_mask (unshifted)
    log_sum_sq_probs: jax.Array | None = None,  # [2B, L] WPO weighting
) -> jax.Array:
    """TRL 1.16's DPOTrainer loss: the weighted sum over `loss_types` of each per-pair loss's mean."""
    beta, smoothing = settings.beta, settings.label_smoothing
    chosen_logps, rejected_logps = jnp.split(logps, 2)
    ref_chosen, ref_rejected = jnp.split(ref_logps, 2)
    chosen_logratios, rejected_logratios = chosen_logps - ref_chosen, rejected_logps - ref_rejected
    chosen_scores, rejected_scores = _scores(chosen_logratios, settings), _scores(rejected_logratios, settings)
    delta = chosen_scores - rejected_scores
    log_sigmoid = jax.nn.log_sigmoid
    loss = jnp.zeros((), jnp.float32)
    for loss_type, weight in zip(settings.loss_types, settings.loss_weights, strict=True):
        if loss_type == "sigmoid":
            per_pair = -log_sigmoid(beta * delta)
        elif loss_type == "hinge":
            per_pair = jax.nn.relu(1 - beta * delta)
        elif loss_type in ("ipo", "sigmoid_norm"):
            chosen_len, rejected_len = jnp.split(jnp.maximum(jnp.sum(completion_mask, axis=1), 1.0), 2)
            averaged = chosen_scores / chosen_len - rejected_scores / rejected_len
            per_pair = (averaged - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -log_sigmoid(beta * averaged)
        elif loss_type == "exo_pair":
            qw, log_qw = jax.nn.sigmoid(beta * delta), log_sigmoid(beta * delta)
            ql, log_ql = jax.nn.sigmoid(-beta * delta), log_sigmoid(-beta * delta)
            per_pair = qw * (log_qw - jnp.log1p(-smoothing)) + ql * (log_ql - jnp.log(smoothing))
        elif loss_type == "nca_pair":
            chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
            per_pair = (
                -log_sigmoid(chosen_rewards) - 0.5 * log_sigmoid(-chosen_rewards) - 0.5 * log_sigmoid(-rejected_rewards)
            )
        elif loss_type == "robust":
            clean = -(1 - smoothing) * log_sigmoid(beta * delta)
            flipped = -smoothing * log_sigmoid(-beta * delta)
            per_pair = (clean - flipped) / (1 - 2 * smoothing)
        elif loss_type == "bco_pair":
            per_pair = -log_sigmoid(beta * chosen_logratios) - log_sigmoid(-beta * rejected_logratios)
        elif loss_type == "sppo_hard":
            per_pair = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif loss_type in ("aot", "aot_unpaired"):
            if loss_type == "aot":
                gap = jnp.sort(chosen_logps - rejected_logps) - jnp.sort(ref_chosen - ref_rejected)
            else:
                gap = jnp.sort(chosen_logratios) - jnp.sort(rejected_logratios)
            per_pair = -log_sigmoid(beta * gap) * (1 - smoothing) - log_sigmoid(-beta * gap) * smoothing
        elif loss_type == "apo_zero":
            per_pair = (1 - jax.nn.sigmoid(beta * chosen_logratios)) + jax.nn.sigmoid(beta * rejected_logratios)
        elif loss_type == "apo_down":
            per_pair = jax.nn.sigmoid(beta * chosen_logratios) + (
                1 - jax.nn.sigmoid(beta * (chosen_logratios - rejected_logratios))
            )
        elif loss_type == "discopop":
            logits = beta * delta
            modulation = jax.nn.sigmoid(logits / settings.discopop_tau)
            per_pair = -log_sigmoid(logits) * (1 - modulation) + jnp.exp(-logits) * modulation
        elif loss_type == "sft":
            chosen_mask = jnp.split(mask, 2)[0]
            chosen_tokens = jnp.split(per_token, 2)[0]
            per_pair = jnp.broadcast_to(-jnp.sum(chosen_tokens * chosen_mask) / jnp.sum(chosen_mask), delta.shape)
        else:
            raise ValueError(f"Unknown loss type: {loss_type}. Should be one of {list(DPO_LOSS_TYPES)}")
        if settings.use_weighting:
            assert log_sum_sq_probs is not None
            lengths = jnp.maximum(jnp.sum(mask, axis=1), 1)
            aligned = jax.lax.stop_gradient((per_token - log_sum_sq_probs) * mask)
            weights = jnp.exp(jnp.sum(aligned, axis=1) / lengths)
            chosen_weights, rejected_weights = jnp.split(weights, 2)
            per_pair = per_pair * chosen_weights * rejected_weights
        loss = loss + jnp.mean(per_pair) * weight
    return loss


def log_sum_sq_probs(logits_BxLxV: jax.Array) -> jax.Array:
    """log(sum_v p_v^2) of each position (WPO's weighting), without gradient."""
    log_p = jax.nn.log_softmax(jax.lax.stop_gradient(logits_BxLxV).astype(jnp.float32), axis=-1)
    return jax.nn.logsumexp(2 * log_p, axis=-1)
