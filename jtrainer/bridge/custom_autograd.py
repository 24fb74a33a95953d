"""A user's `torch.autograd.Function` under the bridge: its own `backward`, as `jax.custom_vjp`.

torchax runs a Function's `forward` op by op and JAX would differentiate those ops, ignoring the `backward` the
user wrote (a straight-through estimator, a clipped or rescaled gradient): torch's gradients would silently not
be these. While the bridge runs torch code, `Function.apply` on torchax tensors becomes a `jax.custom_vjp` whose
forward is the Function's `forward` and whose backward is its `backward`, both traced through torchax.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch


class Context:
    """torch's `ctx` for a Function run under the bridge: saved tensors, `needs_input_grad`, and any attribute the
    forward sets. Its tensors cross from the forward to the backward as the custom_vjp's residuals."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple[Any, ...] = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.to_save = tensors

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return self.to_save

    def mark_non_differentiable(self, *tensors) -> None:
        """Its outputs' cotangents are zeros here (as torch materialises them)."""

    def mark_dirty(self, *tensors) -> None:
        """In-place outputs: the bridge's tensors are values, the forward's result is what counts."""

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _is_tensor(value) -> bool:
    import torchax.tensor

    return isinstance(value, torchax.tensor.Tensor)


def _differentiable(array) -> bool:
    return jnp.issubdtype(array.dtype, jnp.inexact)


def _split_context(ctx: Context) -> tuple[list[jax.Array], Any]:
    """The context's tensors (saved, or set as attributes) as arrays, and a function putting them back."""
    leaves, treedef = torch.utils._pytree.tree_flatten(dict(vars(ctx)))
    positions = [i for i, leaf in enumerate(leaves) if _is_tensor(leaf)]
    arrays = [leaves[i]._elem for i in positions]

    def restored(env, residuals):
        filled = list(leaves)
        for i, array in zip(positions, residuals):
            filled[i] = env.j2t_iso(array)
        restored_ctx = Context(ctx.needs_input_grad)
        vars(restored_ctx).update(torch.utils._pytree.tree_unflatten(filled, treedef))
        return restored_ctx

    return arrays, restored


def _run_forward(function, args: list, ctx: Context):
    if _defines_setup_context(function):
        output = function.forward(*args)
        function.setup_context(ctx, tuple(args), output)
        return output
    return function.forward(ctx, *args)


def _defines_setup_context(function) -> bool:
    return torch.autograd.function._is_setup_context_defined(function.setup_context)


def apply(function, *args, **kwargs):
    """`function.apply(*args)` with torchax tensors among the arguments: forward and backward the Function's own."""
    env = next(a for a in args if _is_tensor(a))._env
    if kwargs:
        args = tuple(inspect.signature(function.forward).bind(None, *args, **kwargs).args[1:])
    positions = [i for i, a in enumerate(args) if _is_tensor(a)]
    needs_grad = tuple(_is_tensor(a) and _differentiable(a._elem) for a in args)
    found: dict[str, Any] = {}

    def forward(arrays):
        call_args = list(args)
        for i, array in zip(positions, arrays):
            call_args[i] = env.j2t_iso(array)
        ctx = Context(needs_grad)
        output = _run_forward(function, call_args, ctx)
        outputs, treedef = torch.utils._pytree.tree_flatten(output)
        found["treedef"] = treedef
        found["dtypes"] = [o._elem.dtype if _is_tensor(o) else None for o in outputs]
        return [o._elem if _is_tensor(o) else o for o in outputs], ctx

    @jax.custom_vjp
    def call(*arrays):
        return forward(arrays)[0]

    def call_forward(*arrays):
        outputs, ctx = forward(arrays)
        residuals, restore = _split_context(ctx)
        found["restore"] = restore
        return outputs, residuals

    def call_backward(residuals, cotangents):
        with env, own_backward():  # JAX transposes after the forward's torch code has returned
            return backward(residuals, cotangents)

    def backward(residuals, cotangents):
        ctx = found["restore"](env, residuals)
        grads_in = [
            env.j2t_iso(jnp.zeros(c.shape, dtype) if c.dtype == jax.dtypes.float0 else c)
            for c, dtype in zip(cotangents, found["dtypes"])
        ]
        grads = function.backward(ctx, *grads_in)
        grads = grads if isinstance(grads, tuple) else (grads,)
        result: list[Any] = []  # numpy float0 zeros beside JAX arrays
        for i in positions:  # the inputs' shapes and dtypes are static: the arguments' own
            grad = grads[i] if i < len(grads) else None
            array = args[i]._elem
            shape = array.shape
            if not _differentiable(array):
                result.append(np.zeros(shape, jax.dtypes.float0))
            elif grad is None:
                result.append(jnp.zeros(shape, array.dtype))
            else:
                result.append(env.t2j_iso(grad).astype(array.dtype).reshape(shape))
        return tuple(result)

    call.defvjp(call_forward, call_backward)
    outputs = call(*[args[i]._elem for i in positions])
    tensors = [env.j2t_iso(o) if isinstance(o, jax.Array) else o for o in outputs]
    return torch.utils._pytree.tree_unflatten(tensors, found["treedef"])


@contextlib.contextmanager
def own_backward() -> Iterator[None]:
    """`torch.autograd.Function.apply` with its own backward for torchax tensors, for the duration; torch's own
    for anything else."""
    original = torch.autograd.Function.__dict__["apply"]

    @functools.wraps(original.__func__)
    def dispatching(cls, *args, **kwargs):
        if any(_is_tensor(a) for a in (*args, *kwargs.values())):
            return apply(cls, *args, **kwargs)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(dispatching)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]
