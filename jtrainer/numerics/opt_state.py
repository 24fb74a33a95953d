"""Surgery on optax states: the injected hyperparameters (learning rate, schedule numbers, max_grad_norm) and
the update count, found through wrappers (apply_if_finite, loss scaling, inject_hyperparams) and set from the host
between steps (the compiled step is reused)."""

from __future__ import annotations

import jax
import numpy as np


def hyperparameter(opt_state, name: str) -> jax.Array | None:
    """One injected hyperparameter's current value (None when the optimizer has no such entry)."""
    hyper = find_hyperparams(opt_state)
    return None if hyper is None else hyper.get(name)


def nested_states(opt_state):
    """An optimizer state and the states wrapped inside it (`inner_state`: apply_if_finite, loss scaling,
    inject_hyperparams), outermost first."""
    while opt_state is not None:
        yield opt_state
        opt_state = getattr(opt_state, "inner_state", None)


def find_hyperparams(opt_state) -> dict | None:
    """inject_hyperparams' dict of the (possibly wrapped, e.g. apply_if_finite) optimizer state."""
    return next((s.hyperparams for s in nested_states(opt_state) if getattr(s, "hyperparams", None) is not None), None)


def replace_hyperparam(opt_state, name: str, value):
    """The optimizer state with one injected hyperparameter replaced (through wrappers)."""
    if getattr(opt_state, "hyperparams", None) is not None:
        return opt_state._replace(hyperparams={**opt_state.hyperparams, name: value})
    return opt_state._replace(inner_state=replace_hyperparam(opt_state.inner_state, name, value))


def map_hyperparams(opt_state, fn):
    """The optimizer state with inject_hyperparams' dict replaced by `fn(dict)` (through wrappers; unchanged
    without one)."""
    if getattr(opt_state, "hyperparams", None) is not None:
        return opt_state._replace(hyperparams=fn(opt_state.hyperparams))
    inner = getattr(opt_state, "inner_state", None)
    return opt_state if inner is None else opt_state._replace(inner_state=map_hyperparams(inner, fn))


def set_hyperparam(opt_state, name: str, value: float):
    """The optimizer state with one injected hyperparameter set to a host value, placed with the dtype and
    sharding of the one it replaces (between steps: the compiled step is reused)."""
    current = hyperparameter(opt_state, name)
    assert current is not None, f"the optimizer state has no {name!r} hyperparameter"
    return replace_hyperparam(opt_state, name, jax.device_put(np.asarray(value, current.dtype), current.sharding))


def schedule_count(opt_state) -> jax.Array | None:
    """The number of updates inject_hyperparams has applied (skipped non-finite ones not counted): the scheduler
    step of the next update."""
    return next((s.count for s in nested_states(opt_state) if getattr(s, "hyperparams", None) is not None), None)


def set_schedule_count(opt_state, value: int):
    """The optimizer state with inject_hyperparams' update count (the schedule's step) set to a host value."""
    if getattr(opt_state, "hyperparams", None) is not None:
        count = opt_state.count
        return opt_state._replace(count=jax.device_put(np.asarray(value, count.dtype), count.sharding))
    return opt_state._replace(inner_state=set_schedule_count(opt_state.inner_state, value))


def current_learning_rate(opt_state) -> jax.Array | None:
    """The rate that the last update used (inject_hyperparams keeps it in the state)."""
    return hyperparameter(opt_state, "learning_rate")
