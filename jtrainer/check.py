"""`jtrainer check CONFIG`: what each set TrainingArguments field does here, and the train step compiled ahead of
time (`jit(...).lower(...).compile()`) on this machine's devices, with its memory per device and FLOPs, before
any data is read or any parameter allocated.

The model is built abstractly (shapes only); the batch is zeros of the configured shape. The mesh is the
config's, so run the check on the target machine (or, with `XLA_FLAGS=--xla_force_host_platform_device_count=N`,
on a CPU with the same device count and a shrunk model).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jtrainer import args as args_module
from jtrainer import batch_size, jobs

# Fields honoured through a JAX mechanism rather than the torch one HF uses.
EMULATED: dict[str, str] = {
    "fsdp": "parameters and optimizer state split over the mesh's fsdp axis (GSPMD)",
    "parallelism_config": "mapped onto the mesh's data/fsdp/tensor/sequence axes",
    "gradient_checkpointing": "jax.checkpoint (remat) around every block",
    "gradient_checkpointing_kwargs": "remat policy from jax.checkpoint_policies",
    "activation_checkpointing": "jax.checkpoint (remat) around every block",
    "activation_checkpointing_kwargs": "remat policy from jax.checkpoint_policies",
    "bf16": "compute in bfloat16, float32 master weights and optimizer state",
    "bf16_full_eval": "evaluation in bfloat16",
    "fp16": "compute in float16 with dynamic loss scaling (torch's GradScaler), float32 master weights",
    "fp16_full_eval": "evaluation in float16",
    "optim": "the optax equivalent of the torch optimizer",
    "torch_compile": "the step is always compiled by XLA",
    "dataloader_num_workers": "one background thread prepares and places batches",
    "dataloader_prefetch_factor": "see prefetch_batches",
    "dataloader_pin_memory": "batches are placed on devices ahead of the step",
    "use_cpu": "JAX_PLATFORMS=cpu picks the CPU",
    "gradient_accumulation_steps": "a scan over micro-batches inside one compiled step",
    "auto_find_batch_size": "XLA out-of-memory or the compiled step's memory analysis; effective batch kept",
}


def field_report(training_args) -> list[tuple[str, Any, str, str]]:
    """(field, value, honoured|emulated|ignored, why) for every field that differs from its default."""
    defaults = type(training_args)(output_dir=training_args.output_dir)
    rows = []
    for f in dataclasses.fields(training_args):
        if not f.init or f.name in ("output_dir",):
            continue
        value = getattr(training_args, f.name)
        if value == getattr(defaults, f.name):
            continue
        if f.name in args_module.IGNORED_FIELDS:
            rows.append((f.name, value, "ignored", args_module.IGNORED_FIELDS[f.name]))
        elif f.name in EMULATED:
            rows.append((f.name, value, "emulated", EMULATED[f.name]))
        else:
            rows.append((f.name, value, "honoured", ""))
    return rows


def sample_batch(task: str, rows: int, length: int, target_length: int) -> dict[str, np.ndarray]:
    """Zeros shaped like one collated batch of the task."""
    ids = np.ones((rows, length), np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if task == "causal_lm":
        batch["labels"] = ids.copy()
    elif task == "sequence_classification":
        batch["labels"] = np.zeros((rows,), np.int32)
    else:
        batch["labels"] = np.ones((rows, target_length), np.int32)
    return batch


def compile_step(model_args, data_args, training_args) -> dict[str, Any]:
    """Compile the config's train step ahead of time; its memory and FLOPs."""
    from flax import nnx

    from jtrainer import sharding
    from jtrainer.seq2seq import Seq2SeqTrainer
    from jtrainer.step import StepBatch

    vocab = data_args.tokenizer_vocab_size
    special = {"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 1}
    model = jobs.build_model(model_args, vocab, special, training_args.seed, abstract=True)
    if training_args.activation_checkpointing:
        model.gradient_checkpointing_enable(training_args.activation_checkpointing_kwargs)
    training_args.push_to_hub = False  # a dry run creates no repository
    trainer_class = Seq2SeqTrainer if model_args.task == "seq2seq" else None
    from jtrainer.trainer import Trainer

    trainer = (trainer_class or Trainer)(model=model, args=training_args, eval_dataset=())
    ga = training_args.gradient_accumulation_steps
    rows = training_args.per_device_train_batch_size * sharding.data_parallel_size(trainer.mesh)
    batch = sample_batch(model_args.task, rows, data_args.block_size, data_args.max_target_length)
    spec = trainer._loss_spec(batch)
    max_steps = training_args.max_steps if training_args.max_steps > 0 else 1000
    trainer.create_optimizer_and_scheduler(max_steps)
    tx = trainer._step_optimizer()
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    shardings = trainer._state_shardings(tx, params)
    state_shapes = jax.eval_shape(trainer._train_state_init(tx), params, rest)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state_shapes, shardings)
    stacked = {k: np.stack([v] * ga) for k, v in batch.items()}
    step_batch = StepBatch(
        inputs=sharding.put_global(stacked, trainer.mesh, row_dim=1, global_rows=rows),
        micro_weight=jax.device_put(np.ones((ga,), np.float32), sharding.replicated(trainer.mesh)),
    )
    train_step = trainer._compiled_train_step(tx, spec, shardings)
    with trainer._mesh_context():
        compiled = train_step.lower(state, step_batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float((cost or {}).get("flops", 0.0))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    tokens = ga * rows * data_args.block_size
    return {
        "mesh": dict(trainer.mesh.shape),
        "devices": jax.device_count(),
        "parameters": n_params,
        "tokens_per_step": tokens,
        "step_bytes_per_device": batch_size.step_bytes(compiled),
        "device_memory_bytes": batch_size.device_memory_bytes(),
        "flops_per_step_per_device": flops,
        "model_flops_per_step": 6 * n_params * tokens,
    }


def run_check(model_args, data_args, training_args) -> dict[str, Any]:
    """Print the field report and the compiled step's numbers; returns both."""
    from jtrainer.cli import say

    jobs.check_task(model_args)
    report = field_report(training_args)
    say("jtrainer check: TrainingArguments set in this config")
    width = max((len(name) for name, *_ in report), default=10)
    for name, value, status, why in report:
        shown = getattr(value, "value", value)
        say(f"  {name:<{width}}  {status:<8}  {shown!r}" + (f"  ({why})" if why else ""))
    numbers = compile_step(model_args, data_args, training_args)
    gib = 2**30
    say(f"jtrainer check: train step compiled for mesh {numbers['mesh']} on {numbers['devices']} device(s)")
    say(f"  parameters                 {numbers['parameters']:,}")
    say(f"  tokens per step            {numbers['tokens_per_step']:,}")
    if numbers["step_bytes_per_device"] is not None:
        say(f"  memory per device          {numbers['step_bytes_per_device'] / gib:.3f} GiB")
    if numbers["device_memory_bytes"] is not None:
        say(f"  device memory              {numbers['device_memory_bytes'] / gib:.3f} GiB")
    say(f"  XLA FLOPs per device/step  {numbers['flops_per_step_per_device']:.3e}")
    say(f"  model FLOPs per step (6ND) {numbers['model_flops_per_step']:.3e}")
    return {"fields": report, **numbers}
