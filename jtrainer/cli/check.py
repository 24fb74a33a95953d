"""`jtrainer check CONFIG [--target v5litepod-16]`: what each set TrainingArguments field does here, and the train
step (and, when the config evaluates, the eval step) compiled ahead of time (`jit(...).lower(...).compile()`),
with memory per device, FLOPs and whether it fits, before any data is read or any parameter allocated.

The model is built abstractly (shapes only); the batch is ones of the configured shape; the steps are the ones
training runs, built by the functions the Trainer builds them with (`jtrainer.sizing.abstract_step`), with no
Trainer constructed. Without `--target` it compiles for
this machine's devices; with one, for a TPU slice or GPU nodes that are not here (compile-only topologies,
`jtrainer.sizing.targets`): sizing a run
before renting it. A step that does not fit makes `jtrainer check` exit 1.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import warnings
from typing import Any

import jax
import numpy as np

from jtrainer.cli import tasks
from jtrainer.cli.console import phase, say
from jtrainer.models import remat
from jtrainer.models.kernels import attention, splash_attention
from jtrainer.sizing import abstract_step, batch_size, ledger, memory_report, targets
from jtrainer.sizing.memory_report import size
from jtrainer.trainer import args as args_module


def field_report(training_args) -> list[tuple[str, Any, str, str]]:
    """(field, value, honoured|emulated|ignored, why) for every field that differs from its default."""
    with warnings.catch_warnings():  # the defaults' own deprecation notes were shown when the config was read
        warnings.simplefilter("ignore")
        defaults = type(training_args)(output_dir=training_args.output_dir)
    rows = []
    for f in dataclasses.fields(training_args):
        if not f.init or f.name in ("output_dir",):
            continue
        value = getattr(training_args, f.name)
        if value == getattr(defaults, f.name):
            continue
        trl_fields = getattr(type(training_args), "trl_fields", {})  # SFTConfig / DPOConfig's own fields
        treatment = trl_fields[f.name] if f.name in trl_fields else args_module.field_treatment(f.name)
        rows.append((f.name, value, *treatment))
    return rows


def sample_batch(task: str, rows: int, length: int, target_length: int) -> dict[str, np.ndarray]:
    """A collated batch of the task's shapes (token ids 1, labels 0 or 1: values do not change the program)."""
    ids = np.ones((rows, length), np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if task == "causal_lm":
        batch["labels"] = ids.copy()
    elif task == "sequence_classification":
        batch["labels"] = np.zeros((rows,), np.int32)
    else:
        batch["labels"] = np.ones((rows, target_length), np.int32)
    return batch


ATTENTION_NAMES = {
    "splash": "splash attention (Pallas kernel, blockwise)",
    "cudnn": "cuDNN flash attention",
    "xla": "XLA's (holds [length, length] scores)",
    "cpu": "the CPU formulation (blocked, holds scores)",
}


class StepDoesNotFit(Exception):
    """The compiled train step needs more memory per device than the target has; `largest`: what it spends
    memory on (memory_report), where known."""

    def __init__(self, message: str, largest: list | None = None, shapes=None):
        super().__init__(message)
        self.largest, self.shapes = largest or [], shapes


@contextlib.contextmanager
def _without_compilation_cache(active: bool):
    """Cross-compiled executables must not enter the persistent cache: they cannot be loaded by a real client."""
    if not active:
        yield
        return
    before = getattr(jax.config, "jax_enable_compilation_cache")
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


@contextlib.contextmanager
def _refusal_as(step: str, largest=lambda: [], shapes=None):
    """XLA's own refusal to compile a layout that overflows the chip (TPU compilers check the memory they need)
    -> StepDoesNotFit naming the step and, from `largest()`, what the memory goes to; other errors propagate."""
    try:
        yield
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if "RESOURCE_EXHAUSTED" in line]
        if not lines:
            raise
        raise StepDoesNotFit(f"the {step} step: " + lines[0][:400].rstrip("."), largest(), shapes) from None


def compile_step(model_args, data_args, training_args, target: targets.Target | None = None) -> dict[str, Any]:
    """Compile the config's train step ahead of time, on this machine's devices or for `target`; its memory per
    device (by kind), FLOPs and whether it fits. Raises StepDoesNotFit when XLA refuses the layout. Builds no
    Trainer: the same `sizing.abstract_step` and `kinds.loss_rules` functions the Trainer builds its steps with."""
    from jtrainer.parallel import sharding

    args = copy.copy(training_args)
    vocab = data_args.tokenizer_vocab_size
    special = {"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 1}
    model = tasks.build_model(model_args, vocab, special, args.seed, abstract=True)
    kind = model_args.trainer
    example, eval_example = _sample_batches(model_args, data_args, args)
    rows = args.per_device_train_batch_size
    where = target.name if target else "this machine"
    steps = args.max_steps if args.max_steps > 0 else 1000
    evaluates = str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no"
    # The CLI's classification computes accuracy from the logits, so its eval step returns them.
    with_metrics = model_args.task == "sequence_classification"
    with sharding.use_devices(target.devices if target else None), _without_compilation_cache(target is not None):
        run = abstract_step.AbstractRun.of(model, args, _custom_loss_spec(kind, model_args.use_peft))
        reference = _reference_bytes(kind, model_args, run)
        with (
            splash_attention.forward_flops() as kernel_forward,
            attention.chosen_implementations() as attention_used,
            phase(f"jtrainer check: tracing the train step (per_device_train_batch_size {rows})"),
        ):
            traced, state = run.trace_train(example, steps)
        mesh = run.layout.mesh
        shapes = ledger.step_shapes(
            run.held.module, rows * sharding.data_parallel_size(mesh), data_args.block_size, mesh
        )

        def largest():
            (_, batch_info), _ = traced.args_info  # the program's inputs: the train state, then the batch
            return memory_report.largest_values(traced.jaxpr, shapes, batch_inputs=len(jax.tree.leaves(batch_info)))

        with _refusal_as("train", largest, shapes), phase(f"jtrainer check: XLA compiling the train step for {where}"):
            compiled = abstract_step.compile_traced(traced, run.layout)
        eval_compiled = None
        if evaluates:
            with _refusal_as("eval"), phase(f"jtrainer check: XLA compiling the eval step for {where}"):
                eval_compiled = run.compile_eval(eval_example, state, with_metrics)
    # The splash attention kernels' FLOPs (XLA's cost analysis sees none), one micro-batch's, per device.
    kernel = ledger.kernel_flops(sum(kernel_forward), args.gradient_checkpointing, mesh.devices.size)
    return {
        "largest_values": largest,
        "step_shapes": shapes,
        **ledger.step_numbers(
            compiled,
            eval_compiled,
            mesh,
            args,
            data_args.block_size,
            sequences_per_row=2 if kind == "dpo" else 1,
            reference_bytes=reference,
            kernel_flops=kernel,
            eval_returns_logits=with_metrics,
        ),
        "device_memory_bytes": target.chip.hbm_bytes if target else batch_size.device_memory_bytes(),
        "attention": ", ".join(ATTENTION_NAMES.get(name, name) for name in sorted(attention_used)) or "none traced",
    }


def _custom_loss_spec(kind: str, peft: bool):
    """TRL's trainers' own loss rules (`trainer: sft | dpo`), else None (HF's)."""
    if kind not in TRL_TRAINERS:
        return None
    from jtrainer.trl import sizing as trl_sizing

    return functools.partial(trl_sizing.loss_spec, kind, peft=peft)


def _sample_batches(model_args, data_args, args) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Example train and eval batches (one device's rows) of the shapes the config's collators make (TRL's
    trainers: theirs)."""
    kind = model_args.trainer
    if kind in TRL_TRAINERS:
        from jtrainer.trl import sizing as trl_sizing

        train_rows, eval_rows = args.per_device_train_batch_size, args.per_device_eval_batch_size
        return trl_sizing.sample_batch(kind, args, train_rows), trl_sizing.sample_batch(kind, args, eval_rows)
    task, length, target_length = model_args.task, data_args.block_size, data_args.max_target_length
    return (
        sample_batch(task, args.per_device_train_batch_size, length, target_length),
        sample_batch(task, args.per_device_eval_batch_size, length, target_length),
    )


# `trainer: sft | dpo` (jtrainer.trl): TRL's trainers, whose rows are max_length long.
TRL_TRAINERS = ("sft", "dpo")


def trl_data_arguments(model_args, data_args, training_args):
    """TRL's trainers cut rows at their config's max_length: the row length the checks and the sizing read."""
    if model_args.trainer not in TRL_TRAINERS:
        return data_args
    return dataclasses.replace(data_args, block_size=training_args.max_length)


def _reference_bytes(kind: str, model_args, run: abstract_step.AbstractRun) -> int:
    """Bytes a device holds of DPO's separate reference model: the policy's weights (the same layout) in the
    compute dtype; 0 with peft, whose reference is the policy with its adapter disabled."""
    if kind != "dpo" or model_args.use_peft:
        return 0
    layout = run.layout
    return ledger.parameter_bytes(run.held.module, layout.mesh, layout.axis_rules, run.args.compute_dtype(True))


def _say_largest(values: list, shapes, training_args) -> None:
    """The largest kinds of value of a step that does not fit, and the advice that follows from them (the
    general advice where none follows)."""
    lines = memory_report.advice(values, shapes) if values else []
    if values:
        say("  largest values the step computes (estimated from their shapes and the mesh):")
        for value in values:
            say(f"    {value.describe()}")
    for line in lines:
        say(f"  -> {line}")
    if not lines:
        say(f"  {ADVICE}" + ("." if training_args.gradient_checkpointing else ", or turn on gradient_checkpointing."))


def run_check(
    model_args, data_args, training_args, target_name: str | None = None, num_slices: int = 1, num_nodes: int = 1
) -> dict[str, Any]:
    """Print the field report and the compiled step's numbers (for `target_name`, e.g. "v5litepod-16", when
    given); returns both, with "fits"."""
    tasks.check_task(model_args)
    data_args = trl_data_arguments(model_args, data_args, training_args)
    target = targets.resolve(target_name, num_slices, num_nodes) if target_name else None
    tasks.check_run(model_args, data_args, training_args, len(target.devices) if target else None, sizing=True)
    report = field_report(training_args)
    _say_fields(report)
    where = _where(target, num_nodes)
    try:
        numbers, training_args = _compile_fitting(model_args, data_args, training_args, target, where)
    except StepDoesNotFit as error:
        say(f"jtrainer check: does not fit {where}: {error}.")
        _say_largest(error.largest, error.shapes, training_args)
        return {"fields": report, "fits": False, "largest_values": error.largest}
    say(f"jtrainer check: train step compiled for {where}, mesh {numbers['mesh']} on {numbers['devices']} device(s)")
    trainable = numbers["trainable_parameters"]
    say(
        f"  parameters                 {numbers['parameters']:,}"
        + (f" ({trainable:,} trainable)" if trainable != numbers["parameters"] else "")
    )
    say(f"  tokens per step            {numbers['tokens_per_step']:,}")
    say(f"  attention                  {numbers['attention']}")
    if training_args.gradient_checkpointing:
        policy = (training_args.gradient_checkpointing_kwargs or {}).get("policy") or "full"
        say(f"  rematerialisation          {policy}: {remat.describe(policy)}")
    budget, needed = numbers["device_memory_bytes"], numbers["step_bytes_per_device"]
    if numbers["memory_per_device"] is not None:
        _say_memory("  memory per device", numbers["memory_per_device"], needed, budget)
    fits = budget is None or needed is None or needed <= budget
    eval_needed = numbers["eval_bytes_per_device"]
    if eval_needed is not None:
        eval_batch = training_args.per_device_eval_batch_size
        title = f"  memory per device while evaluating (per_device_eval_batch_size {eval_batch})"
        _say_memory(title, numbers["eval_memory_per_device"], eval_needed, budget)
        fits = fits and (budget is None or eval_needed <= budget)
    if budget is not None and needed is not None:
        say(f"  fits                       {'yes' if fits else 'NO'}")
    _say_flops(numbers, model_args, training_args)
    undercounted = "XLA counts the scanned layers once" if model_args.scan_layers else None
    estimate = ledger.roofline(numbers, target, undercounted) if target else None
    _say_estimate(estimate)
    if not fits:
        worst = max(needed, eval_needed or 0)
        say(
            f"jtrainer check: the {'train' if worst == needed else 'eval'} step does not fit: {size(worst)} per "
            f"device, {size(budget)} available."
        )
        values = numbers["largest_values"]() if worst == needed else []
        _say_largest(values, numbers["step_shapes"], training_args)
    found = {
        name: getattr(training_args, name) for name in ("per_device_train_batch_size", "gradient_accumulation_steps")
    }
    return {"fields": report, **numbers, **found, "fits": fits, "estimate": estimate}


def _say_fields(report) -> None:
    say("jtrainer check: TrainingArguments set in this config")
    width = max((len(name) for name, *_ in report), default=10)
    for name, value, status, why in report:
        shown = getattr(value, "value", value)
        say(f"  {name:<{width}}  {status:<8}  {shown!r}" + (f"  ({why})" if why else ""))


def _where(target, num_nodes: int) -> str:
    """Where the step is compiled for, in words."""
    if not target:
        return "this machine"
    return (
        f"{target.name} ({target.chips} x {target.chip.device_kind}, topology {target.topology}"
        + (f" x {target.num_slices} slices" if target.num_slices > 1 else "")
        + (f" = {num_nodes} node(s) x {target.chips // num_nodes} GPUs" if isinstance(target.chip, targets.Gpu) else "")
        + ", compiled here, not run)"
    )


def _say_memory(title: str, memory: dict[str, int], needed: int, budget: int | None) -> None:
    say(title)
    for kind, value in memory.items():
        say(f"    {kind:<38} {size(value):>11}")
    say(f"    {'total':<38} {size(needed):>11}" + (f" of {size(budget)} ({needed / budget:.0%})" if budget else ""))


def _say_flops(numbers: dict[str, Any], model_args, training_args) -> None:
    """XLA's FLOPs (with what its count leaves out or counts once) and the model's."""
    if numbers["flops_per_step_per_device"]:
        ga = training_args.gradient_accumulation_steps
        say(
            f"  XLA FLOPs per device/step  {numbers['flops_per_step_per_device']:.3e}"
            + (f" (the micro-batch loop's count x {ga})" if ga > 1 else "")
            # The chunked loss is a loop too, whose LM head XLA counts for one chunk only: an undercount.
            + (" (the chunked loss's LM head counted for one chunk)" if training_args.chunked_loss_positions() else "")
            + (" (the scanned layers counted once)" if model_args.scan_layers else "")
            + (
                f" (with {numbers['attention_kernel_flops_per_device']:.3e} in the attention kernel, from its shapes)"
                if numbers["attention_kernel_flops_per_device"]
                else ""
            )
        )
    say(f"  model FLOPs per step ({numbers['model_flops_name']}) {numbers['model_flops_per_step']:.3e}")


def _say_estimate(estimate: dict | None) -> None:
    if estimate is not None and estimate["mfu"] is None:
        say(f"  step time (estimate)       at least {estimate['step_s']:.3f} s, {estimate['basis']}")
    elif estimate is not None:
        say(f"  step time (estimate)       {estimate['step_s']:.3f} s, {estimate['bound']}-bound roofline")
        say(f"  MFU (estimate)             {estimate['mfu']:.1%}")


def run_check_native_and_bridged(
    model_args, data_args, training_args, target_name: str | None = None, num_slices: int = 1, num_nodes: int = 1
) -> dict[str, Any]:
    """`run_check` for the config's native family, then for transformers' own model of the same config through
    the torch bridge, then one table of the two (memory, FLOPs, the step estimate); "fits" when both fit."""
    results = {}
    for bridged in (False, True):
        say(f"jtrainer check: {'through the torch bridge' if bridged else 'the native family'}")
        config = dataclasses.replace(model_args, bridge=bridged)
        results[bridged] = run_check(
            config, data_args, copy.deepcopy(training_args), target_name, num_slices, num_nodes
        )
    native, bridged_result = results[False], results[True]
    say("jtrainer check: native and bridged, the same shape")
    say(f"  {'':<30}{'native':>14}{'bridge':>14}")
    for label, key, shown in (
        ("memory per device (train)", "step_bytes_per_device", size),
        ("memory per device (eval)", "eval_bytes_per_device", size),
        ("XLA FLOPs per device/step", "flops_per_step_per_device", lambda v: f"{v:.3e}"),
    ):
        values = [result.get(key) for result in (native, bridged_result)]
        if any(value is not None for value in values):
            say(f"  {label:<30}" + "".join(f"{shown(v) if v is not None else '-':>14}" for v in values))
    estimates = [(result.get("estimate") or {}).get("step_s") for result in (native, bridged_result)]
    if any(estimate is not None for estimate in estimates):
        say(f"  {'step time (estimate)':<30}" + "".join(f"{f'{e:.3f} s' if e else '-':>14}" for e in estimates))
    say(f"  {'fits':<30}" + "".join(f"{'yes' if r['fits'] else 'NO':>14}" for r in (native, bridged_result)))
    return {"native": native, "bridge": bridged_result, "fits": native["fits"] and bridged_result["fits"]}


class _Oversize(Exception):
    """A compiled train step over the target's memory, with its numbers and arguments (what check reports if
    nothing fits)."""

    def __init__(self, why: str, numbers: dict[str, Any], args):
        super().__init__(why)
        self.numbers, self.args = numbers, args


def _compile_fitting(model_args, data_args, training_args, target, where: str) -> tuple[dict[str, Any], Any]:
    """compile_step; with auto_find_batch_size (as training would search on that machine), the train step is
    compiled again at HF's smaller batch sizes (batch_size.search: x0.9, a divisor of the effective batch,
    accumulation raised to keep it) until it fits the target's memory. Returns the numbers and the arguments of
    the batch found (`training_args` itself is not changed)."""

    def attempt(args):
        numbers = compile_step(model_args, data_args, args, target)
        needed, budget = numbers["step_bytes_per_device"], numbers["device_memory_bytes"]
        if args.auto_find_batch_size and needed is not None and budget is not None and needed > budget:
            raise _Oversize(f"{size(needed)} per device, {size(budget)} available", numbers, args)
        if args is not training_args:
            say(
                f"jtrainer check: auto_find_batch_size: per_device_train_batch_size "
                f"{args.per_device_train_batch_size}, gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps} fit {where}"
            )
        return numbers, args

    def retry_on(error: BaseException) -> bool:  # the search is over the training batch only
        if isinstance(error, StepDoesNotFit):
            return training_args.auto_find_batch_size and not str(error).startswith("the eval step")
        return isinstance(error, _Oversize)

    def on_retry(args, smaller: int, error: BaseException) -> None:
        effective = args.per_device_train_batch_size * args.gradient_accumulation_steps
        say(
            f"jtrainer check: auto_find_batch_size: per_device_train_batch_size "
            f"{args.per_device_train_batch_size} does not fit {where} ({error}); trying {smaller} with "
            f"gradient_accumulation_steps {effective // smaller}"
        )

    try:
        return batch_size.search(attempt, training_args, retry_on=retry_on, on_retry=on_retry)
    except batch_size.NoBatchSizeFits as exhausted:
        last = exhausted.__cause__
        if isinstance(last, _Oversize):  # the smallest batch's numbers, reported as not fitting
            return last.numbers, last.args
        raise StepDoesNotFit(f"no per_device_train_batch_size fits (auto_find_batch_size): {last}") from last


ADVICE = (
    "Split parameters and optimizer state over more devices (mesh_shape fsdp), lower "
    "per_device_train_batch_size (keep the batch with gradient_accumulation_steps) or "
    "per_device_eval_batch_size"
)
