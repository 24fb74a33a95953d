"""HF optimizer names as optax, and the wrappers the step puts around them (clipping, skipping non-finite
updates).

Optimizers are optax chains wrapped in `optax.inject_hyperparams`, so the rate used by each update sits in the
optimizer state (what HF logs as `learning_rate`) and per-evaluation schedulers (`reduce_lr_on_plateau`) can
change it from the host without recompiling. The schedules are jtrainer.numerics.schedules'; the state surgery
jtrainer.numerics.opt_state's.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from transformers.trainer_utils import SchedulerType

from jtrainer.numerics import torch_optimizers
from jtrainer.numerics.opt_state import hyperparameter, nested_states
from jtrainer.numerics.schedules import (
    PER_EVALUATION,
    LearningRate,
    Multiplier,
    Schedule,
    schedule_shape,
    schedule_switch,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------
# Optimizers

# HF's name patterns (Trainer.get_decay_parameter_names): no decay for parameters whose lower-cased dotted name
# matches one, nor for parameters of torch.nn.LayerNorm modules (`layer_norm_paths`, found by type by the caller).
NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decay_mask(param_paths: dict[str, Any], layer_norm_paths: set[str]) -> dict[str, bool]:
    """True for parameters that get weight decay, by HF's rule, keyed by dotted path."""

    def in_layer_norm(path):
        parts = path.split(".")
        return any(".".join(parts[:i]) in layer_norm_paths for i in range(1, len(parts)))

    return {path: not (NO_DECAY.search(path.lower()) or in_layer_norm(path)) for path in param_paths}


def parse_optim_args(optim_args: str | None) -> dict[str, str]:
    """HF's parsing of "momentum=0.9,nesterov=True": spaces dropped, values kept as strings (each optimizer
    converts the keys it reads, as HF's handlers do)."""
    out: dict[str, str] = {}
    for item in (optim_args or "").replace(" ", "").split(","):
        if not item:
            continue
        if item.count("=") != 1:
            raise ValueError(f"optim_args entry {item!r} is not key=value: write e.g. optim_args='momentum=0.9'.")
        key, value = item.split("=")
        out[key] = value
    return out


def _hf_bool(value: str) -> bool:
    return value.lower() in ("true", "1", "yes")


@dataclass(frozen=True)
class OptimizerContext:
    """What an `optim` handler reads besides the injected numbers: HF's name, its optim_args (strings) and the
    decay mask. The numbers (rate, weight decay, betas, epsilon, schedule-free's warmup) come as arguments."""

    name: str
    options: dict[str, str]
    mask: Any


Handler = Callable[..., optax.GradientTransformation]  # (ctx, learning_rate=, weight_decay=, b1=, b2=, eps=, ...)


def _adamw(ctx, *, learning_rate, weight_decay, b1, b2, eps, **_):
    return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=ctx.mask)


def _lion(ctx, *, learning_rate, weight_decay, b1, b2, **_):
    # bitsandbytes' Lion (HF passes betas only): p *= 1 - lr * wd; p -= lr * sign(b1 m + (1 - b1) g).
    return optax.lion(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay, mask=ctx.mask)


def _ademamix(ctx, *, learning_rate, weight_decay, b1, b2, eps, **_):
    """bitsandbytes' AdEMAMix with HF's options, including its alpha and beta3 warm-up schedulers."""
    opts = ctx.options
    b1 = float(opts["beta1"]) if "beta1" in opts else b1
    b2 = float(opts["beta2"]) if "beta2" in opts else b2
    eps = float(opts["eps"]) if "eps" in opts else eps
    b3 = float(opts.get("beta3", 0.9999))
    alpha = float(opts.get("alpha", 5.0))
    alpha_schedule: Any = alpha  # a number, or a function of the update count
    b3_schedule: Any = b3
    if int(opts.get("t_alpha", 0) or 0):
        t_alpha = int(opts["t_alpha"])
        # optax passes the count before this update (0-based); bitsandbytes uses the 1-based step.
        alpha_schedule = lambda c: jnp.minimum((c + 1) * alpha / t_alpha, alpha)  # noqa: E731
    if int(opts.get("t_beta3", 0) or 0):
        t_beta3 = int(opts["t_beta3"])
        ln_b1, ln_b3 = jnp.log(b1), math.log(b3)

        def b3_rising(c):
            scale = (c + 1) / t_beta3
            return jnp.minimum(jnp.exp(ln_b1 * ln_b3 / ((1 - scale) * ln_b3 + scale * ln_b1)), b3)

        b3_schedule = b3_rising

    return optax.contrib.ademamix(
        learning_rate,
        b1=b1,
        b2=b2,
        b3=b3_schedule,
        alpha=alpha_schedule,
        eps=eps,
        weight_decay=weight_decay,
        mask=ctx.mask,
    )


def _adafactor(ctx, *, learning_rate, weight_decay, **_):
    return torch_optimizers.hf_adafactor(learning_rate, weight_decay, ctx.mask)


def _sgd(ctx, *, learning_rate, weight_decay, **_):
    opts = ctx.options
    return torch_optimizers.torch_sgd(
        learning_rate,
        weight_decay,
        ctx.mask,
        momentum=float(opts.get("momentum", 0.0)),
        dampening=float(opts.get("dampening", 0.0)),
        nesterov=_hf_bool(opts.get("nesterov", "false")),
    )


def _adagrad(ctx, *, learning_rate, weight_decay, **_):
    opts = ctx.options
    return torch_optimizers.torch_adagrad(
        learning_rate,
        weight_decay,
        ctx.mask,
        lr_decay=float(opts.get("lr_decay", 0.0)),
        eps=float(opts.get("eps", 1e-10)),
    )


def _rmsprop(ctx, *, learning_rate, weight_decay, **_):
    opts = ctx.options
    return torch_optimizers.torch_rmsprop(
        learning_rate,
        weight_decay,
        ctx.mask,
        alpha=float(opts.get("alpha", 0.99)),
        eps=float(opts.get("eps", 1e-8)),
        momentum=float(opts.get("momentum", 0.0)),
        centered=_hf_bool(opts.get("centered", "false")),
    )


def _schedule_free_options(ctx):
    return {"weight_lr_power": float(ctx.options.get("weight_lr_power", 2.0)), "r": float(ctx.options.get("r", 0.0))}


def _schedule_free_adamw(ctx, *, learning_rate, weight_decay, b1, b2, eps, optimizer_warmup_steps, **_):
    return torch_optimizers.schedule_free(
        learning_rate,
        weight_decay,
        ctx.mask,
        b1=b1,
        b2=b2,
        eps=eps,
        warmup_steps=optimizer_warmup_steps,
        **_schedule_free_options(ctx),
    )


def _schedule_free_sgd(ctx, *, learning_rate, weight_decay, optimizer_warmup_steps, **_):
    # HF passes no momentum: SGDScheduleFree's default 0.9.
    return torch_optimizers.schedule_free(
        learning_rate,
        weight_decay,
        ctx.mask,
        b1=0.9,
        warmup_steps=optimizer_warmup_steps,
        **_schedule_free_options(ctx),
    )


def _stable_adamw(ctx, *, learning_rate, weight_decay, b1, b2, eps, **_):
    opts = ctx.options
    max_lr = opts.get("max_lr")
    return torch_optimizers.stable_adamw(
        learning_rate,
        b1,
        b2,
        eps,
        weight_decay,
        ctx.mask,
        decouple_lr=bool(opts.get("decouple_lr", "")),  # HF: bool() of the string, so any value turns it on
        max_lr=None if max_lr is None else float(max_lr),
    )


@dataclass(frozen=True)
class OptimizerRule:
    handler: Handler
    options: tuple[str, ...] = ()  # the optim_args keys HF's handler reads (others have no effect, in HF too)
    low_bit: bool = False  # HF keeps the state in 8 or 4 bits; jtrainer keeps 32 (the same update rule)


_BNB_ADAMW = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit")
_BNB_RMSPROP = ("rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")
_TORCHAO_ADAMW = ("adamw_torch_4bit", "adamw_torch_8bit")
_ANYPRECISION_OPTIONS = ("use_kahan_summation", "momentum_dtype", "variance_dtype", "compensation_buffer_dtype")
_ADEMAMIX_OPTIONS = ("beta1", "beta2", "beta3", "alpha", "eps", "t_alpha", "t_beta3")

# HF's `optim` name -> the rule of the optimizer it builds (transformers/trainer_optimizer.py's handler table).
OPTIMIZERS: dict[str, OptimizerRule] = {
    **dict.fromkeys(
        ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused"), OptimizerRule(_adamw)
    ),
    "adamw_anyprecision": OptimizerRule(_adamw, _ANYPRECISION_OPTIONS),
    **{name: OptimizerRule(_adamw, low_bit="8bit" in name) for name in _BNB_ADAMW},
    **{name: OptimizerRule(_adamw, ("block_size", "bf16_stochastic_round"), low_bit=True) for name in _TORCHAO_ADAMW},
    **{
        name: OptimizerRule(_lion, low_bit="8bit" in name)
        for name in ("lion_32bit", "lion_8bit", "paged_lion_32bit", "paged_lion_8bit")
    },
    **{
        name: OptimizerRule(_ademamix, _ADEMAMIX_OPTIONS, low_bit="8bit" in name)
        for name in ("ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit")
    },
    "adafactor": OptimizerRule(_adafactor),
    "sgd": OptimizerRule(_sgd, ("momentum", "dampening", "nesterov")),
    "adagrad": OptimizerRule(_adagrad, ("lr_decay", "eps")),
    "rmsprop": OptimizerRule(_rmsprop, ("momentum", "alpha", "eps", "centered")),
    # bitsandbytes' RMSprop: torch's rule at its defaults (HF hands it optim_args as strings, which it cannot take).
    **{name: OptimizerRule(_rmsprop, low_bit="8bit" in name) for name in _BNB_RMSPROP},
    "schedule_free_adamw": OptimizerRule(_schedule_free_adamw, ("weight_lr_power", "r")),
    "schedule_free_sgd": OptimizerRule(_schedule_free_sgd, ("weight_lr_power", "r")),
    "stable_adamw": OptimizerRule(_stable_adamw, ("decouple_lr", "max_lr", "kahan_sum")),
}
SUPPORTED_OPTIMIZERS = sorted(OPTIMIZERS)


def check_optimizer_name(name: Any) -> str:
    name = getattr(name, "value", name)
    if name not in OPTIMIZERS:
        raise ValueError(
            f"--optim {name!r} is not supported by jtrainer. Use one of: {', '.join(SUPPORTED_OPTIMIZERS)}."
        )
    return name


def _check_hyperparameters(name: str, args) -> None:
    """The ranges torch's optimizers refuse when HF builds them (with torch's words), here before anything runs."""
    if args.weight_decay < 0:
        raise ValueError(f"Invalid weight_decay value: {args.weight_decay} (--weight_decay must be >= 0).")
    if "adam" in name:
        for index, beta in enumerate((args.adam_beta1, args.adam_beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(
                    f"Invalid beta parameter at index {index}: {beta} (--adam_beta{index + 1} must lie in [0, 1))."
                )
        if args.adam_epsilon < 0:
            raise ValueError(f"Invalid epsilon value: {args.adam_epsilon} (--adam_epsilon must be >= 0).")


def check_optimizer(args) -> tuple[str, dict[str, str]]:
    """HF's `optim` name and its optim_args, checked before anything compiles: an unknown name, or an option HF
    would honour that jtrainer cannot reproduce, raises naming it."""
    name = check_optimizer_name(args.optim)
    options = parse_optim_args(args.optim_args)
    _check_hyperparameters(name, args)
    if name == "adamw_anyprecision":
        defaults = {
            "use_kahan_summation": "false",
            "momentum_dtype": "float32",
            "variance_dtype": "float32",
            "compensation_buffer_dtype": "bfloat16",
        }
        changed = [k for k in _ANYPRECISION_OPTIONS if k in options and options[k].lower() != defaults[k]]
        if changed:
            raise ValueError(
                f"optim=adamw_anyprecision with optim_args {', '.join(changed)}: torchdistx's low-precision states "
                "and Kahan summation are not reproduced by jtrainer; drop these options (float32 AdamW)."
            )
    if name in _BNB_RMSPROP and options:
        raise ValueError(
            f"optim={name!r} with optim_args {args.optim_args!r}: HF passes them to bitsandbytes' RMSprop as strings, "
            "which fails there; drop optim_args (or use optim='rmsprop', which reads them)."
        )
    if name == "stable_adamw" and options.get("decouple_lr") and "max_lr" not in options:
        raise ValueError("optim_args decouple_lr for stable_adamw needs max_lr=<the schedule's peak rate>.")
    if (
        name == "sgd"
        and _hf_bool(options.get("nesterov", "false"))
        and (float(options.get("momentum", 0)) <= 0 or float(options.get("dampening", 0)) != 0)
    ):
        raise ValueError("optim_args nesterov=True needs momentum > 0 and dampening=0 (torch's SGD refuses it).")
    return name, options


def optimizer_context(args, mask=None) -> OptimizerContext:
    """The checked name and options with the decay mask; options without effect (in HF too) and low-bit names
    (whose state jtrainer keeps in 32 bits) warn."""
    name, options = check_optimizer(args)
    rule = OPTIMIZERS[name]
    for key in options:
        if key not in rule.options:
            logger.warning(f"optim_args {key}={options[key]} has no effect on optim={name!r} (nor in HF's Trainer).")
    if rule.low_bit:
        logger.warning(
            f"optim={name!r}: jtrainer keeps the optimizer state in 32 bits and applies the same update rule; HF's "
            "8/4-bit state differs from it by quantization error."
        )
    return OptimizerContext(name, options, mask)


def make_optimizer(
    args,
    mask,
    *,
    multiplier: Multiplier | None = None,
    warmup_steps: int = 0,
    total_steps: int = 0,
    learning_rate: Schedule | float | None = None,
) -> optax.GradientTransformation:
    """HF's `optim` name -> an optax transformation whose state carries its hyperparameters.

    Every number (weight decay, betas, epsilon, the schedule's base rate, warmup and length and the shape it
    switches to after a resume, max_grad_norm) enters
    the optimizer state through `optax.inject_hyperparams`: it is data, so trials of a hyperparameter search that
    change only numbers reuse one compiled step. With `multiplier` (HF's schedule), each update's rate is
    `base_learning_rate * multiplier(count)` computed from that state; otherwise `learning_rate` is a user's
    schedule or a constant the host may change (reduce_lr_on_plateau). The state's `learning_rate` is the rate
    the last update used (what HF logs).
    """
    ctx = optimizer_context(args, mask)
    handler = OPTIMIZERS[ctx.name].handler

    # Named one by one: inject_hyperparams only injects named numeric arguments.
    def factory(
        learning_rate,
        weight_decay,
        b1,
        b2,
        eps,
        optimizer_warmup_steps,
        base_learning_rate,
        warmup_steps,
        total_steps,
        next_warmup_steps,
        next_total_steps,
        switch_count,
        max_grad_norm,
    ):
        # Read by `scheduled` and the step.
        del base_learning_rate, warmup_steps, total_steps, next_warmup_steps, next_total_steps, switch_count
        del max_grad_norm
        return handler(
            ctx,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            b1=b1,
            b2=b2,
            eps=eps,
            optimizer_warmup_steps=optimizer_warmup_steps,
        )

    base_lr = float(args.learning_rate)
    tx = optax.inject_hyperparams(factory)(
        learning_rate=base_lr if learning_rate is None else learning_rate,
        weight_decay=float(args.weight_decay),
        b1=float(args.adam_beta1),
        b2=float(args.adam_beta2),
        eps=float(args.adam_epsilon),
        # Schedule-free optimizers' own warmup: HF passes its `warmup_steps` argument as given.
        optimizer_warmup_steps=float(args.warmup_steps),
        base_learning_rate=base_lr,
        warmup_steps=float(warmup_steps),
        total_steps=float(total_steps),
        **schedule_switch(warmup_steps, total_steps),
        max_grad_norm=float(args.max_grad_norm or 0.0),
    )
    return tx if multiplier is None else scheduled(tx, multiplier)


def hf_optimizer(
    args, mask, rate: LearningRate | None, schedule: Schedule | None
) -> tuple[optax.GradientTransformation, tuple | None]:
    """HF's optimizer of the arguments over the decay `mask`, with the run's schedule, and its recipe: what the
    compiled step depends on besides numbers (equal recipes share one executable; None where the schedule itself
    is compiled into the step). With the run's `LearningRate` (None: the user's own `schedule`) stepping once per
    update, the schedule's numbers live in the optimizer state, so trials of a search that change them reuse the
    compiled step; a per-evaluation schedule (reduce_lr_on_plateau, greedy) sets the rate in the state itself."""
    per_evaluation = SchedulerType(args.lr_scheduler_type).value in PER_EVALUATION
    if rate is not None and not per_evaluation:
        tx = make_optimizer(
            args, mask, multiplier=rate.multiplier(), warmup_steps=rate.warmup_steps, total_steps=rate.total_steps
        )
        recipe = (
            check_optimizer_name(args.optim),
            args.optim_args,
            rate.kind,
            json.dumps(rate.kwargs, sort_keys=True, default=str),
            tuple(jax.tree.leaves(mask)),
            jax.tree.structure(mask),
        )
        return tx, recipe
    return make_optimizer(args, mask, learning_rate=None if per_evaluation else schedule), None


def scheduled(tx: optax.GradientTransformation, multiplier: Multiplier) -> optax.GradientTransformation:
    """Sets inject_hyperparams' `learning_rate` before each update from the schedule values in its state."""

    def with_rate(state):
        hyper = state.hyperparams
        base = hyper["base_learning_rate"]
        warmup, total = schedule_shape(hyper, state.count)
        rate = base * multiplier(state.count, warmup=warmup, total=total, base_lr=base)
        return state._replace(hyperparams={**hyper, "learning_rate": rate.astype(hyper["learning_rate"].dtype)})

    def init(params):
        return with_rate(tx.init(params))

    def update(updates, state, params=None):
        return tx.update(updates, with_rate(state), params)

    return optax.GradientTransformation(init, update)


def clip_by_global_norm(grads, max_norm):
    """torch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1. `max_norm` may be traced;
    a Python number <= 0 leaves the gradients as they are."""
    if isinstance(max_norm, (int, float)) and max_norm <= 0:
        return grads
    coef = jnp.minimum(1.0, max_norm / (optax.tree.norm(grads) + 1e-6))
    return jax.tree.map(lambda g: g * coef.astype(g.dtype), grads)


def clip_grad_norm(tx: optax.GradientTransformation, max_norm: float) -> optax.GradientTransformation:
    """HF's max_grad_norm in front of `tx`: the gradients clipped by torch's rule before `tx` sees them. The bound
    is `tx`'s injected `max_grad_norm` hyperparameter when it has one (data: a resumed run's new value needs no
    recompile), else `max_norm`. The state is `tx`'s own, so checkpoints do not depend on clipping."""

    def update(updates, state, params=None):
        injected = hyperparameter(state, "max_grad_norm")
        return tx.update(clip_by_global_norm(updates, max_norm if injected is None else injected), state, params)

    return optax.GradientTransformation(tx.init, update)


def skip_non_finite(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Updates with a NaN or Inf are skipped (parameters and moments unchanged) and counted."""
    return optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)


def schedule_free_eval_params(opt_state, params):
    """The parameters schedulefree's `optimizer.eval()` puts in the model, x = y + (1 - 1/b1)(z - y), which HF
    evaluates and saves until the next training step; None when the optimizer is not schedule-free."""
    for state in nested_states(opt_state):
        if isinstance(state, torch_optimizers.ScheduleFreeState):
            weight = 1.0 - 1.0 / state.b1
            return jax.tree.map(lambda y, z: y + weight * (z - y), params, state.z)
    return None
