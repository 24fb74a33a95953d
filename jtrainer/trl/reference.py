"""DPO's reference model on jtrainer: frozen weights on the mesh and the log-probabilities the loss reads.

A reference that is another model (an explicit `ref_model`, TRL's reload of the policy's checkpoint, or the
policy itself before training for `precompute_ref_log_probs`) is held as its own weights, sharded by the same
logical rules as the policy, cast once to the compute dtype, with no optimizer state; a jitted pass computes its
log-probabilities for each batch before the train or eval step, which reads them as the columns TRL's precomputed
log-probabilities would be. A peft policy's reference is the policy with its adapter disabled: the loss computes
it inside the train step, from the same weights (`pair_forward(..., adapter_disabled=True)`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jtrainer.core.state import split_params
from jtrainer.numerics.losses import IGNORE_INDEX
from jtrainer.numerics.step import bound_model, cast_floats, graphdef_in_mode, split_outputs
from jtrainer.parallel import sharding
from jtrainer.trl import losses

SIDES = ("chosen", "rejected")
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def paired(inputs: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """TRL's stacked batch: the chosen rows, then the rejected rows."""
    return {
        name: jnp.concatenate([inputs[f"chosen_{name}"], inputs[f"rejected_{name}"]])
        for name in ("input_ids", "attention_mask", "completion_mask")
    }


def pair_forward(
    model, pair: dict[str, jax.Array], bridged: bool, adapter_disabled: bool = False, router_logits: bool = False
):
    """The model's outputs and logits on the stacked rows, and the completion labels (-100 elsewhere);
    `router_logits`: an MoE model returns its load-balancing loss (outputs.aux_loss)."""
    kwargs: dict[str, Any] = {"input_ids": pair["input_ids"], "attention_mask": pair["attention_mask"]}
    if bridged:
        kwargs["use_cache"] = False  # as TRL
    if router_logits:
        kwargs["output_router_logits"] = True
    if adapter_disabled:
        with model.torch_model.disable_adapter():
            outputs = model(**kwargs)
    else:
        outputs = model(**kwargs)
    labels = jnp.where(pair["completion_mask"] == 0, IGNORE_INDEX, pair["input_ids"])
    return outputs, split_outputs(outputs)[1], labels


def sequence_log_probs(model, pair, bridged: bool, ld_alpha, adapter_disabled: bool = False) -> jax.Array:
    """The summed completion log-probabilities of each stacked row [2B], without gradient."""
    _, logits, labels = pair_forward(model, pair, bridged, adapter_disabled)
    stats = losses.next_token_stats(jax.lax.stop_gradient(logits), labels)
    return jax.lax.stop_gradient(losses.sequence_log_probs(stats.log_probs, stats.mask, ld_alpha))


class Reference:
    """A frozen copy of a model on the mesh and its jitted log-probability pass."""

    def __init__(
        self, nnx_model, mesh, axis_rules, context, compute_dtype, bridged: bool, ld_alpha, adapter_disabled=False
    ):
        graphdef = graphdef_in_mode(nnx_model, training=False)
        _, params, rest = split_params(nnx_model)
        self._context = context  # the Trainer's mesh and logical rules, under which model code traces
        # Cast once (the reference computes in the compute dtype), then placed as the policy's are laid out.
        params = cast_floats(nnx.to_pure_dict(params), compute_dtype)
        # (sharding.place: copies, built by each process from its own whole weights on several hosts.)
        self.params = sharding.place(params, sharding.named(mesh, sharding.param_specs(nnx_model, mesh, axis_rules)))
        self.state = sharding.place(rest, sharding.model_state_shardings(nnx_model, mesh, axis_rules))

        def log_probs(params, state, inputs):
            with bound_model(graphdef, params, state) as model:
                logps = sequence_log_probs(model, paired(inputs), bridged, ld_alpha, adapter_disabled)
            chosen, rejected = jnp.split(logps, 2)
            return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

        def stacked_log_probs(params, state, inputs):  # [micro_batches, rows, ...]
            return jax.lax.map(lambda one: log_probs(params, state, one), inputs)

        self._one = jax.jit(log_probs)
        self._stacked = jax.jit(stacked_log_probs)

    def columns(self, inputs: dict[str, Any], stacked: bool = False) -> dict[str, jax.Array]:
        """The reference's log-probabilities of a batch's chosen and rejected rows."""
        wanted = {k: v for k, v in inputs.items() if k.startswith(SIDES)}
        with self._context():
            return (self._stacked if stacked else self._one)(self.params, self.state, wanted)
