"""fp16 training: dynamic loss scaling, as torch's `GradScaler` does it for HF's `fp16=True`.

float16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by a large scale
before differentiation (and the gradients divided by it after). The scale is dynamic: an update whose gradients
hold an Inf or NaN (the scale was too large) is skipped — parameters, moments and the schedule's step unchanged,
as HF skips `lr_scheduler.step()` then — and the scale halves; after `growth_interval` finite updates in a row it
doubles. torch's defaults: initial scale 2**16, factors 2 and 0.5, interval 2000.

The scale lives in the optimizer state (`LossScaleState`, wrapping the optimizer's own), so it is checkpointed,
restored and sharded with it; the train step reads it with `loss_scale` to scale the loss.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jtrainer.numerics.opt_state import nested_states

INITIAL_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class LossScaleState(NamedTuple):
    scale: jax.Array  # float32: the loss is multiplied by this before differentiation
    good_steps: jax.Array  # int32: finite updates since the scale last changed
    total_notfinite: jax.Array  # int32: skipped updates (optax.apply_if_finite's name: logged as skipped_updates)
    inner_state: Any  # the optimizer's own state


def dynamic_loss_scaling(
    inner: optax.GradientTransformation,
    initial_scale: float | None = None,
    growth_interval: int | None = None,
) -> optax.GradientTransformation:
    """`inner` applied to unscaled gradients when they are all finite; otherwise a skipped update (zero updates,
    `inner`'s state kept) and a smaller scale. The step divides the gradients by the scale before this.
    Defaults: the module's INITIAL_SCALE and GROWTH_INTERVAL (torch's)."""
    initial_scale = INITIAL_SCALE if initial_scale is None else initial_scale
    growth_interval = GROWTH_INTERVAL if growth_interval is None else growth_interval

    def init(params) -> LossScaleState:
        zero = jnp.zeros((), jnp.int32)
        return LossScaleState(jnp.asarray(initial_scale, jnp.float32), zero, zero, inner.init(params))

    def update(grads, state: LossScaleState, params=None):
        finite = jnp.array(True)
        for leaf in jax.tree.leaves(grads):
            finite &= jnp.all(jnp.isfinite(leaf))
        updates, inner_state = inner.update(grads, state.inner_state, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        inner_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), inner_state, state.inner_state)
        good_steps = jnp.where(finite, state.good_steps + 1, 0)
        grow = good_steps >= growth_interval
        scale = jnp.where(
            finite, jnp.where(grow, state.scale * GROWTH_FACTOR, state.scale), state.scale * BACKOFF_FACTOR
        )
        new_state = LossScaleState(
            scale=scale.astype(jnp.float32),
            good_steps=jnp.where(grow, 0, good_steps).astype(jnp.int32),
            total_notfinite=state.total_notfinite + (~finite).astype(jnp.int32),
            inner_state=inner_state,
        )
        return updates, new_state

    return optax.GradientTransformation(init, update)


def loss_scale(opt_state) -> jax.Array | None:
    """The current loss scale of a (possibly wrapped) optimizer state; None without loss scaling."""
    return next((s.scale for s in nested_states(opt_state) if isinstance(s, LossScaleState)), None)
