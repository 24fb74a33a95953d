"""Causal self-attention, and the one place that chooses how it runs: Pallas splash attention on TPUs, cuDNN's
flash attention on GPUs, XLA's elsewhere, a CPU formulation that does less.

On TPUs (the chips the step runs on, or is compiled for by `jtrainer check --target`), attention goes to
`splash_attention`: a blockwise kernel that never materialises the [length, length] scores, skips the blocks
causality or a sliding window hides, and splits queries over the `sequence` mesh axis (context parallelism).
Shapes it cannot run fall back to XLA's formulation with a warning.

On GPUs, bf16/fp16 attention goes to `jax.nn.dot_product_attention(implementation="cudnn")`: a fused kernel that
never materialises the [length, length] scores and skips the tiles causality masks out. A padding or packing
mask travels as an additive bias (cuDNN also returns its gradient, which is dropped). Shapes cuDNN cannot run are
refused while tracing and fall back to XLA's formulation with a warning. `JTRAINER_ATTENTION=xla`, `cudnn` or
`splash` (which then raise instead of falling back) forces one; `splash` off a TPU runs the kernel in Pallas'
interpret mode (slow: for tests).

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

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jtrainer.core import env
from jtrainer.models.kernels import splash_attention
from jtrainer.models.kernels.dense import cpu_backend
from jtrainer.parallel import sharding

logger = logging.getLogger(__name__)

_MIN_BLOCK = 64
_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenMask:
    """What a query may not see besides causality, per token: `padding_BxT` (True for real tokens: a False key
    is seen by no query; HF's attention_mask) and `segment_ids_BxT` (packed rows: a query sees only keys of its
    own segment; 0 marks padding). Either may be None."""

    padding_BxT: jax.Array | None = None
    segment_ids_BxT: jax.Array | None = None

    def dense(self) -> jax.Array | None:
        """The same as booleans [batch, 1, T or 1, T] (None when nothing is masked)."""
        mask = None
        if self.padding_BxT is not None:
            mask = self.padding_BxT.astype(bool)[:, None, None, :]
        if self.segment_ids_BxT is not None:
            ids = self.segment_ids_BxT
            same = (ids[:, None, :, None] == ids[:, None, None, :]) & (ids != 0)[:, None, None, :]
            mask = same if mask is None else mask & same
        return mask


def causal_attention(
    q_BxTxNxH,
    k_BxTxKxH,
    v_BxTxKxH,
    mask: TokenMask | None = None,
    scale: float | None = None,
    sliding_window: int | None = None,
):
    """Causal multi-head (grouped-query when K < N) attention of T queries over the same T keys.

    `mask`: padding and packing (None: causality alone). `sliding_window` (HF's): query i sees key j only when
    i - j < sliding_window."""
    scale = q_BxTxNxH.shape[-1] ** -0.5 if scale is None else scale
    mask = mask or TokenMask()
    chosen = implementation(q_BxTxNxH, k_BxTxKxH)
    if (seen := _CHOSEN.get()) is not None:
        seen.add(chosen)
    if chosen == "splash":
        return splash_attention.splash_attention(
            q_BxTxNxH,
            k_BxTxKxH,
            v_BxTxKxH,
            mask.padding_BxT,
            mask.segment_ids_BxT,
            scale,
            sliding_window,
            interpret=not on_tpu(),
        )
    if chosen == "cpu":
        dense = causal_mask(q_BxTxNxH.shape[1], sliding_window)
        extra = mask.dense()
        return _blocked_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, dense if extra is None else dense & extra, scale)
    return _fused_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask.dense(), scale, sliding_window, chosen)


_CHOSEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("attention_chosen", default=None)


@contextlib.contextmanager
def chosen_implementations() -> Iterator[set[str]]:
    """The implementations (`implementation`'s names) self-attention took in what the block traced."""
    seen: set[str] = set()
    token = _CHOSEN.set(seen)
    try:
        yield seen
    finally:
        _CHOSEN.reset(token)


def on_tpu() -> bool:
    """Whether the step runs on (or is compiled for, `jtrainer check --target`) TPUs: the mesh's devices say."""
    return sharding.mesh_devices()[0].platform == "tpu"


def blockwise_requested() -> bool:
    """Whether self-attention is to run through the splash kernel: on TPUs, or under JTRAINER_ATTENTION=splash."""
    requested = requested_implementation()
    return requested == "splash" or (requested == "auto" and on_tpu())


def cpu_kernel_requested() -> bool:
    """Whether self-attention is to run jtrainer's blocked CPU formulation (JAX's default backend is the CPU,
    JTRAINER_ATTENTION unset)."""
    return not blockwise_requested() and cpu_backend() and requested_implementation() == "auto"


def splash_forced() -> bool:
    """Whether JTRAINER_ATTENTION=splash asks for the splash kernel explicitly (a fallback is then an error)."""
    return requested_implementation() == "splash"


def implementation(q: jax.Array, k: jax.Array) -> str:
    """How self-attention of these queries and keys runs: "splash" on TPUs, else "cpu" (the blocked CPU
    formulation) or the fused kernel's name (`fused_implementation`); `JTRAINER_ATTENTION` overrides."""
    requested = requested_implementation()
    if blockwise_requested():
        refusal = splash_attention.unsupported(q, k)
        if refusal is None:
            return "splash"
        if requested == "splash":
            raise ValueError(f"{env.ATTENTION.name}=splash: the splash attention kernel cannot run here: {refusal}.")
        _warn_once(f"Splash attention cannot run {tuple(q.shape)} ({refusal}): using XLA's attention.")
        return fused_implementation(q)
    if cpu_kernel_requested():
        return "cpu"
    return fused_implementation(q)


def causal_mask(length: int, sliding_window: int | None = None) -> jax.Array:
    """[1, 1, length, length] booleans: query i sees key j when j <= i (and i - j < sliding_window)."""
    offsets = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
    visible = offsets >= 0
    if sliding_window is not None:
        visible = visible & (offsets < sliding_window)
    return visible[None, None]


def requested_implementation() -> str:
    """The implementation env.ATTENTION asks for ('auto' unset), refused in one line when it names none."""
    requested = env.ATTENTION.text().lower()
    if requested not in _IMPLEMENTATIONS:
        raise ValueError(f"{env.ATTENTION.name}={requested!r} is not one of {_IMPLEMENTATIONS}; unset it for 'auto'.")
    return requested


def fused_implementation(q: jax.Array) -> str:
    """ "cudnn" for bf16/fp16 queries on a GPU, else "xla"; `JTRAINER_ATTENTION` overrides."""
    requested = requested_implementation()
    if requested in ("xla", "cudnn"):
        return requested
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    return "cudnn" if on_gpu and q.dtype in (jnp.bfloat16, jnp.float16) else "xla"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A fallback is warned about once, not once per layer."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _fused_attention(q, k, v, mask, scale, sliding_window, chosen: str):
    """jax.nn.dot_product_attention with causality as a mask type (cuDNN then skips the masked tiles)."""
    batch, length = q.shape[:2]
    if mask is not None:  # cuDNN takes a bias of the scores' shape, not a broadcastable one
        mask = jnp.broadcast_to(mask, (batch, 1, length, k.shape[1]))
    window = None if sliding_window is None else (sliding_window - 1, 0)
    kwargs = dict(mask=mask, scale=scale, is_causal=True, local_window_size=window)
    if chosen == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kwargs)
        except (ValueError, NotImplementedError, RuntimeError) as refusal:
            if requested_implementation() == "cudnn":
                raise
            _warn_once(f"cuDNN attention refused {q.shape} {q.dtype} ({refusal}): using XLA's attention.")
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
