"""Which outputs of a traced function depend on which inputs, read off its jaxpr: how the Trainer tells a loss
that no trainable parameter reaches (torch: "does not require grad") before it trains on zero gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core

# Primitives whose outputs carry no derivative of their inputs.
_BLOCKING = frozenset({"stop_gradient"})


def _sub_jaxpr(eqn) -> Any | None:
    """The jaxpr a call-like primitive runs on exactly its operands (jit, remat, custom_vjp/jvp calls)."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        if sub is not None and eqn.primitive.name not in ("scan", "while", "cond"):
            return getattr(sub, "jaxpr", sub)
    return None


def _reached(jaxpr, inputs: Sequence[bool]) -> list[bool]:
    reached = {var for var, flag in zip(jaxpr.invars, inputs) if flag}
    for eqn in jaxpr.eqns:
        flags = [not isinstance(v, core.Literal) and v in reached for v in eqn.invars]
        if eqn.primitive.name in _BLOCKING or not any(flags):
            continue
        sub = _sub_jaxpr(eqn)
        if sub is not None and len(sub.invars) == len(flags):
            outputs = _reached(sub, flags)
        else:  # loops and branches: every output from any input
            outputs = [True] * len(eqn.outvars)
        reached.update(var for var, flag in zip(eqn.outvars, outputs) if flag)
    return [not isinstance(v, core.Literal) and v in reached for v in jaxpr.outvars]


def outputs_reached(closed_jaxpr, inputs: Sequence[bool]) -> list[bool]:
    """For each output of `closed_jaxpr`, whether a flagged input reaches it through differentiable operations."""
    return _reached(closed_jaxpr.jaxpr, inputs)
