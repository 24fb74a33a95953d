"""The torch optimizer and scheduler a user hands the Trainer for a torch model: HF's `optimizers=(optimizer,
scheduler)`, or `optimizer_cls_and_kwargs` with a torch class.

Each parameter group's update rule runs in the compiled step as optax (the rule of its class, from
`numerics.torch_optimizers`, with the group's own hyperparameters); the rates come from the user's torch objects on
the host. The torch scheduler steps after each update, as under HF, so every scheduler (a LambdaLR's Python
function, SequentialLR, OneCycleLR, ReduceLROnPlateau on the evaluated metric, ...) gives torch's rates; they
enter the step's optimizer state as injected hyperparameters (no recompilation). `trainer.optimizer` and
`trainer.lr_scheduler` stay the torch objects HF scripts read (`param_groups[i]["lr"]`, `get_last_lr()`).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import optax

from jtrainer.numerics import opt_state as opt_states
from jtrainer.numerics import torch_optimizers as rules

NOT_OPTIMIZED = "not_optimized"  # parameters that require grad but are in no group: torch leaves them as they are


@dataclasses.dataclass(frozen=True)
class GroupRule:
    """How one parameter group updates: `build(**injected)` makes its optax transformation; `injected` names
    the group values a scheduler may change each step (read by `read`), `fixed` those it must not."""

    build: Callable[..., optax.GradientTransformation]
    injected: dict[str, Callable[[dict], float]]
    fixed: dict[str, Any]


def _lr(group: dict) -> float:
    return float(group["lr"])


def _b1(group: dict) -> float:
    return float(group["betas"][0])


def _fixed_value(group: dict, key: str) -> Any:
    value = float(group["betas"][1]) if key == "betas[1]" else group[key]
    return tuple(value) if isinstance(value, list) else value


def _refuse(name: str, group: dict, **unsupported: Any) -> None:
    for key, default in unsupported.items():
        if group.get(key, default) != default:
            raise ValueError(
                f"optimizers=({name}(..., {key}={group[key]!r}), ...): jtrainer does not reproduce torch's {name} "
                f"with {key}; use {key}={default!r} (or jtrainer's --optim)."
            )


def _adam_family(name: str, fn: Callable, group: dict, **extra: Any) -> GroupRule:
    b2, eps, wd = float(group["betas"][1]), float(group["eps"]), float(group["weight_decay"])
    return GroupRule(
        lambda learning_rate, b1: fn(learning_rate, b1, b2, eps, wd, **extra),
        {"learning_rate": _lr, "b1": _b1},
        {"betas[1]": b2, "eps": eps, "weight_decay": wd},
    )


def _sgd(group: dict) -> GroupRule:
    _refuse("SGD", group, maximize=False)
    fixed = {k: group[k] for k in ("momentum", "dampening", "nesterov", "weight_decay")}
    return GroupRule(
        lambda learning_rate: rules.torch_sgd(
            learning_rate,
            float(group["weight_decay"]),
            None,
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]),
        ),
        {"learning_rate": _lr},
        fixed,
    )


def _adam(group: dict) -> GroupRule:
    _refuse("Adam", group, amsgrad=False, maximize=False, decoupled_weight_decay=False)
    return _adam_family("Adam", rules.torch_adam, group)


def _adamw(group: dict) -> GroupRule:
    _refuse("AdamW", group, amsgrad=False, maximize=False)
    return _adam_family(
        "AdamW",
        lambda learning_rate, b1, b2, eps, wd: optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=wd),
        group,
    )


def _adamax(group: dict) -> GroupRule:
    _refuse("Adamax", group, maximize=False)
    return _adam_family("Adamax", rules.torch_adamax, group)


def _nadam(group: dict) -> GroupRule:
    _refuse("NAdam", group, maximize=False, decoupled_weight_decay=False)
    return _adam_family("NAdam", rules.torch_nadam, group, momentum_decay=float(group["momentum_decay"]))


def _radam(group: dict) -> GroupRule:
    _refuse("RAdam", group, maximize=False, decoupled_weight_decay=False)
    return _adam_family("RAdam", rules.torch_radam, group)


def _adagrad(group: dict) -> GroupRule:
    _refuse("Adagrad", group, maximize=False, initial_accumulator_value=0)
    wd, lr_decay, eps = float(group["weight_decay"]), float(group["lr_decay"]), float(group["eps"])
    return GroupRule(
        lambda learning_rate: rules.torch_adagrad(learning_rate, wd, None, lr_decay=lr_decay, eps=eps),
        {"learning_rate": _lr},
        {"weight_decay": wd, "lr_decay": lr_decay, "eps": eps},
    )


def _rmsprop(group: dict) -> GroupRule:
    _refuse("RMSprop", group, maximize=False)
    fixed = {k: group[k] for k in ("alpha", "eps", "weight_decay", "momentum", "centered")}
    return GroupRule(
        lambda learning_rate: rules.torch_rmsprop(
            learning_rate,
            float(group["weight_decay"]),
            None,
            alpha=float(group["alpha"]),
            eps=float(group["eps"]),
            momentum=float(group["momentum"]),
            centered=bool(group["centered"]),
        ),
        {"learning_rate": _lr},
        fixed,
    )


def _adafactor(group: dict) -> GroupRule:
    """transformers' Adafactor with an explicit rate (how HF's Trainer builds it): no relative step, no
    parameter scaling, no first moment."""
    _refuse("Adafactor", group, relative_step=False, scale_parameter=False, warmup_init=False, beta1=None)
    eps1, wd = float(group["eps"][0]), float(group["weight_decay"])
    clip, decay = float(group["clip_threshold"]), float(group["decay_rate"])
    return GroupRule(
        lambda learning_rate: rules.hf_adafactor(
            learning_rate, wd, None, eps1=eps1, clip_threshold=clip, decay_rate=decay
        ),
        {"learning_rate": _lr},
        {"eps": _fixed_value(group, "eps"), "weight_decay": wd, "clip_threshold": clip, "decay_rate": decay},
    )


# (module, class name) -> the group rule: exact classes only (a subclass may change the step).
RULES: dict[tuple[str, str], Callable[[dict], GroupRule]] = {
    ("torch.optim.sgd", "SGD"): _sgd,
    ("torch.optim.adam", "Adam"): _adam,
    ("torch.optim.adamw", "AdamW"): _adamw,
    ("torch.optim.adamax", "Adamax"): _adamax,
    ("torch.optim.nadam", "NAdam"): _nadam,
    ("torch.optim.radam", "RAdam"): _radam,
    ("torch.optim.adagrad", "Adagrad"): _adagrad,
    ("torch.optim.rmsprop", "RMSprop"): _rmsprop,
    ("transformers.optimization", "Adafactor"): _adafactor,
}
SUPPORTED = ", ".join(sorted(name for _, name in RULES))


def is_torch_optimizer(value: Any) -> bool:
    """Whether `value` is a torch optimizer (checked without importing torch: a script that built one did)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.optim.Optimizer)


def is_torch_optimizer_class(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, type) and issubclass(value, torch.optim.Optimizer)


def group_rule(optimizer: Any, group: dict) -> GroupRule:
    cls = type(optimizer)
    rule = RULES.get((cls.__module__, cls.__name__))
    if rule is None:
        raise ValueError(
            f"optimizers=({cls.__module__}.{cls.__name__}(...), ...): jtrainer runs a torch optimizer's update in "
            f"its compiled step and knows the rules of {SUPPORTED}; pass one of those, or use --optim / an optax "
            "GradientTransformation."
        )
    return rule(group)


class UserTorchOptimizer:
    """The user's torch optimizer (and scheduler) driving jtrainer's step: `transformation(params)` is the optax
    update of every group; `before_update` puts the groups' current rates into the optimizer state;
    `after_update` steps the torch scheduler, as HF does after each optimizer step."""

    def __init__(self, optimizer: Any, scheduler: Any, torch_model: Any):
        self.optimizer, self.scheduler = optimizer, scheduler
        ids = {id(p): name for name, p in torch_model.named_parameters()}
        self.group_of: dict[str, int] = {}
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in ids:
                    raise ValueError(
                        f"optimizers=({type(optimizer).__name__}(...), ...): parameter group {index} holds a tensor "
                        "that is not a parameter of the model (build the optimizer from model.parameters())."
                    )
                self.group_of[ids[id(p)]] = index
        self.rules = [group_rule(optimizer, group) for group in optimizer.param_groups]
        self.tx: optax.GradientTransformation | None = None  # `transformation(params)`, once the Trainer built it
        self.rates: dict[int, float] = {}  # the rate each update used (by update number), as HF logs it
        self._written: dict[str, float] | None = None

    # ---------------------------------------------------------------------------------------- the step's side
    def hyperparameters(self) -> dict[str, float]:
        """The injected values now, by name (`<name>_<group>`), and `learning_rate` (group 0's, what HF logs)."""
        values = {"learning_rate": _lr(self.optimizer.param_groups[0])}
        for index, (rule, group) in enumerate(zip(self.rules, self.optimizer.param_groups)):
            values.update({f"{name}_{index}": read(group) for name, read in rule.injected.items()})
        return values

    def transformation(self, params: Any) -> optax.GradientTransformation:
        """Every group's rule over `params` (a tree whose leaf paths are "params.<torch name>"), its rates
        injected; parameters in no group are left unchanged."""

        def label(path, _):
            name = jax.tree_util.keystr(path, simple=True, separator=".").removeprefix("params.")
            index = self.group_of.get(name)
            return NOT_OPTIMIZED if index is None else f"group_{index}"

        labels = jax.tree_util.tree_map_with_path(label, params)
        rules_by_group = self.rules

        def factory(**hyper):
            transforms = {
                f"group_{i}": rule.build(**{name: hyper[f"{name}_{i}"] for name in rule.injected})
                for i, rule in enumerate(rules_by_group)
            }
            transforms[NOT_OPTIMIZED] = optax.set_to_zero()
            return optax.multi_transform(transforms, labels)

        initial = self.hyperparameters()
        factory.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # inject_hyperparams reads it
            [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in initial]
        )
        self._written = dict(initial)
        return optax.inject_hyperparams(factory)(**initial)

    def before_update(self, opt_state):
        """The optimizer state with the groups' current rates (only those that changed are written)."""
        self._check_fixed()
        values = self.hyperparameters()
        for name, value in values.items():
            if self._written is None or self._written.get(name) != value:
                opt_state = opt_states.set_hyperparam(opt_state, name, value)
        self._written = values
        return opt_state

    def _check_fixed(self) -> None:
        for index, (rule, group) in enumerate(zip(self.rules, self.optimizer.param_groups)):
            for key, value in rule.fixed.items():
                now = _fixed_value(group, key)
                if now != value:
                    raise ValueError(
                        f"The scheduler changed {key} of parameter group {index} ({value} -> {now}): jtrainer "
                        "follows changes of the learning rate (and of Adam's beta1) only; keep the others fixed "
                        "(e.g. OneCycleLR(..., cycle_momentum=False) with SGD)."
                    )

    # ---------------------------------------------------------------------------------------- the host's side
    def after_update(self, update: int) -> None:
        """HF after an optimizer step: the rate just used is what it logs; then the scheduler steps (a
        ReduceLROnPlateau steps after evaluations instead)."""
        self.rates[update] = self.current_rate()
        if self.scheduler is not None and not self.per_evaluation:
            with warnings.catch_warnings():  # torch's optimizer.step() never runs: its order warning is moot
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
                self.scheduler.step()

    def current_rate(self) -> float:
        last = getattr(self.scheduler, "get_last_lr", None)
        if last is not None and not self.per_evaluation:
            return float(last()[0])
        return _lr(self.optimizer.param_groups[0])

    @property
    def per_evaluation(self) -> bool:
        import torch

        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def after_evaluation(self, metric: float) -> None:
        """HF's ReduceLROnPlateau step on the evaluated metric."""
        self.scheduler.step(metric)

    # ------------------------------------------------------------------------------------ checkpoint and resume
    def state_bytes(self) -> bytes:
        """What a checkpoint keeps of the torch objects (HF's optimizer.pt param groups and scheduler.pt): the
        groups' hyperparameters and the scheduler's state; the moments live in the train state."""
        import io

        import torch

        buffer = io.BytesIO()
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        scheduler = None if self.scheduler is None else self.scheduler.state_dict()
        torch.save({"param_groups": groups, "scheduler": scheduler}, buffer)
        return buffer.getvalue()

    def load_state_bytes(self, data: bytes) -> None:
        """A resume, as HF's: the groups' rates and hyperparameters and the scheduler's state come back."""
        import io

        import torch

        saved = torch.load(io.BytesIO(data), weights_only=True)
        for group, values in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update(values)
        if self.scheduler is not None and saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        self._written = None  # every injected value is written before the next update

    def logged_rate(self, update_count: int, device_rate) -> float:
        """The rate of the update that made the count `update_count`, as HF logged it."""
        return self.rates.get(update_count - 1, float(device_rate))
