"""A compiled step's ledger: what one device holds (parameters, optimizer state, activations, code), the FLOPs
and bytes XLA counts for it, and the roofline estimate of its time on a target. Pure functions of compiled steps
and the run's numbers; `jtrainer check` prints them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jtrainer.core.state import Frozen, split_params
from jtrainer.models.kernels import splash_attention
from jtrainer.parallel import sharding
from jtrainer.sizing import memory_report, targets


def per_device_bytes(arg_info, shardings) -> int:
    """Bytes one device holds of a pytree of arguments (shape, dtype) laid out by `shardings`."""
    total = 0
    # An argument the step never reads (pruned by jit) has no sharding and takes no memory.
    for info, sh in zip(jax.tree.leaves(arg_info), jax.tree.leaves(shardings, is_leaf=lambda x: x is None)):
        if sh is not None:
            total += int(np.prod(sh.shard_shape(info.shape))) * np.dtype(info.dtype).itemsize
    return total


def parameter_bytes(module, mesh, axis_rules, dtype) -> int:
    """Bytes a device holds of a model's parameters laid out as training lays them (the logical rules), cast to
    `dtype` (None: their own)."""
    _, params, _ = split_params(module)  # the trainable parameters
    specs = sharding.named(mesh, sharding.param_specs(module, mesh, axis_rules))
    total = 0
    for leaf, spec in zip(jax.tree.leaves(nnx.to_pure_dict(params)), jax.tree.leaves(specs), strict=True):
        itemsize = np.dtype(dtype).itemsize if dtype is not None else np.dtype(leaf.dtype).itemsize
        total += int(np.prod(spec.shard_shape(leaf.shape))) * itemsize
    return total


def step_shapes(model, rows: int, length: int, mesh) -> memory_report.StepShapes:
    """The sizes that name the step's values (memory_report), from the model's config and the batch."""
    config = getattr(model, "config", None)

    def get(*names: str) -> int:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        return -1

    return memory_report.StepShapes(
        rows=rows,
        length=length,
        vocab=get("vocab_size"),
        hidden=get("hidden_size", "n_embd", "d_model"),
        intermediate=get("intermediate_size", "n_inner", "d_ff"),
        heads=get("num_attention_heads", "n_head", "num_heads"),
        mesh=dict(mesh.shape),
    )


def kernel_flops(forward: float, rematerialised: bool, devices: int) -> float:
    """FLOPs per device of the splash attention kernels one micro-batch ran (XLA's cost analysis sees none):
    forward, backward, and the forward again where blocks are rematerialised."""
    if not forward:
        return 0.0
    products = splash_attention.FORWARD_PRODUCTS + splash_attention.BACKWARD_PRODUCTS
    if rematerialised:
        products += splash_attention.FORWARD_PRODUCTS
    return forward * products / splash_attention.FORWARD_PRODUCTS / devices


def train_memory(compiled: jax.stages.Compiled, reference_bytes: int = 0) -> dict[str, int] | None:
    """What a device holds while the train step runs, by kind (None where XLA reports no memory analysis).
    Frozen weights (a peft model's base model) are model state laid out as parameters, without optimizer state;
    `reference_bytes`: a separate reference model's (DPO)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    (state_info, _), _ = compiled.args_info
    (state_shardings, _), _ = compiled.input_shardings
    frozen_info, _ = nnx.split_state(state_info.model_state, Frozen, ...)
    frozen_shardings, _ = nnx.split_state(state_shardings.model_state, Frozen, ...)
    params = per_device_bytes(state_info.params, state_shardings.params)
    optimizer = per_device_bytes(state_info.opt_state, state_shardings.opt_state)
    frozen = per_device_bytes(frozen_info, frozen_shardings)
    return {
        "parameters": params,
        **({"frozen weights (no gradients)": frozen} if frozen else {}),
        **({"reference model (DPO, frozen)": reference_bytes} if reference_bytes else {}),
        "optimizer state": optimizer,
        "batch and other state": int(analysis.argument_size_in_bytes) - params - frozen - optimizer,
        "temporaries (activations, gradients)": int(analysis.temp_size_in_bytes),
        "outputs not in place": int(analysis.output_size_in_bytes - analysis.alias_size_in_bytes),
        "generated code": int(analysis.generated_code_size_in_bytes),
    }


def eval_memory(compiled: jax.stages.Compiled, optimizer_bytes: int, returns_logits: bool) -> dict[str, int] | None:
    """What a device holds while the eval step runs during training: it reads the train state's parameters, and
    the optimizer state stays resident beside it."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return {
        "parameters and batch": int(analysis.argument_size_in_bytes),
        "optimizer state (resident)": optimizer_bytes,
        "temporaries": int(analysis.temp_size_in_bytes),
        "outputs (loss" + (", logits)" if returns_logits else ")"): int(
            analysis.output_size_in_bytes - analysis.alias_size_in_bytes
        ),
        "generated code": int(analysis.generated_code_size_in_bytes),
    }


def parameter_counts(compiled: jax.stages.Compiled) -> tuple[int, int]:
    """(all parameters, trainable ones) of a compiled train step's state."""
    (state_info, _), _ = compiled.args_info
    frozen_info, _ = nnx.split_state(state_info.model_state, Frozen, ...)
    trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state_info.params))
    return trainable + sum(int(np.prod(x.shape)) for x in jax.tree.leaves(frozen_info)), trainable


def xla_costs(compiled: jax.stages.Compiled) -> dict[str, float]:
    """XLA's cost analysis of one pass of the step's body (a loop's body is counted once)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"flops": float((cost or {}).get("flops", 0.0)), "bytes": float((cost or {}).get("bytes accessed", 0.0))}


def roofline(numbers: dict[str, Any], target: targets.Target, undercounted: str | None = None) -> dict | None:
    """An estimate, not a measurement: the step takes at least its FLOPs at the chip's peak and its memory
    traffic at the HBM bandwidth; MFU is 6ND over that time at peak. The FLOPs are the larger of XLA's count
    and 6ND per chip (XLA's cost analysis counts a loop's body once). Where XLA's counts are missing (GPU
    targets) or known to be short (`undercounted` says why: the layers' scan), only the lower bound of 6ND at
    peak is given, without an MFU (it would be 100% by construction). None for a chip of unknown peak."""
    from jtrainer.sizing.throughput import peak_flops

    peak = peak_flops(target.devices[0])
    if not peak:
        return None
    six_nd = numbers["model_flops_per_step"] / numbers["devices"]
    if not numbers["flops_per_step_per_device"] or undercounted:
        why = undercounted or "XLA reports no FLOPs or bytes for this target"
        basis = f"lower bound: {numbers['model_flops_name']} at peak ({why})"
        return {"step_s": six_nd / peak, "bound": "compute", "basis": basis, "mfu": None}
    compute_s = max(numbers["flops_per_step_per_device"], six_nd) / peak
    memory_s = numbers["bytes_accessed_per_device"] / target.chip.hbm_bytes_per_s
    step_s = max(compute_s, memory_s)
    return {
        "step_s": step_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "basis": "roofline",
        "mfu": numbers["model_flops_per_step"] / (step_s * peak * numbers["devices"]),
    }


def step_numbers(
    compiled: jax.stages.Compiled,
    eval_compiled: jax.stages.Compiled | None,
    mesh: jax.sharding.Mesh,
    args: Any,
    length: int,
    sequences_per_row: int,
    reference_bytes: int,
    kernel_flops: float,
    eval_returns_logits: bool,
) -> dict[str, Any]:
    """The compiled steps' ledger: memory a device holds (train, eval), parameters, tokens, XLA's counts with the
    attention kernels' FLOPs for the whole step (its micro-batch scan runs its body GA times; XLA counts a loop's
    body once) and the model FLOPs. `sequences_per_row`: 2 for DPO's pairs; `reference_bytes`: a separate
    reference model's weights a device holds."""
    memory = train_memory(compiled, reference_bytes)
    evaluation = None
    if eval_compiled is not None and memory is not None:
        evaluation = eval_memory(eval_compiled, memory["optimizer state"], eval_returns_logits)
    ga = args.gradient_accumulation_steps
    costs = xla_costs(compiled)
    n_params, trainable = parameter_counts(compiled)
    tokens = ga * args.per_device_train_batch_size * length * sharding.data_parallel_size(mesh) * sequences_per_row
    return {
        "mesh": dict(mesh.shape),
        "devices": mesh.devices.size,
        "device_kind": mesh.devices.flat[0].device_kind,
        "parameters": n_params,
        "trainable_parameters": trainable,
        "tokens_per_step": tokens,
        "memory_per_device": memory,
        "step_bytes_per_device": None if memory is None else sum(memory.values()),
        "eval_memory_per_device": evaluation,
        "eval_bytes_per_device": None if evaluation is None else sum(evaluation.values()),
        "flops_per_step_per_device": (costs["flops"] + kernel_flops) * ga,
        "attention_kernel_flops_per_device": kernel_flops * ga,
        "bytes_accessed_per_device": costs["bytes"] * ga,
        # 6ND; frozen weights (LoRA's base) take no weight gradients: 2N forward + 2N input gradients + 2 x trainable.
        "model_flops_per_step": (4 * n_params + 2 * trainable) * tokens,
        "model_flops_name": "6ND" if trainable == n_params else "4ND+2TD",
    }
