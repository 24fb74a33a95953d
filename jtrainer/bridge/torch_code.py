"""A user's torch-written function (a `compute_loss` override, `preprocess_logits_for_metrics`) inside the
compiled step: its arrays handed over as torchax tensors, its results taken back as JAX values."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import torch

from jtrainer.bridge import custom_autograd, torchax_compat
from jtrainer.bridge.module import TorchModel, outputs_to_jax
from jtrainer.models.outputs import Outputs


def _to_torch(env, value):
    if isinstance(value, jax.Array):
        return env.j2t_iso(value)
    if isinstance(value, dict) or hasattr(value, "items"):
        return Outputs({k: _to_torch(env, v) for k, v in value.items() if v is not None})
    if isinstance(value, (tuple, list)):
        return type(value)(_to_torch(env, v) for v in value)
    return value


class TorchFacing:
    """A native (nnx) model as torch code sees it: called with torch tensors, it answers torch tensors (outputs
    readable as HF's ModelOutput), `model.device` is where torch code puts new tensors, and the rest is the
    model's own."""

    def __init__(self, model):
        self._model = model

    @property
    def device(self) -> torch.device:
        return torchax_compat.DEVICE

    def __call__(self, *args, **kwargs):
        env = torchax_compat.environment()
        args, kwargs = env.t2j_iso((args, kwargs))
        return _to_torch(env, self._model(*args, **kwargs))

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def compute_loss_in_torch(compute_loss: Callable) -> Callable:
    """HF's `compute_loss(model, inputs, return_outputs, num_items_in_batch)` written in torch, callable on JAX
    values inside a trace: inputs and the item count as torchax tensors, `model` answering torch tensors; the
    loss (and outputs) come back as JAX values."""

    @functools.wraps(compute_loss)
    def call(model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        env = torchax_compat.environment()
        with env, custom_autograd.own_backward():
            facing = model if isinstance(model, TorchModel) else TorchFacing(model)
            result = compute_loss(
                facing,
                _to_torch(env, dict(inputs)),
                return_outputs=return_outputs,
                num_items_in_batch=_to_torch(env, num_items_in_batch),
            )
        return outputs_to_jax(env, result)

    return call


def function_in_torch(function: Callable) -> Callable:
    """A function of arrays written in torch (`preprocess_logits_for_metrics(logits, labels)`), callable on JAX
    values inside a trace."""

    @functools.wraps(function)
    def call(*args):
        env = torchax_compat.environment()
        with env, custom_autograd.own_backward():
            result = function(*_to_torch(env, args))
        return outputs_to_jax(env, result)

    return call
