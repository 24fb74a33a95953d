"""What TRL's SFT and DPO trainers share on jtrainer: the model they are given (a path, a model, a peft config),
and TRL's logged statistics, which the loss records in the compiled step and `log` averages as TRL does."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import numpy as np

from jtrainer import bridge
from jtrainer.core.errors import BadInput
from jtrainer.parallel import distributed
from jtrainer.trl.collators import real_tokens


def check_train_dataset(train_dataset: Any) -> None:
    """TRL's: a train dataset is required, a `datasets` Dataset or IterableDataset."""
    import datasets

    if train_dataset is None:
        raise ValueError("`train_dataset` is required")
    if not isinstance(train_dataset, (datasets.Dataset, datasets.IterableDataset)):
        raise TypeError(
            f"`train_dataset` must be a `Dataset` or `IterableDataset`, got `{type(train_dataset).__name__}`."
        )


def load_model(name_or_path: str, args: Any, needs_torch: bool, quantization_config: Any = None):
    """TRL's `create_model_from_path`: jtrainer's native model where the family has one, transformers' own torch
    model (the bridge) otherwise or where peft needs it."""
    if quantization_config is not None or (args.model_init_kwargs or {}).get("quantization_config") is not None:
        raise BadInput(
            "quantization_config: jtrainer.trl trains full-precision or bf16 weights (no bitsandbytes quantization); "
            "leave quantization_config out."
        )
    kwargs = dict(args.model_init_kwargs or {})
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if needs_torch:
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    from jtrainer.models import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)


def apply_peft(model: Any, peft_config: Any, trainer_name: str):
    """TRL's `get_peft_model(model, peft_config)`, on transformers' torch model (the bridge's)."""
    if peft_config is None:
        return model
    import peft

    if not bridge.is_torch_module(model):
        raise BadInput(
            f"{trainer_name}(peft_config=...): peft adapts transformers' torch models; load the model with "
            "transformers.AutoModelForCausalLM (or pass its path) to train an adapter through the bridge."
        )
    if not isinstance(peft_config, peft.PeftConfig):
        raise TypeError(
            f"`peft_config` must be a `peft.PeftConfig` instance (e.g. `peft.LoraConfig`), got "
            f"{type(peft_config).__name__}."
        )
    if isinstance(model, peft.PeftModel):
        raise ValueError(
            "You passed a `PeftModel` instance together with a `peft_config` to the trainer. Please first merge and "
            "unload the existing adapter, save the resulting base model, and then pass that base model along with "
            "the new `peft_config` to the trainer."
        )
    return peft.get_peft_model(model, peft_config)


def tokenizer_of(model: Any, processing_class: Any, args: Any, trainer_name: str):
    """TRL's processing class: the one given, else the model folder's (AutoProcessor); text models only."""
    import transformers
    from trl.trainer.utils import get_config_model_id

    if processing_class is None:
        processing_class = transformers.AutoProcessor.from_pretrained(
            get_config_model_id(model.config), trust_remote_code=args.trust_remote_code
        )
    if not isinstance(processing_class, transformers.PreTrainedTokenizerBase):
        raise BadInput(
            f"processing_class: {type(processing_class).__name__} is not a tokenizer; jtrainer.trl's {trainer_name} "
            "trains text models (pass the tokenizer)."
        )
    return processing_class


def set_pad_token(tokenizer: Any, model: Any, args: Any) -> int:
    """TRL's pad token (the config's, the tokenizer's, else its eos token), told to the model; returns its id."""
    pad_token = args.pad_token or tokenizer.pad_token or tokenizer.eos_token
    if pad_token not in tokenizer.get_vocab():
        raise ValueError(
            f"The specified `pad_token` ('{pad_token}') is not found in the vocabulary of the given "
            f"`processing_class` ({type(tokenizer).__name__}). Ensure that the `pad_token` exists in the "
            "vocabulary before using it as a padding token."
        )
    tokenizer.pad_token = pad_token
    text_config(model).pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return tokenizer.pad_token_id


def text_config(model: Any):
    """The model's (text) config, where TRL writes the tokens it sets."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def router_aux_coefficient(model: Any, args: Any, sync_config: bool = False) -> float:
    """TRL's MoE load-balancing loss weight: the config's router_aux_loss_coef, else the architecture's own (0 when
    the model returns no router logits). 0.0: no auxiliary loss. `sync_config` (SFT): the model's config follows
    it, as TRL's SFTTrainer sets it."""
    config = text_config(model)
    coef = args.router_aux_loss_coef
    weight = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if coef and not hasattr(config, "output_router_logits"):
        raise ValueError(
            f"`router_aux_loss_coef` is set to {coef} but {type(model).__name__} is not a Mixture-of-Experts model "
            "that returns its router logits, so there is no auxiliary loss to weight."
        )
    enabled = hasattr(config, "output_router_logits") and weight != 0.0
    if sync_config and hasattr(config, "router_aux_loss_coef"):
        config.output_router_logits = enabled
        config.router_aux_loss_coef = weight
    return float(weight) if enabled else 0.0


def refuse_lm_head_adapter(model: Any) -> None:
    """TRL's refusal: the log-probabilities read lm_head's weight directly, so an adapter there never trains."""
    if not is_peft_model(model):
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(model.get_output_embeddings(), BaseTunerLayer):
        raise ValueError(
            "Applying a PEFT adapter to `lm_head` is not supported: the log-probabilities are computed from "
            "`lm_head.weight` directly, so the adapter would never be trained. Remove `'lm_head'` from your "
            "`target_modules`."
        )


def refuse_images(sample: dict) -> None:
    if "image" in sample or "images" in sample:
        raise BadInput("train_dataset: images are not supported by jtrainer.trl (text models only).")


def is_peft_model(model: Any) -> bool:
    try:
        import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


class LoggedStatistics:
    """TRL's `_metrics`: per mode, the values each compute_loss call appended; `log` averages and clears them.

    The step records its values on the device (`step_metrics.record`, one per micro-batch); they are read here
    only when a log needs them, so training never waits for them."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._pending: dict[str, list[tuple[dict[str, Any], int]]] = {"train": [], "eval": []}
        self.mode = "train"

    def add(self, recorded: dict[str, Any], micro_batches: int, training: bool) -> None:
        self._pending["train" if training else "eval"].append((recorded, micro_batches))

    def take(self, mode: str) -> list[dict[str, np.ndarray]]:
        """The recorded values since the last call, one dict per compute_loss call (micro-batch), in order."""
        import jax

        pending, self._pending[mode] = self._pending[mode], []
        calls = []
        for recorded, count in jax.device_get(pending):
            for i in range(count):
                calls.append({name: np.asarray(v).reshape(-1)[i] if np.ndim(v) else v for name, v in recorded.items()})
        return calls

    @contextlib.contextmanager
    def evaluating(self):
        """TRL reads the mode from model.training: evaluation's logs take the eval values."""
        previous, self.mode = self.mode, "eval"
        try:
            yield
        finally:
            self.mode = previous

    def averaged(self, mode: str) -> dict[str, float]:
        metrics = {key: sum(values) / len(values) for key, values in self.values[mode].items()}
        self.values[mode].clear()
        return metrics


class StatisticsLogging:
    """TRL's trainers' logging on a jtrainer Trainer: what the loss records (per compute_loss call) averaged into
    each log, `num_tokens` the running count of non-padding training tokens, eval values prefixed eval_."""

    # TRL's order of its metrics in a log (its _metrics dict's insertion order); num_tokens is placed by TRL's code.
    metric_order: tuple[str, ...] = ()
    num_tokens_after: str | None = None  # the metric num_tokens follows (None: last)

    def _init_statistics(self) -> None:
        self._statistics = LoggedStatistics()
        self._total_train_tokens = 0  # this process's rows' tokens (summed over processes when logged)

    def _on_recorded(self, recorded: dict[str, Any], micro_batches: int, training: bool) -> None:
        self._statistics.add(recorded, micro_batches, training)

    def _track_num_input_tokens(self, batch) -> None:
        super()._track_num_input_tokens(batch)  # type: ignore[misc]
        self._total_train_tokens += real_tokens(batch)

    def _evaluate_with_statistics(self, evaluate, *args, **kwargs):
        with self._statistics.evaluating():
            return evaluate(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        statistics = self._statistics
        mode = statistics.mode
        values = statistics.values[mode]
        calls = statistics.take(mode)
        for call in calls:
            for name in sorted(call, key=lambda n: self.metric_order.index(n) if n in self.metric_order else 99):
                values[name].append(float(call[name]))
        if calls:  # (each process counted its own rows; every process logs at the same points)
            values["num_tokens"] = [distributed.agree_sum(self._total_train_tokens)]
            if self.num_tokens_after is not None:  # TRL's insertion order
                order = list(values)
                order.remove("num_tokens")
                order.insert(order.index(self.num_tokens_after) + 1, "num_tokens")
                statistics.values[mode] = values = defaultdict(list, {name: values[name] for name in order})
        metrics = statistics.averaged(mode)
        if mode == "eval":
            metrics = {f"eval_{key}": val for key, val in metrics.items()}
        logs.update(metrics)
        super().log(logs, start_time)  # type: ignore[misc]
