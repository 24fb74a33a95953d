"""HF's rules for the loss of a held model, decided before compiling: which loss the step computes (the model's
own, the Trainer's cross-entropy, a compute_loss_func, a compute_loss override), how it is normalised, and what
HF inspects of the model to decide (its labels, loss kwargs, causal-LM loss). Pure functions of a `LossContext`
and a batch's shapes: the Trainer calls them for its steps, and `jtrainer check` calls them without a Trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any, ContextManager

import jax
import numpy as np

from jtrainer.core.state import split_params
from jtrainer.kinds import user_code
from jtrainer.kinds.protocol import TrainedModel
from jtrainer.models.base import PretrainedMixin
from jtrainer.numerics import dependence
from jtrainer.numerics.losses import LabelSmoother, count_label_tokens
from jtrainer.numerics.step import (
    UNTRACEABLE,
    LossMode,
    LossSpec,
    apply_model,
    bound_model,
    split_outputs,
)
from jtrainer.numerics.step import compute_loss as step_compute_loss
from jtrainer.numerics.step_metrics import recording

Batch = dict[str, np.ndarray]

# torch's error when backward() starts from a loss no trainable parameter reaches (HF's Trainer raises it).
NO_GRAD = "element 0 of tensors does not require grad and does not have a grad_fn"

# The names PreTrainedModel maps to ForCausalLMLoss through its class name (transformers' LOSS_MAPPING).
_CAUSAL_LM_LOSS_NAME = re.compile(r"ForCausalLM|ForConditionalGeneration")


def call_signature(model: Any) -> inspect.Signature:
    """The model's keyword inputs: a torch module's `forward` (HF's signature check), an nnx module's call."""
    return inspect.signature(getattr(model, "forward", None) or model.__call__)


def default_label_names(model: Any) -> list[str]:
    """HF's find_labels: the model's arguments named like labels (QA models: also start/end positions). A model
    taking none (its loss left to the Trainer) keeps ["labels"]."""
    params = call_signature(model).parameters
    qa = "QuestionAnswering" in type(model).__name__
    found = [p for p in params if "label" in p or (qa and p in ("start_positions", "end_positions"))]
    return found or ["labels"]


def accepts_loss_kwargs(model: Any) -> bool:
    """HF's model_accepts_loss_kwargs: the model's own flag, else whether its call takes **kwargs."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    params = call_signature(model).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def label_smoother(args: Any, model: Any) -> LabelSmoother | None:
    """HF's label smoother: none without label_smoothing_factor, and none (with HF's warning) for a multi-label
    classifier, whose float targets it cannot smooth."""
    if not args.label_smoothing_factor:
        return None
    if getattr(getattr(model, "config", None), "problem_type", None) == "multi_label_classification":
        warnings.warn(
            "Label smoothing is not compatible with multi-label classification. "
            "Disabling label smoothing for this training run.",
            UserWarning,
        )
        return None
    return LabelSmoother(args.label_smoothing_factor)


def is_causal_lm(model: Any) -> bool:
    if hasattr(model, "loss_shifts_labels"):
        return bool(model.loss_shifts_labels)
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def counts_shifted_labels(model: Any) -> bool:
    """HF's _loss_shifts_labels: num_items_in_batch counts labels[..., 1:] when the model's loss_type is the
    causal-LM loss (PreTrainedModel derives it from the class name: GPT2LMHeadModel has none) and the model is
    not an encoder-decoder."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type is None and isinstance(model, PretrainedMixin):
        loss_type = next(iter(_CAUSAL_LM_LOSS_NAME.findall(type(model).__name__)), None)
    causal_loss = loss_type is not None and _CAUSAL_LM_LOSS_NAME.fullmatch(str(loss_type)) is not None
    return causal_loss and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def takes_labels(model: Any, label_names: tuple[str, ...]) -> bool:
    params = call_signature(model).parameters
    return label_names[0] in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def no_loss_error(outputs: Any, inputs: Batch) -> Exception:
    """transformers.Trainer's error for a torch model given labels that returns no loss: its ValueError for a
    dict, torch's for a tuple (HF takes `outputs[0]`, the logits, as the loss and backward() fails)."""
    if isinstance(outputs, dict):
        return ValueError(
            "The model did not return a loss from the inputs, only the following keys: "
            f"{','.join(outputs.keys())}. For reference, the inputs it received are {','.join(inputs.keys())}."
        )
    return RuntimeError(
        "grad can be implicitly created only for scalar outputs: the model was given labels and returned no loss "
        "(transformers.Trainer takes its first output as the loss). Return the loss first, or pass "
        "compute_loss_func."
    )


@dataclasses.dataclass(frozen=True)
class LossContext:
    """What HF's loss rules read besides the batch: the held model, the arguments and the Trainer's loss settings
    (HF's public attributes of the same names), and the context model code traces under (the mesh and rules)."""

    held: TrainedModel
    args: Any
    label_names: tuple[str, ...]
    accepts_loss_kwargs: bool
    label_smoother: LabelSmoother | None = None
    compute_loss_func: Callable | None = None
    tracing: Callable[[], ContextManager] = contextlib.nullcontext

    @classmethod
    def of(cls, held: TrainedModel, args: Any, tracing: Callable[[], ContextManager], **settings: Any) -> LossContext:
        """HF's defaults, as its constructor sets them from the arguments and the model."""
        inspected = held.inspected
        names = args.label_names if args.label_names is not None else default_label_names(inspected)
        defaults = dict(
            label_names=tuple(names),
            accepts_loss_kwargs=accepts_loss_kwargs(inspected),
            label_smoother=label_smoother(args, held.given),
        )
        return cls(held=held, args=args, tracing=tracing, **{**defaults, **settings})


def require_trainable(context: LossContext, training: bool) -> None:
    """torch's error, named, for a model with nothing to train."""
    if training and not jax.tree.leaves(split_params(context.held.module)[1]):
        raise RuntimeError(
            f"{NO_GRAD}: {type(context.held.given).__name__} has no trainable parameters (each one has "
            "requires_grad=False, or none exists): nothing would train."
        )


def default_spec(context: LossContext, sample: Batch, training: bool) -> LossSpec:
    """The Trainer's own loss (`default_rules`); where the Trainer computes the cross-entropy itself, with the
    logits' class count, which labels must lie under (a gather would read any other label as 0)."""
    spec = default_rules(context, sample, training)
    if spec.mode is LossMode.TRAINER and any(name in sample for name in context.label_names):
        spec = dataclasses.replace(spec, num_classes=logits_width(context, sample))
    return spec


def abstract_outputs(context: LossContext, inputs: Batch) -> Any:
    """The model's outputs on `inputs`' shapes and dtypes, traced, not run."""
    graphdef, params, rest = split_params(context.held.module)
    probe = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in inputs.items()}
    with context.tracing():
        return jax.eval_shape(lambda p, s, x: apply_model(graphdef, p, s, x)[0], params, rest, probe)


def logits_width(context: LossContext, sample: Batch) -> int | None:
    outputs = abstract_outputs(context, {k: v for k, v in sample.items() if k not in context.label_names})
    _, logits = split_outputs(outputs)
    return int(logits.shape[-1]) if getattr(logits, "ndim", 0) else None


def default_rules(context: LossContext, sample: Batch, training: bool) -> LossSpec:
    """HF's rules for the Trainer's own loss. Without labels, evaluation and prediction still run (no loss),
    as in HF; training fails here, named."""
    held, args, label_names = context.held, context.args, context.label_names
    inspected = held.inspected
    has_labels = any(name in sample for name in label_names)
    smoothing = context.label_smoother.epsilon if context.label_smoother is not None else 0.0
    common = dict(
        label_names=label_names,
        causal=is_causal_lm(inspected),
        count_shifted=counts_shifted_labels(inspected),
        compute_dtype=args.compute_dtype(training),
        accepts_loss_kwargs=context.accepts_loss_kwargs,
        skip_logits_in_loss_only=args.use_liger_kernel,
    )
    if has_labels and context.compute_loss_func is not None:
        counted = "labels" in sample  # HF's num_items_in_batch counts the "labels" column only (else None)
        return LossSpec(LossMode.CUSTOM, compute_loss_func=context.compute_loss_func, pass_num_items=counted, **common)
    if has_labels and smoothing > 0:
        labels = sample[label_names[0]]
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(
                f"label_smoothing_factor={smoothing} smooths class labels, but the {label_names[0]!r} column "
                f"holds {labels.dtype} values (regression or multi-label targets). Set label_smoothing_factor=0."
            )
        # HF's label smoother gets num_items_in_batch only from a model taking loss kwargs; else it is a
        # per-batch mean, divided by the window's micro-batches.
        counted = context.accepts_loss_kwargs
        return LossSpec(
            LossMode.TRAINER,
            label_smoothing=smoothing,
            pass_num_items=counted,
            scaled_for_ga=counted,
            padding_neutral=counted,
            **common,
        )
    if has_labels and not takes_labels(inspected, label_names):
        return LossSpec(LossMode.TRAINER, padding_neutral=True, **common)
    if not has_labels and not training and getattr(getattr(held.given, "config", None), "is_encoder_decoder", False):
        # An encoder-decoder cannot run without labels (no decoder inputs): prediction only generates.
        return LossSpec(LossMode.TRAINER, padding_neutral=True, **common)
    return _model_loss_rules(context, sample, training, has_labels, common)


def _model_loss_rules(
    context: LossContext, sample: Batch, training: bool, has_labels: bool, common: dict[str, Any]
) -> LossSpec:
    """The rules for a model that takes the labels: its own loss, as it returns one."""
    held = context.held
    outputs = abstract_outputs(context, sample)
    loss, _ = split_outputs(outputs)
    if loss is None and has_labels and held.must_return_loss:
        raise no_loss_error(outputs, sample)  # HF computes no loss of its own for a torch model
    if loss is not None:
        # The model's own causal-LM loss with labels: computed without whole logits (nothing else reads them).
        chunked = has_labels and getattr(held.module, "chunks_causal_lm_loss", False)
        if has_labels and context.accepts_loss_kwargs and "labels" in sample:  # HF counts "labels" only
            neutral = held.loss_ignores_padding
            return LossSpec(LossMode.MODEL_SUM, padding_neutral=neutral, chunked_model_loss=chunked, **common)
        return LossSpec(
            LossMode.MODEL_MEAN, pass_num_items=False, scaled_for_ga=False, chunked_model_loss=chunked, **common
        )
    if has_labels or not training:
        return LossSpec(LossMode.TRAINER, padding_neutral=True, **common)
    raise ValueError(
        f"The model did not return a loss from the inputs, and the batch has no label column "
        f"{list(context.label_names)}: its columns are {sorted(sample)}. Add a 'labels' column (or set "
        "--label_names), or pass compute_loss_func."
    )


def override_spec(
    context: LossContext,
    base: LossSpec,
    compute_loss: Callable,
    sample: Batch,
    training: bool,
    scaled_for_ga: bool | None,
    name: str,
) -> LossSpec:
    """A compute_loss override's spec (HF's rules for what it is handed and how its loss is normalised; its
    super() follows `base`), probed on the batch's shapes (`probe_compute_loss`). `name` names it in errors."""
    has_labels = "labels" in sample  # HF's _get_num_items_in_batch looks for "labels" itself
    pass_num_items = has_labels and (context.accepts_loss_kwargs or context.compute_loss_func is not None)
    scaled = scaled_for_ga
    if scaled is None:
        scaled = (context.accepts_loss_kwargs and pass_num_items) or context.compute_loss_func is not None
    spec = dataclasses.replace(
        base,
        mode=LossMode.OVERRIDE,
        compute_loss=compute_loss,
        base=base,
        pass_num_items=pass_num_items,
        scaled_for_ga=bool(scaled),
        padding_neutral=False,
        num_classes=None,  # the override's labels may mean something else: the config's classes
        chunked_model_loss=False,  # the override may read the outputs' logits
    )
    return probe_compute_loss(context, spec, sample, training, name)


def probe_compute_loss(context: LossContext, spec: LossSpec, sample: Batch, training: bool, name: str) -> LossSpec:
    """Trace the override once on the batch's shapes, before compiling. An override written in torch (HF's
    documented examples) runs in the step through torchax when the script has torch (tried first for a torch
    model, after jax.numpy for a native one); code that runs neither way (numpy conversions, float()) fails
    here with its name, as does a non-scalar loss."""
    candidates = [spec]
    assert spec.compute_loss is not None
    if user_code.runs_in_torch() and not getattr(spec.compute_loss, "written_in_jax", False):
        in_torch = dataclasses.replace(spec, compute_loss=user_code.compute_loss_in_torch(spec.compute_loss))
        candidates = [in_torch, spec] if context.held.user_code_in_torch_first else [spec, in_torch]
    errors = []
    for candidate in candidates:
        try:
            loss, trained, recorded = _trace_compute_loss(context, candidate, sample)
            break
        except Exception as error:  # noqa: BLE001  (the next way may run it; else the first error is raised)
            errors.append(error)
    else:
        _raise_untraceable(errors[0], name)
    if getattr(loss, "shape", None) != ():
        raise ValueError(f"{name} must return a scalar loss; it returned {loss!r}.")
    if training and not trained:
        raise RuntimeError(
            f"{NO_GRAD}: no trainable parameter reaches the loss {name} returns "
            "(a detach(), torch.no_grad() or stop_gradient cuts it off)."
        )
    return dataclasses.replace(candidate, recorded=recorded)


def _trace_compute_loss(context: LossContext, spec: LossSpec, sample: Batch):
    """The override's loss, traced on the batch's shapes (nothing runs), whether the trainable parameters
    reach it, and the names it records (step_metrics.record)."""
    graphdef, params, rest = split_params(context.held.module)
    probe = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in sample.items()}

    names: list[str] = []

    def loss_of(p, s, inputs):
        with bound_model(graphdef, p, s, spec.compute_dtype) as model, recording() as recorded:
            num_items = count_label_tokens(inputs["labels"], spec.count_shifted) if spec.pass_num_items else None
            loss = step_compute_loss(model, inputs, spec, num_items)
        names.extend(recorded)
        return loss

    with context.tracing():
        traced, loss = jax.make_jaxpr(loss_of, return_shape=True)(params, rest, probe)
    trainable = [True] * len(jax.tree.leaves(params)) + [False] * len(jax.tree.leaves((rest, probe)))
    return loss, any(dependence.outputs_reached(traced, trainable)), tuple(sorted(names))


def _raise_untraceable(error: Exception, name: str):
    op = user_code.unlowered_op(error)
    if op is not None:
        raise NotImplementedError(
            f"{name} calls torch's {op}, which torchax cannot lower to JAX: the compiled step cannot run it. "
            "Write that part another way (or with jax.numpy)."
        ) from None
    if isinstance(error, UNTRACEABLE):
        raise TypeError(
            f"{name} cannot run inside the compiled train step: {str(error).splitlines()[0]}. Write it with "
            "jax.numpy or torch on the arrays it receives (no numpy conversion, .item() or float()), calling "
            "`model`, not `self.model`."
        ) from error
    raise error


def ignore_keys_at_inference(model: Any) -> tuple[str, ...]:
    """HF's default ignore_keys: the config's keys_to_ignore_at_inference (["cache"] without one), none without
    a config."""
    config = getattr(model, "config", None)
    return tuple([] if config is None else getattr(config, "keys_to_ignore_at_inference", ["cache"]))
