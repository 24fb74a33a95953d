"""jtrainer's own flax.nnx models under the Trainer (`TrainedModel`): the model given is the module the step runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jtrainer.checkpointing import hf_checkpoint
from jtrainer.models.base import PretrainedMixin, count_parameters
from jtrainer.models.base import set_neftune as set_embedding_neftune
from jtrainer.models.layers import LayerNorm
from jtrainer.numerics import optim

# The modules HF excludes from weight decay by type (its ALL_LAYERNORM_LAYERS is [torch.nn.LayerNorm]): flax's
# LayerNorm and jtrainer's port of torch's. RMSNorms are matched by name only, as in HF.
LAYER_NORM_TYPES = (nnx.LayerNorm, LayerNorm)


def dotted(path: tuple) -> str:
    """A pytree path as HF's dotted parameter name."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


class NativeModel:
    """An nnx model (jtrainer's families, or any nnx module returning HF's outputs)."""

    user_code_in_torch_first = False  # a native model's user writes jax.numpy first
    must_return_loss = False  # without a loss of its own, the Trainer's loss on the logits (HF's rule)
    decodes_in_compiled_step = True
    saves_trainable_part_only = False

    def __init__(self, model: Any):
        self.given = self.module = model
        # jtrainer's models leave -100 labels out of their sums; another nnx module is not known to
        self.loss_ignores_padding = isinstance(model, PretrainedMixin)
        self._non_embedding_count: int | None = None

    @staticmethod
    def adopt(model: Any) -> NativeModel:
        return NativeModel(model)

    @staticmethod
    def decay_parameter_names(model: Any) -> list[str]:
        """HF's rule: every parameter but those of LayerNorm modules (by type) and those whose names match HF's
        bias/norm patterns."""
        layer_norms = {
            ".".join(map(str, path)) for path, node in nnx.iter_graph(model) if isinstance(node, LAYER_NORM_TYPES)
        }
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        paths = {dotted(p): None for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
        return [p for p, decays in optim.decay_mask(paths, layer_norms).items() if decays]

    @property
    def inspected(self) -> Any:
        return self.given

    def finish_trainer_init(self, args: Any) -> None:
        pass

    def set_neftune(self, alpha: float | None) -> None:
        set_embedding_neftune(self.module, alpha)

    def prepare_checkpointing(self, args: Any) -> None:
        if args.activation_checkpointing and hasattr(self.given, "gradient_checkpointing_enable"):
            self.given.gradient_checkpointing_enable(args.activation_checkpointing_kwargs)

    def publish(self, source: Any) -> None:
        pass  # the module the step's weights went into is the model given

    def check_takes_translated_optimizer(self) -> None:
        raise TypeError(
            f"A torch optimizer updates a torch model's parameters, and {type(self.given).__name__} is a native "
            "jtrainer model: pass an optax GradientTransformation (optimizers=(tx, None)) or use --optim."
        )

    def decay_path(self, name: str) -> str:
        return name

    def trainable_named_parameters(self) -> list[tuple[str, Any]]:
        return [(dotted(path), node) for path, node in nnx.iter_graph(self.given) if type(node) is nnx.Param]

    def num_non_embedding_parameters(self) -> int:
        if self._non_embedding_count is None:
            self._non_embedding_count = count_parameters(self.module, exclude_embeddings=True)
        return self._non_embedding_count

    def exports_from_train_state(self) -> bool:
        return hasattr(self.given, "config")  # an HF config: jtrainer's HF names and layouts (hf_io)

    def hf_tensors(self, keep: bool) -> dict[str, np.ndarray] | None:
        if getattr(self.given, "save_pretrained", None) is not None and not hasattr(self.given, "config"):
            return None  # a model of the user's own that saves itself
        from jtrainer.models import hf_io

        return hf_io.to_hf_state_dict(self.given, keep=keep)

    def checkpoint_layout(self) -> hf_checkpoint.NativeLayout:
        return hf_checkpoint.NativeLayout(self.given)

    def generate_on_host(
        self,
        inputs: dict[str, np.ndarray],
        generation_config: Any,
        gen_kwargs: dict[str, Any],
        sync: Callable[[], None],
    ) -> np.ndarray:
        raise NotImplementedError("a native model decodes in the compiled step (jtrainer.models.generation.generate)")

    def metric_arrays(self, tree: Any) -> Any:
        return tree
