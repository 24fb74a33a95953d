"""What a train step that does not fit spends its memory on, in words, and what to change.

When XLA refuses a layout (or its memory analysis exceeds the chip), `jtrainer check` reads the traced step's
program: every value it computes, with its shape. Values are named by what their dimensions are (the row length
twice: attention scores; the vocabulary: logits; the MLP width: MLP activations; the model width: hidden
states; no length: parameter-shaped, i.e. gradients and optimizer updates) and sized per chip from the mesh
(rows over the batch axes, the length over `sequence`, heads/MLP/vocabulary over `tensor`, parameter-shaped
values over `fsdp`). These are estimates from shapes, not XLA's buffer assignment: they say which kind of value
dominates, and the advice follows from the kind.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

ATTENTION_SCORES, LOGITS, LOSS_CHUNK, MLP, HIDDEN, PARAMETER_SHAPED, OTHER = (
    "attention scores",
    "logits",
    "logits of one chunk of the loss",
    "MLP activations",
    "hidden states",
    "parameter-shaped (gradients, updates)",
    "other",
)

ADVICE = {
    ATTENTION_SCORES: (
        "attention holds [length, length] scores: on TPUs the splash kernel does not (lengths a multiple of 128); "
        "split rows over the sequence axis (mesh_shape {{fsdp: N, sequence: M}}) or shorten block_size"
    ),
    LOGITS: "whole [tokens, vocabulary] logits: use_liger_kernel: true computes the loss in chunks without them",
    MLP: (
        "activations of {length}-token rows: split rows over the sequence axis (mesh_shape {{fsdp: N, sequence: M}}), "
        "keep gradient checkpointing on with policy full, or lower per_device_train_batch_size / block_size"
    ),
    HIDDEN: (
        "activations of {length}-token rows: split rows over the sequence axis (mesh_shape {{fsdp: N, sequence: M}}), "
        "keep gradient checkpointing on with policy full, or lower per_device_train_batch_size / block_size"
    ),
    PARAMETER_SHAPED: "parameter-sized values: split them over more chips (mesh_shape fsdp)",
}


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The sizes that name a value's dimensions, and the mesh that splits them."""

    rows: int  # global rows of one micro-batch
    length: int
    vocab: int
    hidden: int
    intermediate: int
    heads: int
    mesh: dict[str, int]


@dataclasses.dataclass(frozen=True)
class LargeValue:
    kind: str
    shape: tuple[int, ...]
    dtype: str
    bytes_per_chip: int
    count: int  # values of this shape and kind in the step (one per layer, pass, ...)

    def describe(self) -> str:
        dims = " x ".join(str(d) for d in self.shape)
        many = f", {self.count} in the step" if self.count > 1 else ""
        return f"{self.kind}: [{dims}] {self.dtype}, {size(self.bytes_per_chip)} a chip each{many}"


def largest_values(jaxpr, shapes: StepShapes, count: int = 4) -> list[LargeValue]:
    """The `count` largest kinds of value the step computes, largest first (per chip, estimated)."""
    found: dict[tuple, list] = {}
    for aval, local in _values(jaxpr):
        if not getattr(aval, "shape", None) or not _is_numeric(aval):
            continue
        kind = _kind(aval.shape, shapes)
        per_chip = _bytes(aval) if local else _bytes(aval) // _split(aval.shape, kind, shapes)
        key = (kind, tuple(aval.shape), str(aval.dtype))
        entry = found.setdefault(key, [per_chip, 0])
        entry[1] += 1
    ranked = sorted(found.items(), key=lambda item: -item[1][0])
    out: list[LargeValue] = []
    for (kind, shape, dtype), (per_chip, n) in ranked:
        if kind == OTHER or any(v.kind == kind for v in out):
            continue  # the largest of each kind says what matters
        out.append(LargeValue(kind, shape, dtype, per_chip, n))
        if len(out) == count:
            break
    return out


def advice(values: list[LargeValue], shapes: StepShapes) -> list[str]:
    """What to change, for the kinds among the largest values (largest first, each said once)."""
    said, lines = set(), []
    for value in values:
        text = ADVICE.get(value.kind)
        if text and text not in said:
            said.add(text)
            lines.append(text.format(length=shapes.length))
    return lines


def _values(jaxpr, local: bool = False) -> Iterator[tuple]:
    """Every output value of every equation, sub-programs included; `local`: inside shard_map (per-device
    shapes). Pallas kernels' insides (their tiles) are not the step's values."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval, local
        if eqn.primitive.name == "pallas_call":
            continue
        inner_local = local or eqn.primitive.name == "shard_map"
        for sub in _subjaxprs(eqn):
            yield from _values(sub, inner_local)


def _subjaxprs(eqn) -> Iterator:
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner


def _kind(shape: tuple[int, ...], s: StepShapes) -> str:
    dims = list(shape)
    if dims.count(s.length) >= 2 and len(dims) >= 3:  # [rows, heads, queries, keys]; a [D, D] weight is not
        return ATTENTION_SCORES
    tokens = s.length in dims or s.rows * s.length in dims
    if s.vocab in dims and s.hidden not in dims:  # [tokens or a chunk of them, vocab]; a [vocab, width] table is not
        return LOGITS if tokens else LOSS_CHUNK
    if not tokens:
        return PARAMETER_SHAPED if math.prod(dims) >= s.hidden * s.hidden // 4 else OTHER
    if s.intermediate in dims and len(dims) <= 3:  # [rows, length, width]; per-head tensors have more dims
        return MLP
    if s.hidden in dims or s.heads in dims:
        return HIDDEN
    return OTHER


def _split(shape: tuple[int, ...], kind: str, s: StepShapes) -> int:
    """Over how many chips a value of this kind and shape is spread (an estimate)."""
    batch = s.mesh.get("data", 1) * s.mesh.get("fsdp", 1) * s.mesh.get("expert", 1)
    tensor, sequence = s.mesh.get("tensor", 1), s.mesh.get("sequence", 1)
    if kind == PARAMETER_SHAPED:
        return batch if any(d % batch == 0 for d in shape) else 1
    split = 1
    if s.rows in shape and s.rows % batch == 0:
        split *= batch
    if s.length in shape and s.length % sequence == 0:
        split *= sequence
    if tensor > 1 and any(d in (s.vocab, s.intermediate, s.heads) and d % tensor == 0 for d in shape):
        split *= tensor
    return split


def _is_numeric(aval) -> bool:
    try:
        np.dtype(aval.dtype)
    except TypeError:  # random keys
        return False
    return True


def _bytes(aval) -> int:
    return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def size(n: float) -> str:
    """Bytes in GiB (or MiB below one GiB), as `jtrainer check` prints them."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
