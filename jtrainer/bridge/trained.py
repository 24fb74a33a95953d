"""A torch model under the Trainer (`jtrainer.kinds.protocol.TrainedModel`): transformers' model (or a peft model
around one) is the model given, its `module.TorchModel` the module the step runs; the given model is written back
whenever the Trainer hands it the trained weights."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jtrainer import bridge
from jtrainer.bridge import adapters
from jtrainer.bridge.module import TorchModel, checkpointing_enabled

if TYPE_CHECKING:
    from jtrainer.bridge.resume import TorchModelLayout

logger = logging.getLogger(__name__)
_TOLD_WHERE_GENERATION_RUNS: weakref.WeakSet = weakref.WeakSet()  # torch models whose user was told, once each


class BridgedModel:
    """A torch `nn.Module` trained through torchax."""

    user_code_in_torch_first = True  # HF's documented overrides for a torch model are torch code
    must_return_loss = True  # HF computes no loss of its own for a torch model
    loss_ignores_padding = True  # transformers' losses leave -100 labels out of their sums
    decodes_in_compiled_step = False  # transformers' generate, in torch on the host

    def __init__(self, model: Any, module: TorchModel):
        self.given = model
        self.module = module
        self.saves_trainable_part_only = adapters.is_peft_model(model)
        self._published: Any = None  # the (train state, mode) whose weights the torch model holds
        self._non_embedding_count: int | None = None

    @staticmethod
    def adopt(model: Any) -> BridgedModel:
        return BridgedModel(model, bridge.as_nnx(model))

    @staticmethod
    def decay_parameter_names(model: Any) -> list[str]:
        return bridge.decay_parameter_names(model)

    @property
    def inspected(self) -> Any:
        return adapters.inspected(self.given)

    def finish_trainer_init(self, args: Any) -> None:
        if getattr(self.given, "config", None) is not None:
            self.given.config.use_cache = args.use_cache  # as transformers.Trainer does last in its constructor

    def set_neftune(self, alpha: float | None) -> None:
        self.module.set_neftune(alpha)  # transformers' own forward hook, its noise from the step's key

    def prepare_checkpointing(self, args: Any) -> None:
        """transformers' flag, set by `args` or by the script: each checkpointed layer rematerialised."""
        if args.activation_checkpointing:
            self.module.gradient_checkpointing_enable(args.activation_checkpointing_kwargs)
        self.module.gradient_checkpointing = checkpointing_enabled(self.module.torch_model)

    def publish(self, source: Any) -> None:
        """The torch model takes the module's weights, once per (train state, mode) it is handed."""
        held = self._published
        if held is not None and held[0] is source[0] and held[1] == source[1]:
            return
        self.module.write_to_torch()
        self._published = source

    def check_takes_translated_optimizer(self) -> None:
        pass  # its parameters are torch's: HF's groups, translated for the step (bridge.user_optimizer)

    def decay_path(self, name: str) -> str:
        return f"params.{name}"  # HF's names, under the bridge's "params" root

    def trainable_named_parameters(self) -> list[tuple[str, Any]]:
        return [(n, p) for n, p in self.given.named_parameters() if p.requires_grad]

    def num_non_embedding_parameters(self) -> int:
        """transformers' own count; HF's 0 for a model without one."""
        if self._non_embedding_count is None:
            counts = hasattr(self.given, "num_parameters")
            self._non_embedding_count = self.given.num_parameters(exclude_embeddings=True) if counts else 0
        return self._non_embedding_count

    def exports_from_train_state(self) -> bool:
        return False  # the torch model, holding the weights, writes itself

    def hf_tensors(self, keep: bool) -> dict[str, np.ndarray] | None:
        return None

    def checkpoint_layout(self) -> TorchModelLayout:
        from jtrainer.bridge.resume import TorchModelLayout

        return TorchModelLayout(self.module)

    def generate_on_host(
        self,
        inputs: dict[str, np.ndarray],
        generation_config: Any,
        gen_kwargs: dict[str, Any],
        sync: Callable[[], None],
    ) -> np.ndarray:
        """transformers' own `generate` (HF's Seq2SeqTrainer.prediction_step call) on the torch model holding the
        trained weights, on the host's CPU, one process (see docs/bridge.md for its speed)."""
        import torch

        if jax.process_count() > 1:
            raise NotImplementedError(
                "predict_with_generate on a torch model runs transformers' generate on one host; with "
                f"{jax.process_count()} processes, evaluate without it or save the model and generate afterwards."
            )
        if self.given not in _TOLD_WHERE_GENERATION_RUNS:
            _TOLD_WHERE_GENERATION_RUNS.add(self.given)
            logger.warning(
                f"predict_with_generate: {type(self.given).__name__} is a torch model, so transformers' generate "
                "decodes it in torch on this host's CPU, one process (jtrainer.models' families decode in a "
                "compiled step on the mesh)."
            )
        sync()
        self.given.eval()  # HF's evaluation_loop calls model.eval(): no dropout while generating
        with torch.no_grad():
            ids = self.given.generate(
                **{k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()},
                generation_config=generation_config,
                **gen_kwargs,
            )
        return ids.numpy()

    def metric_arrays(self, tree: Any) -> Any:
        return bridge.as_torch_tensors(tree)
