"""Causal attention through Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention): the TPU
kernel that computes attention block by block and never holds a [length, length] score matrix.

- Causality and sliding windows are the kernel's static block masks: blocks above the diagonal (or left of the
  window) are skipped, not computed and masked.
- Grouped-query attention runs the kernel's multi-query form once per key/value head over the query heads that
  share it, so keys and values are never repeated.
- Padding and packed rows (segment ids) are the kernel's segment ids: query i sees key j when their ids are equal.
  Queries carry their document's id, keys theirs, and a padding key an id no query has.
- Under a mesh, the kernel runs inside `shard_map` (Mosaic kernels cannot be partitioned by XLA): rows over the
  batch axes, heads over `tensor`, queries over `sequence`. Keys and values enter whole along the length, so
  XLA all-gathers them over `sequence` (their gradients are reduce-scattered back): context parallelism, with
  each chip's attention memory that of its own queries. The kernel's block masks are split by query shard
  (`q_seq_shards`), so every shard skips exactly the blocks its queries do not see, and the queries are put in a
  load-balanced order first (`_balanced_order`: each shard one early and one late chunk of the row, so under
  causality every shard has the same work; two collective permutes of half a shard each, `_exchange`; the
  kernel's mask reads their positions from that order).

Values and gradients are XLA attention's (to float rounding) on every query row that sees at least one key. A row
that sees none (a padding token before any real one) gets a finite value of the kernel's making where XLA's
attention gives the mean of all values: a position whose label is -100, as HF's collators set for padding, so
losses and gradients are the same. On CPU the kernel runs in Pallas' interpret mode (tests; slow).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtrainer.models import remat
from jtrainer.parallel import sharding

# The kernel's tile along queries and keys (MaxText's default on TPU v5e/v5p); shorter rows take one tile.
BLOCK = 512
# Lanes of a TPU vector register: every tile is a multiple of this (in interpret mode too).
_LANES = 128
# Segment id of padding keys: never a query's (queries carry their document's id, >= 0).
_PADDING_KEY = -1


# Products of [queries, head_dim] x [head_dim, keys] size the kernel's work: 2 forward (scores, output), 7 backward
# (scores and their gradient again in each of the dq and dk/dv kernels, then dq, dk, dv).
FORWARD_PRODUCTS, BACKWARD_PRODUCTS = 2, 7

_LEDGER: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("splash_flops", default=None)


@contextlib.contextmanager
def forward_flops() -> Iterator[list[float]]:
    """Collects the forward FLOPs of every kernel call traced in the block (XLA's cost analysis cannot see inside
    a Pallas kernel): `sum(ledger)` once the block has traced."""
    ledger: list[float] = []
    token = _LEDGER.set(ledger)
    try:
        yield ledger
    finally:
        _LEDGER.reset(token)


def _record_flops(batch: int, length: int, heads: int, head_dim: int, sliding_window: int | None) -> None:
    ledger = _LEDGER.get()
    if ledger is not None:  # keys a query sees on average: causal half the row, or its window
        seen = length / 2 if sliding_window is None else min(sliding_window, length / 2)
        ledger.append(2.0 * FORWARD_PRODUCTS * batch * heads * length * seen * head_dim)


def unsupported(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array) -> str | None:
    """Why the kernel cannot run these shapes here (None when it can)."""
    length, heads, kv_heads = q_BxTxNxH.shape[1], q_BxTxNxH.shape[2], k_BxTxKxH.shape[2]
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} key/value heads"
    shards = _sequence_shards()
    if length % (shards * shards):
        return f"a length of {length} is not a multiple of the sequence shards squared ({shards * shards})"
    local = length // shards
    if local % _LANES or local % _block(local) or length % _block(length):
        return f"a length of {length} ({local} a sequence shard) is not a multiple of {_LANES}"
    return None


def splash_attention(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    padding_BxT: jax.Array | None,
    segment_ids_BxT: jax.Array | None,
    scale: float,
    sliding_window: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention [batch, length, heads, head_dim] -> same shape. `padding_BxT`: True for real tokens
    (keys that are False are seen by no query); `segment_ids_BxT`: packed documents, 0 for padding."""
    batch, length, heads, head_dim = q_BxTxNxH.shape
    _record_flops(batch, length, heads, head_dim, sliding_window)
    mesh = _mesh()
    if mesh is not None and _kv_heads_split(mesh) and k_BxTxKxH.shape[2] % mesh.shape[sharding.TENSOR]:
        # Fewer key/value heads than `tensor` shards: each shard's query heads take their key/value head whole.
        groups = heads // k_BxTxKxH.shape[2]
        k_BxTxKxH, v_BxTxKxH = jnp.repeat(k_BxTxKxH, groups, axis=2), jnp.repeat(v_BxTxKxH, groups, axis=2)
    kv_heads = k_BxTxKxH.shape[2]
    groups = heads // kv_heads
    q_ids, kv_ids = _segment_ids(padding_BxT, segment_ids_BxT)
    # Queries scaled once ([T, H]), not every score; the kernel's layout puts heads before the length.
    q_BxKxGxTxH = (q_BxTxNxH * jnp.asarray(scale, q_BxTxNxH.dtype)).reshape(batch, length, kv_heads, groups, head_dim)
    q_BxKxGxTxH = q_BxKxGxTxH.transpose(0, 2, 3, 1, 4)
    k_BxKxTxH, v_BxKxTxH = k_BxTxKxH.transpose(0, 2, 1, 3), v_BxTxKxH.transpose(0, 2, 1, 3)
    shards = _sequence_shards()
    order = _balanced_order(length, shards)
    kernel = _kernel(length, groups, sliding_window, shards, interpret, BLOCK, order)
    if mesh is None:
        out = _run(kernel, q_BxKxGxTxH, k_BxKxTxH, v_BxKxTxH, q_ids, kv_ids)
    else:
        operands = (q_BxKxGxTxH, k_BxKxTxH, v_BxKxTxH, q_ids, kv_ids)
        out = _sharded(mesh, kernel, operands, shards, balanced=order is not None)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, head_dim)


def _pallas():
    """The kernel's modules, imported where a step uses them (`import jtrainer` does not need Pallas)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel, splash_attention_mask

    return splash_attention_kernel, splash_attention_mask


def _balanced_order(length: int, shards: int) -> np.ndarray | None:
    """The order of query positions that gives each of `shards` sequence shards the same causal work: the row
    cut in 2 x shards chunks, shard i taking chunks i and 2 x shards - 1 - i (one early, one late). None with
    one shard, or where a chunk would not be a whole number of kernel tiles."""
    chunk = length // (2 * shards)
    if shards == 1 or length % (2 * shards) or chunk % _LANES or chunk % _block(chunk):
        return None
    chunks = [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks]).astype(np.int32)


def _segment_ids(padding_BxT, segment_ids_BxT) -> tuple[jax.Array | None, jax.Array | None]:
    """(query ids, key ids) for the kernel: a query sees the keys of its own id (and no padding key)."""
    if padding_BxT is None and segment_ids_BxT is None:
        return None, None
    if segment_ids_BxT is None:
        q_ids = jnp.zeros(padding_BxT.shape, jnp.int32)  # one document; padding keys are hidden by their id
        return q_ids, jnp.where(padding_BxT, q_ids, _PADDING_KEY)
    q_ids = segment_ids_BxT.astype(jnp.int32)
    real = q_ids != 0 if padding_BxT is None else (q_ids != 0) & padding_BxT
    # A query of segment 0 (padding) then sees no key, as in XLA's attention.
    return q_ids, jnp.where(real, q_ids, _PADDING_KEY)


def _run(kernel, q_BxKxGxTxH, k_BxKxTxH, v_BxKxTxH, q_ids_BxT, kv_ids_BxS):
    """The kernel over rows and key/value heads (vmap); each call is one multi-query attention."""
    if q_ids_BxT is None:
        return jax.vmap(jax.vmap(lambda q, k, v: kernel(q, k, v)))(q_BxKxGxTxH, k_BxKxTxH, v_BxKxTxH)

    def row(q_KxGxTxH, k_KxSxH, v_KxSxH, q_ids_T, kv_ids_S):
        ids = _pallas()[0].SegmentIds(q=q_ids_T, kv=kv_ids_S)
        return jax.vmap(lambda q, k, v: kernel(q, k, v, ids))(q_KxGxTxH, k_KxSxH, v_KxSxH)

    return jax.vmap(row)(q_BxKxGxTxH, k_BxKxTxH, v_BxKxTxH, q_ids_BxT, kv_ids_BxS)


def _sharded(mesh, kernel, operands, shards: int, balanced: bool):
    """`_run` inside shard_map: each device runs the kernel on its rows, heads and (over `shards` sequence
    shards) queries; keys and values enter whole along the length (XLA gathers them over `sequence`). With
    `balanced`, each device's queries are exchanged into the balanced order first and its outputs back after."""
    q, _, _, q_ids, _ = operands
    rules = sharding.current_rules()
    rows = sharding.logical_to_spec(("batch",), rules, mesh)[0]
    heads = sharding.logical_to_spec(("heads",), rules, mesh)[0] if _kv_heads_split(mesh) else None
    length = sharding.SEQUENCE if shards > 1 else None
    q_spec, kv_spec = P(rows, heads, None, length, None), P(rows, heads, None, None)
    ids_specs = (P(rows, length), P(rows, None)) if q_ids is not None else (None, None)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, length)))

    def local(kernel, q, k, v, q_ids, kv_ids):
        if not balanced:
            return _run(kernel, q, k, v, q_ids, kv_ids)
        q = _exchange(q, 3, shards, to_balanced=True)
        q_ids = None if q_ids is None else _exchange(q_ids, 1, shards, to_balanced=True)
        return _exchange(_run(kernel, q, k, v, q_ids, kv_ids), 3, shards, to_balanced=False)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, *ids_specs),
        out_specs=q_spec,
        check_vma=False,
    )(kernel, *operands)


def _exchange(x: jax.Array, axis: int, shards: int, to_balanced: bool) -> jax.Array:
    """One device's positions (`axis`) between the contiguous layout (shard s: chunks 2s, 2s+1 of the row's
    2 x shards) and the balanced one (shard r: chunks r, 2 x shards - 1 - r), by two collective permutes of half
    a shard each (no gather of the row). Chunk j of the contiguous layout is half j % 2 of shard j // 2; it goes
    to shard j (first half) if j < shards, else to shard 2 x shards - 1 - j (second half)."""

    def home(chunk: int) -> int:
        return chunk if chunk < shards else 2 * shards - 1 - chunk

    moves = [[(s, home(2 * s + half)) for s in range(shards)] for half in (0, 1)]
    # Shard r holds (after) chunks r and 2n-1-r; the even one of them is the one half 0 carries.
    even = jax.lax.axis_index(sharding.SEQUENCE) % 2 == 0
    first, second = jnp.split(x, 2, axis=axis)
    if to_balanced:
        from_half0, from_half1 = (
            jax.lax.ppermute(part, sharding.SEQUENCE, moves[h]) for h, part in enumerate((first, second))
        )
        return jnp.where(
            even, jnp.concatenate([from_half0, from_half1], axis), jnp.concatenate([from_half1, from_half0], axis)
        )
    to_half0 = jnp.where(even, first, second)
    to_half1 = jnp.where(even, second, first)
    back = [[(dst, src) for src, dst in move] for move in moves]
    return jnp.concatenate(
        [
            jax.lax.ppermute(to_half0, sharding.SEQUENCE, back[0]),
            jax.lax.ppermute(to_half1, sharding.SEQUENCE, back[1]),
        ],
        axis,
    )


def _mesh():
    """The mesh the step is traced under, if it has more than one device (else the kernel runs bare)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    return mesh


def _kv_heads_split(mesh) -> bool:
    """Whether attention heads are split over `tensor` (the `heads` rule maps there and it has > 1 shard)."""
    spec = sharding.logical_to_spec(("heads",), sharding.current_rules(), mesh)
    return spec[0] is not None


def _sequence_shards() -> int:
    """How many `sequence` shards the queries are split into (1 without a mesh or when `length` is not split)."""
    mesh = _mesh()
    if mesh is None:
        return 1
    spec = sharding.logical_to_spec(("length",), sharding.current_rules(), mesh)
    return mesh.shape[sharding.SEQUENCE] if spec[0] == sharding.SEQUENCE else 1


def _block(length: int, block: int | None = None) -> int:
    return min(block or BLOCK, length)


def _kernel(
    length: int,
    groups: int,
    sliding_window: int | None,
    shards: int,
    interpret: bool,
    block: int,
    order: np.ndarray | None = None,
):
    """The kernel for rows of `length`, `groups` query heads per key/value head, its masks split into `shards`
    query shards, tiles of up to `block` tokens, queries in `order` (their positions; None: as they come).
    Built in each trace (its mask arrays become the trace's constants); the block masks it works out on the
    host are cached by the kernel's library, per mask."""
    kernels, masks = _pallas()
    if sliding_window is None:
        mask = masks.CausalMask((length, length), shard_count=shards)
    else:  # HF: query i sees key j when 0 <= i - j < sliding_window
        mask = masks.LocalMask((length, length), (sliding_window - 1, 0), offset=0, shard_count=shards)
    if order is not None:  # the mask (on the host and in the kernel) reads each query's position from here
        mask.q_sequence = order
    q_block = _block(length // shards if order is None else length // (2 * shards), block)
    kv_block = _block(length, block)
    blocks = kernels.BlockSizes(
        block_q=q_block,
        block_kv=kv_block,
        block_kv_compute=kv_block,
        block_q_dkv=q_block,
        block_kv_dkv=kv_block,
        block_kv_dkv_compute=kv_block,
        block_q_dq=q_block,
        block_kv_dq=kv_block,
    )
    return kernels.make_splash_mqa(
        mask=masks.MultiHeadMask([mask] * groups),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=shards,
        residual_checkpoint_name=remat.CONTEXT,  # kept with the context by save_dots_except_mlp
        interpret=interpret,
    )
