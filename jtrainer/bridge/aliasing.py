"""torch's views under torchax: a view shares its base's storage, so an in-place op through either is seen by both.

torchax 0.0.13 gives every view op (`narrow`, `select`, `transpose`, `view`, `unsqueeze`, `expand`, `diagonal`,
`as_strided`, `split`, ...) a copy, and keeps a view only for basic indexing (`h[:, 0]`): `h.narrow(2, 0, 4).add_(1)`
is then silently lost. Here every torchax tensor a view op returns is recorded as a view of its root tensor: the
ops from the root's array to its own, and a meta tensor with torch's sizes and strides. After any op that replaced
a recorded tensor's array (an in-place op), the new values are written through to the root and every live view of
the root is recomputed from it, as torch's shared storage would show them.

The meta tensor decides what torch would have done where torchax's tensors (all contiguous to torch) hide it:
`reshape` / `contiguous` of a non-contiguous view copy in torch and are copies here; a write into an expanded view
(stride 0) raises torch's error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

_Step = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Alias:
    """A view's root tensor, the steps from the root's array to the view's, and the view's torch layout."""

    root: Any  # torchax.tensor.Tensor
    steps: tuple[_Step, ...]
    meta: torch.Tensor
    of_many: str | None = None  # "Output i of <op>" for one of several views an op returned (split, unbind)

    def values(self, root_array: jax.Array) -> jax.Array:
        for step in self.steps:
            root_array = step(root_array)
        return root_array

    def written(self, root_array: jax.Array, view_array: jax.Array) -> jax.Array:
        """The root's array with the view's elements replaced by `view_array`."""
        positions = self.values(jnp.arange(root_array.size, dtype=jnp.int32).reshape(root_array.shape))
        flat = root_array.reshape(-1).at[positions.reshape(-1)].set(view_array.reshape(-1).astype(root_array.dtype))
        return flat.reshape(root_array.shape)


_ALIASES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # view -> Alias
_VIEWS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # root -> {id: view} (weak values)
_WRITTEN: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the array last written through

# View ops whose result does not index the root's elements one to one: not tracked (a copy, as before).
_UNTRACKED = frozenset(
    {"aten::view.dtype", "aten::view_as_real", "aten::view_as_complex", "aten::real", "aten::imag", "aten::detach"}
)


def is_view_op(func) -> bool:
    """An aten op whose output aliases its input (schema `Tensor(a)`, not written)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns:
        return False
    if schema.name in _UNTRACKED or f"{schema.name}.{schema.overload_name}" in _UNTRACKED:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _plain_torch():
    """torch itself, for meta tensors: torchax's dispatch and function modes off."""
    stack = contextlib.ExitStack()
    stack.enter_context(_disable_current_modes())
    stack.enter_context(torch._C.DisableTorchFunction())
    return stack


def _meta_of(tensor) -> torch.Tensor:
    alias = _ALIASES.get(tensor)
    if alias is not None:
        return alias.meta
    with _plain_torch():
        return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")


def record_view(func, args, kwargs, result, run: Callable) -> None:
    """Record the torchax tensors `func` (a view op) returned as views of `args[0]`'s root. `run(func, args,
    kwargs)` runs an op on torchax tensors without recording."""
    import torchax.tensor

    base = args[0]
    if not isinstance(base, torchax.tensor.Tensor):
        return
    try:
        with _plain_torch():
            meta_out = func(_meta_of(base), *args[1:], **kwargs)
    except RuntimeError:  # no view of this layout: torch's reshape copies here, and so it stays
        return
    parent = _ALIASES.get(base)
    root, steps = (base, ()) if parent is None else (parent.root, parent.steps)
    env = base._env
    outputs, metas = (result, meta_out) if isinstance(result, (list, tuple)) else ([result], [meta_out])
    for index, (output, meta) in enumerate(zip(outputs, metas)):
        if not isinstance(output, torchax.tensor.Tensor):
            continue

        def step(array, index=index):
            out = run(func, (torchax.tensor.Tensor(array, env), *args[1:]), kwargs)
            return (out[index] if isinstance(out, (list, tuple)) else out)._elem

        op = "".join(part.title() for part in func._schema.name.split("::")[-1].split("_"))  # torch's node name
        of_many = f"Output {index} of {op}" if outputs is result else None
        _ALIASES[output] = Alias(root, (*steps, step), meta, of_many)
        _VIEWS.setdefault(root, weakref.WeakValueDictionary())[id(output)] = output


def is_tracked(tensor) -> bool:
    return tensor in _ALIASES or bool(_VIEWS.get(tensor))


def is_contiguous(tensor) -> bool:
    """torch's answer for a tracked view (torchax's tensors all claim to be contiguous)."""
    alias = _ALIASES.get(tensor)
    return alias is None or alias.meta.is_contiguous()


def written(tensor) -> None:
    """`tensor`'s array was replaced by an in-place op: the write reaches its root and every view of the root."""
    if _WRITTEN.get(tensor) is tensor._elem:
        return
    alias = _ALIASES.get(tensor)
    root = tensor
    if alias is not None:
        meta = alias.meta
        if any(stride == 0 and size > 1 for size, stride in zip(meta.shape, meta.stride())):
            raise RuntimeError(
                "unsupported operation: more than one element of the written-to tensor refers to a single memory "
                "location. Please clone() the tensor before performing the operation."
            )
        if alias.of_many is not None and torch.is_grad_enabled():
            raise RuntimeError(
                f"{alias.of_many} is a view and is being modified inplace. This view is the output of a function "
                "that returns multiple views. Such functions do not allow the output views to be modified inplace. "
                "You should replace the inplace operation by an out-of-place one."
            )
        root = alias.root
        root._elem = alias.written(root._elem, tensor._elem)
        _WRITTEN[root] = root._elem
    _WRITTEN[tensor] = tensor._elem
    for view in list(_VIEWS.get(root, {}).values()):
        if view is not tensor:
            view._elem = _ALIASES[view].values(root._elem)
            _WRITTEN[view] = view._elem
