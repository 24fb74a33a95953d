"""The layers the model families share: activations by HF's names, dense and embedding layers whose parameters
carry logical axis names (see jtrainer.parallel.sharding), torch's LayerNorm and HF's RMSNorm with HF's parameter
names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jtrainer.models.base import Embed
from jtrainer.models.kernels import dense_dot_general

# The logical axes of a [batch, length, width] activation between blocks.
ACTIVATION_AXES = ("batch", "length", "act_embed")

# HF's ACT2FN names -> the same function (torch's gelu is exact; "gelu_new" / "gelu_pytorch_tanh" the tanh form).
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def linear(
    din: int, dout: int, std: float, axes, rngs: nnx.Rngs, *, bias: bool = True, dtype=None, param_dtype=jnp.float32
) -> nnx.Linear:
    """nnx.Linear (kernel [in, out], normal(std) initialised, jtrainer's dense backward pass) whose kernel and bias
    carry the logical `axes` (the bias the output axis)."""
    layer = nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nnx.initializers.normal(std),
        dot_general=dense_dot_general,
        rngs=rngs,
    )
    layer.kernel.set_metadata(logical_axes=axes)
    if layer.bias is not None:
        layer.bias.set_metadata(logical_axes=axes[1:])
    return layer


def embedding(n: int, d: int, std: float, axes, rngs: nnx.Rngs, *, param_dtype=jnp.float32) -> Embed:
    """An [n, d] embedding table, normal(std) initialised, carrying the logical `axes`."""
    table = Embed(n, d, embedding_init=nnx.initializers.normal(std), param_dtype=param_dtype, rngs=rngs)
    table.embedding.set_metadata(logical_axes=axes)
    return table


class LayerNorm(nnx.Module):
    """torch's LayerNorm with HF's parameter names (`weight`, `bias`)."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,)), logical_axes=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,)), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.weight[...] + self.bias[...]


class RMSNorm(nnx.Module):
    """HF's LlamaRMSNorm (and T5's LayerNorm): normalise in fp32, then scale by `weight` in the input dtype."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x = x_BxLxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x_BxLxD.dtype) * x.astype(x_BxLxD.dtype)
