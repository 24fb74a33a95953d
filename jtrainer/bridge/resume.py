"""Resuming a transformers.Trainer `checkpoint-N` for a torch model trained through the bridge (a peft model
included): the names and layouts `jtrainer.checkpointing.hf_checkpoint.restore` needs, read off the torch
model itself."""

from __future__ import annotations

import logging
import os

import numpy as np
import transformers

from jtrainer.bridge import adapters


def _torch_name(tree_path) -> str:
    """A train-state parameter's torch name: its path under the bridge's `params` root."""
    return ".".join(str(getattr(k, "key", k)) for k in tree_path[1:])


class TorchModelLayout:
    """`hf_checkpoint.ModelLayout` of a `bridge.module.TorchModel`: parameters are the torch model's trainable
    ones, by name, in torch's layout; optimizer.pt's order is transformers.Trainer's (decayed first, each group in
    `named_parameters` order) on the torch model given."""

    def __init__(self, model):
        self.model = model  # the TorchModel

    def parameter_order(self, torch, folder):
        torch_model = self.model.torch_model
        decayed = set(transformers.Trainer.get_decay_parameter_names(None, torch_model))  # type: ignore[arg-type]  # no self read
        named = [(n, tuple(p.shape)) for n, p in torch_model.named_parameters() if p.requires_grad]
        order = [n for n, _ in named if n in decayed] + [n for n, _ in named if n not in decayed]
        return order, dict(named), frozenset(n for n, _ in named if n in decayed)

    def torch_names(self, tree_path):
        return [_torch_name(tree_path)]

    def moment(self, tree_path, moments):
        return np.asarray(moments[_torch_name(tree_path)])

    def decayed(self, decay_mask):
        import jax

        return frozenset(_torch_name(p) for p, decays in jax.tree_util.tree_flatten_with_path(decay_mask)[0] if decays)

    def load_weights(self, folder, mesh, rules):
        """As transformers.Trainer's _load_from_checkpoint: a peft model loads its saved adapter (trainable), any
        other model the saved weights; the bridge's arrays then take them from the torch model."""
        torch_model = self.model.torch_model
        if adapters.is_peft_model(torch_model):
            torch_model.load_adapter(folder, torch_model.active_adapters[0], is_trainable=True)
        elif os.path.isfile(single := os.path.join(folder, "model.safetensors")):
            import safetensors.torch

            _warn_after_load(
                torch_model, torch_model.load_state_dict(safetensors.torch.load_file(single), strict=False)
            )
        else:
            from transformers.trainer_utils import load_sharded_checkpoint

            _warn_after_load(torch_model, load_sharded_checkpoint(torch_model, folder, strict=False))
        self.model.read_from_torch()


def _warn_after_load(model, load_result) -> None:
    """transformers.Trainer's `_issue_warnings_after_load`: missing keys (unless they are the model's
    `_keys_to_ignore_on_save`, then its weights are tied again) and unexpected keys, in its words."""
    logger = logging.getLogger("transformers.trainer")
    if load_result.missing_keys:
        ignored = getattr(model, "_keys_to_ignore_on_save", None)
        if ignored and set(load_result.missing_keys) == set(ignored):
            model.tie_weights()
        else:
            logger.warning(f"There were missing keys in the checkpoint model loaded: {load_result.missing_keys}.")
    if load_result.unexpected_keys:
        logger.warning(f"There were unexpected keys in the checkpoint model loaded: {load_result.unexpected_keys}.")
