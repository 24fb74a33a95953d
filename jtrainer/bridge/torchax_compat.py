"""torchax, imported and set up for the bridge in one place.

torchax runs torch code on `jax.Array`s: a `torch.Tensor` subclass holding one, and torch's ops lowered to JAX.
Three things about torchax 0.0.13 are fixed here, each tested in tests/test_bridge.py so that the test
fails once torchax no longer needs it:

1. Its op tables name about twenty named-tensor overloads torch 2.13 removed (`aten.prod.dim_Dimname`, ...): at
   import, a missing overload of an op packet reads as a placeholder, which is taken out of the tables afterwards.
2. Importing it renames torch's private backend to "jax" and registers a `torch.jax` device module: torch then
   reports "jax" as its accelerator, and transformers.Trainer or accelerate in the same process move models onto
   it. Here the backend keeps torch's own name (`privateuseone`), its device module is registered under that
   name (torch's factories need one for `device=tensor.device`), and every other global it sets (torch's MHA
   fast path, a JAX client option, an environment variable) is put back.
3. Its `scaled_dot_product_attention` gives NaN for a query whose keys are all masked (torch gives 0): right
   padding inside a sliding window turns a whole padded row NaN, and NaN reaches the gradients through 0 * NaN.
4. It has no lowering for `aten::_grouped_mm`, the grouped matmul of transformers' default experts implementation
   (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek): here it is `jax.lax.ragged_dot` (tokens sorted by expert, one group of
   rows per expert), differentiated by JAX.
5. Its batch norm computes the new running statistics and drops them: here training-mode batch norm writes them
   into `running_mean` / `running_var` as torch does (the unbiased batch variance, `momentum`).
6. Its view ops copy (`narrow(...).add_(1)` is lost): `aliasing` gives views torch's shared storage.
7. It ignores `torch.no_grad()` (JAX differentiates through what torch does not): results computed with grad mode
   off are `stop_gradient`. A CPU tensor made in forward without `device=` (`torch.tensor(0.5)`,
   `torch.from_numpy(a)`) meeting a torchax tensor is a constant of the step (torchax raises "mixed math").
8. `Tensor.type_as` changes the tensor it is called on (torch returns a new one), and `Tensor.flatten` always
   copies: both are torch's own again.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import torch

from jtrainer.bridge import aliasing, linear

DEVICE = torch.device("privateuseone", 0)  # what `tensor.device` says of a torchax tensor (see point 2)


class RemovedOverload:
    """What a torch op packet answers, during torchax's import, for an overload torch no longer has."""

    def __init__(self, packet: str, overload: str):
        self.name = f"{packet}.{overload}"

    def __repr__(self):
        return f"RemovedOverload({self.name})"


REMOVED_OVERLOADS: list[RemovedOverload] = []


@contextlib.contextmanager
def _removed_overloads_tolerated():
    packet_type = torch._ops.OpOverloadPacket
    original = packet_type.__getattr__

    def getattr_or_placeholder(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            placeholder = RemovedOverload(self._qualified_op_name, key)
            REMOVED_OVERLOADS.append(placeholder)
            return placeholder

    packet_type.__getattr__ = getattr_or_placeholder  # type: ignore[method-assign]  # for torchax's import only
    try:
        yield
    finally:
        packet_type.__getattr__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _torch_globals_kept():
    """torchax's import-time changes to torch's and JAX's globals, undone (point 2 of the module docstring)."""
    rename, register = torch.utils.rename_privateuse1_backend, torch._register_device_module
    fast_path = torch.backends.mha.get_fastpath_enabled()
    telemetry = os.environ.get("ENABLE_RUNTIME_UPTIME_TELEMETRY")
    client_options = getattr(jax.config, "jax_pjrt_client_create_options", None)
    torch.utils.rename_privateuse1_backend = lambda backend_name: None
    torch._register_device_module = lambda name, module: None
    try:
        yield
    finally:
        torch.utils.rename_privateuse1_backend, torch._register_device_module = rename, register
        torch.backends.mha.set_fastpath_enabled(fast_path)
        if telemetry is None:
            os.environ.pop("ENABLE_RUNTIME_UPTIME_TELEMETRY", None)
        if client_options is not None or hasattr(jax.config, "jax_pjrt_client_create_options"):
            jax.config.update("jax_pjrt_client_create_options", client_options)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's scaled_dot_product_attention on jax arrays, as torch computes it: a query whose keys are all masked
    attends to nothing (0), not NaN."""
    length, source = query.shape[-2], key.shape[-2]
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    allowed = jnp.ones((length, source), bool)
    bias = jnp.zeros((length, source), query.dtype)
    if is_causal:
        allowed = jnp.tril(allowed)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            allowed = allowed & attn_mask
        else:
            bias = bias + attn_mask.astype(query.dtype)
            allowed = allowed & (attn_mask > -jnp.inf)
    if enable_gqa:
        key = jnp.repeat(key, query.shape[-3] // key.shape[-3], axis=-3)
        value = jnp.repeat(value, query.shape[-3] // value.shape[-3], axis=-3)
    scores = jnp.einsum("...qd,...kd->...qk", query, key) * jnp.asarray(scale, query.dtype) + bias
    scores = jnp.where(allowed, scores, -jnp.inf)
    any_key = jnp.any(allowed, axis=-1, keepdims=True)
    weights = jax.nn.softmax(jnp.where(any_key, scores, 0.0), axis=-1)
    weights = jnp.where(allowed & any_key, weights, 0.0).astype(query.dtype)
    if dropout_p > 0:
        import torchax

        rng = torchax.default_env().get_and_rotate_prng_key()
        keep = jax.random.bernoulli(rng, 1.0 - dropout_p, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_p), 0.0).astype(query.dtype)
    return jnp.einsum("...qk,...kd->...qd", weights, value)


def _sdpa_on_tensors(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    import torchax.tensor

    env = query._env
    query, key, value, attn_mask = env.t2j_iso((query, key, value, attn_mask))
    out = _sdpa(
        query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return torchax.tensor.Tensor(out, env)


def _grouped_mm(lhs, rhs, offs=None, bias=None, out_dtype=None):
    """torch's `_grouped_mm` on jax arrays. With `offs` (cumulative row ends, one per group) a 2-D `lhs` [rows,
    k] is multiplied group by group with `rhs` [groups, k, n]; without, it is a (batched) matmul."""
    if offs is None:
        out = jnp.matmul(lhs, rhs)
    elif lhs.ndim == 2 and rhs.ndim == 3:
        ends = offs.astype(jnp.int32)
        sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
        out = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    else:
        raise NotImplementedError(
            f"torch._grouped_mm of a {lhs.ndim}-D by a {rhs.ndim}-D tensor with offsets: the bridge lowers the "
            "grouped rows of transformers' experts (2-D by 3-D) only."
        )
    if bias is not None:
        out = out + bias
    dtype = lhs.dtype if out_dtype is None else out_dtype
    return out.astype(dtype)


def _grouped_mm_on_tensors(lhs, rhs, offs=None, bias=None, out_dtype=None):
    import torchax.tensor
    from torchax.ops import mappings

    env = lhs._env
    lhs, rhs, offs, bias = env.t2j_iso((lhs, rhs, offs, bias))
    dtype = None if out_dtype is None else mappings.t2j_dtype(out_dtype)
    return torchax.tensor.Tensor(_grouped_mm(lhs, rhs, offs, bias, out_dtype=dtype), env)


def _update_running_statistics(env, input, running_mean, running_var, training, momentum) -> None:
    """Training-mode batch norm's update of the running statistics, in place, as torch's (the unbiased batch
    variance)."""
    if not training or running_mean is None:
        return
    x = jax.lax.stop_gradient(env.t2j_iso(input)).astype(jnp.float32)
    axes = (0, *range(2, x.ndim))
    count = x.size // x.shape[1]
    batch = {"mean": jnp.mean(x, axis=axes), "var": jnp.var(x, axis=axes) * (count / max(count - 1, 1))}
    for stat, value in ((running_mean, batch["mean"]), (running_var, batch["var"])):
        stat._elem = ((1 - momentum) * stat._elem + momentum * value).astype(stat._elem.dtype)


def _stop_gradient(result, inputs: set[int]):
    """Grad mode off: the op's new torchax tensors carry no gradient (tensors it mutated keep theirs)."""
    import torchax.tensor

    for leaf in torch.utils._pytree.tree_leaves(result):
        if isinstance(leaf, torchax.tensor.Tensor) and id(leaf) not in inputs:
            leaf._elem = jax.lax.stop_gradient(leaf._elem)


def _with_torch_semantics(env, dispatch):
    """torchax's dispatch with points 5-7 of the module docstring."""
    import torchax.tensor

    def as_constant(value):
        if isinstance(value, torchax.tensor.Tensor) or value.is_meta or value.device.type != "cpu":
            return value
        return torchax.tensor.Tensor(env.t2j_copy(value.detach()), env)

    def torchax_tensors(args, kwargs) -> tuple[list, bool]:
        """The torchax tensors among the arguments, and whether other torch tensors are there too."""
        tensors = [leaf for leaf in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        ours = [tensor for tensor in tensors if isinstance(tensor, torchax.tensor.Tensor)]
        return ours, len(ours) < len(tensors)

    def run(func, types, args, kwargs=None):
        kwargs = kwargs or {}
        ours, mixed = torchax_tensors(args, kwargs)
        if ours and mixed:
            args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, as_constant, (args, kwargs))
            ours, _ = torchax_tensors(args, kwargs)
        if func is torch.Tensor.contiguous and ours and not aliasing.is_contiguous(args[0]):
            return torchax.tensor.Tensor(args[0]._elem, env)  # torch copies a non-contiguous view
        tracked = [(tensor, tensor._elem) for tensor in ours if aliasing.is_tracked(tensor)]
        result = dispatch(func, types, args, kwargs)
        if func in _BATCH_NORMS:
            _update_running_statistics(env, *_batch_norm_args(func, args, kwargs))
        for tensor, before in tracked:
            if tensor._elem is not before:
                aliasing.written(tensor)
        if ours and aliasing.is_view_op(func):
            aliasing.record_view(func, args, kwargs, result, lambda f, a, k: dispatch(f, (), a, k))
        if ours and not torch.is_grad_enabled():
            _stop_gradient(result, {id(t) for t in ours})
        return result

    return run


_BATCH_NORMS = (
    torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit_no_training.default,
    torch.ops.aten.native_batch_norm.default,
)


def _batch_norm_args(func, args, kwargs):
    """(input, running_mean, running_var, training, momentum) of any of _BATCH_NORMS."""
    bound = dict(zip([argument.name for argument in func._schema.arguments], args)) | kwargs
    names = ("input", "running_mean", "running_var", "training", "momentum")
    return tuple(bound.get(name, False if name == "training" else None) for name in names)


# torchax's own methods the fixes replace (tests check that torchax still needs the fixes).
TORCHAX_OWN: dict[str, object] = {}


def _type_as(self, other):
    return self.to(other.dtype)


@functools.cache
def environment():
    """torchax's environment with the fixes above (imported on first use: torch and torchax load here)."""
    with _removed_overloads_tolerated(), _torch_globals_kept():
        import torchax
        import torchax.decompositions  # noqa: F401  (their op tables are read at import: inside the fixes)
        import torchax.ops.jaten  # noqa: F401
        import torchax.ops.jtorch  # noqa: F401

        env = torchax.default_env()
    import torchax.amp
    import torchax.device_module
    import torchax.tensor
    import torchax.view

    for table in (torchax.amp.autocast_policy, env._ops, env._decomps):
        for op in [op for op in table if isinstance(op, RemovedOverload)]:
            del table[op]
    torch._register_device_module(DEVICE.type, torchax.device_module)
    torchax.tensor.Tensor.device = property(lambda self: DEVICE)
    torchax.view.View.device = property(lambda self: DEVICE)
    sdpa: tuple[Any, ...] = (
        torch.nn.functional.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention,
    )
    for op in sdpa:
        env.override_op_definition(op, _sdpa_on_tensors)
    env.override_op_definition(torch.ops.aten._grouped_mm.default, _grouped_mm_on_tensors)
    linear.register(env)  # not a fix: the native models' dense kernel for torch's Linear (bridge/linear.py)
    # Basic indexing is a view like any other (aliasing), not torchax's own View: torch's __getitem__ again.
    env._ops.pop(torch.Tensor.__getitem__, None)
    TORCHAX_OWN.update(type_as=torchax.tensor.Tensor.type_as, flatten=torchax.tensor.Tensor.flatten)
    del torchax.tensor.Tensor.flatten
    torchax.tensor.Tensor.type_as = _type_as
    setitem = torchax.tensor.Tensor.__setitem__

    def set_item(self, key, value):
        setitem(self, key, value)
        if aliasing.is_tracked(self):
            aliasing.written(self)

    torchax.tensor.Tensor.__setitem__ = set_item
    env.dispatch = _with_torch_semantics(env, env.dispatch)
    return env
