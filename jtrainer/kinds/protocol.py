"""What the Trainer asks of the model it trains: one small interface, `TrainedModel`, with one implementation per
kind of model (jtrainer's own nnx models: `jtrainer.kinds.native`; transformers' torch models through the bridge:
`jtrainer.bridge.trained`). The Trainer holds the model once, as one of these, and never asks which kind it is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from flax import nnx

from jtrainer.checkpointing.hf_checkpoint import ModelLayout


class TrainedModel(Protocol):
    """A model under the Trainer: the object the user gave and the nnx module the compiled steps run."""

    # Read-only (covariant): each kind holds its own module type.
    @property
    def given(self) -> Any:
        """The model the user passed: HF's `trainer.model`, which holds the trained weights after train()."""

    @property
    def module(self) -> nnx.Module:
        """The nnx module the compiled steps run (`given` itself for a native model)."""

    @property
    def user_code_in_torch_first(self) -> bool:
        """Whether a user's compute_loss written in torch is tried before jax.numpy (HF's documented overrides
        for a torch model are torch code)."""

    @property
    def must_return_loss(self) -> bool:
        """Whether the model must return its own loss when the batch has labels (HF computes none for a torch
        model)."""

    @property
    def loss_ignores_padding(self) -> bool:
        """Whether the model's own loss leaves -100 labels out of its sums (HF's num_items_in_batch contract)."""

    @property
    def decodes_in_compiled_step(self) -> bool:
        """Whether predict_with_generate decodes in a compiled step on the mesh (else `generate_on_host`)."""

    @property
    def saves_trainable_part_only(self) -> bool:
        """Whether checkpoints keep only the trainable part (a peft model's adapters; the given model holds its
        frozen base)."""

    @property
    def inspected(self) -> Any:
        """The model whose class and forward HF inspects (labels, columns, loss kwargs): a peft model's base."""

    def finish_trainer_init(self, args: Any) -> None:
        """What HF's Trainer does to the model last in its constructor."""

    def set_neftune(self, alpha: float | None) -> None:
        """NEFTune noise on the input embeddings in training steps (None: off)."""

    def prepare_checkpointing(self, args: Any) -> None:
        """Activation checkpointing as `args` (and the model's own flag) ask, before the step is built."""

    def publish(self, source: Any) -> None:
        """After `module` took the trained weights of `source` (a train state and mode): the given model holds
        them too (nothing to do where `module` is the given model)."""

    def check_takes_translated_optimizer(self) -> None:
        """Raise one line where a user's torch optimizer cannot update this model's parameters."""

    def decay_path(self, name: str) -> str:
        """A name of `decay_parameter_names` as the path of its parameter in `module`'s parameters."""

    def trainable_named_parameters(self) -> list[tuple[str, Any]]:
        """HF's named trainable parameters, as the given model holds them (torch parameters, nnx variables)."""

    def num_non_embedding_parameters(self) -> int:
        """The parameter count HF's floating_point_ops uses (0 where the model cannot tell), counted once per model:
        floating_point_ops asks for it every micro-batch."""

    def exports_from_train_state(self) -> bool:
        """Whether a checkpoint's HF weights can be read off the saved train state (jtrainer's HF layout)."""

    def hf_tensors(self, keep: bool) -> dict[str, np.ndarray] | None:
        """The weights as HF-named host arrays (gathered; kept only where `keep`), or None where the given model
        writes itself (save_pretrained)."""

    def checkpoint_layout(self) -> ModelLayout:
        """How a transformers.Trainer checkpoint's torch names meet this model."""

    def generate_on_host(
        self,
        inputs: dict[str, np.ndarray],
        generation_config: Any,
        gen_kwargs: dict[str, Any],
        sync: Callable[[], None],
    ) -> np.ndarray:
        """Generated ids where decoding runs outside the compiled step (`decodes_in_compiled_step` False); `sync`
        hands the given model the trained weights, once the decoding is known to be possible."""

    def metric_arrays(self, tree: Any) -> Any:
        """Host arrays as HF hands them to this model's metric functions (torch tensors for a torch model)."""


class ModelKind(Protocol):
    """A kind of model: how it holds one, and HF's rules that read the model alone."""

    @staticmethod
    def adopt(model: Any) -> TrainedModel: ...

    @staticmethod
    def decay_parameter_names(model: Any) -> list[str]:
        """transformers.Trainer.get_decay_parameter_names of `model`."""
