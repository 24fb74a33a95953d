"""The update rules of the torch optimizers HF builds, as optax transformations, where optax's own differ.

Each one is the rule of the class `transformers.Trainer.create_optimizer()` instantiates for an `optim` name
(torch.optim, transformers' Adafactor, torch-optimi's StableAdamW, schedulefree), step for step, and is tested
against that class. `learning_rate` is the rate of this update (HF's scheduler sets the group's `lr` before each
step); `decays` is the weight-decay mask (True: the parameter is in HF's decay group).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _decay_tree(decays, params):
    """The decay mask as a tree of bools (every parameter decays without one)."""
    return jax.tree.map(lambda _: True, params) if decays is None else decays


def _decay_rate(weight_decay):
    """Per parameter: its weight decay if it is in a decay group, else 0."""
    return lambda decayed: jnp.where(decayed, weight_decay, 0.0)


# ---------------------------------------------------------------------------------------------------------------
# torch.optim.SGD


class SGDState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # optax's name for the step (shadows tuple.count)
    momentum_buffer: Any


def torch_sgd(learning_rate, weight_decay, decays, momentum=0.0, dampening=0.0, nesterov=False):
    """torch.optim.SGD: g += wd * p; buf = g on the first step, then momentum * buf + (1 - dampening) * g;
    nesterov steps along g + momentum * buf; p -= lr * (that)."""

    def init(params):
        buf = jax.tree.map(jnp.zeros_like, params) if momentum else None
        return SGDState(jnp.zeros([], jnp.int32), buf)

    def update(grads, state, params):
        wd = _decay_rate(weight_decay)
        grads = jax.tree.map(lambda g, p, d: g + wd(d) * p, grads, params, _decay_tree(decays, params))
        buf = state.momentum_buffer
        if momentum:
            first = state.count == 0
            buf = jax.tree.map(lambda b, g: jnp.where(first, g, momentum * b + (1.0 - dampening) * g), buf, grads)
            grads = jax.tree.map(lambda g, b: g + momentum * b, grads, buf) if nesterov else buf
        updates = jax.tree.map(lambda g: -learning_rate * g, grads)
        return updates, SGDState(optax.safe_int32_increment(state.count), buf)

    return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------------------------------
# torch.optim.Adagrad


class AdagradState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # optax's name for the step (shadows tuple.count)
    sum: Any


def torch_adagrad(learning_rate, weight_decay, decays, lr_decay=0.0, eps=1e-10):
    """torch.optim.Adagrad (initial_accumulator_value 0, as HF builds it): g += wd * p; sum += g^2;
    p -= lr / (1 + (t - 1) * lr_decay) * g / (sqrt(sum) + eps)."""

    def init(params):
        return AdagradState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params):
        wd = _decay_rate(weight_decay)
        grads = jax.tree.map(lambda g, p, d: g + wd(d) * p, grads, params, _decay_tree(decays, params))
        sums = jax.tree.map(lambda s, g: s + g * g, state.sum, grads)
        clr = learning_rate / (1.0 + state.count * lr_decay)
        updates = jax.tree.map(lambda g, s: -clr * g / (jnp.sqrt(s) + eps), grads, sums)
        return updates, AdagradState(optax.safe_int32_increment(state.count), sums)

    return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------------------------------
# torch.optim.RMSprop


class RMSpropState(NamedTuple):
    square_avg: Any
    grad_avg: Any
    momentum_buffer: Any


def torch_rmsprop(learning_rate, weight_decay, decays, alpha=0.99, eps=1e-8, momentum=0.0, centered=False):
    """torch.optim.RMSprop: g += wd * p; v = alpha v + (1 - alpha) g^2; avg = sqrt(v [- mean_g^2]) + eps;
    with momentum buf = momentum * buf + g / avg and p -= lr * buf (the rate after the buffer), else
    p -= lr * g / avg."""

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return RMSpropState(zeros(), zeros() if centered else None, zeros() if momentum else None)

    def update(grads, state, params):
        wd = _decay_rate(weight_decay)
        grads = jax.tree.map(lambda g, p, d: g + wd(d) * p, grads, params, _decay_tree(decays, params))
        square_avg = jax.tree.map(lambda v, g: alpha * v + (1.0 - alpha) * g * g, state.square_avg, grads)
        grad_avg = state.grad_avg
        if centered:
            grad_avg = jax.tree.map(lambda m, g: alpha * m + (1.0 - alpha) * g, grad_avg, grads)
            avg = jax.tree.map(lambda v, m: jnp.sqrt(v - m * m) + eps, square_avg, grad_avg)
        else:
            avg = jax.tree.map(lambda v: jnp.sqrt(v) + eps, square_avg)
        direction = jax.tree.map(jnp.divide, grads, avg)
        buf = state.momentum_buffer
        if momentum:
            buf = jax.tree.map(lambda b, d: momentum * b + d, buf, direction)
            direction = buf
        updates = jax.tree.map(lambda d: -learning_rate * d, direction)
        return updates, RMSpropState(square_avg, grad_avg, buf)

    return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------------------------------
# transformers.optimization.Adafactor(scale_parameter=False, relative_step=False, warmup_init=False)


class AdafactorState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # optax's name for the step (shadows tuple.count)
    row: Any  # [..., R] per factored parameter (ndim >= 2), a placeholder otherwise
    col: Any  # [..., C]
    full: Any  # the second moment of parameters with ndim < 2, a placeholder otherwise


def _placeholder():
    return jnp.zeros((1,), jnp.float32)


def hf_adafactor(learning_rate, weight_decay, decays, eps1=1e-30, clip_threshold=1.0, decay_rate=-0.8):
    """HF's Adafactor as the Trainer builds it (beta1 None: no first moment). Parameters with two or more
    dimensions factor their second moment over the last two; the update is clipped to RMS `clip_threshold`,
    scaled by the rate, and weight decay is `p -= weight_decay * lr * p`."""

    def init(params):
        factored = lambda p: p.ndim >= 2  # noqa: E731
        return AdafactorState(
            jnp.zeros([], jnp.int32),
            jax.tree.map(lambda p: jnp.zeros(p.shape[:-1], p.dtype) if factored(p) else _placeholder(), params),
            jax.tree.map(
                lambda p: jnp.zeros(p.shape[:-2] + p.shape[-1:], p.dtype) if factored(p) else _placeholder(), params
            ),
            jax.tree.map(lambda p: _placeholder() if factored(p) else jnp.zeros_like(p), params),
        )

    def update(grads, state, params):
        count = optax.safe_int32_increment(state.count)
        beta2t = 1.0 - count.astype(jnp.float32) ** decay_rate

        def one(g, p, row, col, full, decayed):
            sq = g * g + eps1
            if g.ndim >= 2:
                row = beta2t * row + (1.0 - beta2t) * jnp.mean(sq, axis=-1)
                col = beta2t * col + (1.0 - beta2t) * jnp.mean(sq, axis=-2)
                r_factor = jax.lax.rsqrt(row / jnp.mean(row, axis=-1, keepdims=True))[..., None]
                c_factor = jax.lax.rsqrt(col)[..., None, :]
                u = r_factor * c_factor * g
            else:
                full = beta2t * full + (1.0 - beta2t) * sq
                u = jax.lax.rsqrt(full) * g
            rms = jnp.sqrt(jnp.mean(u * u))
            u = u / jnp.maximum(rms / clip_threshold, 1.0) * learning_rate
            decay = jnp.where(decayed, weight_decay, 0.0) * learning_rate
            return -(u + decay * p), row, col, full

        out = jax.tree.map(one, grads, params, state.row, state.col, state.full, _decay_tree(decays, params))
        pick = lambda i: jax.tree.map(lambda _, o: o[i], grads, out)  # noqa: E731
        return pick(0), AdafactorState(count, pick(1), pick(2), pick(3))

    return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------------------------------
# optimi.StableAdamW


class StableAdamWState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # optax's name for the step (shadows tuple.count)
    exp_avg: Any
    exp_avg_sq: Any


def _debias_beta(beta, step):
    """optimi's debiased beta: beta * (1 - beta^(t-1)) / (1 - beta^t)."""
    return (beta**step - beta) / (beta**step - 1.0)


def stable_adamw(learning_rate, b1, b2, eps, weight_decay, decays, decouple_lr=False, max_lr=None):
    """torch-optimi's StableAdamW: AdamW with debiased betas whose rate is divided, per tensor, by
    max(1, RMS(g / sqrt(max(v, eps^2)))); weight decay `p *= 1 - lr_t * wd` (or `1 - lr_t / max_lr * wd` with
    decouple_lr)."""

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return StableAdamWState(jnp.zeros([], jnp.int32), zeros(), zeros())

    def update(grads, state, params):
        count = optax.safe_int32_increment(state.count)
        step = count.astype(jnp.float32)
        beta1_hat, beta2_hat = _debias_beta(b1, step), _debias_beta(b2, step)

        def one(g, p, m, v, decayed):
            m = beta1_hat * m + (1.0 - beta1_hat) * g
            v = beta2_hat * v + (1.0 - beta2_hat) * g * g
            rms = jnp.sqrt(jnp.mean(g * g / jnp.maximum(v, eps * eps)))
            lr = learning_rate / jnp.maximum(1.0, rms)
            rate = lr / max_lr if decouple_lr else lr
            decayed_p = p * (1.0 - jnp.where(decayed, weight_decay, 0.0) * rate)
            new_p = decayed_p - lr * m / (jnp.sqrt(v) + eps)
            return new_p - p, m, v

        out = jax.tree.map(one, grads, params, state.exp_avg, state.exp_avg_sq, _decay_tree(decays, params))
        pick = lambda i: jax.tree.map(lambda _, o: o[i], grads, out)  # noqa: E731
        return pick(0), StableAdamWState(count, pick(1), pick(2))

    return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------------------------------
# schedulefree.AdamWScheduleFree / SGDScheduleFree


class ScheduleFreeState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # k, the steps taken (optax's name; shadows tuple.count)
    weight_sum: jax.Array
    lr_max: jax.Array
    z: Any
    exp_avg_sq: Any  # AdamW only (None for SGD)
    b1: jax.Array  # beta1 / momentum: what `schedule_free_eval_params` needs to form x


def schedule_free(
    learning_rate,
    weight_decay,
    decays,
    *,
    b1,
    b2=None,
    eps=1e-8,
    warmup_steps=0.0,
    r=0.0,
    weight_lr_power=2.0,
):
    """schedulefree's AdamWScheduleFree (`b2` given) or SGDScheduleFree (momentum `b1`), in train mode: the
    parameters are y. The rate is the scheduled one times the optimizer's own warmup `(k + 1) / warmup_steps`
    (HF passes its `warmup_steps` argument); x = y + (1 - 1 / b1)(z - y) is what HF evaluates and saves after
    `optimizer.eval()` (`schedule_free_eval_params`)."""
    adam = b2 is not None

    def init(params):
        return ScheduleFreeState(
            jnp.zeros([], jnp.int32),
            jnp.zeros([], jnp.float32),
            jnp.asarray(-1.0, jnp.float32),
            jax.tree.map(jnp.copy, params),
            jax.tree.map(jnp.zeros_like, params) if adam else None,
            jnp.asarray(b1, jnp.float32),
        )

    def update(grads, state, params):
        k = state.count.astype(jnp.float32)
        sched = jnp.where(k < warmup_steps, (k + 1.0) / jnp.where(warmup_steps > 0, warmup_steps, 1.0), 1.0)
        lr = learning_rate * sched
        lr_max = jnp.maximum(lr, state.lr_max)
        weight = (k + 1.0) ** r * lr_max**weight_lr_power
        weight_sum = state.weight_sum + weight
        ckp1 = jnp.where(weight_sum > 0, weight / jnp.where(weight_sum > 0, weight_sum, 1.0), 0.0)
        exp_avg_sq = state.exp_avg_sq
        if adam:
            exp_avg_sq = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, exp_avg_sq, grads)
            bias_correction2 = 1.0 - b2 ** (k + 1.0)
            grads = jax.tree.map(lambda g, v: g / (jnp.sqrt(v / bias_correction2) + eps), grads, exp_avg_sq)
        wd = _decay_rate(weight_decay)
        grads = jax.tree.map(lambda g, y, d: g + wd(d) * y, grads, params, _decay_tree(decays, params))

        def new_y(y, z, g):
            return y + ckp1 * (z - y) + lr * (b1 * (1.0 - ckp1) - 1.0) * g

        updates = jax.tree.map(lambda y, z, g: new_y(y, z, g) - y, params, state.z, grads)
        z = jax.tree.map(lambda z, g: z - lr * g, state.z, grads)
        return updates, ScheduleFreeState(
            optax.safe_int32_increment(state.count), weight_sum, lr_max, z, exp_avg_sq, state.b1
        )

    return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------------------------------
# torch.optim.Adam (L2 weight decay), Adamax, NAdam, RAdam: the classes a user passes as optimizers=(...)


def torch_adam(learning_rate, b1, b2, eps, weight_decay):
    """torch.optim.Adam: g += wd * p (L2, not decoupled), then Adam with bias correction (optax's rule)."""
    return optax.chain(
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_adam(b1, b2, eps),
        optax.scale_by_learning_rate(learning_rate),
    )


class AdamaxState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # optax's name for the step (shadows tuple.count)
    exp_avg: Any
    exp_inf: Any


def torch_adamax(learning_rate, b1, b2, eps, weight_decay):
    """torch.optim.Adamax: g += wd * p; m = b1 m + (1 - b1) g; u = max(b2 u, |g| + eps);
    p -= lr / (1 - b1^t) * m / u."""

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return AdamaxState(jnp.zeros([], jnp.int32), zeros(), zeros())

    def update(grads, state, params):
        count = optax.safe_int32_increment(state.count)
        grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
        exp_avg = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.exp_avg, grads)
        exp_inf = jax.tree.map(lambda u, g: jnp.maximum(b2 * u, jnp.abs(g) + eps), state.exp_inf, grads)
        clr = learning_rate / (1.0 - b1 ** count.astype(jnp.float32))
        updates = jax.tree.map(lambda m, u: -clr * m / u, exp_avg, exp_inf)
        return updates, AdamaxState(count, exp_avg, exp_inf)

    return optax.GradientTransformation(init, update)


class NAdamState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # optax's name for the step (shadows tuple.count)
    mu_product: jax.Array
    exp_avg: Any
    exp_avg_sq: Any


def torch_nadam(learning_rate, b1, b2, eps, weight_decay, momentum_decay=4e-3):
    """torch.optim.NAdam (decoupled_weight_decay=False): g += wd * p; mu_t = b1 (1 - 0.5 * 0.96^(t psi));
    p -= lr (1 - mu_t) / (1 - prod mu) * g / d + lr mu_{t+1} / (1 - prod mu * mu_{t+1}) * m / d,
    d = sqrt(v / (1 - b2^t)) + eps."""

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return NAdamState(jnp.zeros([], jnp.int32), jnp.ones([], jnp.float32), zeros(), zeros())

    def update(grads, state, params):
        count = optax.safe_int32_increment(state.count)
        t = count.astype(jnp.float32)
        grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
        mu = b1 * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))
        mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((t + 1.0) * momentum_decay))
        mu_product = state.mu_product * mu
        exp_avg = jax.tree.map(lambda m, g: m + (g - m) * (1.0 - b1), state.exp_avg, grads)
        exp_avg_sq = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.exp_avg_sq, grads)
        bias_correction2 = 1.0 - b2**t

        def step(g, m, v):
            denom = jnp.sqrt(v / bias_correction2) + eps
            grad_part = learning_rate * (1.0 - mu) / (1.0 - mu_product) * g / denom
            momentum_part = learning_rate * mu_next / (1.0 - mu_product * mu_next) * m / denom
            return -(grad_part + momentum_part)

        updates = jax.tree.map(step, grads, exp_avg, exp_avg_sq)
        return updates, NAdamState(count, mu_product, exp_avg, exp_avg_sq)

    return optax.GradientTransformation(init, update)


class RAdamState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # optax's name for the step (shadows tuple.count)
    exp_avg: Any
    exp_avg_sq: Any


def _radam_table(b2: float) -> np.ndarray:
    """RAdam's per-step scalar for steps 1..n in float64, as torch computes it in Python: where rho_t > 5,
    rect_t * sqrt(1 - b2^t) (else 0). Its float32 formula cancels catastrophically while 1 - b2^t is small
    (rho_t is a difference of two numbers near 2 / (1 - b2)); past the table it does not (b2^t < e^-30)."""
    steps = np.arange(1, int(math.ceil(30.0 / (1.0 - b2))) + 1, dtype=np.float64)
    bias_correction2 = 1.0 - b2**steps
    rho_inf = 2.0 / (1.0 - b2) - 1.0
    rho_t = rho_inf - 2.0 * steps * b2**steps / bias_correction2
    with np.errstate(invalid="ignore"):
        rect = np.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t))
    adaptive = np.where(rho_t > 5.0, rect * np.sqrt(bias_correction2), 0.0)
    return adaptive.astype(np.float32)


def torch_radam(learning_rate, b1, b2, eps, weight_decay):
    """torch.optim.RAdam (decoupled_weight_decay=False): g += wd * p; Adam's moments; where the variance's
    length of the approximated SMA rho_t > 5, p -= lr * m_hat * rect * sqrt(1 - b2^t) / (sqrt(v) + eps), else
    p -= lr * m_hat. The step's scalars come from a float64 table (`_radam_table`)."""
    adaptive_table = _radam_table(float(b2))

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return RAdamState(jnp.zeros([], jnp.int32), zeros(), zeros())

    def update(grads, state, params):
        count = optax.safe_int32_increment(state.count)
        t = count.astype(jnp.float32)
        grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
        exp_avg = jax.tree.map(lambda m, g: m + (g - m) * (1.0 - b1), state.exp_avg, grads)
        exp_avg_sq = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.exp_avg_sq, grads)
        in_table = count <= len(adaptive_table)
        index = jnp.minimum(count, len(adaptive_table)) - 1
        bias_correction2 = 1.0 - b2**t
        rho_inf = 2.0 / (1.0 - b2) - 1.0
        rho_t = rho_inf - 2.0 * t * b2**t / bias_correction2
        rect = jnp.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t))
        inverse_bc1 = 1.0 / (1.0 - b1**t)
        adaptive = jnp.where(in_table, jnp.asarray(adaptive_table)[index], rect * jnp.sqrt(bias_correction2))

        def step(m, v):
            m_hat = m * inverse_bc1
            return -learning_rate * jnp.where(adaptive > 0.0, m_hat * adaptive / (jnp.sqrt(v) + eps), m_hat)

        updates = jax.tree.map(step, exp_avg, exp_avg_sq)
        return updates, RAdamState(count, exp_avg, exp_avg_sq)

    return optax.GradientTransformation(init, update)
