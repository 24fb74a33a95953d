"""A user's own functions and optimizers written for torch (HF's documented overrides are torch code): the bridge
runs them inside the compiled step, or says in one line why it cannot. What the Trainer asks about them, in one
place, so that the Trainer itself never imports torch or the bridge."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jtrainer import bridge
from jtrainer.bridge import user_optimizer

TranslatedOptimizer = user_optimizer.UserTorchOptimizer  # a user's torch optimizer and scheduler, run as optax


def runs_in_torch() -> bool:
    """Whether a user's function written in torch can run inside the step: the script has torch (it imported
    it) and torchax is installed."""
    return bridge.runs_torch_code()


def compute_loss_in_torch(compute_loss: Callable) -> Callable:
    """A Trainer's compute_loss written in torch, as a function of JAX values (torchax at its boundary)."""
    from jtrainer.bridge.torch_code import compute_loss_in_torch as in_torch

    return in_torch(compute_loss)


def function_in_torch(function: Callable) -> Callable:
    """preprocess_logits_for_metrics (or any array function) written in torch, as a function of JAX values."""
    from jtrainer.bridge.torch_code import function_in_torch as in_torch

    return in_torch(function)


def array_function_alternative(function: Callable | None) -> Callable | None:
    """The other way to run a user's array function inside the step (preprocess_logits_for_metrics, which HF's
    contract lets users write in torch): through torchax, where the script has torch; else None."""
    if function is None or not runs_in_torch():
        return None
    return function_in_torch(function)


def unlowered_op(error: Exception) -> str | None:
    """The torch op torchax could not lower that raised `error`, or None."""
    return bridge.unlowered_op(error)


def is_optimizer(value: Any) -> bool:
    """Whether `value` is a torch optimizer (never imports torch)."""
    return user_optimizer.is_torch_optimizer(value)


def is_optimizer_class(value: Any) -> bool:
    return user_optimizer.is_torch_optimizer_class(value)


def optimizer_for_step(optimizer: Any, scheduler: Any, model: Any) -> TranslatedOptimizer:
    """A user's torch optimizer (and scheduler) on a torch model, run as optax."""
    return user_optimizer.UserTorchOptimizer(optimizer, scheduler, model)


def call_on_host(function: Callable, predictions: Any, labels: Any, reason: Any, announce: Callable[[], None]) -> Any:
    """HF's call of a function JAX could not trace: torch tensors of the host arrays in, its result back as
    numpy (`reason`: why it could not run in the step, for the error when torch is missing; `announce` runs once
    torch is known to be there, before the call)."""
    try:
        import torch
    except ImportError:
        raise TypeError(
            f"preprocess_logits_for_metrics could not be traced by JAX ({reason!r}) and torch is not installed to "
            "call it with torch tensors as HF does: write it with jax.numpy (e.g. logits.argmax(axis=-1)) or "
            "install torch."
        ) from reason
    announce()

    def to_torch(tree):
        return jax.tree.map(lambda x: torch.from_numpy(np.array(x)), tree)  # a writable copy, as torch wants

    result = function(to_torch(predictions), None if labels is None else to_torch(labels))
    return jax.tree.map(lambda t: t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t), result)
