"""Rematerialisation policies by name: what a block keeps from its forward pass for the backward pass.

HF's `gradient_checkpointing_kwargs={"policy": NAME}` (alias `activation_checkpointing_kwargs`) picks one, for
every block `gradient_checkpointing` wraps:

- `full` (the default): nothing inside a block is kept; the backward pass runs the block's forward again from
  its input. Least memory, one more forward pass of compute.
- `save_dots_except_mlp`: attention's query/key/value projections, its context (and the attention kernel's own
  residuals) and output projection are kept; only the MLP, the widest part, is recomputed.
- `offload_dots_except_mlp`: the same values, moved to host memory (`pinned_host`) during the forward pass and
  back for the backward pass: HBM of `full`, compute of `save_dots_except_mlp`, at the cost of host transfers
  (on CPU the two memories are one).
- any name of `jax.checkpoint_policies` (`dots_saveable`, `nothing_saveable`, ...), as before.

The named values are tagged with `jax.ad_checkpoint.checkpoint_name` by the native families that declare
`names_activations` (Llama and its relatives, GPT-2); other models (and bridged torch models, whose values carry
no names) take `full` or a jax.checkpoint_policies name.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

# The values a block names (jax.ad_checkpoint.checkpoint_name), which the policies below select.
QUERY, KEY, VALUE, CONTEXT, OUT = "query_proj", "key_proj", "value_proj", "attention_context", "out_proj"
ATTENTION_NAMES = (QUERY, KEY, VALUE, CONTEXT, OUT)

POLICIES: dict[str, str] = {
    "full": "every block recomputed in the backward pass from its input",
    "save_dots_except_mlp": "attention's projections and context kept, the MLP recomputed",
    "offload_dots_except_mlp": "attention's projections and context kept in host memory, the MLP recomputed",
}
NAMED = ("save_dots_except_mlp", "offload_dots_except_mlp")


def check(name: str | None, names_activations: bool, argument: str = "activation_checkpointing_kwargs") -> None:
    """A one-line error for a policy that is neither jtrainer's nor jax's, or that needs named values the
    model does not name."""
    if name is None or name in POLICIES or hasattr(jax.checkpoint_policies, name):
        if name in NAMED and not names_activations:
            raise ValueError(
                f"{argument} policy={name!r} keeps values jtrainer's Llama-family and GPT-2 models name; this "
                "model names none (it would keep nothing): use 'full' or a jax.checkpoint_policies name."
            )
        return
    raise ValueError(
        f"{argument} policy={name!r} is neither one of {sorted(POLICIES)} nor a jax.checkpoint_policies name "
        "(e.g. 'dots_saveable', 'nothing_saveable', 'dots_with_no_batch_dims_saveable')."
    )


def policy(name: str | None) -> Callable | None:
    """The jax.checkpoint policy of `name` (None: keep nothing, as `full`)."""
    if name is None or name == "full":
        return None
    if name == "save_dots_except_mlp":
        return jax.checkpoint_policies.save_only_these_names(*ATTENTION_NAMES)
    if name == "offload_dots_except_mlp":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(ATTENTION_NAMES),
            offload_src="device",
            offload_dst="pinned_host",
        )
    return getattr(jax.checkpoint_policies, name)


def describe(name: str | None) -> str:
    """What `name` keeps, in words (for `jtrainer check`)."""
    name = name or "full"
    return POLICIES.get(name, f"jax.checkpoint_policies.{name}")
