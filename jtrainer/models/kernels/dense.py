"""x @ kernel with a weight gradient XLA's CPU backend computes at GEMM speed.

The weight gradient of y = x @ W is x^T @ dy, a contraction over the token dimension, which is the major
dimension of both operands. XLA's CPU backend feeds its GEMMs row-major operands only, so it copies one
operand into transposed order first, and it fuses that copy with whatever elementwise work produced the
operand (the SiLU gradient, the softmax gradient): the fused loop then reads every input with a stride of a
whole row. In a small Llama's train step these transposing fusions took a quarter of the step; the LM head's
alone (a [tokens, vocab] gradient) took ~90 ms where its GEMM took ~12.

On CPU, `dense`'s backward pass therefore transposes the narrower of x and dy itself, behind an optimisation
barrier: the transpose reads an operand that is already in memory, and the GEMM gets both operands in the
order it wants. On TPUs and GPUs, whose matrix units take either orientation for free, `dense` is a plain
`jnp.dot` (see `cpu_backend`), so sharding, remat policies and mixed precision see what they always saw.
Results are the same on every platform (same products, same sums).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jtrainer.parallel import sharding


def cpu_backend() -> bool:
    """Whether the programs traced now run on CPU, which picks this module's and `attention`'s CPU formulations.

    The default backend decides, not `jax.lax.platform_dependent`: autodiff linearises every branch of a
    platform_dependent, which tripled a small Llama's train-step tracing time. Both formulations compute the same
    values, so a program lowered for another platform than the default only runs at the other one's speed. A step
    compiled here for other chips (`jtrainer check --target`: the mesh's devices are not CPUs) is not CPU code."""
    return jax.default_backend() == "cpu" and sharding.mesh_devices()[0].platform == "cpu"


def _weight_grad_transposing(x_NxI: jax.Array, dy_NxO: jax.Array, precision) -> jax.Array:
    """x^T @ dy (any two operands sharing the token dimension N) with the narrower operand transposed explicitly
    (the barrier keeps XLA from folding it back)."""
    if x_NxI.shape[1] <= dy_NxO.shape[1]:
        return jnp.dot(jax.lax.optimization_barrier(x_NxI.T), dy_NxO, precision=precision)
    return jnp.dot(jax.lax.optimization_barrier(dy_NxO.T), x_NxI, precision=precision).T


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dense(x: jax.Array, kernel: jax.Array, precision=None) -> jax.Array:
    return jnp.dot(x, kernel, precision=precision)


def _dense_fwd(x, kernel, precision=None):
    return jnp.dot(x, kernel, precision=precision), (x, kernel)


def _dense_bwd(precision, residuals, dy):
    x, kernel = residuals
    dx = jnp.dot(dy, kernel.T, precision=precision).astype(x.dtype)
    dkernel = _weight_grad_transposing(x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), precision)
    return dx, dkernel.astype(kernel.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense(x: jax.Array, kernel: jax.Array, precision=None) -> jax.Array:
    """x[..., in] @ kernel[in, out] (see the module docstring for its backward pass on CPU)."""
    if not cpu_backend():
        return jnp.dot(x, kernel, precision=precision)
    return _dense(x, kernel, precision)


def _times_transposed(x: jax.Array, weight_OxI: jax.Array, precision) -> jax.Array:
    return jax.lax.dot_general(x, weight_OxI, (((x.ndim - 1,), (1,)), ((), ())), precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dense_transposed(x: jax.Array, weight_OxI: jax.Array, precision=None) -> jax.Array:
    return _times_transposed(x, weight_OxI, precision)


def _dense_transposed_fwd(x, weight_OxI, precision=None):
    return _times_transposed(x, weight_OxI, precision), (x, weight_OxI)


def _dense_transposed_bwd(precision, residuals, dy):
    x, weight_OxI = residuals
    dx = jnp.dot(dy, weight_OxI, precision=precision).astype(x.dtype)
    dweight = _weight_grad_transposing(dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]), precision)
    return dx, dweight.astype(weight_OxI.dtype)


_dense_transposed.defvjp(_dense_transposed_fwd, _dense_transposed_bwd)


def dense_transposed(x: jax.Array, weight_OxI: jax.Array, precision=None) -> jax.Array:
    """x[..., in] @ weight[out, in]^T, a torch `Linear`'s layout, with `dense`'s backward pass on CPU (the weight
    gradient dy^T @ x is the same token contraction)."""
    if not cpu_backend():
        return jnp.einsum("...i,oi->...o", x, weight_OxI, precision=precision)
    return _dense_transposed(x, weight_OxI, precision)


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """A `jax.lax.dot_general` for `nnx.Linear(dot_general=...)`: `dense` for the contraction nnx.Linear makes
    (last input dimension with the kernel's first), `lax.dot_general` for anything else."""
    (lhs_contract, rhs_contract), batch = dimension_numbers
    if (
        tuple(lhs_contract) == (lhs.ndim - 1,)
        and tuple(rhs_contract) == (0,)
        and batch == ((), ())
        and rhs.ndim == 2
        and preferred_element_type is None
        and out_sharding is None
    ):
        return dense(lhs, rhs, precision)
    return jax.lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )


def project(x: jax.Array, *layers) -> list[jax.Array]:
    """`[layer(x) for layer in layers]` for `nnx.Linear`s reading the same input (q/k/v, gate/up).

    On CPU, one product with the kernels side by side: one GEMM and one transposed copy of x in the backward
    pass instead of one per layer. Elsewhere each layer runs alone, so tensor-parallel kernels, sharded along
    their output axis, are never concatenated across devices."""
    if not cpu_backend() or len(layers) == 1:
        return [layer(x) for layer in layers]
    first = layers[0]
    kernel = jnp.concatenate([layer.kernel[...] for layer in layers], axis=1)
    bias = None
    if first.bias is not None:
        bias = jnp.concatenate([layer.bias[...] for layer in layers])
    x, kernel, bias = first.promote_dtype((x, kernel, bias), dtype=first.dtype)
    y = dense(x, kernel, first.precision)
    if bias is not None:
        y = y + bias
    ends = [layer.kernel.shape[1] for layer in layers]
    return jnp.split(y, [sum(ends[: i + 1]) for i in range(len(ends) - 1)], axis=-1)
