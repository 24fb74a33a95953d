"""torch's `Linear` on the native models' dense kernel: a bridged model's projections train at the native
models' speed on CPU.

torchax lowers `F.linear` to an einsum, whose weight gradient (dy^T @ x, a contraction over the tokens) XLA's
CPU backend computes by copying an operand into transposed order fused with the elementwise work that produced
it, reading every input with a whole row's stride: the cost `jtrainer.models.kernels.dense` removes for the
native families. Here `F.linear` and `aten.linear` run `dense_transposed` (the same kernel for torch's [out, in]
weight layout) when input and weight share a dtype, as torch requires; on other platforms, and for mixed dtypes,
torchax's own lowering runs unchanged. The values are the same products and sums either way.
"""

from __future__ import annotations

from typing import Any

import torch

from jtrainer.models import kernels

_LINEAR_OPS = (torch.nn.functional.linear, torch.ops.aten.linear, torch.ops.aten.linear.default)


def register(env: Any) -> None:
    """Route the environment's linear ops through `dense_transposed` (torchax's lowering kept as the fallback)."""
    for op in _LINEAR_OPS:
        own = env._ops.get(op)
        if own is not None:
            env.override_op_definition(op, _linear_on_tensors(env, own.func))


def _linear_on_tensors(env: Any, own: Any):
    import torchax.tensor

    def linear(input, weight, bias=None):
        x, w, b = env.t2j_iso((input, weight, bias))
        if not kernels.cpu_backend() or x.dtype != w.dtype or w.ndim != 2:
            return torchax.tensor.Tensor(own(x, w, b), env)
        y = kernels.dense_transposed(x, w)
        return torchax.tensor.Tensor(y if b is None else y + b, env)

    return linear
