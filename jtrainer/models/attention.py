"""Causal self-attention: cuDNN's flash attention on GPUs, XLA's on TPUs, a CPU formulation that does less.

On GPUs, bf16/fp16 attention goes to `jax.nn.dot_product_attention(implementation="cudnn")`: a fused kernel that
never materialises the [length, length] scores and skips the tiles causality masks out. A padding or packing
mask travels as an additive bias (cuDNN also returns its gradient, which is dropped). Shapes cuDNN cannot run are
refused while tracing and fall back to XLA's formulation with a warning; `JTRAINER_ATTENTION=xla` (or `cudnn`,
which then raises instead of falling back) forces one.

On CPU, XLA runs attention as separate passes over [batch, heads, length, length] tensors, and in a small
Llama's train step attention took a third of the time. The CPU branch here
- splits the queries into blocks and gives block i only the keys of blocks <= i (the others are masked by
  causality anyway): 10/16 of the work with four blocks;
- stacks the query heads that share a key/value head (grouped-query attention) along the rows, so every
  product is one [groups * block, head_dim] x [head_dim, keys] GEMM per key/value head: keys and values are
  never repeated, and their gradients come out already summed over the group;
- scales the queries once (a [length, head_dim] product) rather than every [length, length] score and score
  gradient, which XLA's CPU backend would do by materialising a broadcast constant of that size;
- runs each block with a hand-written backward pass whose products all take their operands in the order
  XLA's CPU GEMMs want, so no [length, length] tensor is ever transposed (only the small q, k, v are).
Values and gradients equal `jax.nn.dot_product_attention`'s (to float rounding), fully masked query rows
included: there the reference gives the mean of all values, and so does this.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jtrainer import env
from jtrainer.models.linear import cpu_backend

logger = logging.getLogger(__name__)

_MIN_BLOCK = 64
_IMPLEMENTATIONS = ("auto", "xla", "cudnn")


def causal_attention(
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask_Bx1xTxT=None, scale: float | None = None, sliding_window: int | None = None
):
    """Causal multi-head (grouped-query when K < N) attention.

    `mask_Bx1xTxT`: what else a query may not see (padding, other documents of a packed row), booleans of shape
    [batch or 1, 1, T or 1, T]; it may include causality, and None means causality alone. `sliding_window`
    (HF's): query i sees key j only when i - j < sliding_window."""
    scale = q_BxTxNxH.shape[-1] ** -0.5 if scale is None else scale
    if cpu_backend():
        dense = causal_mask(q_BxTxNxH.shape[1], sliding_window)
        dense = dense if mask_Bx1xTxT is None else dense & mask_Bx1xTxT
        return _blocked_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, dense, scale)
    return _fused_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask_Bx1xTxT, scale, sliding_window)


def causal_mask(length: int, sliding_window: int | None = None) -> jax.Array:
    """[1, 1, length, length] booleans: query i sees key j when j <= i (and i - j < sliding_window)."""
    offsets = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
    visible = offsets >= 0
    if sliding_window is not None:
        visible = visible & (offsets < sliding_window)
    return visible[None, None]


def _requested_implementation() -> str:
    requested = env.ATTENTION.get().lower()
    if requested not in _IMPLEMENTATIONS:
        raise ValueError(f"{env.ATTENTION.name}={requested!r} is not one of {_IMPLEMENTATIONS}; unset it for 'auto'.")
    return requested


def fused_implementation(q: jax.Array) -> str:
    """ "cudnn" for bf16/fp16 queries on a GPU, else "xla"; `JTRAINER_ATTENTION` overrides."""
    requested = _requested_implementation()
    if requested != "auto":
        return requested
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    return "cudnn" if on_gpu and q.dtype in (jnp.bfloat16, jnp.float16) else "xla"


_warned: set[str] = set()


def _fused_attention(q, k, v, mask, scale, sliding_window):
    """jax.nn.dot_product_attention with causality as a mask type (cuDNN then skips the masked tiles)."""
    batch, length = q.shape[:2]
    if mask is not None:  # cuDNN takes a bias of the scores' shape, not a broadcastable one
        mask = jnp.broadcast_to(mask, (batch, 1, length, k.shape[1]))
    window = None if sliding_window is None else (sliding_window - 1, 0)
    kwargs = dict(mask=mask, scale=scale, is_causal=True, local_window_size=window)
    if fused_implementation(q) == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kwargs)
        except (ValueError, NotImplementedError, RuntimeError) as refusal:
            if _requested_implementation() == "cudnn":
                raise
            message = f"cuDNN attention refused {q.shape} {q.dtype} ({refusal}): using XLA's attention."
            if message not in _warned:  # once, not once per layer
                _warned.add(message)
                logger.warning(message)
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)


def _num_blocks(length: int) -> int:
    for blocks in (4, 2):
        if length % blocks == 0 and length // blocks >= _MIN_BLOCK:
            return blocks
    return 1


def _blocked_attention(q, k, v, mask, scale):
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    # Operands laid out once for all blocks (query head n = kv head n // groups, as in jax.nn); the barrier
    # keeps XLA from folding these transposes into every block's slices.
    q_BxKxGxTxH = (q * jnp.asarray(scale, q.dtype)).reshape(batch, length, kv_heads, groups, head_dim)
    q_BxKxGxTxH, k_BxKxHxS, v_BxKxSxH = jax.lax.optimization_barrier(
        (q_BxKxGxTxH.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))
    )
    size = length // _num_blocks(length)
    outs = []
    for end in range(size, length + 1, size):
        rows = slice(end - size, end)
        q_BxKxMxH = q_BxKxGxTxH[:, :, :, rows].reshape(batch, kv_heads, groups * size, head_dim)
        out = _grouped_attention(q_BxKxMxH, k_BxKxHxS[..., :end], v_BxKxSxH[:, :, :end], mask[:, :, rows, :end])
        outs.append(out.reshape(batch, kv_heads, groups, size, head_dim))
    out = jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4).reshape(q.shape)
    # A query row that sees no key: jax.nn's softmax over all-minimal scores is uniform over every key.
    no_key_Bx1xT = ~jnp.any(mask, axis=-1)
    mean_v_Bx1xNxH = jnp.repeat(jnp.mean(v, axis=1), groups, axis=1)[:, None].astype(out.dtype)
    return jnp.where(no_key_Bx1xT.transpose(0, 2, 1)[..., None], mean_v_Bx1xNxH, out)


@jax.custom_vjp
def _grouped_attention(q_BxKxMxH, k_BxKxHxS, v_BxKxSxH, mask_Bx1xTxS):
    """softmax(q k^T, masked) v for one block of pre-scaled queries, M = groups * T rows per kv head."""
    return _attention_fwd(q_BxKxMxH, k_BxKxHxS, v_BxKxSxH, mask_Bx1xTxS)[0]


def _attention_fwd(q, k, v, mask):
    scores = jnp.matmul(q, k, preferred_element_type=jnp.float32)
    batch, kv_heads, rows, keys = scores.shape
    # Rows are (group, query) pairs: view them as [groups, T] so the [T, S] mask broadcasts over the groups.
    scores = scores.reshape(batch, kv_heads, rows // mask.shape[2], mask.shape[2], keys)
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(scores.dtype).min).reshape(batch, kv_heads, rows, keys)
    exp = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = exp * (1.0 / jnp.sum(exp, axis=-1, keepdims=True))
    out = jnp.matmul(probs.astype(v.dtype), v)
    return out, (q, k, v, probs, out)


def _attention_bwd(residuals, dout):
    """The [M, S] tensors (probs, their gradient) are only ever contracted along the axis XLA's CPU GEMMs
    want; the small [M, H] / [S, H] operands are transposed instead."""
    q, k, v, probs, out = residuals
    dprobs = jnp.matmul(dout, jnp.swapaxes(v, 2, 3), preferred_element_type=jnp.float32)
    delta = jnp.sum(dout * out, axis=-1, keepdims=True, dtype=jnp.float32)
    dscores = probs * (dprobs - delta)  # masked entries have probs 0, hence no gradient
    dq = jnp.matmul(dscores.astype(q.dtype), jnp.swapaxes(k, 2, 3))
    dk = jnp.matmul(jnp.swapaxes(q, 2, 3), dscores.astype(q.dtype))  # sums over the group's rows
    dv = jnp.swapaxes(jnp.matmul(jnp.swapaxes(dout, 2, 3), probs.astype(v.dtype)), 2, 3)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_grouped_attention.defvjp(_attention_fwd, _attention_bwd)
