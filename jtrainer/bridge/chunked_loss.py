"""A transformers causal LM's loss without whole [tokens, vocabulary] logits, under the bridge.

transformers' causal LMs end their forward with `logits = self.lm_head(hidden_states)` and, given labels,
`self.loss_function(logits, labels, ...)` (ForCausalLMLoss). For one call asked for its loss alone, the model runs
without labels and its output embeddings (lm_head, a peft adapter on it included) hand their input to jtrainer's
chunked loss (models.lm_head), which calls the head's own forward one chunk of positions at a time, and return a
stand-in for the logits. A model that does anything with the logits after the head (Gemma's soft-capping, Cohere's
scale) returns something else than the stand-in, one that adds to its loss (an MoE router's aux_loss) returns an
aux_loss: those calls run again with whole logits (`NotChunked`), so the loss is always the model's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from jtrainer.bridge import adapters, torchax_compat


class NotChunked(Exception):
    """This model's call did not end in the plain LM head and ForCausalLMLoss: it runs with whole logits."""


def _output_embeddings(model: Any) -> torch.nn.Module | None:
    try:
        head = getattr(model, "get_output_embeddings", lambda: None)()
    except NotImplementedError:
        return None
    return head if isinstance(head, torch.nn.Module) else None


# Config fields of transformers' families that change the logits after the head (soft-capping, scaling) or add
# the router's loss to the model's.
_AFTER_THE_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_router_logits")


def chunkable(model: torch.nn.Module) -> bool:
    """Whether `model` (a peft model: its base) is a decoder-only transformers causal LM whose loss is
    ForCausalLMLoss on its LM head's output: transformers' own forward, computing its loss by
    `self.loss_function`, which its loss_type resolves to ForCausalLMLoss; no `skip_logits` of its own (a
    Liger-patched forward takes the flag itself)."""
    if any(getattr(c, "is_prompt_learning", False) for c in (getattr(model, "peft_config", None) or {}).values()):
        return False  # peft's virtual tokens lengthen the hidden states, and peft pads the labels to match
    base = adapters.inspected(model)
    forward = getattr(type(base), "forward", None)
    config = getattr(base, "config", None)
    if forward is None or config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if any(getattr(config, name, None) for name in _AFTER_THE_HEAD):
        return False  # known at once; check_outputs finds the others when their call is traced
    return (
        getattr(base, "loss_type", None) in (None, "ForCausalLM")  # None: PreTrainedModel's ForCausalLMLoss
        and "_loss_function" not in vars(base)
        and str(getattr(forward, "__module__", "")).startswith("transformers.models.")
        and _loss_from_loss_function(forward)
        and "skip_logits" not in inspect.signature(forward).parameters
        and _output_embeddings(base) is not None
    )


@functools.cache
def _loss_from_loss_function(forward: Callable) -> bool:
    """Whether the forward's code computes its loss by `self.loss_function` (not a loss of its own)."""
    try:
        return "self.loss_function(" in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


@dataclasses.dataclass
class HeadCall:
    """What the intercepted LM head saw in one call: the loss it computed and the stand-in it returned."""

    loss: jax.Array | None = None
    stand_in: torch.Tensor | None = None


@contextlib.contextmanager
def loss_at_head(model: torch.nn.Module, labels_shape: tuple[int, ...], loss_of_hidden: Callable[..., jax.Array]):
    """For one call of `model`: its LM head computes `loss_of_hidden(hidden, project)` (`project`: the head's own
    forward on a chunk of hidden states, as JAX arrays; logits in float32, as ForCausalLMLoss upcasts them) and
    returns a stand-in for the logits (hidden states of other positions than the labels' [rows, length]: raises
    NotChunked). Yields the `HeadCall`; the head's own forward is put back after."""
    head = _output_embeddings(adapters.inspected(model))
    assert head is not None, "chunkable(model) was checked"
    env = torchax_compat.environment()
    own_forward = head.forward
    had_instance_forward = "forward" in vars(head)
    call = HeadCall()

    def project(hidden_BxCxD: jax.Array) -> jax.Array:
        return env.t2j_iso(own_forward(env.j2t_iso(hidden_BxCxD))).astype(jnp.float32)

    def forward(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or call.stand_in is not None or tuple(hidden.shape[:2]) != tuple(labels_shape):
            raise NotChunked  # an unusual head call (or positions the labels do not match): whole logits
        call.loss = loss_of_hidden(env.t2j_iso(hidden), project)
        call.stand_in = hidden.new_zeros(())
        return call.stand_in

    head.forward = forward
    try:
        yield call
    finally:
        if had_instance_forward:
            head.forward = own_forward
        else:
            del head.forward


def check_outputs(outputs: Any, call: HeadCall) -> None:
    """Raise NotChunked unless the model returned the head's stand-in as its logits and nothing added to a loss."""
    logits = outputs.get("logits") if isinstance(outputs, dict) else None
    if call.stand_in is None or logits is not call.stand_in or outputs.get("aux_loss") is not None:
        raise NotChunked
