"""The device train state (one pytree) and HF's host-side JSON state.

`TrainState` is what jit, sharding and orbax see. `TrainerState` / `TrainerControl` are HF's own classes, so
`trainer_state.json` and every callback see exactly what they see under transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
from flax import nnx, struct
from transformers.trainer_callback import ExportableState, TrainerControl, TrainerState

from jtrainer.core import host_rng

__all__ = ["Frozen", "LoopState", "TrainState", "TrainerState", "TrainerControl", "ExportableState"]


class Frozen(nnx.Variable):
    """A weight no optimizer updates (a torch parameter with `requires_grad=False`: a peft model's base model).
    It is model state, laid out over the mesh as parameters are; a peft model's checkpoints leave it out."""


@struct.dataclass
class TrainState:
    """Everything a train step reads and writes: the optimizer step, parameters, optimizer and model state."""

    # Leaves are arrays; the same tree with shardings or ShapeDtypeStructs describes a layout.
    step: jax.Array | Any
    params: Any  # pure nested dict of arrays (nnx.to_pure_dict), fp32 master weights
    opt_state: Any
    model_state: Any  # the model's non-parameter nnx state (rng counters, batch statistics, ...)
    rng: jax.Array | Any  # uint32 key data of the run's base key; step keys are fold_in(rng, step)

    if TYPE_CHECKING:  # struct.dataclass adds it

        def replace(self, **changes: Any) -> TrainState: ...


def split_params(module: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """A module as (graph, parameters, every other state): what the steps take apart and merge back."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]  # flax's stub: variadic
    return graphdef, params, rest


class LoopState(NamedTuple):
    """The host side of a step that its checkpoint keeps, so that a resumed run goes on exactly as this one."""

    collator_rng: host_rng.HostRngState | None  # the training collator's generators after this step's batches
    padded_length: int | None  # the padded sequence length reached (a resumed run pads the same)
    # Batches prepared step by step (a random collator with evaluations during training): HF's loader had read
    # the next batch before this step's evaluation drew, so the draws after that batch go on from here.
    collator_rng_after_next: host_rng.HostRngState | None = None
