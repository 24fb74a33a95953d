"""transformers' attention, routed to jtrainer's on TPUs: a bridged Gemma or Llama trains long rows through the
splash kernel (`jtrainer.models.kernels.attention`) as the native families do.

transformers picks a model's attention by name (`config._attn_implementation`) from two registries: the
attention function (`AttentionInterface`) and the function that builds its mask (`AttentionMaskInterface`). Both
are registered here as "jtrainer". For plain causal self-attention (training: queries and keys are the same
tokens; padding only, or a sliding window) the mask function hands over the 2-D padding mask and the window
instead of a [length, length] mask, and the attention function runs `causal_attention`, which chooses the
kernel. Everything else (a cache, packed rows, bidirectional or image-token masks, attention dropout, soft-capped
logits, sinks) goes to transformers' own SDPA path unchanged.

The bridge switches a model to "jtrainer" only while it traces a step that attention runs blockwise in: on TPUs
(the mesh's devices), or anywhere under `JTRAINER_ATTENTION=splash` (Pallas' interpret mode off TPUs: tests).
On the CPU backend it switches only configs that chose transformers' SDPA attention: their plain causal layers
run the native models' blocked CPU formulation (no [length, length] probabilities kept for the backward pass),
and any other call runs the same SDPA function with the same mask as unswitched, silently. Eager attention
(soft-capping, sinks, T5's position bias) is left as the model chose it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from jtrainer.core import env
from jtrainer.models.kernels import attention as native_attention

NAME = "jtrainer"


@dataclasses.dataclass(frozen=True)
class CausalPadding:
    """The mask of plain causal self-attention: `padding` [batch, length] (True for real tokens; None: none)
    and HF's sliding window (query i sees key j when i - j < window; None: the whole row)."""

    padding: torch.Tensor | None
    window: int | None

    def dense(self, length: int) -> torch.Tensor:
        """The same as transformers' boolean [batch or 1, 1, length, length] mask."""
        offsets = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        visible = offsets >= 0
        if self.window is not None:
            visible = visible & (offsets < self.window)
        visible = visible[None, None]
        if self.padding is not None:
            visible = visible & self.padding[:, None, None, :]
        return visible


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """transformers' mask function under the name "jtrainer": plain causal self-attention -> CausalPadding;
    anything else -> SDPA's mask."""
    plain = kwargs.get("allow_is_causal_skip") is True and q_length == kv_length and not q_offset and not kv_offset
    if not plain:
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            attention_mask=attention_mask,
            **kwargs,
        )
    padding = None if attention_mask is None else attention_mask[:, -kv_length:].to(torch.bool)
    return CausalPadding(padding, kwargs.get("local_size"))


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention function under the name "jtrainer" ([batch, heads, length, head_dim] in,
    [batch, length, heads, head_dim] out, no weights)."""
    reason = _not_blockwise(module, attention_mask, dropout, kwargs)
    if reason is not None:
        _fall_back(module, reason)
        if isinstance(attention_mask, CausalPadding):
            attention_mask = attention_mask.dense(query.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    env = query._env
    q, k, v = (env.t2j_iso(t).transpose(0, 2, 1, 3) for t in (query, key, value))
    padding = None if attention_mask.padding is None else env.t2j_iso(attention_mask.padding)
    out = native_attention.causal_attention(
        q, k, v, native_attention.TokenMask(padding), scaling, sliding_window=attention_mask.window
    )
    import torchax.tensor

    return torchax.tensor.Tensor(out, env), None


def _not_blockwise(module, attention_mask, dropout: float, kwargs) -> str | None:
    """Why this attention call cannot run blockwise (None: it can)."""
    if not isinstance(attention_mask, CausalPadding):
        return (
            "its mask is not plain causal self-attention (a KV cache, packed rows, a bidirectional or image-token mask)"
        )
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        return "it is not causal"
    if kwargs.get("position_bias") is not None:
        return "an additive position bias"
    if dropout and module.training:
        return f"attention dropout ({dropout}) in training"
    if kwargs.get("softcap") is not None:
        return "soft-capped attention logits"
    if kwargs.get("s_aux") is not None:
        return "attention sinks"
    if kwargs.get("output_attentions"):
        return "output_attentions asks for the attention weights"
    return None


_TOLD: set[tuple[str, str]] = set()


def _fall_back(module, reason: str) -> None:
    """An explicit JTRAINER_ATTENTION=splash that this call cannot take is an error; otherwise, where the splash
    kernel was asked for, one warning per layer class and reason that it runs transformers' SDPA with a dense
    [length, length] mask (on the CPU route nothing: the call runs the SDPA the model chose)."""
    if not native_attention.blockwise_requested():
        return  # the CPU route: such a call runs the SDPA the model chose
    layer = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if native_attention.splash_forced():
        raise ValueError(
            f"{env.ATTENTION.name}=splash: {layer} cannot run through the splash kernel: {reason}. Unset "
            f"{env.ATTENTION.name} to let such layers run transformers' SDPA attention."
        )
    if (type(module).__name__, reason) not in _TOLD:
        _TOLD.add((type(module).__name__, reason))
        logging.getLogger(__name__).warning(
            f"{type(module).__name__} layers run transformers' SDPA attention with a dense [length, length] mask, "
            f"not the splash kernel: {reason}."
        )


@contextlib.contextmanager
def routed(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention (every config in it) switched to "jtrainer" for one call where attention runs
    blockwise, or on the CPU backend where it chose SDPA; its own implementation is put back after."""
    if native_attention.blockwise_requested():
        switched: tuple[str | None, ...] = (None, "sdpa", "eager")
    elif native_attention.cpu_kernel_requested():
        switched = ("sdpa",)
    else:
        yield
        return
    _register()
    configs: dict[int, Any] = {
        id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")
    }
    before = {key: config._attn_implementation for key, config in configs.items()}
    for config in configs.values():
        if config._attn_implementation in switched:
            config._attn_implementation = NAME
    try:
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]


def _register() -> None:
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, mask)
