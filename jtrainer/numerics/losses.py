"""Token cross-entropy as HF computes it: ignore index -100, causal shift, label smoothing, exact normalisation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

IGNORE_INDEX = -100


def shift_labels(labels_BxL: jax.Array) -> jax.Array:
    """Causal LMs predict token t+1 at position t: labels move left and the last position is ignored."""
    pad = jnp.full_like(labels_BxL[:, :1], IGNORE_INDEX)
    return jnp.concatenate([labels_BxL[:, 1:], pad], axis=1)


_shift_left = shift_labels  # LabelSmoother's argument of the same name hides the function


def token_cross_entropy_sum(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """Sum over tokens whose label is not -100 of the (smoothed) cross-entropy, computed in fp32.

    Label smoothing as HF's `LabelSmoother`: (1 - eps) * nll + eps * mean over classes of -log p.
    """
    return _cross_entropy_sum(logits.astype(jnp.float32), labels, float(label_smoothing))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cross_entropy_sum(logits: jax.Array, labels: jax.Array, label_smoothing: float) -> jax.Array:
    return _cross_entropy_fwd(logits, labels, label_smoothing)[0]


def _cross_entropy_fwd(logits, labels, label_smoothing):
    valid = labels != IGNORE_INDEX
    safe_labels = jnp.where(valid, labels, 0)
    # jax.nn.log_softmax's arithmetic, kept apart so the backward pass can reuse it.
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_normaliser = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    nll = (log_normaliser - jnp.take_along_axis(shifted, safe_labels[..., None], axis=-1))[..., 0]
    if label_smoothing:
        smooth = (log_normaliser - jnp.mean(shifted, axis=-1, keepdims=True))[..., 0]
        nll = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    return jnp.sum(jnp.where(valid, nll, 0.0)), (shifted, log_normaliser, labels)


def _cross_entropy_bwd(label_smoothing, residuals, g):
    """d/dlogits = softmax - (1 - eps) one_hot - eps / classes on valid tokens, 0 elsewhere.

    Written out because autodiff of the label lookup is a scatter into a zero [tokens, classes] buffer, a slow,
    serial loop on CPU; the one-hot here is an elementwise compare that fuses with the softmax."""
    shifted, log_normaliser, labels = residuals
    classes = shifted.shape[-1]
    one_hot = jax.lax.broadcasted_iota(labels.dtype, shifted.shape, shifted.ndim - 1) == labels[..., None]
    target = jnp.where(one_hot, 1.0 - label_smoothing, 0.0) + label_smoothing / classes
    weight = jnp.where(labels != IGNORE_INDEX, g, 0.0)[..., None]
    return (jnp.exp(shifted - log_normaliser) - target) * weight, None


_cross_entropy_sum.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


@dataclasses.dataclass(frozen=True)
class LabelSmoother:
    """HF's LabelSmoother (Trainer.label_smoother) on jax arrays: smoothed token cross-entropy over the labels
    that are not -100, divided by num_items_in_batch when given, else by their count."""

    epsilon: float = 0.1
    ignore_index: int = IGNORE_INDEX

    def __post_init__(self):
        if self.ignore_index != IGNORE_INDEX:
            raise ValueError(f"LabelSmoother(ignore_index={self.ignore_index}): jtrainer's losses ignore -100 only.")

    def __call__(self, model_output, labels, shift_labels: bool = False, num_items_in_batch=None) -> jax.Array:
        if isinstance(model_output, dict):
            logits = model_output["logits"]
        else:
            logits = getattr(model_output, "logits", None)
            logits = model_output[0] if logits is None else logits
        targets = _shift_left(labels) if shift_labels else labels
        count = jnp.sum(targets != IGNORE_INDEX) if num_items_in_batch is None else num_items_in_batch
        return token_cross_entropy_sum(logits, targets, self.epsilon) / count


def token_loss(logits: jax.Array, labels: jax.Array, num_items_in_batch=None, *, causal: bool = False) -> jax.Array:
    """HF's model loss for token labels: sum of token losses / num_items_in_batch (the mean when not given)."""
    targets = shift_labels(labels) if causal else labels
    count = num_items_in_batch if num_items_in_batch is not None else jnp.sum(targets != IGNORE_INDEX)
    return token_cross_entropy_sum(logits, targets) / count


def chunked_token_loss(
    hidden_BxLxD: jax.Array,
    project: Callable[[jax.Array], jax.Array],
    labels_BxL: jax.Array,
    num_items_in_batch=None,
    *,
    chunk_positions: int,
    causal: bool = False,
) -> jax.Array:
    """`token_loss(project(hidden), labels, ...)` without the [tokens, vocab] logits: the positions go through
        `project` (the LM head) and the cross-entropy `chunk_positions` at a time, and the backward pass recomputes
        each chunk's logits (jax.checkpoint), so one chunk's logits and their gradient exist at once. The LM head's
        weight gradient is summed over the chunks by the scan's transpose. Rows of at most `chunk_positions` positions
    are one chunk, computed as the whole logits are (no recomputation)."""
    targets_BxL = shift_labels(labels_BxL) if causal else labels_BxL
    count = num_items_in_batch if num_items_in_batch is not None else jnp.sum(targets_BxL != IGNORE_INDEX)
    batch, length = targets_BxL.shape
    chunk = min(chunk_positions, length)
    chunks = -(-length // chunk)
    if chunks == 1:  # the whole logits are one chunk: nothing to save, nothing to recompute in the backward pass
        return token_cross_entropy_sum(project(hidden_BxLxD), targets_BxL) / count
    pad = chunks * chunk - length  # padded positions carry label -100: they add nothing to the sum
    hidden_BxLxD = jnp.pad(hidden_BxLxD, ((0, 0), (0, pad), (0, 0)))
    targets_BxL = jnp.pad(targets_BxL, ((0, 0), (0, pad)), constant_values=IGNORE_INDEX)
    # Chunks along the positions, not the flattened tokens: each chunk keeps the batch's sharding over the mesh.
    hidden_NxBxCxD = hidden_BxLxD.reshape(batch, chunks, chunk, -1).swapaxes(0, 1)
    targets_NxBxC = targets_BxL.reshape(batch, chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_loss(hidden_BxCxD, targets_BxC):
        return token_cross_entropy_sum(project(hidden_BxCxD), targets_BxC)

    def add_chunk(total, chunk_inputs):
        return total + chunk_loss(*chunk_inputs), None

    total, _ = jax.lax.scan(add_chunk, jnp.zeros((), jnp.float32), (hidden_NxBxCxD, targets_NxBxC))
    return total / count


def count_label_tokens(labels: jax.Array, causal: bool) -> jax.Array:
    """HF's `num_items_in_batch`: label tokens that are not -100, after the causal shift for causal LMs.

    Counted on the device over the global batch, so it is the same number on every process.
    """
    if causal:
        labels = labels[..., 1:]
    return jnp.sum(labels != IGNORE_INDEX)


def check_class_labels(labels, num_classes: int, column: str) -> None:
    """Class labels must be -100 or in [0, num_classes), as torch's cross-entropy demands (it raises; a gather on
    the device would silently read another class or clamp). Checked on the host batch before its step."""
    import numpy as np

    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer) or labels.size == 0:
        return
    bad = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= num_classes))]
    if bad.size:
        raise ValueError(
            f"Label {int(bad.flat[0])} in column {column!r} is outside [0, {num_classes}) (the model has "
            f"{num_classes} classes; -100 marks ignored positions). Fix the labels or the model's num_labels."
        )
