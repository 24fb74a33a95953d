"""HF optimizer names and learning-rate schedules as optax.

Schedules are pure `step -> learning rate` functions traced inside the compiled step, with HF's exact formulas
(`transformers/optimization.py`). Optimizers are optax chains wrapped in `optax.inject_hyperparams`, so the rate
used by each update sits in the optimizer state (what HF logs as `learning_rate`) and per-evaluation schedulers
(`reduce_lr_on_plateau`) can change it from the host without recompiling.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from transformers.trainer_utils import SchedulerType
from transformers.training_args import OptimizerNames

Schedule = Callable[[jax.Array], jax.Array]

# ---------------------------------------------------------------------------------------------------------------
# Schedules: multipliers of the base rate at scheduler step s (HF's `lr_lambda`s), written with jnp.where.


def _warmup(s, warmup):
    return s / max(1, warmup)


def _linear(s, *, warmup, total):
    decay = jnp.maximum(0.0, (total - s) / max(1, total - warmup))
    return jnp.where(s < warmup, _warmup(s, warmup), decay)


def _cosine(s, *, warmup, total, num_cycles=0.5, min_lr_rate=0.0):
    progress = (s - warmup) / max(1, total - warmup)
    factor = 0.5 * (1.0 + jnp.cos(math.pi * num_cycles * 2.0 * progress))
    factor = jnp.maximum(0.0, factor * (1 - min_lr_rate) + min_lr_rate)
    return jnp.where(s < warmup, _warmup(s, warmup), factor)


def _cosine_with_restarts(s, *, warmup, total, num_cycles=1):
    progress = (s - warmup) / max(1, total - warmup)
    factor = jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(math.pi * jnp.mod(num_cycles * progress, 1.0))))
    factor = jnp.where(progress >= 1.0, 0.0, factor)
    return jnp.where(s < warmup, _warmup(s, warmup), factor)


def _polynomial(s, *, warmup, total, lr_init, lr_end=1e-7, power=1.0):
    if not lr_init > lr_end:
        raise ValueError(f"lr_end ({lr_end}) must be smaller than initial lr ({lr_init})")
    pct_remaining = 1 - (s - warmup) / max(1, total - warmup)
    decay = ((lr_init - lr_end) * jnp.maximum(pct_remaining, 0.0) ** power + lr_end) / lr_init
    decay = jnp.where(s > total, lr_end / lr_init, decay)
    return jnp.where(s < warmup, _warmup(s, warmup), decay)


def _constant(s):
    return jnp.ones_like(s)


def _constant_with_warmup(s, *, warmup):
    return jnp.where(s < warmup, _warmup(s, warmup), 1.0)


def _inverse_sqrt(s, *, warmup, timescale=None):
    timescale = timescale or warmup or 10_000
    decay = 1.0 / jnp.sqrt((s + timescale - warmup) / timescale)
    return jnp.where(s < warmup, _warmup(s, warmup), decay)


def _cosine_warmup_with_min_lr(s, *, warmup, total, min_lr_rate, num_cycles=0.5, warmup_lr_rate=None):
    if warmup_lr_rate is None:
        warm = (s + 1.0) / max(1.0, warmup)
    else:
        warm = warmup_lr_rate + (1.0 - warmup_lr_rate) * s / max(1, warmup - 1)
    progress = (s - warmup + 1.0) / max(1.0, total - warmup)
    factor = 0.5 * (1.0 + jnp.cos(math.pi * num_cycles * 2.0 * progress))
    factor = jnp.maximum(0.0, factor * (1 - min_lr_rate) + min_lr_rate)
    return jnp.where(s < warmup, warm, factor)


_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": None,  # depends on num_cycles, see _wsd
    "1-sqrt": lambda p: 1.0 - jnp.sqrt(jnp.clip(p, 0.0, 1.0)),
}


def _wsd(
    s,
    *,
    warmup,
    num_decay_steps,
    total=None,
    num_stable_steps=None,
    warmup_type="linear",
    decay_type="cosine",
    min_lr_ratio=0.0,
    num_cycles=0.5,
):
    for name, kind in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if kind not in _SHAPES:
            raise ValueError(f"lr_scheduler_kwargs {name}={kind!r}: use one of 'linear', 'cosine', '1-sqrt'.")
    if num_stable_steps is None:
        num_stable_steps = total - warmup - num_decay_steps
    p_warm = s / max(1, warmup)
    if warmup_type == "cosine":
        up = 0.5 * (1.0 - jnp.cos(math.pi * p_warm))
    elif warmup_type == "1-sqrt":
        up = 1.0 - jnp.sqrt(jnp.clip(1.0 - p_warm, 0.0, 1.0))
    else:
        up = p_warm
    p_decay = (s - warmup - num_stable_steps) / max(1, num_decay_steps)
    if decay_type == "cosine":
        down = 0.5 * (1.0 + jnp.cos(math.pi * num_cycles * 2.0 * p_decay))
    else:
        down = _SHAPES[decay_type](p_decay)
    scale = lambda f: jnp.maximum(0.0, f * (1.0 - min_lr_ratio) + min_lr_ratio)  # noqa: E731
    stable_end = warmup + num_stable_steps
    return jnp.select(
        [s < warmup, s < stable_end, s < stable_end + num_decay_steps],
        [scale(up), jnp.ones_like(s), scale(down)],
        min_lr_ratio * jnp.ones_like(s),
    )


def make_schedule(
    name: str | SchedulerType,
    base_lr: float,
    num_warmup_steps: int,
    num_training_steps: int,
    kwargs: dict[str, Any] | None = None,
) -> Schedule:
    """HF's `get_scheduler(name, ...)` as a jnp function of the scheduler step: the rate, not the multiplier."""
    name = SchedulerType(name).value
    kw = dict(kwargs or {})
    w, t = num_warmup_steps, num_training_steps
    if name == "constant":
        multiplier = _constant
    elif name in ("reduce_lr_on_plateau", "greedy"):
        # These step once per evaluation on the host (see PlateauScheduler); the traced part is constant.
        multiplier = _constant
    elif name == "constant_with_warmup":
        multiplier = lambda s: _constant_with_warmup(s, warmup=w)  # noqa: E731
    elif name == "inverse_sqrt":
        multiplier = lambda s: _inverse_sqrt(s, warmup=w, **kw)  # noqa: E731
    elif name == "warmup_stable_decay":
        if "num_decay_steps" not in kw:
            raise ValueError("lr_scheduler_type warmup_stable_decay needs lr_scheduler_kwargs={'num_decay_steps': N}.")
        if "num_stable_steps" in kw:
            t = None
        multiplier = lambda s: _wsd(s, warmup=w, total=t, **kw)  # noqa: E731
    elif name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        min_lr, min_lr_rate = kw.pop("min_lr", None), kw.pop("min_lr_rate", None)
        if min_lr is not None and min_lr_rate is not None:
            raise ValueError("Only one of min_lr or min_lr_rate should be set")
        if min_lr is None and min_lr_rate is None:
            raise ValueError("One of min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`")
        rate = min_lr / base_lr if min_lr is not None else min_lr_rate
        fn = _cosine if name == "cosine_with_min_lr" else _cosine_warmup_with_min_lr
        multiplier = lambda s: fn(s, warmup=w, total=t, min_lr_rate=rate, **kw)  # noqa: E731
    else:
        fns = {
            "linear": _linear,
            "cosine": _cosine,
            "cosine_with_restarts": _cosine_with_restarts,
            "polynomial": lambda s, **k: _polynomial(s, lr_init=base_lr, **k),
        }
        fn = fns[name]
        multiplier = lambda s: fn(s, warmup=w, total=t, **kw)  # noqa: E731

    def schedule(step):
        return base_lr * multiplier(jnp.asarray(step, jnp.float32))

    return schedule


@dataclass
class PlateauScheduler:
    """torch's ReduceLROnPlateau with HF's defaults, stepped on the host once per evaluation."""

    mode: str = "min"
    factor: float = 0.1
    patience: int = 10
    threshold: float = 1e-4
    threshold_mode: str = "rel"
    cooldown: int = 0
    min_lr: float = 0.0
    eps: float = 1e-8
    best: float | None = None
    num_bad_epochs: int = 0
    cooldown_counter: int = 0

    def _is_better(self, current: float) -> bool:
        if self.best is None:
            return True
        rel = self.threshold_mode == "rel"
        if self.mode == "min":
            return current < (self.best * (1 - self.threshold) if rel else self.best - self.threshold)
        return current > (self.best * (1 + self.threshold) if rel else self.best + self.threshold)

    def step(self, metric: float, lr: float) -> float:
        """The new learning rate after an evaluation that measured `metric`."""
        if self._is_better(metric):
            self.best, self.num_bad_epochs = metric, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            new_lr = max(lr * self.factor, self.min_lr)
            if lr - new_lr > self.eps:
                lr = new_lr
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        return lr


# ---------------------------------------------------------------------------------------------------------------
# Optimizers

# HF's rule (trainer_optimizer.get_decay_parameter_names): no decay for norm layers and these name patterns.
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)", re.IGNORECASE)


def decay_mask(param_paths: dict[str, Any], norm_module_paths: set[str]) -> dict[str, bool]:
    """True for parameters that get weight decay, by HF's rule, keyed by dotted path."""
    mask = {}
    for path in param_paths:
        module = path.rsplit(".", 1)[0] if "." in path else ""
        mask[path] = not (_NO_DECAY.search(path) or module in norm_module_paths)
    return mask


def parse_optim_args(optim_args: str | None) -> dict[str, Any]:
    """HF's "momentum=0.9,nesterov=True" -> {"momentum": 0.9, "nesterov": True}."""
    out: dict[str, Any] = {}
    for item in (optim_args or "").replace(" ", "").split(","):
        if not item:
            continue
        key, _, raw = item.partition("=")
        if raw.lower() in ("true", "false"):
            out[key] = raw.lower() == "true"
        else:
            try:
                out[key] = int(raw)
            except ValueError:
                out[key] = float(raw)
    return out


_ADAMW_NAMES = {n.value for n in OptimizerNames if n.value.startswith(("adamw", "paged_adamw"))} | {"stable_adamw"}
_LION_NAMES = {"lion_32bit", "lion_8bit", "paged_lion_32bit", "paged_lion_8bit"}
_ADEMAMIX_NAMES = {"ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit"}
SUPPORTED_OPTIMIZERS = sorted(
    _ADAMW_NAMES
    | _LION_NAMES
    | _ADEMAMIX_NAMES
    | {"adafactor", "sgd", "adagrad", "rmsprop", "schedule_free_adamw", "schedule_free_sgd"}
)


def _sgd(learning_rate, weight_decay, mask, momentum=0.0, nesterov=False, dampening=0.0):
    # torch SGD: g += wd * p before momentum; the buffer accumulates g (dampening 0), p -= lr * buf.
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask),
        optax.trace(decay=momentum, nesterov=nesterov) if momentum else optax.identity(),
        optax.scale_by_learning_rate(learning_rate),
    )


def _base_optimizer(name: str, args, learning_rate, mask) -> optax.GradientTransformation:
    wd, b1, b2, eps = args.weight_decay, args.adam_beta1, args.adam_beta2, args.adam_epsilon
    extra = parse_optim_args(args.optim_args)
    if name in _ADAMW_NAMES:
        return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=wd, mask=mask)
    if name in _LION_NAMES:
        return optax.lion(learning_rate, b1=b1, b2=b2, weight_decay=wd, mask=mask)
    if name in _ADEMAMIX_NAMES:
        return optax.contrib.ademamix(
            learning_rate,
            b1=b1,
            b2=b2,
            b3=extra.get("beta3", 0.9999),
            alpha=extra.get("alpha", 5.0),
            eps=eps,
            weight_decay=wd,
            mask=mask,
        )
    if name == "adafactor":
        # HF: Adafactor(scale_parameter=False, relative_step=False) with the schedule's rate.
        return optax.adafactor(
            learning_rate,
            min_dim_size_to_factor=1,
            decay_rate=0.8,
            multiply_by_parameter_scale=False,
            clipping_threshold=1.0,
            weight_decay_rate=wd or None,
            weight_decay_mask=mask,
            eps=1e-30,
        )
    if name == "sgd":
        return _sgd(learning_rate, wd, mask, **extra)
    if name == "adagrad":
        return optax.chain(
            optax.add_decayed_weights(wd, mask),
            optax.scale_by_rss(initial_accumulator_value=extra.get("initial_accumulator_value", 0.0), eps=1e-10),
            optax.scale_by_learning_rate(learning_rate),
        )
    if name == "rmsprop":
        return optax.chain(
            optax.add_decayed_weights(wd, mask),
            optax.rmsprop(
                learning_rate,
                decay=extra.get("alpha", 0.99),
                eps=extra.get("eps", 1e-8),
                momentum=extra.get("momentum", 0.0) or None,
                centered=extra.get("centered", False),
                eps_in_sqrt=False,
            ),
        )
    if name == "schedule_free_adamw":
        return optax.contrib.schedule_free_adamw(
            learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=wd
        )
    if name == "schedule_free_sgd":
        return optax.contrib.schedule_free_sgd(learning_rate, b1=extra.get("momentum", 0.9), weight_decay=wd)
    raise ValueError(
        f"--optim {name!r} is not supported by jtrainer. Use one of: {', '.join(SUPPORTED_OPTIMIZERS)}."
    )


def check_optimizer_name(name: Any) -> str:
    name = getattr(name, "value", name)
    if name not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"--optim {name!r} is not supported by jtrainer. Use one of: {', '.join(SUPPORTED_OPTIMIZERS)}."
        )
    return name


def make_optimizer(args, schedule: Schedule | float, mask) -> optax.GradientTransformation:
    """HF's `optim` name -> an optax transformation whose state carries the learning rate it used."""
    name = check_optimizer_name(args.optim)
    factory = lambda learning_rate: _base_optimizer(name, args, learning_rate, mask)  # noqa: E731
    return optax.inject_hyperparams(factory)(learning_rate=schedule)


def find_hyperparams(opt_state) -> dict | None:
    """inject_hyperparams' dict of the (possibly wrapped, e.g. apply_if_finite) optimizer state."""
    while opt_state is not None:
        hyper = getattr(opt_state, "hyperparams", None)
        if hyper is not None:
            return hyper
        opt_state = getattr(opt_state, "inner_state", None)
    return None


def replace_hyperparam(opt_state, name: str, value):
    """The optimizer state with one injected hyperparameter replaced (through wrappers)."""
    if getattr(opt_state, "hyperparams", None) is not None:
        return opt_state._replace(hyperparams={**opt_state.hyperparams, name: value})
    return opt_state._replace(inner_state=replace_hyperparam(opt_state.inner_state, name, value))


def current_learning_rate(opt_state) -> jax.Array | None:
    """The rate that the last update used (inject_hyperparams keeps it in the state)."""
    hyper = find_hyperparams(opt_state)
    return None if hyper is None else hyper.get("learning_rate")


def skip_non_finite(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Updates with a NaN or Inf are skipped (parameters and moments unchanged) and counted."""
    return optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
