"""The one place a Mesh is built; logical axis rules -> PartitionSpecs for parameters, batches and activations.

Mesh axes: `data` (replicated parameters, split batch: DDP), `fsdp` (split batch and split parameters, gradients
and optimizer state: ZeRO-3), `expert` (a mixture of experts' experts split over it; like `data` for the rest of
the model: split batch), `tensor` (Megatron column/row splits of heads and MLP), `sequence` (split sequence
length: context parallel). One jit-compiled step runs on any combination; XLA inserts the collectives.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtrainer.core.state import Frozen, split_params

DATA, FSDP, EXPERT, TENSOR, SEQUENCE = "data", "fsdp", "expert", "tensor", "sequence"
MESH_AXES = (DATA, FSDP, EXPERT, TENSOR, SEQUENCE)
BATCH_AXES = (DATA, FSDP, EXPERT)

# Logical axis name -> mesh axis (or axes, or None: replicated). Users override entries with
# `TrainingArguments(logical_axis_rules={"mlp": None, ...})`.
DEFAULT_RULES: dict[str, Any] = {
    "batch": BATCH_AXES,
    "length": SEQUENCE,
    "act_embed": None,
    "embed": FSDP,
    "vocab": TENSOR,
    "mlp": TENSOR,
    "heads": TENSOR,
    "kv": None,  # key/value projections are replicated over `tensor` (GQA models have few kv heads)
    "norm": None,
    "layers": None,
    "expert": EXPERT,  # the experts dimension of a mixture of experts' stacked weights
}

# Parameters with fewer elements than this are replicated when they carry no annotation.
MIN_SHARDED_SIZE = 1024

_CURRENT_RULES: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("rules", default=None)


def _as_dict(value: Any, name: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError(f"--{name} must be a dict (or a JSON string of one), got {value!r}.")
    return dict(value)


def resolve_mesh_shape(args: Any, num_devices: int) -> dict[str, int]:
    """Mesh axis sizes from `mesh_shape`, HF's `parallelism_config` or `fsdp`; -1 takes the remaining devices."""
    shape = _as_dict(getattr(args, "mesh_shape", None), "mesh_shape")
    source = "mesh_shape"
    if not shape and getattr(args, "parallelism_config", None) is not None:
        pc, source = args.parallelism_config, "parallelism_config"
        get = (lambda k: pc.get(k)) if isinstance(pc, dict) else (lambda k: getattr(pc, k, None))
        shape = {
            DATA: get("dp_replicate_size") or 1,
            FSDP: get("dp_shard_size") or -1,
            TENSOR: get("tp_size") or 1,
            SEQUENCE: get("cp_size") or 1,
        }
    if not shape and getattr(args, "fsdp", None):
        shape, source = {FSDP: -1}, "fsdp"
    if not shape:
        shape = {DATA: -1}
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"--{source} has unknown mesh axes {sorted(unknown)}; use {list(MESH_AXES)}.")
    sizes = {axis: int(shape.get(axis, 1)) for axis in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"--{source}: at most one axis may be -1, got {free}.")
    known = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if known <= 0 or num_devices % known:
            raise ValueError(
                f"--{source} {shape}: the fixed axes ({known} devices) do not divide the {num_devices} devices."
            )
        sizes[free[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices or min(sizes.values()) < 1:
        raise ValueError(
            f"--{source} {shape} needs {math.prod(sizes.values())} devices but there are {num_devices}: "
            "make the axis sizes multiply to the device count (or use -1 for one axis)."
        )
    return sizes


_TARGET_DEVICES: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("target_devices", default=None)


@contextlib.contextmanager
def use_devices(devices: Sequence[Any] | None) -> Iterator[None]:
    """Meshes built in the block use `devices` (a compile-only TPU topology for `jtrainer check --target`)
    instead of `jax.devices()`; None changes nothing."""
    token = _TARGET_DEVICES.set(tuple(devices) if devices is not None else _TARGET_DEVICES.get())
    try:
        yield
    finally:
        _TARGET_DEVICES.reset(token)


def mesh_devices() -> list:
    """The devices meshes are built over: `jax.devices()`, or those of an enclosing `use_devices`."""
    target = _TARGET_DEVICES.get()
    return list(target if target is not None else jax.devices())


def make_mesh(sizes: dict[str, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A 5-axis mesh laid out for the machine (`device_grid`); `data` is outermost, so on many hosts and
    slices it spans them (the DCN axis) by default."""
    devices = list(devices if devices is not None else mesh_devices())
    sizes = sizes or {DATA: len(devices)}
    sizes = {axis: sizes.get(axis, 1) for axis in MESH_AXES}
    grid = device_grid([sizes[a] for a in MESH_AXES], devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_grid(shape: list[int], devices: list) -> np.ndarray:
    """The devices arranged as the mesh `shape` [data, fsdp, expert, tensor, sequence] along the interconnect.

    One process: `mesh_utils.create_device_mesh`, which follows the chips' torus (TPU) so each mesh axis runs
    over neighbouring chips. Several processes (hosts, slices): `create_hybrid_device_mesh` with each process a
    granule, its devices laid out for the torus inside it, the processes split over the batch axes (`data`
    first, then `fsdp`) in process order, which puts slices on `data`. Each process's rows of a batch then stay
    one contiguous block (what the loader feeds). Where neither applies (a split that would interleave the
    processes' rows, devices mesh_utils does not know), the devices keep their order (a plain reshape)."""
    from jax.experimental import mesh_utils

    plain = np.asarray(devices, dtype=object).reshape(shape)
    processes = sorted({d.process_index for d in devices})
    try:
        if len(processes) == 1:
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        else:
            granules = len(processes)
            over_data = math.gcd(shape[0], granules)
            over_fsdp = granules // over_data
            if shape[1] % over_fsdp or (over_fsdp > 1 and shape[0] // over_data > 1):
                return plain
            inner = [shape[0] // over_data, shape[1] // over_fsdp, *shape[2:]]
            over_processes = [over_data, over_fsdp] + [1] * len(shape[2:])
            grid = mesh_utils.create_hybrid_device_mesh(
                inner, over_processes, devices, process_is_granule=True, allow_split_physical_axes=True
            )
    except (ValueError, NotImplementedError, AssertionError, KeyError, AttributeError):
        return plain
    return grid if _rows_contiguous(grid) else plain


def _rows_contiguous(grid: np.ndarray) -> bool:
    """Whether every process's devices take one contiguous run of the batch axes (data x fsdp x expert,
    flattened)."""
    per_row = grid.reshape(math.prod(grid.shape[: len(BATCH_AXES)]), -1)
    if any(len({d.process_index for d in row}) > 1 for row in per_row):
        return False  # tensor / sequence shards of one row on several processes: rows are shared, not split
    owners = [row[0].process_index for row in per_row]
    seen, last = set(), None
    for owner in owners:
        if owner != last and owner in seen:
            return False
        seen.add(owner)
        last = owner
    return True


def merged_rules(overrides: Any = None) -> dict[str, Any]:
    rules = dict(DEFAULT_RULES)
    for key, value in _as_dict(overrides, "logical_axis_rules").items():
        rules[key] = tuple(value) if isinstance(value, list) else value
    return rules


def _mesh_axes_of(rule: Any) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def logical_to_spec(
    logical: Sequence[str | None],
    rules: dict[str, Any],
    mesh: Mesh | AbstractMesh,
    shape: Sequence[int] | None = None,
    name="",
) -> P:
    """PartitionSpec of an array whose dimensions carry these logical names; size-1 mesh axes are dropped."""
    used: set[str] = set()
    entries = []
    for dim, logical_name in enumerate(logical):
        axes: tuple[str, ...]
        if logical_name in MESH_AXES:
            axes = (str(logical_name),)
        else:
            axes = _mesh_axes_of(rules.get(logical_name)) if logical_name is not None else ()
        axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in used)
        if shape is not None and axes:
            split = math.prod(mesh.shape[a] for a in axes)
            if shape[dim] % split:
                raise ValueError(
                    f"Parameter {name} of shape {tuple(shape)}: dimension {dim} ({logical_name!r}, size "
                    f"{shape[dim]}) cannot be split over mesh axes {axes} of total size {split}. Change the mesh "
                    "(mesh_shape) or map this logical axis elsewhere (logical_axis_rules)."
                )
        used.update(axes)
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*entries)


def default_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """For parameters without annotations: fsdp-split the largest divisible dimension; replicate small ones."""
    n = mesh.shape[FSDP]
    if n == 1 or math.prod(shape) < MIN_SHARDED_SIZE:
        return P()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % n == 0:
            return P(*[FSDP if d == dim else None for d in range(len(shape))])
    return P()


def _logical_axes(var: nnx.Variable) -> tuple | None:
    meta = var.get_metadata()
    for key in ("logical_axes", "sharding_names", "sharding"):
        value = meta.get(key)
        if value is not None:
            return tuple(value)
    return None


def flatten_specs(tree: dict, prefix: tuple = ()) -> dict[tuple, P]:
    """A nested dict of PartitionSpecs (as param_specs returns) -> {path: spec}."""
    flat: dict[tuple, P] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_specs(value, prefix + (key,)))
        else:
            flat[prefix + (key,)] = value
    return flat


def _unflatten(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def param_specs(model: nnx.Module, mesh: Mesh, rules: dict[str, Any], of: Any = nnx.Param) -> dict:
    """PartitionSpecs of the model's parameters (or of its variables of type `of`), as a pure dict shaped like
    nnx.to_pure_dict(params)."""
    flat = {}
    for path, var in nnx.to_flat_state(nnx.state(model, of)):
        shape = tuple(var.shape)
        logical = _logical_axes(var)
        name = ".".join(map(str, path))
        if logical is None:
            flat[path] = default_spec(shape, mesh)
        else:
            if len(logical) != len(shape):
                raise ValueError(f"Parameter {name} has shape {shape} but {len(logical)} logical axes {logical}.")
            flat[path] = logical_to_spec(logical, rules, mesh, shape, name)
    return _unflatten(flat)


def model_state_shardings(model: nnx.Module, mesh: Mesh, rules: dict[str, Any]) -> Any:
    """Shardings of the model's non-parameter state, shaped like it: frozen weights (`state.Frozen`) laid out as
    parameters are (a peft model's base model is most of the model), the rest (buffers, keys) replicated."""
    _, _, rest = split_params(model)
    frozen = flatten_specs(param_specs(model, mesh, rules, of=Frozen))
    flat = nnx.to_flat_state(rest)
    leaves = [NamedSharding(mesh, frozen[path]) if path in frozen else replicated(mesh) for path, _ in flat]
    treedef = jax.tree.structure(rest)
    assert len(jax.tree.leaves(rest)) == len(leaves), "one array per model-state variable"
    return jax.tree.unflatten(treedef, leaves)


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_spec(ndim: int, row_dim: int, token_level: bool) -> P:
    """Rows over (data, fsdp); for token-level arrays the next dimension (the length) over `sequence`."""
    entries: list[Any] = [None] * ndim
    entries[row_dim] = BATCH_AXES
    if token_level and ndim > row_dim + 1:
        entries[row_dim + 1] = SEQUENCE
    return P(*entries)


def batch_shardings(mesh: Mesh, batch: dict[str, np.ndarray], row_dim: int) -> dict[str, NamedSharding]:
    return {
        k: NamedSharding(mesh, batch_spec(v.ndim, row_dim, v.ndim - row_dim >= 2 and v.dtype.kind in "iub"))
        for k, v in batch.items()
    }


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def check_length_divisible(length: int | None, mesh: Mesh) -> None:
    n = mesh.shape[SEQUENCE]
    if length is not None and length % n:
        raise ValueError(
            f"A sequence length of {length} cannot be split over the {n}-way `sequence` mesh axis: pad sequences "
            f"to a multiple of {n} (e.g. the collator's pad_to_multiple_of={n}) or change mesh_shape."
        )


def process_row_range(mesh: Mesh, global_rows: int) -> tuple[int, int]:
    """The contiguous rows [start, stop) of a global batch whose shards live on this process's devices."""
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    slices = [s for s in sharding.addressable_devices_indices_map((global_rows,)).values() if s is not None]
    starts = [s[0].start or 0 for s in slices]
    stops = [s[0].stop if s[0].stop is not None else global_rows for s in slices]
    return min(starts), max(stops)


def put_global(batch: dict[str, np.ndarray], mesh: Mesh, row_dim: int, global_rows: int) -> dict[str, jax.Array]:
    """This process's rows -> global jax.Arrays split over the mesh (`make_array_from_process_local_data`)."""
    shardings = batch_shardings(mesh, batch, row_dim)
    out = {}
    for key, local in batch.items():
        shape = list(local.shape)
        shape[row_dim] = global_rows
        out[key] = jax.make_array_from_process_local_data(shardings[key], local, tuple(shape))
    return out


def place(tree: Any, shardings: Any) -> Any:
    """Arrays every process holds whole (a torch model's weights, built alike by each process) laid out on their
    shardings; on several processes each builds its own shards from its copy (no transfer between hosts)."""

    def one(value, target: NamedSharding):
        if target.is_fully_addressable:
            return jax.device_put(value, target, may_alias=False)
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            return jax.device_put(value, target)  # already global: resharded by XLA
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):  # a key: its data placed, then wrapped again
            if target.spec != P():
                raise ValueError(f"Random keys are placed replicated, not by {target.spec}.")
            return jax.random.wrap_key_data(one(jax.random.key_data(value), target), impl=jax.random.key_impl(value))
        host = np.asarray(jax.device_get(value))
        return jax.make_array_from_callback(host.shape, target, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


@contextlib.contextmanager
def axis_rules(rules: dict[str, Any]) -> Iterator[None]:
    token = _CURRENT_RULES.set(rules)
    try:
        yield
    finally:
        _CURRENT_RULES.reset(token)


def current_rules() -> dict[str, Any]:
    """The logical axis rules of the step being traced (`axis_rules`), else the defaults."""
    return _CURRENT_RULES.get() or DEFAULT_RULES


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Constrain an activation's sharding by logical names under the current mesh (a no-op without one)."""
    rules = _CURRENT_RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh is None or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical, rules, mesh))


def per_device_bytes(tree: Any) -> dict[str, int]:
    """Bytes of a pytree's arrays held by each local device (from the addressable shards)."""
    totals: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                key = str(shard.device)
                totals[key] = totals.get(key, 0) + shard.data.nbytes
    return totals
