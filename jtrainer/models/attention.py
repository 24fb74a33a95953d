"""Causal self-attention: `jax.nn.dot_product_attention` on TPUs and GPUs, a CPU formulation that does less.

On CPU, XLA runs attention as separate passes over [batch, heads, length, length] tensors, and in a small
Llama's train step attention took a third of the time. The CPU branch here
- splits the queries into blocks and gives block i only the keys of blocks <= i (the others are masked by
  causality anyway): 10/16 of the work with four blocks;
- runs each block heads-major ([batch, heads, length, head_dim]) with a hand-written backward pass whose
  products all take their operands in the order XLA's CPU GEMMs want, so no [length, length] tensor is ever
  transposed (only the small query, key and value tensors are).
Values and gradients equal `jax.nn.dot_product_attention`'s (to float rounding), fully masked query rows
included: there the reference gives the mean of all values, and so does this.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jtrainer.models.linear import cpu_backend

_MIN_BLOCK = 64


def causal_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask_Bx1xTxT, scale: float | None = None):
    """Multi-head (grouped-query when K < N) attention whose mask already includes causality."""
    scale = q_BxTxNxH.shape[-1] ** -0.5 if scale is None else scale
    if cpu_backend():
        return _blocked_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask_Bx1xTxT, scale)
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask=mask_Bx1xTxT, scale=scale)


def _num_blocks(length: int) -> int:
    for blocks in (4, 2):
        if length % blocks == 0 and length // blocks >= _MIN_BLOCK:
            return blocks
    return 1


def _blocked_attention(q, k, v, mask, scale):
    length, groups = q.shape[1], q.shape[2] // k.shape[2]
    # Heads-major operands built once for all blocks; the barrier keeps XLA from folding the transposes into
    # each block's products (it still fuses part of the RoPE arithmetic into the blocks' slices).
    q_BxNxTxH, k_BxNxHxS, v_BxNxSxH = jax.lax.optimization_barrier(
        (q.transpose(0, 2, 1, 3), _heads_major(k, groups, transpose=True), _heads_major(v, groups))
    )
    size = length // _num_blocks(length)
    outs = []
    for end in range(size, length + 1, size):
        rows = slice(end - size, end)
        outs.append(_heads_major_attention(
            q_BxNxTxH[:, :, rows], k_BxNxHxS[..., :end], v_BxNxSxH[:, :, :end], mask[:, :, rows, :end], scale
        ))
    out = jnp.concatenate(outs, axis=2).transpose(0, 2, 1, 3)
    # A query row that sees no key: jax.nn's softmax over all-minimal scores is uniform over every key.
    no_key_Bx1xT = ~jnp.any(mask, axis=-1)
    mean_v_Bx1xNxH = jnp.repeat(jnp.mean(v, axis=1), groups, axis=1)[:, None].astype(out.dtype)
    return jnp.where(no_key_Bx1xT.transpose(0, 2, 1)[..., None], mean_v_Bx1xNxH, out)


def _heads_major(x_BxSxKxH, groups: int, transpose: bool = False):
    """[B, S, K, H] -> [B, K * groups, S, H] (or [..., H, S]); each key/value head repeated for its groups."""
    x = x_BxSxKxH.transpose(0, 2, 3, 1) if transpose else x_BxSxKxH.transpose(0, 2, 1, 3)
    return jnp.repeat(x, groups, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _heads_major_attention(q_BxNxTxH, k_BxNxHxS, v_BxNxSxH, mask, scale):
    """softmax(q k^T * scale, masked) v for one block of queries, every operand heads-major."""
    return _attention_fwd(q_BxNxTxH, k_BxNxHxS, v_BxNxSxH, mask, scale)[0]


def _attention_fwd(q, k, v, mask, scale):
    scores = jnp.matmul(q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    exp = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = exp * (1.0 / jnp.sum(exp, axis=-1, keepdims=True))
    out = jnp.matmul(probs.astype(v.dtype), v)
    return out, (q, k, v, probs, out)


def _attention_bwd(scale, residuals, dout):
    """The [T, S] tensors (probs, their gradient) are only ever contracted along the axis XLA's CPU GEMMs
    want; the small [T, H] / [S, H] operands are transposed instead."""
    q, k, v, probs, out = residuals
    dprobs = jnp.matmul(dout, jnp.swapaxes(v, 2, 3), preferred_element_type=jnp.float32)
    delta = jnp.sum(dout * out, axis=-1, keepdims=True, dtype=jnp.float32)
    dscores = probs * (dprobs - delta) * scale  # masked entries have probs 0, hence no gradient
    dq = jnp.matmul(dscores.astype(q.dtype), jnp.swapaxes(k, 2, 3))
    dk = jnp.matmul(jnp.swapaxes(q, 2, 3), dscores.astype(q.dtype))
    dv = jnp.swapaxes(jnp.matmul(jnp.swapaxes(dout, 2, 3), probs.astype(v.dtype)), 2, 3)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_heads_major_attention.defvjp(_attention_fwd, _attention_bwd)
