"""The kinds of model a Trainer trains, each in its own room behind one protocol (`protocol.TrainedModel`):
jtrainer's own nnx models (`native.NativeModel`) and transformers' torch models through the bridge
(`jtrainer.bridge.trained.BridgedModel`). `adopt` is the one place that tells them apart; a new kind of model adds
a room and a line to `kind_of`, not branches in the Trainer."""

from __future__ import annotations

from typing import Any

import jax

from jtrainer import bridge
from jtrainer.kinds.native import NativeModel, dotted
from jtrainer.kinds.protocol import ModelKind, TrainedModel


def kind_of(model: Any) -> type[ModelKind]:
    """The kind of `model`: a torch module is the bridge's (checked without importing torch; the bridge's room is
    imported only then), anything else native (any nnx module)."""
    if bridge.is_torch_module(model):
        from jtrainer.bridge.trained import BridgedModel

        return BridgedModel
    return NativeModel


def adopt(model: Any) -> TrainedModel:
    """`model` held for the Trainer, as its kind holds it."""
    return kind_of(model).adopt(model)


def decay_parameter_names(model: Any) -> list[str]:
    """transformers.Trainer.get_decay_parameter_names of any model the Trainer could hold."""
    return kind_of(model).decay_parameter_names(model)


def decay_mask(held: TrainedModel, params: Any, decayed_names: list[str]) -> Any:
    """The optimizer's weight-decay mask over the step's parameters (a pure dict): True where HF decays (the
    names `decay_parameter_names` gives, as the held model's kind maps them onto the step's paths)."""
    decayed = {held.decay_path(name) for name in decayed_names}
    return jax.tree_util.tree_map_with_path(lambda path, _: dotted(path) in decayed, params)


__all__ = ["ModelKind", "NativeModel", "TrainedModel", "adopt", "decay_mask", "decay_parameter_names", "kind_of"]
