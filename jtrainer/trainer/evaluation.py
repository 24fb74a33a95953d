"""Evaluation and prediction for the Trainer: HF's evaluate / predict / evaluation_loop over a jitted eval step.

Batches are padded to static shapes and split over the mesh like training batches; predictions and labels are
gathered from every process, padded rows are dropped, and batches of different lengths are joined with -100
padding, as HF's nested concatenation does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from transformers.trainer_utils import (
    EvalLoopOutput,
    EvalPrediction,
    PredictionOutput,
    denumpify_detensorize,
    speed_metrics,
)

from jtrainer.core.state import split_params
from jtrainer.kinds import loss_rules, user_code
from jtrainer.numerics.losses import IGNORE_INDEX
from jtrainer.numerics.step import (
    EvalOutputs,
    LossSpec,
    MicroBatching,
    batch_label_values,
    graphdef_in_mode,
    make_shard_loss_step,
)
from jtrainer.parallel import distributed, sharding
from jtrainer.runtime import compiled_steps
from jtrainer.sizing import abstract_step
from jtrainer.trainer import data
from jtrainer.trainer.overrides import check_loader
from jtrainer.trainer.trainer_parts import TrainerParts


def concat_padded(arrays: list[np.ndarray], pad: int = IGNORE_INDEX) -> np.ndarray:
    """Concatenate along rows, padding dimension 1 with `pad` where batches differ (HF's nested_concat)."""
    if not arrays:
        return np.zeros((0,))
    if arrays[0].ndim < 2 or all(a.shape[1:] == arrays[0].shape[1:] for a in arrays):
        return np.concatenate(arrays, axis=0)
    width = max(a.shape[1] for a in arrays)
    padded = [
        np.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2), constant_values=pad) for a in arrays
    ]
    return np.concatenate(padded, axis=0)


def _gather_tree(trees: list[Any]) -> Any:
    if not trees:
        return None
    if isinstance(trees[0], (tuple, list)):
        return type(trees[0])(_gather_tree([t[i] for t in trees]) for i in range(len(trees[0])))
    if isinstance(trees[0], dict):
        return {k: _gather_tree([t[k] for t in trees]) for k in trees[0]}
    return concat_padded([np.asarray(t) for t in trees])


def _slice_tree(tree: Any, rows: int, padded_length: int | None, length: int | None) -> Any:
    """Drop padded rows, and the positions a sequence was padded with past its collated `length`, of a host pytree
    of arrays (dimension 1 is cut only where it is the padded sequence length: class scores keep theirs)."""

    def cut(x):
        x = np.asarray(x)[:rows]
        if length is not None and padded_length is not None and x.ndim >= 2 and x.shape[1] == padded_length:
            return x[:, :length]
        return x

    return jax.tree.map(cut, tree)


def _with_last(iterable):
    """Yield (item, is_last): HF's `end_of_dataloader` for batch_eval_metrics' compute_result."""
    iterator = iter(iterable)
    try:
        item = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield item, False
        item = following
    yield item, True


def _mean_loss(losses: np.ndarray, drop_non_finite: bool) -> float:
    """HF's eval loss: the mean over rows, non-finite batch losses left out under logging_nan_inf_filter."""
    finite = np.isfinite(losses)
    if drop_non_finite and finite.any():
        losses = losses[finite]
    return float(np.mean(losses))


hf_logger = logging.getLogger("transformers.trainer")  # HF's banners, as transformers.Trainer logs them
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _BatchValues:
    """One evaluation batch's values on the host (None: not computed or not asked for)."""

    losses: np.ndarray | None
    preds: Any
    labels: Any
    inputs: Any  # the main input's rows (include_for_metrics "inputs")
    gather_inputs: Callable[[], Any]  # every input column, gathered (on every process alike) when asked for


@dataclasses.dataclass
class _EvaluationPass:
    """One evaluation loop: its fixed choices, the eval step built for its first batch, and what it keeps."""

    params: Any
    model_state: Any
    generating: bool
    want_logits: bool
    ignore: tuple[str, ...]
    keep_all: bool
    include: frozenset[str]
    gathers_all: bool
    spec: LossSpec | None = None
    step: Any = None
    ragged_rows: bool = False
    num_classes: int | None = None
    losses: list[Any] = dataclasses.field(default_factory=list)
    preds: list[Any] = dataclasses.field(default_factory=list)
    labels: list[Any] = dataclasses.field(default_factory=list)
    inputs: list[Any] = dataclasses.field(default_factory=list)
    num_samples: int = 0
    metrics: Any = None

    def keep(self, values: _BatchValues, rows: int) -> None:
        if values.losses is not None:
            self.losses.append(values.losses)
        if self.keep_all:
            for store, value in (
                (self.preds, values.preds),
                (self.labels, values.labels),
                (self.inputs, values.inputs),
            ):
                if value is not None:
                    store.append(value)
        self.num_samples += rows


class EvaluationMixin(TrainerParts):
    """The Trainer's evaluate / predict methods (they use the Trainer's mesh, model, callbacks and state)."""

    def _generates(self) -> bool:
        """Whether predictions are generated ids rather than logits (overridden by Seq2SeqTrainer)."""
        return False

    def _current_params(self):
        if self._train_state is not None:
            self._optimizer_eval()  # HF's evaluation_loop: optimizer.eval()
            return self._model_params(), self._train_state.model_state
        _, params, rest = split_params(self.nnx_model)
        return (
            jax.device_put(nnx.to_pure_dict(params), sharding.named(self.mesh, self._param_specs)),
            jax.device_put(rest, sharding.replicated(self.mesh)),
        )

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        override = eval_dataset is not None
        eval_dataset = eval_dataset if override else self.eval_dataset
        if isinstance(eval_dataset, dict):
            metrics = {}
            for name, dataset in eval_dataset.items():
                metrics.update(self.evaluate(dataset if override else name, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        loader = check_loader(self, self.get_eval_dataloader(eval_dataset), "get_eval_dataloader")
        # HF: no point gathering predictions (logits, or generated ids) when there are no metrics to compute.
        output = self._timed_loop(loader, "Evaluation", ignore_keys, metric_key_prefix, self._evaluate_loss_only())
        metrics = output.metrics or {}  # evaluation_loop always sets them
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        loader = check_loader(self, self.get_test_dataloader(test_dataset), "get_test_dataloader")
        output = self._timed_loop(loader, "Prediction", ignore_keys, metric_key_prefix)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, output.metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)

    def _evaluate_loss_only(self) -> bool | None:
        """evaluate()'s prediction_loss_only, as HF passes it: True without compute_metrics, else the argument's."""
        return True if self.compute_metrics is None else None

    def _timed_loop(self, loader, description, ignore_keys, prefix, loss_only: bool | None = None) -> EvalLoopOutput:
        """evaluation_loop plus HF's speed metrics (runtime, samples/s, steps/s) under the prefix."""
        start_time = time.time()
        output = self.evaluation_loop(loader, description, loss_only, ignore_keys, prefix)
        total_batch = self.args.eval_batch_size * self.args.world_size
        assert output.metrics is not None and output.num_samples is not None
        output.metrics.update(
            speed_metrics(
                prefix,
                start_time,
                num_samples=output.num_samples,
                num_steps=math.ceil(output.num_samples / total_batch),
            )
        )
        return output

    def _eval_micro_batching(self) -> MicroBatching | None:
        return abstract_step.eval_micro_batching(self.args, self.mesh)

    def _eval_step(self, spec: LossSpec, want_logits: bool, ignore_keys: tuple[str, ...]):
        """The jitted eval step, shared by structure like the train step (trials of a search reuse it)."""
        graphdef = graphdef_in_mode(self.nnx_model, training=False)
        micro = self._eval_micro_batching()
        key = (graphdef, spec, want_logits, self.preprocess_logits_for_metrics, ignore_keys, micro)
        if key not in compiled_steps.EVAL_STEPS:
            preprocess = self.preprocess_logits_for_metrics
            alternative = user_code.array_function_alternative(preprocess)
            compiled_steps.EVAL_STEPS[key] = abstract_step.eval_step(
                graphdef, spec, want_logits, ignore_keys, micro, preprocess, alternative
            )
        step, self._preprocess_placement = compiled_steps.EVAL_STEPS[key]
        return step

    def _preprocess_on_host(self, predictions, labels):
        """HF's call of preprocess_logits_for_metrics, for a function JAX could not trace: torch tensors of the
        batch's logits and labels in, its result back as numpy."""
        placement = self._preprocess_placement
        assert placement is not None, "set with the eval step"

        def warn_once() -> None:
            if placement.warned:
                return
            placement.warned = True
            size = sum(np.asarray(x).nbytes for x in jax.tree.leaves(predictions))
            reason = placement.reason
            why = "untraceable" if reason is None else next(iter(str(reason).splitlines()), type(reason).__name__)
            logger.warning(
                "preprocess_logits_for_metrics cannot run inside the compiled evaluation step "
                f"({why}): it runs on the "
                f"host, and every batch's whole logits ({size / 2**20:.1f} MiB a batch here) are copied there first. "
                "Write it with torch or jax.numpy ops on its arguments (no numpy, .item() or Python control flow on "
                "values) to keep it in the step."
            )

        preprocess = self.preprocess_logits_for_metrics
        assert preprocess is not None, "placed on the host when it ran"
        return user_code.call_on_host(preprocess, predictions, labels, placement.reason, announce=warn_once)

    def _gathers_completing_rows(self) -> bool:
        """HF's gather_function of this evaluation: the Trainer's gather_for_metrics (False) leaves out the rows
        completing a short last batch on several processes and counts each row's loss once; Seq2SeqTrainer's
        evaluate/predict gather (True) keeps those rows in the predictions and labels and repeats every batch's
        loss for a whole batch."""
        return False

    def _eval_ragged_rows(self, spec: LossSpec, dataloader) -> bool:
        """Whether a ragged last batch runs at its own rows (one data shard, a loss padding would change), as in
        training. On several data shards the loader completes it with the first rows, as HF's distributed loader
        does, whatever the loss (dropped again before metrics; its loss is HF's per-process one, `_shard_losses`)."""
        # Padding rows of -100 labels add nothing to jtrainer's own losses; several shards complete the batch.
        return sharding.data_parallel_size(self.mesh) == 1 and not spec.padding_neutral

    def _shard_losses(self, spec: LossSpec, params, model_state, inputs, rows: int, global_rows: int) -> np.ndarray:
        """HF's losses of a completed last batch on several processes: each process's batch loss, repeated
        over its rows, the first `rows` of them kept (accelerate's gather_for_metrics)."""
        shards = sharding.data_parallel_size(self.mesh)
        graphdef = graphdef_in_mode(self.nnx_model, training=False)
        key = ("shard_losses", graphdef, spec, shards)
        if key not in compiled_steps.EVAL_STEPS:
            compiled_steps.EVAL_STEPS[key] = jax.jit(
                make_shard_loss_step(graphdef, spec, shards), out_shardings=sharding.replicated(self.mesh)
            )  # every process reads it
        with self._mesh_context():
            per_shard = np.asarray(
                jax.device_get(compiled_steps.EVAL_STEPS[key](params, model_state, inputs)), np.float64
            )
        return np.repeat(per_shard, global_rows // shards)[:rows]

    def _ignore_keys(self, ignore_keys) -> tuple[str, ...]:
        """HF's default: the config's keys_to_ignore_at_inference (`loss_rules.ignore_keys_at_inference`)."""
        return loss_rules.ignore_keys_at_inference(self.model) if ignore_keys is None else tuple(ignore_keys)

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ) -> EvalLoopOutput:
        args = self.args
        loss_only = prediction_loss_only if prediction_loss_only is not None else args.prediction_loss_only
        generating = not loss_only and self._generates()  # predictions are generated ids (Seq2SeqTrainer)
        params, model_state = self._current_params()
        run = _EvaluationPass(
            params=params,
            model_state=model_state,
            generating=generating,
            want_logits=not loss_only and not generating,
            ignore=self._ignore_keys(ignore_keys),
            # HF keeps every batch's values unless batch_eval_metrics computes metrics batch by batch (predict
            # keeps them).
            keep_all=not args.batch_eval_metrics or description == "Prediction",
            include=frozenset(args.include_for_metrics or []),
            gathers_all=self._gathers_completing_rows(),
        )
        if generating:
            self._sync_model()  # generation reads the model: give it the trained parameters
        self.callback_handler.eval_dataloader = dataloader
        self._log_evaluation_start(dataloader, description)
        pad_id = getattr(self.processing_class, "pad_token_id", None) or 0
        shapes = data.ShapeKeeper(dataloader.local_rows, pad_id, agree=distributed.agree_max)
        for (batch, rows), is_last in _with_last(dataloader):
            values = self._evaluate_batch(run, shapes, dataloader, batch, rows)
            run.keep(values, rows)
            self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)
            if args.batch_eval_metrics and self.compute_metrics is not None:
                if values.preds is not None and values.labels is not None:  # HF: the last batch computes the result
                    run.metrics = self._batch_metrics(values, run.include, is_last)
        return self._evaluation_output(run, metric_key_prefix)

    def _log_evaluation_start(self, dataloader, description: str) -> None:
        hf_logger.info(f"\n***** Running {description} *****")
        if dataloader.sized:
            hf_logger.info(f"  Num examples = {self.num_examples(dataloader)}")
        else:
            hf_logger.info("  Num examples: Unknown")
        hf_logger.info(f"  Batch size = {self.args.eval_batch_size}")

    def _evaluate_batch(self, run: _EvaluationPass, shapes: data.ShapeKeeper, dataloader, batch, rows: int):
        """One batch through the eval step (built for the first batch's loss spec), its values on the host."""
        length = shapes.sequence_length([batch])
        sharding.check_length_divisible(length, self.mesh)
        if run.spec is None:
            run.spec = self._loss_spec(shapes.pad(batch, length), training=False)
            run.step = self._eval_step(run.spec, run.want_logits, run.ignore)
            run.ragged_rows = self._eval_ragged_rows(run.spec, dataloader)
            run.num_classes = self._label_classes(run.spec)
        spec = run.spec
        self._check_labels(batch, run.num_classes)
        # A ragged last batch keeps its own rows where padding rows would enter the loss (one more compile).
        padded = shapes.pad(batch, length, pad_rows=not run.ragged_rows)
        global_rows = dataloader.batch_size if not run.ragged_rows else rows
        inputs = self._evaluation_inputs(sharding.put_global(padded, self.mesh, row_dim=0, global_rows=global_rows))
        out: EvalOutputs
        if run.generating and not any(name in padded for name in self.label_names):
            out = EvalOutputs(None, None)  # HF's Seq2SeqTrainer: generation alone, no forward without labels
        else:
            with self._mesh_context():
                out = run.step(run.params, run.model_state, inputs)
            if out.recorded:
                self._on_recorded(out.recorded, 1, training=False)
        collated_len = distributed.agree_max(max((v.shape[1] for v in batch.values() if v.ndim >= 2), default=0))

        # HF's gather_for_metrics drops the rows completing a short last batch; Seq2SeqTrainer's plain gather
        # keeps them, and counts a short batch's loss as a full batch's.
        kept = global_rows if run.gathers_all and dataloader.complete_last else rows
        loss_rows = dataloader.batch_size if run.gathers_all else rows
        if isinstance(dataloader, data.IterableBatches):
            # A loader of the user's own (an overridden get_*_dataloader): HF repeats each batch's loss
            # eval_batch_size times on each process and, the loader not being accelerate's, keeps them all.
            loss_rows = self.args.eval_batch_size * jax.process_count()

        def host(tree):
            return _slice_tree(jax.tree.map(distributed.gather_rows, tree), kept, length, collated_len or None)

        losses = None if out.loss is None else np.full(loss_rows, float(out.loss), np.float64)
        if losses is not None and dataloader.complete_last and rows < global_rows:
            losses = self._shard_losses(spec, run.params, run.model_state, inputs, kept, global_rows)
        labels = batch_label_values(padded, tuple(self.label_names))
        labels = None if labels is None else host(labels)
        preds = None
        if run.generating:
            preds = self._generate_batch(padded, kept)
            if labels is not None:  # the collated labels' own width, then HF's padding
                labels = self._prediction_labels(labels[:, : np.shape(batch[self.label_names[0]])[-1]])
        elif run.want_logits and out.logits is not None:
            preds = host(out.logits)
            placement = self._preprocess_placement
            if self.preprocess_logits_for_metrics is not None and placement is not None and placement.on_host:
                preds = self._preprocess_on_host(preds, labels)
        main = padded.get(getattr(self.model, "main_input_name", "input_ids"))
        inputs_kept = host(main) if ("inputs" in run.include and main is not None) else None
        return _BatchValues(losses, preds, labels, inputs_kept, lambda: host(padded))

    def _batch_metrics(self, values: _BatchValues, include: frozenset[str], is_last: bool) -> Any:
        """batch_eval_metrics: HF hands over the batch's loss repeated over its rows and its whole input dict,
        as the model's framework holds them (torch tensors for a torch model, numpy for a native one)."""
        whole_inputs = values.gather_inputs() if "inputs" in include else None
        batch = (values.preds, values.labels, values.losses if "loss" in include else None, whole_inputs)
        predictions, label_ids, losses, inputs = self._held.metric_arrays(batch)
        prediction = EvalPrediction(predictions=predictions, label_ids=label_ids, losses=losses, inputs=inputs)
        assert self.compute_metrics is not None, "batch metrics are computed only with compute_metrics"
        return self.compute_metrics(prediction, compute_result=is_last)

    def _evaluation_output(self, run: _EvaluationPass, metric_key_prefix: str) -> EvalLoopOutput:
        """HF's EvalLoopOutput of the whole pass: the metrics on everything kept (unless batch by batch), the mean
        loss, every key under the prefix; predictions None when only losses were asked for."""
        all_losses = np.concatenate(run.losses) if run.losses else None
        all_preds = _gather_tree(run.preds) if run.preds else None
        all_labels = _gather_tree(run.labels) if run.labels else None
        metrics = run.metrics
        if self.compute_metrics is not None and not self.args.batch_eval_metrics and all_preds is not None:
            if all_labels is not None:
                metrics = self.compute_metrics(
                    EvalPrediction(
                        predictions=all_preds,
                        label_ids=all_labels,
                        losses=all_losses if "loss" in run.include else None,
                        inputs=_gather_tree(run.inputs) if "inputs" in run.include else None,
                    )
                )
        metrics = denumpify_detensorize(metrics or {})
        if all_losses is not None:
            metrics[f"{metric_key_prefix}_loss"] = _mean_loss(all_losses, self.args.logging_nan_inf_filter)
        for key in list(metrics):
            if not key.startswith(f"{metric_key_prefix}_"):
                metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
        return EvalLoopOutput(predictions=all_preds, label_ids=all_labels, metrics=metrics, num_samples=run.num_samples)  # type: ignore[arg-type]
