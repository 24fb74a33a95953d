"""The learning rate: HF's schedules as jnp functions, the per-evaluation schedulers, and `LearningRate`, the one
object a run holds for its rate.

Schedules are pure `step -> learning rate` functions traced inside the compiled step, with HF's exact formulas
(`transformers/optimization.py`); the same formulas in numpy give HF's float64 value, which is what HF logs.
Per-evaluation schedulers (`reduce_lr_on_plateau`, `greedy`) step on the host, as torch's do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from transformers.trainer_utils import SchedulerType

from jtrainer.numerics import opt_state as opt_states

Schedule = Callable[[jax.Array], jax.Array]

# ---------------------------------------------------------------------------------------------------------------
# Schedules: multipliers of the base rate at scheduler step s (HF's `lr_lambda`s), written with jnp so that the
# warmup, the total and the base rate may be traced values: a hyperparameter search changes them without a
# recompile.


def _at_least_1(x, xp=jnp):
    return xp.maximum(1.0, x)


def _warmup(s, warmup, xp=jnp):
    return s / _at_least_1(warmup, xp)


def _linear(s, *, warmup, total, base_lr, xp=jnp):
    decay = xp.maximum(0.0, (total - s) / _at_least_1(total - warmup, xp))
    return xp.where(s < warmup, _warmup(s, warmup, xp), decay)


def _cosine(s, *, warmup, total, base_lr, num_cycles=0.5, min_lr_rate=0.0, min_lr=None, xp=jnp):
    if min_lr is not None:
        min_lr_rate = min_lr / base_lr
    progress = (s - warmup) / _at_least_1(total - warmup, xp)
    factor = 0.5 * (1.0 + xp.cos(math.pi * num_cycles * 2.0 * progress))
    factor = xp.maximum(0.0, factor * (1 - min_lr_rate) + min_lr_rate)
    return xp.where(s < warmup, _warmup(s, warmup, xp), factor)


def _cosine_with_restarts(s, *, warmup, total, base_lr, num_cycles=1, xp=jnp):
    progress = (s - warmup) / _at_least_1(total - warmup, xp)
    factor = xp.maximum(0.0, 0.5 * (1.0 + xp.cos(math.pi * xp.mod(num_cycles * progress, 1.0))))
    factor = xp.where(progress >= 1.0, 0.0, factor)
    return xp.where(s < warmup, _warmup(s, warmup, xp), factor)


def _polynomial(s, *, warmup, total, base_lr, lr_end=1e-7, power=1.0, xp=jnp):
    pct_remaining = 1 - (s - warmup) / _at_least_1(total - warmup, xp)
    decay = ((base_lr - lr_end) * xp.maximum(pct_remaining, 0.0) ** power + lr_end) / base_lr
    decay = xp.where(s > total, lr_end / base_lr, decay)
    return xp.where(s < warmup, _warmup(s, warmup, xp), decay)


def _constant(s, xp=jnp, **_):
    return xp.ones_like(s)


def _constant_with_warmup(s, *, warmup, xp=jnp, **_):
    return xp.where(s < warmup, _warmup(s, warmup, xp), 1.0)


def _inverse_sqrt(s, *, warmup, timescale=None, xp=jnp, **_):
    if timescale is None:
        timescale = xp.where(warmup > 0, warmup, 10_000.0)
    decay = 1.0 / xp.sqrt((s + timescale - warmup) / timescale)
    return xp.where(s < warmup, _warmup(s, warmup, xp), decay)


def _cosine_warmup_with_min_lr(
    s, *, warmup, total, base_lr, min_lr_rate=None, min_lr=None, num_cycles=0.5, warmup_lr_rate=None, xp=jnp
):
    if min_lr is not None:
        min_lr_rate = min_lr / base_lr
    if warmup_lr_rate is None:
        warm = (s + 1.0) / _at_least_1(warmup, xp)
    else:
        warm = warmup_lr_rate + (1.0 - warmup_lr_rate) * s / _at_least_1(warmup - 1, xp)
    progress = (s - warmup + 1.0) / _at_least_1(total - warmup, xp)
    factor = 0.5 * (1.0 + xp.cos(math.pi * num_cycles * 2.0 * progress))
    factor = xp.maximum(0.0, factor * (1 - min_lr_rate) + min_lr_rate)
    return xp.where(s < warmup, warm, factor)


_SHAPES = ("linear", "cosine", "1-sqrt")


def _wsd(
    s,
    *,
    warmup,
    num_decay_steps,
    total=None,
    base_lr=None,
    num_stable_steps=None,
    warmup_type="linear",
    decay_type="cosine",
    min_lr_ratio=0.0,
    num_cycles=0.5,
    xp=jnp,
):
    if num_stable_steps is None:
        num_stable_steps = total - warmup - num_decay_steps
    p_warm = s / _at_least_1(warmup, xp)
    if warmup_type == "cosine":
        up = 0.5 * (1.0 - xp.cos(math.pi * p_warm))
    elif warmup_type == "1-sqrt":
        up = 1.0 - xp.sqrt(xp.clip(1.0 - p_warm, 0.0, 1.0))
    else:
        up = p_warm
    p_decay = (s - warmup - num_stable_steps) / max(1, num_decay_steps)
    if decay_type == "cosine":
        down = 0.5 * (1.0 + xp.cos(math.pi * num_cycles * 2.0 * p_decay))
    elif decay_type == "1-sqrt":
        down = 1.0 - xp.sqrt(xp.clip(p_decay, 0.0, 1.0))
    else:
        down = 1.0 - p_decay
    scale = lambda f: xp.maximum(0.0, f * (1.0 - min_lr_ratio) + min_lr_ratio)  # noqa: E731
    stable_end = warmup + num_stable_steps
    return xp.select(
        [s < warmup, s < stable_end, s < stable_end + num_decay_steps],
        [scale(up), xp.ones_like(s), scale(down)],
        min_lr_ratio * xp.ones_like(s),
    )


_MULTIPLIERS: dict[str, Callable[..., Any]] = {
    "linear": _linear,
    "cosine": _cosine,
    "cosine_with_restarts": _cosine_with_restarts,
    "polynomial": _polynomial,
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
    "inverse_sqrt": _inverse_sqrt,
    "warmup_stable_decay": _wsd,
    "cosine_with_min_lr": _cosine,
    "cosine_warmup_with_min_lr": _cosine_warmup_with_min_lr,
    # These step once per evaluation on the host (see PlateauScheduler); the traced part is constant.
    "reduce_lr_on_plateau": _constant,
    "greedy": _constant,
}

Multiplier = Callable[..., jax.Array]  # (step, warmup=, total=, base_lr=) -> multiplier of the base rate


def schedule_multiplier(name: str | SchedulerType, base_lr: float, kwargs: dict[str, Any] | None = None) -> Multiplier:
    """HF's `lr_lambda` for scheduler `name`, after HF's checks of `lr_scheduler_kwargs` (raised here, before
    anything compiles). The static kwargs are bound; warmup, total and the base rate stay arguments."""
    name = SchedulerType(name).value
    kw = dict(kwargs or {})
    if name == "warmup_stable_decay":
        if "num_decay_steps" not in kw:
            raise ValueError("lr_scheduler_type warmup_stable_decay needs lr_scheduler_kwargs={'num_decay_steps': N}.")
        for key in ("warmup_type", "decay_type"):
            if kw.get(key, "linear") not in _SHAPES:
                raise ValueError(f"lr_scheduler_kwargs {key}={kw[key]!r}: use one of 'linear', 'cosine', '1-sqrt'.")
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        if "min_lr" in kw and "min_lr_rate" in kw:
            raise ValueError("Only one of min_lr or min_lr_rate should be set")
        if "min_lr" not in kw and "min_lr_rate" not in kw:
            raise ValueError("One of min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`")
    if name == "polynomial" and not base_lr > kw.get("lr_end", 1e-7):
        raise ValueError(f"lr_end ({kw.get('lr_end', 1e-7)}) must be smaller than initial lr ({base_lr})")
    fn = _MULTIPLIERS[name]
    return lambda s, *, warmup, total, base_lr: fn(  # noqa: E731
        jnp.asarray(s, jnp.float32), warmup=warmup, total=total, base_lr=base_lr, **kw
    )


def host_learning_rate(
    name: str | SchedulerType,
    base_lr: float,
    step: int,
    num_warmup_steps: int,
    num_training_steps: int,
    kwargs: dict[str, Any] | None = None,
) -> float:
    """HF's rate at scheduler step `step` as HF computes it (Python float64): what the logs show. The device
    applies the float32 rounding of the same formula."""
    schedule_multiplier(name, base_lr, kwargs)  # HF's checks
    fn = _MULTIPLIERS[SchedulerType(name).value]
    with np.errstate(divide="ignore", invalid="ignore"):  # branches not taken (as jnp.where) may divide by 0
        multiplier = fn(
            np.float64(step),
            warmup=float(num_warmup_steps),
            total=float(num_training_steps),
            base_lr=float(base_lr),
            xp=np,
            **dict(kwargs or {}),
        )
    return float(base_lr) * float(multiplier)


def make_schedule(
    name: str | SchedulerType,
    base_lr: float,
    num_warmup_steps: int,
    num_training_steps: int,
    kwargs: dict[str, Any] | None = None,
) -> Schedule:
    """HF's `get_scheduler(name, ...)` as a jnp function of the scheduler step: the rate, not the multiplier."""
    multiplier = schedule_multiplier(name, base_lr, kwargs)

    def schedule(step):
        return base_lr * multiplier(step, warmup=num_warmup_steps, total=num_training_steps, base_lr=base_lr)

    return schedule


def _improves(current: float, best: float, mode: str, threshold_mode: str, threshold: float) -> bool:
    """torch's (and GreedyLR's) test of a new best metric, with a relative or absolute threshold."""
    rel = threshold_mode == "rel"
    if mode == "min":
        return current < (best * (1 - threshold) if rel else best - threshold)
    return current > (best * (1 + threshold) if rel else best + threshold)


class _HostSchedulerState:
    """state_dict / load_state_dict of a host-side scheduler (a checkpoint's scheduler.json, as HF's scheduler.pt)."""

    last_lr: float  # the host's float64 rate, as torch's scheduler keeps it (set when the run starts)

    def state_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in vars(self).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class PlateauScheduler(_HostSchedulerState):
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
        return self.best is None or _improves(current, self.best, self.mode, self.threshold_mode, self.threshold)

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


@dataclass
class GreedyScheduler(_HostSchedulerState):
    """HF's GreedyLR (`lr_scheduler_type="greedy"`), stepped on the host once per evaluation: the rate is divided
    by `factor` after more than `patience` improving evaluations in a row and multiplied by it after more than
    `patience` non-improving ones (within [min_lr, max_lr]); `cooldown` / `warmup` evaluations pause the counting
    after a decrease / an increase; after `reset_start` decreases spent at min_lr everything restarts from the
    initial rate. `smooth` compares a rolling mean of the last `window_size` metrics. HF's defaults."""

    initial_lr: float
    mode: str = "min"
    factor: float = 0.95
    patience: int = 10
    threshold: float = 1e-6
    threshold_mode: str = "abs"
    cooldown: int = 0
    warmup: int = 0
    min_lr: float = 1e-3
    max_lr: float = 1.0
    eps: float = 1e-8
    verbose: bool = False
    smooth: bool = False
    window_size: int = 50
    reset_start: int = 500

    def __post_init__(self):
        if self.factor >= 1.0:
            raise ValueError("lr_scheduler_kwargs factor should be < 1.0 for the greedy scheduler.")
        if self.mode not in ("min", "max") or self.threshold_mode not in ("rel", "abs"):
            raise ValueError(
                f"greedy scheduler: mode {self.mode!r} / threshold_mode {self.threshold_mode!r} is unknown."
            )
        self._reset_start_original = self.reset_start
        self._window: list[float] = []
        self._clear()

    def _clear(self) -> None:
        self.best = float("inf") if self.mode == "min" else float("-inf")
        self.num_bad_epochs = self.num_good_epochs = self.cooldown_counter = self.warmup_counter = 0

    def _is_better(self, current: float) -> bool:
        return _improves(current, self.best, self.mode, self.threshold_mode, self.threshold)

    def step(self, metric: float, lr: float) -> float:
        """The new learning rate after an evaluation that measured `metric`."""
        current = float(metric)
        if self.smooth:
            self._window = (self._window + [current])[-self.window_size :]
            current = sum(self._window) / len(self._window)
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = self.num_good_epochs = 0
        elif self.warmup_counter > 0:
            self.warmup_counter -= 1
            self.num_bad_epochs = self.num_good_epochs = 0
        else:
            if self._is_better(current):
                self.best, self.num_bad_epochs = current, 0
                self.num_good_epochs += 1
            else:
                self.num_bad_epochs += 1
                self.num_good_epochs = 0
            if self.num_good_epochs > self.patience:
                raised = min(lr / self.factor, self.max_lr)
                lr = raised if raised - lr > self.eps else lr
                self.reset_start = self._reset_start_original
                self.warmup_counter, self.num_good_epochs = self.warmup, 0
            elif self.num_bad_epochs > self.patience:
                lowered = max(lr * self.factor, self.min_lr)
                lr = lowered if lr - lowered > self.eps else lr
                if lr <= self.min_lr:
                    self.reset_start -= 1
                    if self.reset_start <= 0:
                        lr, self.reset_start, self._window = self.initial_lr, self._reset_start_original, []
                        self._clear()
                self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        return lr


PER_EVALUATION = (SchedulerType.REDUCE_ON_PLATEAU.value, SchedulerType.GREEDY.value)


def per_evaluation_scheduler(args) -> PlateauScheduler | GreedyScheduler:
    """The host scheduler of a per-evaluation `lr_scheduler_type`, at the arguments' rate."""
    kwargs = args.lr_scheduler_kwargs or {}
    if SchedulerType(args.lr_scheduler_type) == SchedulerType.REDUCE_ON_PLATEAU:
        scheduler: PlateauScheduler | GreedyScheduler = PlateauScheduler(
            mode="max" if args.greater_is_better else "min", **kwargs
        )
    else:  # HF's GreedyLR: its own defaults (mode "min"), lr_scheduler_kwargs override them
        scheduler = GreedyScheduler(initial_lr=args.learning_rate, **kwargs)
    scheduler.last_lr = float(args.learning_rate)  # saved and restored with the scheduler's counters
    return scheduler


# The numbers of a schedule's shape switch (`schedule_switch`), which optimizer states saved before they existed
# lack: a restore fills them in as "no switch" (`no_schedule_switch`).
SCHEDULE_SWITCH = ("next_warmup_steps", "next_total_steps", "switch_count")


def schedule_switch(warmup_steps: float, total_steps: float, switch_count: float = 0) -> dict[str, float]:
    """The optimizer state's numbers of a schedule shape switch: updates from the `switch_count`-th on follow
    (warmup_steps, total_steps); the ones before keep the state's own shape. A resume whose arguments change the
    shape sets them (`schedules.LearningRate.resumed`): the first resumed update still applies the saved shape,
    as torch's scheduler steps after it."""
    return dict(
        next_warmup_steps=float(warmup_steps), next_total_steps=float(total_steps), switch_count=float(switch_count)
    )


def no_schedule_switch(hyperparams: dict) -> dict:
    """Hyperparameters saved before schedule switches existed, completed: the saved shape throughout."""
    missing = {name: None for name in SCHEDULE_SWITCH if name not in hyperparams}
    if not missing or "warmup_steps" not in hyperparams:
        return hyperparams
    warmup, total = hyperparams["warmup_steps"], hyperparams["total_steps"]
    # New buffers placed as the saved numbers are (the step donates each one of the state).
    added = dict(next_warmup_steps=warmup + 0, next_total_steps=total + 0, switch_count=warmup * 0)
    return {**hyperparams, **{name: added[name] for name in missing}}


def schedule_shape(hyperparams: dict, count):
    """(warmup, total) the update at `count` follows: the state's own shape before its switch, the switched one
    from it on (jnp or numpy values alike)."""
    switched = count >= hyperparams["switch_count"]
    warmup = jnp.where(switched, hyperparams["next_warmup_steps"], hyperparams["warmup_steps"])
    total = jnp.where(switched, hyperparams["next_total_steps"], hyperparams["total_steps"])
    return warmup, total


@dataclass(frozen=True)
class LearningRate:
    """A run's learning rate, built once by the Trainer from `lr_scheduler_type` (HF's create_scheduler), in the
    three forms that must agree:

    - `schedule`: HF's lr_scheduler, step -> rate, traced (what `Trainer.lr_scheduler` shows);
    - `multiplier()`: what the optimizer applies on the device from the numbers in its state (base rate, warmup
      and length, and a resume's switch to another shape: a hyperparameter search or a resume changes them
      without a recompile);
    - `host_rate(...)`: HF's float64 value of an update's rate from those same numbers, what the logs show.

    A value: what changes the rate at run time (a resume's new shape, a per-evaluation scheduler's step) lives
    in the optimizer state."""

    kind: str  # a SchedulerType value
    base_rate: float  # HF's float64 base rate of the arguments
    warmup_steps: int
    total_steps: int
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def from_args(cls, args, num_training_steps: int) -> LearningRate:
        """HF's create_scheduler: the schedule `lr_scheduler_type` names, over `num_training_steps` updates (HF's
        checks of `lr_scheduler_kwargs` raise here, before anything compiles)."""
        kind = SchedulerType(args.lr_scheduler_type).value
        schedule_multiplier(kind, args.learning_rate, args.lr_scheduler_kwargs)
        return cls(
            kind,
            float(args.learning_rate),
            args.get_warmup_steps(num_training_steps),
            num_training_steps,
            dict(args.lr_scheduler_kwargs or {}),
        )

    @functools.cached_property
    def schedule(self) -> Schedule:
        """HF's lr_scheduler as a traced function of the scheduler step (built once)."""
        return make_schedule(self.kind, self.base_rate, self.warmup_steps, self.total_steps, self.kwargs)

    def multiplier(self) -> Multiplier:
        return schedule_multiplier(self.kind, self.base_rate, self.kwargs)

    def host_rate(self, count, numbers: dict[str, float] | None = None) -> float:
        """The rate of the update that made the optimizer's count `count`, as HF logs it: its scheduler's Python
        float64 value (the device stepped with its float32 rounding), from the optimizer state's schedule
        `numbers` (host values of its hyperparameters; None: this schedule as built). The base rate is the
        arguments' float64 one where the state holds its float32 rounding, else the state's (a resume keeps the
        checkpoint's, as torch loads its scheduler)."""
        step = max(int(count) - 1, 0)
        if numbers is None:
            return host_learning_rate(self.kind, self.base_rate, step, self.warmup_steps, self.total_steps, self.kwargs)
        saved_base = float(numbers["base_learning_rate"])
        base = self.base_rate if np.float32(self.base_rate) == np.float32(saved_base) else saved_base
        warmup, total = _host_shape(numbers, step)
        return host_learning_rate(self.kind, base, step, warmup, total, self.kwargs)

    def resumed(self, opt_state):
        """A restored optimizer state under this run's schedule, as HF resumes: torch loads the saved scheduler
        state, so the base rate stays the checkpoint's, while the shape (warmup, length) is this run's from the
        update after the first resumed one (which applies the saved shape): the state's switch says so."""
        hyper = opt_states.find_hyperparams(opt_state)
        if hyper is None or "switch_count" not in hyper:
            return opt_state
        count = int(opt_states.schedule_count(opt_state))  # type: ignore[arg-type]  # inject_hyperparams' state
        numbers = {name: float(value) for name, value in hyper.items() if np.ndim(value) == 0}
        saved = _host_shape(numbers, count)
        if saved == (self.warmup_steps, self.total_steps):
            return opt_state
        # The update at `count` follows the saved shape; the ones after it this run's.
        for name, value in (("warmup_steps", saved[0]), ("total_steps", saved[1])):
            opt_state = opt_states.set_hyperparam(opt_state, name, value)
        for name, number in schedule_switch(self.warmup_steps, self.total_steps, count + 1).items():
            opt_state = opt_states.set_hyperparam(opt_state, name, number)
        return opt_state


def _host_shape(numbers: dict[str, float], count: int) -> tuple[int, int]:
    """(warmup, total) the update at `count` followed, from the optimizer state's schedule numbers (a state saved
    before shape switches existed has none: its own shape)."""
    if "switch_count" in numbers and count >= numbers["switch_count"]:
        return int(numbers["next_warmup_steps"]), int(numbers["next_total_steps"])
    return int(numbers["warmup_steps"]), int(numbers["total_steps"])


def plateau_step(scheduler: PlateauScheduler | GreedyScheduler, metric: float, opt_state):
    """A per-evaluation scheduler's step on the evaluated metric: the new rate goes into the optimizer state."""
    rate = scheduler.last_lr  # the host's float64 rate, as torch's scheduler keeps it
    new_rate = scheduler.last_lr = scheduler.step(metric, rate)
    if new_rate != rate:
        opt_state = opt_states.set_hyperparam(opt_state, "learning_rate", new_rate)
    return opt_state
