"""TRL's DPOTrainer on jtrainer: TRL's dataset preparation, the DPO losses in jtrainer's compiled step.

What runs where (docs/trl.md): TRL's own `_prepare_dataset` tokenizes prompts, chosen and rejected completions;
`collators.PreferenceCollator` makes TRL's batches (one row per pair); the reference's log-probabilities come from
`reference.Reference` (another model, frozen on the mesh) or, for a peft policy, from the policy with its adapter
disabled inside the step; every loss type TRL 1.16 offers and its logged statistics are computed in the step.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx
from trl.trainer import dpo_trainer as trl_dpo
from trl.trainer.utils import disable_dropout_in_model, get_config_model_id

from jtrainer import bridge
from jtrainer.core.errors import BadInput
from jtrainer.numerics import step_metrics
from jtrainer.numerics.step import LossMode, LossSpec
from jtrainer.parallel import sharding
from jtrainer.trainer import data
from jtrainer.trainer.trainer import Trainer
from jtrainer.trl import losses
from jtrainer.trl.collators import PreferenceCollator
from jtrainer.trl.common import (
    StatisticsLogging,
    apply_peft,
    check_train_dataset,
    is_peft_model,
    load_model,
    refuse_images,
    refuse_lm_head_adapter,
    router_aux_coefficient,
    set_pad_token,
    tokenizer_of,
)
from jtrainer.trl.config import DPOConfig, padding_multiple
from jtrainer.trl.reference import REFERENCE_COLUMNS, Reference, pair_forward, paired, sequence_log_probs

logger = transformers.utils.logging.get_logger(__name__)

DPO_METRICS = (
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "mean_token_accuracy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def dpo_base_spec(args: Any, training: bool) -> LossSpec:
    """The rules DPO's loss follows: no label column (the loss reads the chosen and rejected rows, computed in
    evaluation too), a per-batch mean."""
    return LossSpec(
        LossMode.MODEL_MEAN,
        label_names=(),
        compute_dtype=args.compute_dtype(training),
        pass_num_items=False,
        scaled_for_ga=False,
        loss_without_labels=True,
    )


def with_reference_columns(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A DPO batch with the reference's log-probability columns (zeros where absent: only their shapes matter
    to the rules)."""
    rows = len(sample["chosen_input_ids"])
    missing = {name: np.zeros(rows, np.float32) for name in REFERENCE_COLUMNS if name not in sample}
    return {**sample, **missing}


@dataclasses.dataclass(frozen=True)
class DPOLossFunction:
    """TRL's DPO loss as a compute_loss (HF's signature), run inside the compiled step, recording TRL's rewards,
    log-probabilities and statistics. `adapter_reference`: the reference is the policy with its adapter disabled
    (else the batch carries the reference's log-probabilities); `bridged`: the model is transformers' torch
    model; `router_aux_coef`: TRL's weight of an MoE model's load-balancing loss (0: none)."""

    settings: losses.DPOSettings
    bridged: bool = False
    adapter_reference: bool = False
    router_aux_coef: float = 0.0
    written_in_jax: ClassVar[bool] = True

    def __call__(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        pair = paired(inputs)
        outputs, logits, labels = pair_forward(model, pair, self.bridged, router_logits=bool(self.router_aux_coef))
        stats = losses.next_token_stats(logits, labels)
        settings = self.settings
        logps = losses.sequence_log_probs(stats.log_probs, stats.mask, settings.ld_alpha)
        if self.adapter_reference:  # the policy with its adapter disabled (TRL: use_adapter(model, None))
            ref_logps = sequence_log_probs(model, pair, self.bridged, settings.ld_alpha, adapter_disabled=True)
        else:
            ref_logps = jnp.concatenate([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
        ref_logps = jax.lax.stop_gradient(ref_logps.astype(jnp.float32))
        weighting = losses.log_sum_sq_probs(logits) if settings.use_weighting else None
        loss = losses.dpo_loss(
            settings, logps, ref_logps, stats.log_probs, stats.mask, pair["completion_mask"], weighting
        )
        if self.router_aux_coef:  # TRL: added to the per-batch mean as it is
            loss = loss + self.router_aux_coef * outputs.aux_loss
            step_metrics.record("aux_loss", outputs.aux_loss)
        _record_statistics(settings.beta, logits, stats, logps, ref_logps)
        return (loss, outputs) if return_outputs else loss


class DPOLoss:
    """TRL's DPO loss as a Trainer's compute_loss (`DPOLossFunction`). The Trainer sets `_settings`
    (`dpo_settings`), `_bridged` and `_adapter_reference`."""

    _settings: losses.DPOSettings
    _bridged: bool = False
    _adapter_reference: bool = False
    _router_aux_coef: float = 0.0  # MoE models: TRL's weight of the load-balancing loss (0: none)
    args: Any

    def _default_loss_spec(self, sample, training: bool) -> LossSpec:
        return dpo_base_spec(self.args, training)

    def _loss_spec(self, sample, training: bool = True) -> LossSpec:
        return super()._loss_spec(with_reference_columns(sample), training)  # type: ignore[misc]

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """TRL's DPO loss in the compiled step (`DPOLossFunction`)."""
        loss = DPOLossFunction(self._settings, self._bridged, self._adapter_reference, self._router_aux_coef)
        return loss(model, inputs, return_outputs, num_items_in_batch)

    compute_loss.written_in_jax = True  # type: ignore[attr-defined]


class DPOTrainer(StatisticsLogging, DPOLoss, Trainer):
    """TRL's `DPOTrainer(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class, ...)`,
    trained by jtrainer's compiled step."""

    _tag_names = ["trl", "dpo"]
    _name = "DPO"
    loss_is_scaled_for_ga = False  # TRL's: a per-batch mean, divided by the accumulation steps
    metric_order = ("aux_loss", *DPO_METRICS)
    num_tokens_after = "entropy"

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: DPOConfig | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = DPOConfig(f"{name.split('/')[-1]}-DPO")
        elif not isinstance(args, DPOConfig):
            raise BadInput(
                f"args: jtrainer.trl.DPOTrainer takes a jtrainer.trl.DPOConfig (TRL's fields), got "
                f"{type(args).__module__}.{type(args).__name__}."
            )
        check_train_dataset(train_dataset)
        _check_settings(args)
        transformers.set_seed(args.seed)
        if isinstance(model, str):
            model = load_model(
                model, args, needs_torch=peft_config is not None, quantization_config=quantization_config
            )
        elif quantization_config is not None:
            raise ValueError(
                "You passed `quantization_config` to the trainer, but your model is already instantiated. "
                "Quantization can only be applied when the model is loaded from a model identifier (`str`)."
            )
        if ref_model is not None and ref_model is model:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object. In most cases you should omit `ref_model` and "
                "we'll initialize it to a copy of `model` for you."
            )
        processing_class = tokenizer_of(model, processing_class, args, "DPOTrainer")
        self._tokenizer = processing_class
        self._is_vlm = False
        self._is_vision_dataset = False
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        passed_peft_model = is_peft_model(model)
        model = apply_peft(model, peft_config, "DPOTrainer")
        if args.padding_free:
            logger.warning(
                "`padding_free=True` is temporarily unavailable after a refactor and is currently disabled. Falling "
                "back to standard padding (`padding_free=False`)."
            )  # TRL 1.16's own behaviour
        dataset_sample = next(iter(train_dataset))
        refuse_images(dataset_sample)
        if data_collator is None:
            pad_token_id = set_pad_token(self._tokenizer, model, args)
            data_collator = PreferenceCollator(
                pad_token_id=pad_token_id,
                max_length=args.max_length,
                truncation_mode=args.truncation_mode,
                pad_to_multiple_of=padding_multiple(args),
            )
        refuse_lm_head_adapter(model)
        train_dataset = self._prepare_trl_dataset(train_dataset, processing_class, args, "train")
        if eval_dataset is not None:
            eval_dataset = self._prepare_eval(eval_dataset, processing_class, args)

        self.beta = args.beta
        self.precompute_ref_logps = args.precompute_ref_log_probs
        self._settings = dpo_settings(args)
        self._router_aux_coef = router_aux_coefficient(model, args)
        if args.disable_dropout:
            _disable_dropout(model)
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
        )
        self._bridged = bridge.is_bridged(self.nnx_model)
        self._set_reference(ref_model, passed_peft_model)

    # ------------------------------------------------------------------------------------------ reference
    def _set_reference(self, ref_model: Any, passed_peft_model: bool) -> None:
        """TRL's choice of reference: the given model; a peft policy with its adapter disabled (or, for a peft
        model passed in, a frozen copy of its adapter as it was); else the policy's checkpoint loaded again;
        with precomputed log-probabilities, the policy itself before training."""
        args = self.args
        self._adapter_reference = False
        self.ref_model = ref_model
        peft = is_peft_model(self.model)
        if ref_model is None and peft and not passed_peft_model:
            self._adapter_reference = True  # TRL: use_adapter(model, None)
            reference_model = None
        elif ref_model is None and (passed_peft_model or args.precompute_ref_log_probs):
            # The policy as it is now (TRL: a "ref" copy of its adapter). A torch policy is copied: the reference's
            # pass may trace while the train step does (batches are prepared ahead), and both swap the weights of
            # the torch module they call.
            policy = self.model
            reference_model = copy.deepcopy(policy) if bridge.is_torch_module(policy) else self.nnx_model
        elif ref_model is None:
            path = get_config_model_id(self.model.config)
            reference_model = load_model(path, args, needs_torch=bridge.is_torch_module(self.model))
            self.ref_model = reference_model
        else:
            reference_model = ref_model
        if reference_model is not None and args.disable_dropout:
            _disable_dropout(reference_model)
        self._reference = None
        precompute_by_adapter = self._adapter_reference and args.precompute_ref_log_probs
        if reference_model is not None or precompute_by_adapter:
            nnx_reference = self.nnx_model if precompute_by_adapter else bridge.as_nnx(reference_model)
            self._reference = Reference(
                nnx_reference,
                self.mesh,
                self.axis_rules,
                self._mesh_context,
                args.compute_dtype(True),
                bridge.is_bridged(nnx_reference),
                args.ld_alpha,
                adapter_disabled=precompute_by_adapter,
            )
        if args.precompute_ref_log_probs:
            self.train_dataset = self._precompute_ref_logps(self.train_dataset, args.per_device_train_batch_size)
            if self.eval_dataset is not None:
                size = args.per_device_eval_batch_size
                self.eval_dataset = (
                    {k: self._precompute_ref_logps(d, size) for k, d in self.eval_dataset.items()}
                    if isinstance(self.eval_dataset, dict)
                    else self._precompute_ref_logps(self.eval_dataset, size)
                )
            self._reference = None  # the columns hold it now; its weights are let go
            self._adapter_reference = False

    def _precompute_ref_logps(self, dataset: Any, batch_size: int):
        """TRL's precompute_ref_log_probs: the reference's log-probabilities of every row, as two columns."""
        if isinstance(dataset, datasets.IterableDataset):
            raise ValueError(
                "`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a map-style "
                "Dataset or set `precompute_ref_log_probs=False`."
            )
        assert self._reference is not None
        batch_size = self.args.precompute_ref_batch_size or batch_size
        shapes = data.ShapeKeeper(batch_size, self._tokenizer.pad_token_id)
        chosen: list[np.ndarray] = []
        rejected: list[np.ndarray] = []
        for start in range(0, len(dataset), batch_size):
            rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
            batch = self.data_collator(rows)
            padded = shapes.pad(batch, shapes.sequence_length([batch]))
            whole = sharding.replicated(self.mesh)  # every process computes every row (each holds them all)
            placed = sharding.place(padded, {name: whole for name in padded})
            columns = jax.device_get(self._reference.columns(placed))
            chosen.append(columns["ref_chosen_logps"][: len(rows)])
            rejected.append(columns["ref_rejected_logps"][: len(rows)])
        dataset = dataset.add_column("ref_chosen_logps", np.concatenate(chosen).astype(np.float32).tolist())
        return dataset.add_column("ref_rejected_logps", np.concatenate(rejected).astype(np.float32).tolist())

    def _step_batch(self, run, batches):
        step_batch = super()._step_batch(run, batches)
        if self._reference is None:
            return step_batch
        inputs: dict[str, Any] = {**step_batch.inputs, **self._reference.columns(step_batch.inputs, stacked=True)}
        tail = step_batch.tail
        if tail is not None:
            tail = {**tail, **self._reference.columns(tail)}
        return step_batch._replace(inputs=inputs, tail=tail)

    def _evaluation_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if self._reference is None:
            return inputs
        return {**inputs, **self._reference.columns(inputs)}

    # ------------------------------------------------------------------------------------- TRL's preparation
    def _prepare_trl_dataset(self, dataset, processing_class, args, dataset_name):
        prepare = trl_dpo.DPOTrainer._prepare_dataset
        return prepare(self, dataset, processing_class, args, dataset_name)  # type: ignore[arg-type]  # as SFT's

    def _prepare_eval(self, eval_dataset, processing_class, args):
        if isinstance(eval_dataset, dict):
            return {k: self._prepare_trl_dataset(d, processing_class, args, k) for k, d in eval_dataset.items()}
        return self._prepare_trl_dataset(eval_dataset, processing_class, args, "eval")

    def _signature_columns(self) -> list[str]:
        return ["prompt_ids", "chosen_ids", "rejected_ids", *REFERENCE_COLUMNS]

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix="eval"):
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            if self.precompute_ref_logps and self.ref_model is None and self.state.global_step > 0:
                raise ValueError(
                    "Cannot compute reference log-probs for a dataset passed to `evaluate()` after training has "
                    "started, because `precompute_ref_log_probs=True` and no `ref_model` was provided. Provide this "
                    "dataset as `eval_dataset` at initialization, pass an explicit `ref_model`, or set "
                    "`precompute_ref_log_probs=False`."
                )
            eval_dataset = self._prepare_eval(eval_dataset, self.processing_class, self.args)
        return self._evaluate_with_statistics(
            super().evaluate, eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )


def dpo_settings(args: DPOConfig) -> losses.DPOSettings:
    """DPOConfig's loss settings, as the compiled step reads them."""
    return losses.DPOSettings(
        loss_types=tuple(args.loss_type),
        loss_weights=tuple(float(w) for w in (args.loss_weights or [1.0] * len(args.loss_type))),
        beta=float(args.beta),
        label_smoothing=float(args.label_smoothing),
        f_divergence_type=args.f_divergence_type,
        f_alpha_divergence_coef=float(args.f_alpha_divergence_coef),
        discopop_tau=float(args.discopop_tau),
        ld_alpha=args.ld_alpha,
        use_weighting=bool(args.use_weighting),
    )


def _record_statistics(beta: float, logits, stats: losses.TokenStats, logps, ref_logps) -> None:
    """TRL's DPO statistics of this micro-batch (each a mean over its pairs or completion tokens)."""
    record = step_metrics.record
    record("entropy", losses.mean_over_tokens(stats.entropy, stats))
    mean_logits = jnp.mean(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)
    chosen_mask, rejected_mask = jnp.split(stats.mask, 2)
    chosen_logits, rejected_logits = jnp.split(mean_logits, 2)

    def masked_mean(values, mask):
        count = jnp.sum(mask)
        return jnp.where(count > 0, jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(count, 1), 0.0)

    record("logits/chosen", masked_mean(chosen_logits, chosen_mask))
    record("logits/rejected", masked_mean(rejected_logits, rejected_mask))
    record("mean_token_accuracy", masked_mean(jnp.split(stats.is_top1, 2)[0], chosen_mask))
    logps = jax.lax.stop_gradient(logps)
    chosen_logps, rejected_logps = jnp.split(logps, 2)
    chosen_rewards, rejected_rewards = jnp.split(beta * (logps - ref_logps), 2)
    record("rewards/chosen", jnp.mean(chosen_rewards))
    record("rewards/rejected", jnp.mean(rejected_rewards))
    record("rewards/accuracies", jnp.mean((chosen_rewards > rejected_rewards).astype(jnp.float32)))
    record("rewards/margins", jnp.mean(chosen_rewards - rejected_rewards))
    record("logps/chosen", jnp.mean(chosen_logps))
    record("logps/rejected", jnp.mean(rejected_logps))


def _check_settings(args: DPOConfig) -> None:
    """TRL's checks of the loss settings, before anything is loaded."""
    unknown = [t for t in args.loss_type if t not in losses.DPO_LOSS_TYPES]
    if unknown:
        raise ValueError(f"Unknown loss type: {unknown[0]}. Should be one of {list(losses.DPO_LOSS_TYPES)}")
    if args.f_divergence_type != "reverse_kl" and not set(args.loss_type) <= losses.F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(
            f"`f_divergence_type='{args.f_divergence_type}'` is only supported for the following loss types: "
            f"{sorted(losses.F_DIVERGENCE_LOSS_TYPES)}. You provided {args.loss_type}. Use the default "
            "`f_divergence_type='reverse_kl'` with these losses."
        )
    if args.use_weighting and any(t in {"aot", "aot_unpaired"} for t in args.loss_type):
        raise NotImplementedError(
            "WPO-style weighting is not implemented for 'aot' or 'aot_unpaired' because those losses sort "
            "samples, which would misalign per-pair weights."
        )
    if "exo_pair" in args.loss_type and args.label_smoothing == 0.0:
        raise ValueError(
            "Label smoothing must be greater than 0.0 when using 'exo_pair' loss. The EXO paper recommends a value "
            "of 1e-3."
        )
    if args.loss_weights is not None and len(args.loss_weights) != len(args.loss_type):
        raise BadInput(
            f"loss_weights: {len(args.loss_weights)} weights for {len(args.loss_type)} loss types; give one per type."
        )


def _disable_dropout(model: Any) -> None:
    """TRL's disable_dropout_in_model: every dropout probability 0 (torch modules and jtrainer's nnx ones)."""
    if bridge.is_torch_module(model):
        disable_dropout_in_model(model)
        return
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Dropout):
            module.rate = 0.0


__all__ = ["DPOTrainer"]
