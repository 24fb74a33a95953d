"""TRL's SFTTrainer on jtrainer: TRL's dataset preparation, jtrainer's compiled step.

What runs where (docs/trl.md): TRL's own `_prepare_dataset` (chat templates, prompt/completion and assistant masks,
truncation, `pack_dataset`) builds the dataset, so its rows are TRL's by construction; the collator makes TRL's
batches as fixed-shape numpy rows (`collators.LanguageModelingCollator`); the loss, entropy and token accuracy are
computed from the logits inside jtrainer's compiled step (`losses`), whose gradients train the model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, ClassVar

import transformers
from trl.chat_template_utils import (
    clone_chat_template,
    get_training_chat_template,
    has_generation_markers,
    is_chat_template_stop_token_trained,
)
from trl.data_utils import get_dataset_column_names, is_conversational
from trl.trainer import sft_trainer as trl_sft
from trl.trainer.utils import get_config_model_id

from jtrainer import bridge
from jtrainer.core.errors import BadInput
from jtrainer.numerics import step_metrics
from jtrainer.numerics.step import split_outputs, window_micro_batches
from jtrainer.trainer.trainer import Trainer
from jtrainer.trl import losses
from jtrainer.trl.collators import LanguageModelingCollator
from jtrainer.trl.common import (
    StatisticsLogging,
    apply_peft,
    check_train_dataset,
    load_model,
    refuse_images,
    refuse_lm_head_adapter,
    router_aux_coefficient,
    set_pad_token,
    text_config,
    tokenizer_of,
)
from jtrainer.trl.config import SFTConfig, padding_multiple

logger = transformers.utils.logging.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class SFTLossFunction:
    """TRL's SFT loss as a compute_loss (HF's signature), run inside the compiled step: -sum(log p(label)) /
    num_items_in_batch (DFT: each term weighted by its probability), recording TRL's entropy and
    mean_token_accuracy. `bridged`: the model is transformers' torch model; `router_aux_coef`: TRL's weight of an
    MoE model's load-balancing loss (0: none)."""

    loss_type: str
    bridged: bool = False
    router_aux_coef: float = 0.0
    written_in_jax: ClassVar[bool] = True

    def __call__(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        if self.bridged:
            inputs.pop("segment_ids", None)  # transformers' models find documents from position_ids
            inputs["use_cache"] = False  # as TRL: with a cache, packed documents would attend to each other
        if self.router_aux_coef:
            inputs["output_router_logits"] = True
        outputs = model(**inputs)
        _, logits = split_outputs(outputs)
        stats = losses.next_token_stats(logits, labels)
        loss = losses.sft_loss(stats, num_items_in_batch, self.loss_type)
        if self.router_aux_coef:
            # TRL: a per-micro-batch mean, averaged over the window when the loss is normalised by num_items.
            steps = window_micro_batches() if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_coef * outputs.aux_loss / steps
            step_metrics.record("aux_loss", outputs.aux_loss)
        step_metrics.record("entropy", losses.mean_over_tokens(stats.entropy, stats))
        step_metrics.record("mean_token_accuracy", losses.mean_over_tokens(stats.is_top1, stats))
        return (loss, outputs) if return_outputs else loss


class SFTLoss:
    """TRL's SFT loss as a Trainer's compute_loss (`SFTLossFunction`; `_bridged`: the model is transformers'
    torch model, set by the Trainer)."""

    _bridged: bool = False
    _router_aux_coef: float = 0.0  # MoE models: TRL's weight of the load-balancing loss (0: none)
    args: Any

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """TRL's SFT loss in the compiled step (`SFTLossFunction`)."""
        loss = SFTLossFunction(self.args.loss_type, self._bridged, self._router_aux_coef)
        return loss(model, inputs, return_outputs, num_items_in_batch)

    compute_loss.written_in_jax = True  # type: ignore[attr-defined]


class SFTTrainer(StatisticsLogging, SFTLoss, Trainer):
    """TRL's `SFTTrainer(model, args, data_collator, train_dataset, eval_dataset, processing_class, ...)`, trained
    by jtrainer's compiled step."""

    _tag_names = ["trl", "sft"]
    _name = "SFT"
    metric_order = ("entropy", "mean_token_accuracy", "aux_loss")
    num_tokens_after = "mean_token_accuracy"

    def __init__(
        self,
        model: Any,
        args: SFTConfig | transformers.TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        optimizer_cls_and_kwargs: tuple | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        formatting_func: Callable[[dict], str] | None = None,
    ):
        args = _sft_config(model, args)
        _check_arguments(args, train_dataset, compute_loss_func)
        transformers.set_seed(args.seed)  # TRL: peft draws its adapter weights after this
        model = self._model_and_tokenizer(model, args, processing_class, quantization_config, peft_config)
        processing_class = self._tokenizer
        dataset_sample = next(iter(train_dataset))
        refuse_images(dataset_sample)
        self.padding_free = args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"})
        self._router_aux_coef = router_aux_coefficient(model, args, sync_config=True)
        if self.padding_free:
            if data_collator is not None:
                raise ValueError("Passing a custom data collator is not supported when using padding-free.")
            _check_takes_segments(model)
            if self._router_aux_coef:
                raise BadInput(
                    "router_aux_loss_coef: TRL's MoE load-balancing loss over padding-free rows counts every token of "
                    "one concatenated row, and jtrainer's fixed-length rows hold padding it would count: set "
                    "router_aux_loss_coef=0.0, or packing_strategy='wrapped' (or packing=False)."
                )
        self._set_loss_masks(args, dataset_sample)
        if data_collator is None:
            data_collator = LanguageModelingCollator(
                pad_token_id=set_pad_token(self._tokenizer, model, args),
                padding_free=self.padding_free,
                pad_to_multiple_of=padding_multiple(args),
                fixed_length=args.max_length if (self.padding_free and args.packing) else None,
            )
        if self.padding_free and not args.packing and args.max_length is not None:
            raise ValueError(
                "When `padding_free=True` without packing, `max_length` is not enforced. Either enable packing "
                "(e.g., `packing=True, packing_strategy='bfd'`), provide already truncated inputs, or set "
                "`max_length=None`."
            )
        train_dataset, eval_dataset = self._prepared(train_dataset, eval_dataset, args, formatting_func)
        self._init_statistics()
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self._bridged = bridge.is_bridged(self.nnx_model)

    def _model_and_tokenizer(self, model, args, processing_class, quantization_config, peft_config):
        """TRL's model (loaded from a path, wrapped by peft) and tokenizer (eos token, chat template)."""
        if isinstance(model, str):
            model = load_model(
                model, args, needs_torch=peft_config is not None, quantization_config=quantization_config
            )
        elif quantization_config is not None:
            logger.warning("You passed `quantization_config` to the trainer, but your model is already instantiated.")
        self._tokenizer = tokenizer_of(model, processing_class, args, "SFTTrainer")
        self._is_vlm = False
        self._is_vision_dataset = False
        self._set_eos_token(model, args)
        model = self._set_chat_template(model, args)
        model = apply_peft(model, peft_config, "SFTTrainer")
        refuse_lm_head_adapter(model)
        return model

    def _set_loss_masks(self, args: SFTConfig, dataset_sample: dict) -> None:
        """TRL's choice of the tokens the loss reads: assistant turns (with a training chat template where the
        tokenizer's has no generation markers), completions, or everything."""
        tokenizer = self._tokenizer
        if args.assistant_only_loss and not is_conversational(dataset_sample):
            raise ValueError(
                "You set `assistant_only_loss=True`, but the dataset is not conversational. This option is only "
                "supported for conversational datasets."
            )
        if args.assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
            self.chat_template = get_training_chat_template(tokenizer)
        else:
            self.chat_template = None
        if args.assistant_only_loss and not is_chat_template_stop_token_trained(
            tokenizer, chat_template=self.chat_template
        ):
            logger.warning(
                "The chat template does not include the assistant turn's end-of-turn token in the loss mask; the "
                "model may not learn to stop. Either set `assistant_only_loss=False` or edit the chat template so the "
                "end-of-turn token falls inside `{% generation %}...{% endgeneration %}`."
            )
        if args.completion_only_loss is None:
            self.completion_only_loss = "prompt" in dataset_sample and "completion" in dataset_sample
        else:
            self.completion_only_loss = args.completion_only_loss

    def _prepared(self, train_dataset, eval_dataset, args: SFTConfig, formatting_func):
        """The train and eval datasets through TRL's preparation (unless `skip_prepare_dataset`)."""
        dataset_kwargs = args.dataset_kwargs if isinstance(args.dataset_kwargs, dict) else {}
        self._skip_prepare_dataset = bool(dataset_kwargs.get("skip_prepare_dataset"))
        self._formatting_func = formatting_func
        eval_datasets = (
            eval_dataset if isinstance(eval_dataset, dict) else {"eval": eval_dataset} if eval_dataset else {}
        )
        self._reject_skip_prepare_without_labels({"train": train_dataset, **eval_datasets})
        if self._skip_prepare_dataset:
            return train_dataset, eval_dataset
        if self.completion_only_loss and formatting_func:
            raise ValueError(
                "A formatting function was provided while `completion_only_loss=True`, which is incompatible. "
                "Using a formatter converts the dataset to a language modeling type, conflicting with "
                "completion-only loss. To resolve this, apply your formatting function before passing the "
                "dataset, or disable `completion_only_loss` in `SFTConfig`."
            )
        tokenizer = self._tokenizer
        train_dataset = self._prepare_trl_dataset(
            train_dataset, tokenizer, args, args.packing, formatting_func, "train"
        )
        if eval_dataset is not None:
            eval_dataset = self._prepare_eval(eval_dataset, tokenizer, args)
        return train_dataset, eval_dataset

    # ------------------------------------------------------------------------------------- TRL's preparation
    def _prepare_trl_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL's own preparation (tokenizing, chat templates, loss masks, truncation, packing)."""
        return trl_sft.SFTTrainer._prepare_dataset(
            self,  # type: ignore[arg-type]  # TRL's method on jtrainer's trainer: it reads what both define
            dataset,
            processing_class,
            args,
            packing,
            formatting_func,
            dataset_name,
        )

    def _prepare_eval(self, eval_dataset, processing_class, args):
        packing = args.packing if args.eval_packing is None else args.eval_packing
        if isinstance(eval_dataset, dict):
            return {
                key: self._prepare_trl_dataset(dataset, processing_class, args, packing, self._formatting_func, key)
                for key, dataset in eval_dataset.items()
            }
        return self._prepare_trl_dataset(eval_dataset, processing_class, args, packing, self._formatting_func, "eval")

    def _reject_skip_prepare_without_labels(self, named: dict[str, Any]) -> None:
        if not self._skip_prepare_dataset:
            return
        for name, dataset in named.items():
            cols = get_dataset_column_names(dataset)
            if "labels" not in cols and ("completion_mask" in cols or "assistant_masks" in cols):
                raise ValueError(
                    f"The {name} dataset has mask columns but no 'labels', and `skip_prepare_dataset=True` skips "
                    "label building, so it would train on the full sequence. Add a 'labels' column (-100 for "
                    "non-loss tokens) or drop `skip_prepare_dataset`."
                )

    def _signature_columns(self) -> list[str]:
        return ["input_ids", "labels", "seq_lengths"]

    def _set_eos_token(self, model: Any, args: SFTConfig) -> None:
        if args.eos_token is None:
            return
        if args.eos_token not in self._tokenizer.get_vocab():
            raise ValueError(
                f"The specified `eos_token` ('{args.eos_token}') is not found in the vocabulary of the given "
                f"`processing_class` ({type(self._tokenizer).__name__}). Ensure that the `eos_token` exists in the "
                "vocabulary before using it as an EOS token."
            )
        self._tokenizer.eos_token = args.eos_token
        text_config(model).eos_token_id = self._tokenizer.eos_token_id
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            ids = generation.eos_token_id
            ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
            if self._tokenizer.eos_token_id not in ids:
                generation.eos_token_id = [self._tokenizer.eos_token_id, *ids]

    def _set_chat_template(self, model: Any, args: SFTConfig):
        path = args.chat_template_path
        if path is None:
            return model
        if os.path.isfile(path) and path.endswith((".jinja", ".j2")):
            with open(path, encoding="utf-8") as template:
                self._tokenizer.chat_template = template.read()
            return model
        if not bridge.is_torch_module(model):
            raise BadInput(
                f"chat_template_path={path!r}: cloning a tokenizer's template resizes the embeddings of transformers' "
                "torch model; load it with transformers.AutoModelForCausalLM, or pass a .jinja file."
            )
        model, self._tokenizer, _ = clone_chat_template(model, self._tokenizer, path)
        return model

    # ---------------------------------------------------------------------------------------------- logs
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix="eval"):
        if not self._skip_prepare_dataset and eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._prepare_eval(eval_dataset, self.processing_class, self.args)
        return self._evaluate_with_statistics(
            super().evaluate, eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )


def _sft_config(model: Any, args: Any) -> SFTConfig:
    """TRL's rules: no arguments give SFTConfig("<model>-SFT"); TrainingArguments become an SFTConfig."""
    if args is None:
        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return SFTConfig(f"{name.split('/')[-1]}-SFT")
    if isinstance(args, SFTConfig):
        return args
    if isinstance(args, transformers.TrainingArguments):
        if type(args).__module__.startswith("trl."):
            raise BadInput(
                f"args: a trl.{type(args).__name__} reached jtrainer.trl; import {type(args).__name__} from "
                "jtrainer.trl (its fields are TRL's)."
            )
        fields = args.to_dict()
        fields["hub_token"] = args.hub_token
        return SFTConfig(**fields)
    raise TypeError(f"args must be an SFTConfig or TrainingArguments, got {type(args).__name__}.")


def _check_arguments(args: SFTConfig, train_dataset: Any, compute_loss_func: Any) -> None:
    """TRL's checks of the arguments, and what jtrainer.trl refuses, before anything is loaded."""
    check_train_dataset(train_dataset)
    if compute_loss_func is not None:
        raise BadInput(
            "compute_loss_func: TRL deprecates it for SFTTrainer; subclass jtrainer.trl.SFTTrainer and override "
            "compute_loss (it runs inside the compiled step)."
        )
    if args.label_smoothing_factor > 0:
        raise BadInput(
            "label_smoothing_factor: TRL deprecates label smoothing in SFTTrainer and jtrainer.trl does not build it; "
            "set label_smoothing_factor=0."
        )
    if args.loss_type not in ("nll", "dft"):
        raise ValueError(f"Invalid `loss_type` {args.loss_type} passed. Supported values are 'nll' and 'dft'.")


def _check_takes_segments(model: Any) -> None:
    """Padding-free rows need a model that keeps documents apart: transformers' (from position_ids) or a native
    family taking segment_ids."""
    if bridge.is_torch_module(model):
        return
    import inspect

    if "segment_ids" not in inspect.signature(model.__call__).parameters:
        raise BadInput(
            f"packing / padding_free: jtrainer's native {type(model).__name__} cannot keep packed documents apart "
            "(no segment_ids); use packing_strategy='wrapped', or transformers' torch model (the bridge)."
        )
