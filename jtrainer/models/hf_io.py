"""HF weight files <-> nnx parameters: names and layouts exactly as PyTorch transformers writes them.

nnx paths follow HF module names; only the leaf names and layouts differ: `kernel` [in, out] <-> `weight`
[out, in] (torch Linear), `embedding` <-> `weight`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jtrainer.core.errors import BadInput

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def _hf_name(path: tuple) -> tuple[str, bool]:
    """nnx path -> (HF tensor name, whether the tensor is transposed)."""
    *module, leaf = (str(p) for p in path)
    if leaf == "kernel":
        return ".".join([*module, "weight"]), True
    if leaf == "embedding":
        return ".".join([*module, "weight"]), False
    return ".".join([*module, leaf]), False


def layer_count(model: Any, path: tuple) -> int | None:
    """How many layers parameter `path` stacks along its leading axis (a scan_layers model), else None."""
    stacked = getattr(model, "stacked_layers", None)
    if stacked is None:
        return None
    prefix, count = stacked
    return count if tuple(str(p) for p in path[: len(prefix)]) == prefix else None


def hf_names(model: Any, path: tuple) -> list[tuple[str, bool]]:
    """The HF tensors of one nnx parameter, as (name, whether transposed): one, or one per layer for a stacked
    parameter (layer i's name has the index after the prefix, as `model.layers.{i}.self_attn...`)."""
    count = layer_count(model, path)
    if count is None:
        return [_hf_name(path)]
    at = len(model.stacked_layers[0])
    return [_hf_name((*path[:at], i, *path[at:])) for i in range(count)]


def param_path(tree_path: tuple) -> tuple:
    """A jax key path (from `tree_flatten_with_path` over a parameter tree) as the plain keys of an nnx path."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in tree_path)


def param_from_hf(model: Any, path: tuple, tensors) -> np.ndarray:
    """One parameter's value in jtrainer's layout from HF-named tensors in torch's layout (a mapping holding
    each of `hf_names`): kernels transposed back, a stacked parameter's layers stacked. The inverse of the
    export's layout."""
    parts = [tensors[name].T if transposed else tensors[name] for name, transposed in hf_names(model, path)]
    return parts[0] if layer_count(model, path) is None else np.stack(parts)


# The most bytes one gather replicates on every device at once: a larger parameter (a 128k-vocabulary embedding
# is 2 GB in float32) is gathered in row blocks, so the export never needs a whole parameter's room per chip.
GATHER_BLOCK_BYTES = 256 * 2**20


def host_value(x, keep: bool = True) -> np.ndarray | None:
    """The whole value of an array on this host; sharded arrays spanning processes are gathered (a collective:
    every process calls it), in row blocks of at most GATHER_BLOCK_BYTES. With `keep=False` this process only
    takes part in the gathers and holds one block at a time; it returns None."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x)) if keep else None
    if not isinstance(x.sharding, jax.sharding.NamedSharding):
        from jax.experimental import multihost_utils

        value = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return value if keep else None
    replicated = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    if x.ndim == 0 or x.nbytes <= GATHER_BLOCK_BYTES:
        return _gathered(x, replicated, 0, x.shape[0] if x.ndim else 0, keep)
    rows = max(1, x.shape[0] * GATHER_BLOCK_BYTES // x.nbytes)
    out = np.empty(x.shape, x.dtype) if keep else None
    for start in range(0, x.shape[0], rows):
        block = _gathered(x, replicated, start, min(rows, x.shape[0] - start), keep)
        if out is not None:
            out[start : start + len(block)] = block
    return out


def _gathered(x: jax.Array, replicated, start: int, rows: int, keep: bool):
    """Rows [start, start + rows) of `x` replicated on every device, copied to this host if `keep`."""
    if x.ndim == 0:
        block = _replicate(replicated)(x)
    else:
        block = _replicate_rows(rows, replicated)(x, np.int32(start))
    block.block_until_ready()  # one gather in flight at a time, on every process alike
    value = np.array(block.addressable_data(0), copy=True) if keep else None  # a copy: the block is freed next
    block.delete()
    return value


@functools.cache
def _replicate(replicated):
    return jax.jit(lambda x: x, out_shardings=replicated)


@functools.cache
def _replicate_rows(rows: int, replicated):
    # The start is an argument, so all blocks of one size (and every layer's same-shaped parameter) share a program.
    return jax.jit(lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, rows), out_shardings=replicated)


def to_hf_state_dict(model: Any, keep: bool = True) -> dict[str, np.ndarray]:
    """HF-named numpy tensors of a model's parameters (gathered to this host). On many hosts every process
    calls it (each gather is a collective); `keep=False`, for a process that writes nothing, keeps nothing and
    holds one gathered block at a time (the whole model is 32 GB at 8B)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = host_value(var[...], keep)
        if value is not None:  # kept
            out.update(_named(model, path, value))
    return out


def _named(model: Any, path: tuple, value: np.ndarray) -> dict[str, np.ndarray]:
    """One parameter's value as its HF tensors (one per layer for a stacked parameter), in HF's layout."""
    names = hf_names(model, path)
    layers = [value] if layer_count(model, path) is None else list(value)
    return {
        name: np.ascontiguousarray(part.T if transposed else part)
        for (name, transposed), part in zip(names, layers, strict=True)
    }


def hf_tensors_from_params(model: Any, params: dict) -> dict[str, np.ndarray]:
    """HF-named tensors of a parameter tree read back from a checkpoint (nested dicts as `nnx.to_pure_dict`
    gives, keys possibly strings), in the order `to_hf_state_dict` gives them (so shards split alike)."""
    out = {}
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        node = params
        for key in path:
            node = node[key] if key in node else node[str(key)]
        out.update(_named(model, path, np.asarray(node)))
    return out


def save_pretrained(model: Any, save_directory: str, max_shard_size: int = 5 * 1024**3) -> None:
    """config.json + model.safetensors (sharded with an index past `max_shard_size` bytes), as HF writes them."""
    write_hf_folder(model.config, to_hf_state_dict(model), save_directory, max_shard_size)
    write_generation_config(model, save_directory)


def write_generation_config(model: Any, save_directory: str) -> None:
    """generation_config.json beside config.json for a model that generates, as transformers' save_pretrained."""
    can_generate = getattr(model, "can_generate", None)
    if can_generate is not None and can_generate():
        model.generation_config.save_pretrained(save_directory)


def write_hf_folder(config, tensors: dict[str, np.ndarray], save_directory: str, max_shard_size: int = 5 * 1024**3):
    os.makedirs(save_directory, exist_ok=True)
    config.save_pretrained(save_directory)
    write_weights(tensors, save_directory, max_shard_size)


def write_weights(tensors: dict[str, np.ndarray], save_directory: str, max_shard_size: int = 5 * 1024**3) -> None:
    """model.safetensors, or shards of at most `max_shard_size` bytes with HF's index."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(save_directory, WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(save_directory, filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(save_directory, WEIGHTS_INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


class TensorFiles:
    """The tensors of an HF folder (single or sharded safetensors), read lazily, slice by slice."""

    def __init__(self, directory: str):
        single = os.path.join(directory, WEIGHTS_NAME)
        index_path = os.path.join(directory, WEIGHTS_INDEX_NAME)
        if os.path.exists(single):
            with _open(single) as f:
                self.files = dict.fromkeys(f.keys(), single)
        elif os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            root = os.path.realpath(directory)
            for file in set(weight_map.values()):
                if os.path.isabs(file) or not os.path.realpath(os.path.join(directory, file)).startswith(root + os.sep):
                    raise ValueError(f"{index_path}: weight_map names {file!r}, a file outside {directory}.")
            self.files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        else:
            raise FileNotFoundError(f"No {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} in {directory}.")
        self.directory = directory

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """The stored tensor's shape and safetensors dtype name (F32, BF16, I64, BOOL, ...), from the header."""
        with _open(self.files[name]) as f:
            stored = f.get_slice(name)
            return tuple(stored.get_shape()), stored.get_dtype()

    def read(self, name: str, index: tuple = (), transposed: bool = False) -> np.ndarray:
        """The tensor (or the part `index` of its nnx layout) as numpy; only that part is read from disk."""
        index = tuple(index)
        stored = tuple(reversed(index)) if transposed else index
        with _open(self.files[name]) as f:
            try:
                part = f.get_slice(name)[stored] if stored else f.get_tensor(name)
            except Exception as e:  # safetensors' own errors do not say which file
                raise BadInput(
                    f"{self.files[name]}: tensor {name!r} cannot be read ({e}); the file is damaged or "
                    "truncated: copy it again."
                ) from None
        return part.T if transposed else part


@contextlib.contextmanager
def _open(path: str):
    """safe_open, with the file named when its header is unreadable (a truncated or damaged download)."""
    try:
        handle = safe_open(path, framework="np")
    except Exception as e:
        raise BadInput(
            f"{path} is not a readable safetensors file ({e}); it is damaged or truncated: copy it again."
        ) from None
    with handle as f:
        yield f


@dataclasses.dataclass
class LoadReport:
    """What `load_weights` found, in HF's terms (transformers' LoadStateDictInfo): checkpoint tensors the model
    has no parameter for, parameters the checkpoint lacks, and those whose shapes differ."""

    missing_keys: list[str] = dataclasses.field(default_factory=list)
    unexpected_keys: list[str] = dataclasses.field(default_factory=list)
    mismatched_keys: list[tuple[str, tuple, tuple]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        """As transformers' `output_loading_info=True` gives it."""
        return {
            "missing_keys": set(self.missing_keys),
            "unexpected_keys": set(self.unexpected_keys),
            "mismatched_keys": set(self.mismatched_keys),
            "error_msgs": [],
        }

    def text(self, model_name: str, source: str) -> str | None:
        """HF's load report: one line per key and status, then what each status means (None: nothing to say)."""
        rows = [f"{k}  UNEXPECTED" for k in self.unexpected_keys] + [f"{k}  MISSING" for k in self.missing_keys]
        rows += [
            f"{k}  MISMATCH  Reinit due to size mismatch - ckpt: {a} vs model:{b}" for k, a, b in self.mismatched_keys
        ]
        if not rows:
            return None
        notes = []
        if self.unexpected_keys:
            notes.append(
                "- UNEXPECTED:\tcan be ignored when loading from different task/architecture; not ok if you "
                "expect identical arch."
            )
        if self.missing_keys:
            notes.append(
                "- MISSING:\tthose params were newly initialized because missing from the checkpoint. "
                "Consider training on your downstream task."
            )
        if self.mismatched_keys:
            notes.append(
                "- MISMATCH:\tckpt weights were loaded, but they did not match the original empty weight shapes."
            )
        return (
            f"{model_name} LOAD REPORT from: {source}\nKey  Status\n"
            + "\n".join(rows)
            + "\n\nNotes:\n"
            + "\n".join(notes)
        )


def load_weights(
    model: Any,
    directory: str,
    *,
    mesh=None,
    rules=None,
    dtype=None,
    strict: bool = True,
    fresh=None,
    ignore_mismatched_sizes: bool = False,
    source: str | None = None,
) -> LoadReport:
    """Fill a model's parameters from HF weight files, checking names and shapes.

    With a mesh, each parameter is created directly on its sharding (logical rules as in training) from the
    slices each device needs: the whole model is never gathered on one device. `dtype` casts the weights.
    `strict` (a checkpoint of this very model): a missing or unexpected weight or another shape is an error.
    Otherwise HF's from_pretrained rules: parameters the files lack take their values from `fresh()` (a newly
    initialised model of the same class), unexpected tensors are reported and skipped, and a shape mismatch is
    an error unless `ignore_mismatched_sizes` (the parameter is then initialised afresh); the report is
    logged as HF logs it and returned.
    """
    from jtrainer.parallel import sharding

    files = TensorFiles(directory)
    params = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(params))
    specs = {}
    if mesh is not None:
        specs = sharding.flatten_specs(sharding.param_specs(model, mesh, rules or sharding.merged_rules()))
    report, expected, afresh = LoadReport(), set[str](), []
    for path, var in flat.items():
        names = hf_names(model, path)
        stacked = layer_count(model, path) is not None
        label = ".".join(map(str, path))
        layer_shape = tuple(var.shape[1:]) if stacked else tuple(var.shape)
        target = np.dtype(dtype or var.dtype)
        expected.update(name for name, _ in names)
        checked = _StoredCheck(files, directory, label, layer_shape, stacked, target, strict)
        if not all([checked.usable(name, transposed, report) for name, transposed in names]):  # a list: report all
            afresh.append((path, var, target))
            continue
        read = _reader(files, names, stacked, target)
        if mesh is None:
            var.set_value(jax.numpy.asarray(read(())))
        else:
            placement = jax.sharding.NamedSharding(mesh, specs[path])
            var.set_value(jax.make_array_from_callback(tuple(var.shape), placement, read))
    _report_unexpected(model, files, expected, report, strict, directory)
    if not strict:
        _log_or_refuse(model, report, source or directory, ignore_mismatched_sizes)
    if afresh:
        initial = dict(nnx.to_flat_state(nnx.state(fresh(), nnx.Param)))
        for path, var, target in afresh:
            value = jax.numpy.asarray(initial[path][...], target)
            if mesh is not None:
                value = jax.device_put(value, jax.sharding.NamedSharding(mesh, specs[path]))
            var.set_value(value)
    nnx.update(model, params)
    return report


@dataclasses.dataclass(frozen=True)
class _StoredCheck:
    """A stored weight against the model's parameter made of it (`label`, one layer's shape when stacked)."""

    files: Any  # TensorFiles
    directory: str
    label: str
    layer_shape: tuple[int, ...]
    stacked: bool
    target: np.dtype
    strict: bool

    def usable(self, name: str, transposed: bool, report: LoadReport) -> bool:
        """Whether the weight can be read into the parameter; strict: an error where not, else noted in the
        report (the parameter is then initialised afresh). Integers for a float parameter are always an error."""
        if name not in self.files.files:
            if self.strict:
                raise KeyError(f"Weight {name!r} (parameter {self.label}) is missing from {self.directory}.")
            report.missing_keys.append(name)
            return False
        stored, stored_dtype = self.files.header(name)  # in torch's layout
        shape = tuple(reversed(stored)) if transposed else stored
        if shape != self.layer_shape:
            if self.strict:
                raise ValueError(
                    f"Weight {name!r} has shape {shape} in {self.directory}, but the model's parameter {self.label} "
                    f"has shape {self.layer_shape}" + (" per layer." if self.stacked else ".")
                )
            layer_shape = self.layer_shape
            report.mismatched_keys.append(
                (name, tuple(stored), tuple(reversed(layer_shape)) if transposed else layer_shape)
            )
            return False
        if np.issubdtype(self.target, np.floating) and not stored_dtype.startswith(("F", "BF")):
            raise BadInput(
                f"Weight {name!r} in {self.directory} is stored as integers, but the model's parameter "
                f"{self.label} is floating point: the folder is not a checkpoint of this model (or is quantized)."
            )
        return True


def _reader(files, names: list[tuple[str, bool]], stacked: bool, target: np.dtype):
    """The parameter's values at a device's index: one weight, or the stacked layers that device holds."""

    def read(index):
        if not stacked:
            name, transposed = names[0]
            return files.read(name, index, transposed).astype(target)
        index = tuple(index) or (slice(None),)
        picked = range(len(names))[index[0]]  # the layers this device holds
        return np.stack([files.read(names[i][0], index[1:], names[i][1]).astype(target) for i in picked])

    return read


def _report_unexpected(model, files, expected: set[str], report: LoadReport, strict: bool, directory: str) -> None:
    """Stored weights no parameter reads (tied weights excepted): an error when strict, else reported."""
    tied = set(getattr(model, "tied_hf_weights", ()))
    if getattr(model.config, "tie_word_embeddings", False):
        tied.add("lm_head.weight")
    unexpected = sorted(set(files.files) - expected - tied)
    if unexpected and strict:
        raise KeyError(f"Unexpected weights in {directory}: {unexpected}")
    report.unexpected_keys = unexpected


def _log_or_refuse(model, report: LoadReport, source: str, ignore_mismatched_sizes: bool) -> None:
    """HF's from_pretrained: the load report logged where transformers logs it; shape mismatches refused with
    torch's message unless `ignore_mismatched_sizes`."""
    text = report.text(type(model).__name__, source)
    if text:  # where transformers logs its load report, so a script sees it where it would
        logging.getLogger("transformers.modeling_utils").warning(text)
    if report.mismatched_keys and not ignore_mismatched_sizes:
        details = "\n\t".join(
            f"size mismatch for {k}: copying a param with shape {a} from checkpoint, the shape in current model is {b}."
            for k, a, b in report.mismatched_keys
        )
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(model).__name__}:\n\t{details}\n\tYou may "
            "consider adding `ignore_mismatched_sizes=True` to `from_pretrained(...)` if "
            "appropriate."
        )
