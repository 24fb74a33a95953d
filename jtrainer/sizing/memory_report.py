"""What a train step that does not fit spends its memory on, in words, and what to change.

When XLA refuses a layout (or its memory analysis exceeds the chip), `jtrainer check` reads the traced step's
program: every value it computes, with its shape. Values are named by where they come from in the program
(`_Provenance`): a product with a vocabulary-sized weight makes logits, a batched product of two activations
that grows (queries by keys) makes attention scores, a product of two activations over the tokens makes a
gradient, values computed from the parameters alone are parameter-shaped, and a value of the same shape computed
from one of these is of its kind (softmax, the logits' gradient). The remaining activations are named by their
dimensions (the MLP width: MLP activations; the model width: hidden states), and every value is sized per chip
from the mesh (rows over the batch axes, the length over `sequence`, heads/MLP/vocabulary over `tensor`,
parameter-shaped values over `fsdp`, whole on every `data` replica). These are estimates from shapes, not XLA's
buffer assignment: they say which kind of value dominates, and the advice follows from the kind.
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
    LOGITS: (
        "whole [tokens, vocabulary] logits: something reads them (a compute_loss override, compute_loss_func, label "
        "smoothing, compute_metrics' predictions) or loss_chunk_size is 0; the loss alone is computed in chunks "
        "without them"
    ),
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


def largest_values(jaxpr, shapes: StepShapes, count: int = 4, batch_inputs: int = 0) -> list[LargeValue]:
    """The `count` largest kinds of value the step computes, largest first (per chip, estimated). The program's
    last `batch_inputs` inputs are the batch; the others (parameters, optimizer state) are weights."""
    found: dict[tuple, list] = {}
    provenance = _Provenance(jaxpr, shapes, batch_inputs)
    for var, aval, local in _values(jaxpr):
        if not getattr(aval, "shape", None) or not _is_numeric(aval):
            continue
        kind = provenance.kind(var, aval.shape)
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
    """Every output value of every equation (variable, aval, local), sub-programs included; `local`: inside
    shard_map (per-device shapes). Pallas kernels' insides (their tiles) are not the step's values."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var, var.aval, local
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


def _is_var(value) -> bool:
    return not hasattr(value, "val")  # a Literal carries its value


def _size(var) -> int:
    return math.prod(getattr(var.aval, "shape", ()) or (1,))


class _Provenance:
    """What each value of a program is, from the operations that made it (see the module docstring)."""

    def __init__(self, jaxpr, shapes: StepShapes, batch_inputs: int):
        self.shapes = shapes
        self.labels: dict = {}
        self.weights: set = set()
        program = getattr(jaxpr, "jaxpr", jaxpr)
        inputs = list(program.invars)
        weights = inputs[: len(inputs) - batch_inputs] if batch_inputs else []
        self.weights.update(v for v in weights if _is_numeric(v.aval))
        self.weight_shapes = {tuple(v.aval.shape) for v in self.weights if len(v.aval.shape) >= 2}
        self._walk(program)
        self._walk_back(program)
        self._walk(program)  # what the backward walk named carries forward (the one-hot gradient's negation)

    def kind(self, var, shape: tuple[int, ...]) -> str:
        if var in self.labels:
            return self.labels[var]
        if var in self.weights or tuple(shape) in self.weight_shapes:
            s = self.shapes
            return PARAMETER_SHAPED if math.prod(shape) >= s.hidden * s.hidden // 4 else OTHER
        if self.weights:  # the program's weights are known: an activation is never parameter-shaped
            return _kind_of_activation(shape, self.shapes)
        kind = _kind(shape, self.shapes)
        # Logits and attention scores are known by where they come from; by dimensions alone they are guesses
        # (the row length can equal the model width).
        return _kind_of_activation(shape, self.shapes) if kind in (LOGITS, ATTENTION_SCORES) else kind

    def _walk(self, jaxpr) -> None:
        for eqn in jaxpr.eqns:
            inputs = [v for v in eqn.invars if _is_var(v)]
            subs = _called(eqn)
            if subs:
                for sub in subs:
                    self._enter(eqn, sub)
                continue
            if eqn.primitive.name == "dot_general" and len(inputs) == 2:
                self._product(eqn, *eqn.invars)
            elif inputs and all(v in self.weights for v in inputs):
                self.weights.update(eqn.outvars)
            else:  # an elementwise or shape-keeping operation carries its input's kind
                for out in eqn.outvars:
                    shape = getattr(out.aval, "shape", None)
                    for v in inputs:
                        if v in self.labels and getattr(v.aval, "shape", None) == shape:
                            self.labels[out] = self.labels[v]
                            break

    def _weight_shaped(self, shape) -> bool:
        """The shape of a weight (or of its transpose), or any shape when the weights are not known."""
        return not self.weights or tuple(shape) in self.weight_shapes or tuple(reversed(shape)) in self.weight_shapes

    def _walk_back(self, jaxpr) -> None:
        """A value of a kind's shape that only feeds that kind (the one-hot gradient the logits' gradient is
        made from) is of that kind too."""
        for eqn in reversed(jaxpr.eqns):
            subs = _called(eqn)
            for sub in subs:
                if len(sub.outvars) == len(eqn.outvars):
                    for inner, out in zip(sub.outvars, eqn.outvars):
                        if _is_var(inner) and out in self.labels:
                            self.labels.setdefault(inner, self.labels[out])
                self._walk_back(sub)
                for theirs, ours in zip(_outer_inputs(eqn, sub), sub.invars):
                    if _is_var(theirs) and ours in self.labels and theirs not in self.weights:
                        self.labels.setdefault(theirs, self.labels[ours])
            if subs or eqn.primitive.name == "dot_general":
                continue
            labelled = [self.labels[o] for o in eqn.outvars if o in self.labels]
            if not labelled:
                continue
            shape = getattr(eqn.outvars[0].aval, "shape", None)
            for v in eqn.invars:
                if _is_var(v) and v not in self.weights and getattr(v.aval, "shape", None) == shape:
                    self.labels.setdefault(v, labelled[0])

    def _product(self, eqn, lhs, rhs) -> None:
        out = eqn.outvars[0]
        (_, _), (batch_lhs, _) = eqn.params["dimension_numbers"]
        lhs_weight, rhs_weight = lhs in self.weights, rhs in self.weights
        if lhs_weight and rhs_weight:
            self.weights.add(out)
        elif lhs_weight or rhs_weight:
            weight = lhs if lhs_weight else rhs
            vocab = self.shapes.vocab
            if vocab in weight.aval.shape and vocab in out.aval.shape:
                tokens = self.shapes.length in out.aval.shape or self.shapes.rows * self.shapes.length in out.aval.shape
                self.labels[out] = LOGITS if tokens else LOSS_CHUNK
        elif batch_lhs and _size(out) > max(_size(lhs), _size(rhs)):
            self.labels[out] = ATTENTION_SCORES  # [rows, heads, queries, keys] from queries and keys
        elif not batch_lhs and self._weight_shaped(out.aval.shape):
            self.labels[out] = PARAMETER_SHAPED  # activations contracted over the tokens: a weight's gradient

    def _enter(self, eqn, sub) -> None:
        """Carry kinds into a sub-program (by position) and its results back out."""
        for theirs, ours in zip(_outer_inputs(eqn, sub), sub.invars):
            if not _is_var(theirs):
                continue
            if theirs in self.weights:
                self.weights.add(ours)
            if theirs in self.labels:
                self.labels[ours] = self.labels[theirs]
        self._walk(sub)
        if len(sub.outvars) == len(eqn.outvars):
            for inner, out in zip(sub.outvars, eqn.outvars):
                if not _is_var(inner):
                    continue
                if inner in self.labels:
                    self.labels.setdefault(out, self.labels[inner])
                elif inner in self.weights and not any(v for v in eqn.invars if _is_var(v) and v not in self.weights):
                    self.weights.add(out)


# Operations that run a sub-program on their operands (a scatter's or a reduction's combiner is not one).
_CALLS = {
    "pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call",
    "custom_vjp_call_jaxpr", "scan", "while", "cond", "shard_map",
}  # fmt: skip


def _called(eqn) -> list:
    return list(_subjaxprs(eqn)) if eqn.primitive.name in _CALLS else []


def _outer_inputs(eqn, sub) -> list:
    """The operands of a call that its sub-program's inputs stand for, in order (a while loop's body skips the
    condition's constants, a cond's branches the predicate); none where they cannot be matched."""
    outer = list(eqn.invars)
    if eqn.primitive.name == "while" and len(sub.invars) != len(outer):
        outer = outer[eqn.params.get("cond_nconsts", 0) :]
    elif eqn.primitive.name == "cond":
        outer = outer[1:]
    return outer[len(outer) - len(sub.invars) :] if len(outer) >= len(sub.invars) else []


def _kind_of_activation(shape: tuple[int, ...], s: StepShapes) -> str:
    dims = list(shape)
    if s.intermediate in dims and len(dims) <= 3:
        return MLP
    if s.hidden in dims or s.heads in dims:
        return HIDDEN
    return OTHER


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
    if kind == PARAMETER_SHAPED:  # split over fsdp, replicated over data
        fsdp = s.mesh.get("fsdp", 1)
        return fsdp if any(d % fsdp == 0 for d in shape) else 1
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
