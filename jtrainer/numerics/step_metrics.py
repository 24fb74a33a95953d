"""Values a loss reports beside itself from inside the compiled step (TRL's entropy, token accuracy, DPO's
rewards): `record(name, value)` while the loss is traced; the step returns them per micro-batch.

A loss function cannot return them (HF's compute_loss returns the loss, or the loss and the outputs), and a
compiled step cannot append to a Python list the way TRL's trainers do; so the step opens a recording around each
micro-batch's loss and hands what was recorded out of `jax.value_and_grad` as auxiliary data.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_RECORDING: contextvars.ContextVar[dict[str, jax.Array] | None] = contextvars.ContextVar(
    "jtrainer_step_metrics", default=None
)


def record(name: str, value) -> None:
    """Report a scalar for this micro-batch (no gradient flows through it); outside a step it is dropped."""
    recorded = _RECORDING.get()
    if recorded is not None:
        recorded[name] = jax.lax.stop_gradient(jnp.asarray(value, jnp.float32).reshape(()))


@contextlib.contextmanager
def recording() -> Iterator[dict[str, jax.Array]]:
    """Collect what `record` reports while the block runs (a fresh dict per micro-batch)."""
    recorded: dict[str, jax.Array] = {}
    token = _RECORDING.set(recorded)
    try:
        yield recorded
    finally:
        _RECORDING.reset(token)
