"""Llama-family causal LMs in flax.nnx, parameter for parameter HF's `LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM` and `Qwen3ForCausalLM` (one implementation; the members differ in attention details).

Parameter paths mirror HF's module names (`model.layers.0.self_attn.q_proj.kernel` <-> HF
`model.layers.0.self_attn.q_proj.weight`), so `hf_io` converts weights by name alone.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from jtrainer.models import remat
from jtrainer.models.base import Embed, PretrainedMixin, StaticConfig, call_block
from jtrainer.models.kernels import TokenMask, causal_attention, project
from jtrainer.models.layers import ACTIVATION_AXES, RMSNorm, linear
from jtrainer.models.lm_head import ChunkedLossHead
from jtrainer.models.outputs import ModelOutput
from jtrainer.parallel.sharding import TENSOR, constrain

# Activations between layers: rows over (data, fsdp), positions over `sequence`, features whole.


def rope_inverse_frequencies(config, head_dim: int) -> tuple[float, ...]:
    """RoPE inverse frequencies as HF computes them (fp32) for rope types default, linear and llama3."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(base) ** exponents)).astype(np.float32)
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    elif rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif rope_type != "default":
        raise ValueError(
            f"{type(config).__name__}.rope_parameters rope_type={rope_type!r} is not supported yet; "
            "use 'default', 'linear' or 'llama3'."
        )
    return tuple(float(x) for x in inv_freq)


def attention_variant(config) -> dict:
    """What the Llama-family members change in attention: biases, q/k norm, sliding windows per layer."""
    kind = getattr(config, "model_type", "llama")
    bias = bool(getattr(config, "attention_bias", False))
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    if kind == "mistral":
        windows = [window] * config.num_hidden_layers
    else:
        windows = [window if t == "sliding_attention" else None for t in layer_types]
    return {
        "qkv_bias": True if kind == "qwen2" else bias,
        "o_bias": False if kind == "qwen2" else bias,
        "qk_norm": kind == "qwen3",
        "windows": windows,
    }


def apply_rope(x_BxLxNxH: jax.Array, cos_BxLxH: jax.Array, sin_BxLxH: jax.Array) -> jax.Array:
    half = x_BxLxNxH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxLxNxH[..., half:], x_BxLxNxH[..., :half]], axis=-1)
    return x_BxLxNxH * cos_BxLxH[:, :, None, :] + rotated * sin_BxLxH[:, :, None, :]


class LlamaAttention(nnx.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        variant = attention_variant(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.sliding_window = variant["windows"][layer_idx]
        d, h, std = config.hidden_size, self.head_dim, config.initializer_range
        qkv, o = variant["qkv_bias"], variant["o_bias"]
        self.q_proj = linear(
            d, self.num_heads * h, std, ("embed", "heads"), rngs, bias=qkv, dtype=dtype, param_dtype=param_dtype
        )
        self.k_proj = linear(
            d, self.num_kv_heads * h, std, ("embed", "kv"), rngs, bias=qkv, dtype=dtype, param_dtype=param_dtype
        )
        self.v_proj = linear(
            d, self.num_kv_heads * h, std, ("embed", "kv"), rngs, bias=qkv, dtype=dtype, param_dtype=param_dtype
        )
        self.o_proj = linear(
            self.num_heads * h, d, std, ("heads", "embed"), rngs, bias=o, dtype=dtype, param_dtype=param_dtype
        )
        if variant["qk_norm"]:  # Qwen3: RMSNorm of each head's queries and keys, before RoPE
            self.q_norm = RMSNorm(h, config.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(h, config.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, x_BxLxD, cos_BxLxH, sin_BxLxH, mask, offsets_LxS, cache=None):
        """Attention of L queries over S keys; with a cache ((keys, values), index), the L new keys and values
        are written at `index` first and S is the cache length. `offsets_LxS` = query position - key position.
        `mask`: a TokenMask without a cache (causality is the attention's), else booleans [B, 1, L, S]."""
        b, length, _ = x_BxLxD.shape
        q, k, v = project(x_BxLxD, self.q_proj, self.k_proj, self.v_proj)
        q = q.reshape(b, length, self.num_heads, self.head_dim)
        k = k.reshape(b, length, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, length, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos_BxLxH, sin_BxLxH), apply_rope(k, cos_BxLxH, sin_BxLxH)
        q, k, v = checkpoint_name(q, remat.QUERY), checkpoint_name(k, remat.KEY), checkpoint_name(v, remat.VALUE)
        new_cache = None
        if cache is not None:
            (keys_BxSxKxH, values_BxSxKxH), index = cache
            keys_BxSxKxH = jax.lax.dynamic_update_slice(keys_BxSxKxH, k.astype(keys_BxSxKxH.dtype), (0, index, 0, 0))
            values_BxSxKxH = jax.lax.dynamic_update_slice(
                values_BxSxKxH, v.astype(values_BxSxKxH.dtype), (0, index, 0, 0)
            )
            k, v, new_cache = keys_BxSxKxH, values_BxSxKxH, (keys_BxSxKxH, values_BxSxKxH)
        if cache is None:  # self-attention over the L tokens: the mask holds padding / packing, if any
            out_BxLxNxH = causal_attention(q, k, v, mask, sliding_window=self.sliding_window)
        else:
            if self.sliding_window is not None:  # HF: position i sees j when i - j < sliding_window
                mask = mask & (offsets_LxS < self.sliding_window)[None, None]
            out_BxLxNxH = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask)
        out_BxLxNxH = checkpoint_name(out_BxLxNxH, remat.CONTEXT)
        out = checkpoint_name(self.o_proj(out_BxLxNxH.reshape(b, length, self.num_heads * self.head_dim)), remat.OUT)
        return out if cache is None else (out, new_cache)


class LlamaMLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, f, std = config.hidden_size, config.intermediate_size, config.initializer_range
        bias = bool(getattr(config, "mlp_bias", False))
        if config.hidden_act != "silu":
            raise ValueError(f"LlamaConfig.hidden_act={config.hidden_act!r} is not supported; use 'silu'.")
        self.gate_proj = linear(d, f, std, ("embed", "mlp"), rngs, bias=bias, dtype=dtype, param_dtype=param_dtype)
        self.up_proj = linear(d, f, std, ("embed", "mlp"), rngs, bias=bias, dtype=dtype, param_dtype=param_dtype)
        self.down_proj = linear(f, d, std, ("mlp", "embed"), rngs, bias=bias, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x_BxLxD):
        gate, up = project(x_BxLxD, self.gate_proj, self.up_proj)
        return self.down_proj(jax.nn.silu(gate) * up)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.self_attn = LlamaAttention(config, layer_idx, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp = LlamaMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, x_BxLxD, cos, sin, mask, offsets, cache=None):
        attended = self.self_attn(self.input_layernorm(x_BxLxD), cos, sin, mask, offsets, cache)
        attended, new_cache = attended if cache is not None else (attended, None)
        x_BxLxD = x_BxLxD + attended
        x_BxLxD = x_BxLxD + self.mlp(self.post_attention_layernorm(x_BxLxD))
        return x_BxLxD if cache is None else (x_BxLxD, new_cache)


class LlamaModel(nnx.Module):
    """Embedding, decoder layers, final norm. `scan_layers`: the layers' parameters stacked along a leading
    `layers` axis and run by one `nnx.scan` over a single compiled layer (MaxText's scan_layers), so compile
    time does not grow with depth; same outputs and gradients, same HF names on export and import."""

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs, scan_layers: bool = False):
        self.embed_tokens = Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(config.initializer_range),
            rngs=rngs,
        )
        self.embed_tokens.embedding.set_metadata(logical_axes=("vocab", "embed"))
        self.scan_layers = scan_layers
        self.layers: Any  # one scanned layer (stacked parameters) or an nnx.List of layers
        if scan_layers:
            self.layers = _stacked_layers(config, dtype, param_dtype, rngs)
        else:
            self.layers = nnx.List(
                [
                    LlamaDecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                    for i in range(config.num_hidden_layers)
                ]
            )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.inv_freq = rope_inverse_frequencies(config, head_dim)  # a static tuple: part of the graph
        self.gradient_checkpointing = False
        self.remat_policy: str | None = None

    def __call__(self, input_ids_BxL, attention_mask_BxS=None, position_ids_BxL=None, cache=None, segment_ids_BxL=None):
        """Hidden states; with a KVCache, also the updated cache (the attention mask then covers the cache).

        `segment_ids_BxL` (packed sequences, see `jtrainer.trainer.data.pack_sequences`): a token attends only to
        earlier tokens of its own segment; 0 marks padding."""
        b, length = input_ids_BxL.shape
        start = 0 if cache is None else cache.index
        if position_ids_BxL is None:
            position_ids_BxL = jnp.broadcast_to(start + jnp.arange(length), (b, length))
        freqs = position_ids_BxL[..., None].astype(jnp.float32) * jnp.asarray(self.inv_freq, jnp.float32)
        angles_BxLxH = jnp.concatenate([freqs, freqs], axis=-1)
        x = self.embed_tokens(input_ids_BxL)
        cos, sin = jnp.cos(angles_BxLxH).astype(x.dtype), jnp.sin(angles_BxLxH).astype(x.dtype)
        if segment_ids_BxL is not None and cache is not None:
            raise ValueError("segment_ids (packed sequences) are for training; generation takes one sequence per row.")
        offsets_LxS = None  # no [L, L] array without a cache: at 128k tokens it would not fit
        if cache is None:  # causality is the attention's own (a blockwise kernel skips what it hides)
            padding = None if attention_mask_BxS is None else attention_mask_BxS.astype(bool)
            mask: Any = TokenMask(padding, segment_ids_BxL)  # a TokenMask, or booleans [B, 1, L, S] with a cache
        else:  # causal in cache slots, and padding
            offsets_LxS = (start + jnp.arange(length))[:, None] - jnp.arange(cache.keys[0].shape[1])[None, :]
            mask = (offsets_LxS >= 0)[None, None]
            if attention_mask_BxS is not None:
                mask = mask & attention_mask_BxS.astype(bool)[:, None, None, :]
        x = constrain(x, ACTIVATION_AXES)
        if self.scan_layers:
            return self._scanned(x, cos, sin, mask, offsets_LxS, cache, start, length)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            if cache is not None:
                x, (k, v) = layer(x, cos, sin, mask, offsets_LxS, ((cache.keys[i], cache.values[i]), start))
                new_keys.append(k)
                new_values.append(v)
            else:
                x = call_block(self, layer, x, cos, sin, mask, offsets_LxS)
            x = constrain(x, ACTIVATION_AXES)
        if cache is None:
            return self.norm(x)
        return self.norm(x), KVCache(new_keys, new_values, cache.index + length)

    def _scanned(self, x, cos, sin, mask, offsets_LxS, cache, start, length):
        """The layers as one scan; a cache's keys and values are then stacked too, [layers, batch, ...]."""
        owner = _RematSettings(self.gradient_checkpointing, self.remat_policy)
        if cache is None:

            def body(layer, x):
                return constrain(call_block(owner, layer, x, cos, sin, mask, offsets_LxS), ACTIVATION_AXES)

            x = nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.layers, x)
            return self.norm(x)

        def cached(layer, x, keys, values):
            x, (keys, values) = layer(x, cos, sin, mask, offsets_LxS, ((keys, values), start))
            return constrain(x, ACTIVATION_AXES), (keys, values)

        x, (keys, values) = nnx.scan(cached, in_axes=(0, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))(
            self.layers, x, cache.keys, cache.values
        )
        return self.norm(x), KVCache(keys, values, cache.index + length)


@dataclasses.dataclass(frozen=True)
class _RematSettings:
    """What `call_block` reads of its owner, taken out of the module so the scanned body closes over no module."""

    gradient_checkpointing: bool
    remat_policy: str | None


def _stacked_layers(config, dtype, param_dtype, rngs: nnx.Rngs) -> "LlamaDecoderLayer":
    """One LlamaDecoderLayer whose every parameter has a leading axis of num_hidden_layers (logical `layers`,
    never sharded), each layer initialised from its own split of `rngs`."""
    windows = set(attention_variant(config)["windows"])
    if len(windows) > 1:
        raise ValueError(
            f"scan_layers runs one compiled layer for all, but this config's layers differ (sliding windows "
            f"{sorted(windows, key=str)} by config.layer_types): load it with scan_layers=False."
        )

    @nnx.split_rngs(splits=config.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return LlamaDecoderLayer(config, 0, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    layers = make(rngs)
    for _, var in nnx.iter_graph(layers):
        if isinstance(var, nnx.Param):
            axes = var.get_metadata().get("logical_axes")
            var.set_metadata(logical_axes=("layers", *(axes or (None,) * (var[...].ndim - 1))))
    return layers


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer, [batch, max_length, kv_heads, head_dim], and the next free slot. With
    scan_layers they are two arrays [layers, batch, max_length, kv_heads, head_dim] instead of lists."""

    keys: list[jax.Array] | jax.Array
    values: list[jax.Array] | jax.Array
    index: jax.Array

    def reorder(self, rows: jax.Array) -> "KVCache":
        """The cache with its batch rows taken in the order `rows` (beam search)."""
        keys, values = self.keys, self.values
        if isinstance(keys, list) and isinstance(values, list):
            return KVCache([c[rows] for c in keys], [c[rows] for c in values], self.index)
        assert not isinstance(keys, list) and not isinstance(values, list)
        return KVCache(keys[:, rows], values[:, rows], self.index)


class LlamaForCausalLM(ChunkedLossHead, PretrainedMixin, nnx.Module):
    """HF's `LlamaForCausalLM`: `__call__(input_ids, attention_mask, position_ids, labels, num_items_in_batch)`."""

    generates = True
    names_activations = True  # attention's values carry remat names (jtrainer.models.remat)
    config_class: Any = LlamaConfig
    accepts_loss_kwargs = True
    loss_shifts_labels = True

    def get_input_embeddings(self) -> Embed:
        return self.model.embed_tokens

    @property
    def logits_use_input_embeddings(self) -> bool:  # type: ignore[override]  # a class attribute in the base
        return bool(self.config.tie_word_embeddings)

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        scan_layers: bool = False,
    ):
        self._config = StaticConfig(config)
        # The chunked loss's settings (lm_head.ChunkedLossHead), set by the Trainer. `deterministic` is nnx's
        # train()/eval() flag: use_liger_kernel's skip_logits holds only in training.
        self.loss_chunk_positions: int | None = None
        self.skip_logits_in_training = False
        self.deterministic = False
        self.model = LlamaModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, scan_layers=scan_layers)
        if not config.tie_word_embeddings:
            self.lm_head = linear(
                config.hidden_size,
                config.vocab_size,
                config.initializer_range,
                ("embed", "vocab"),
                rngs,
                bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
            )

    @property
    def stacked_layers(self) -> tuple[tuple[str, ...], int] | None:
        """(path prefix, count) of parameters stacked along a leading layer axis (scan_layers), for hf_io."""
        return (("model", "layers"), self.config.num_hidden_layers) if self.model.scan_layers else None

    def check_mesh(self, mesh) -> None:
        """Tensor parallelism splits attention heads: the `tensor` axis must divide the number of heads."""
        n, heads = mesh.shape[TENSOR], self.config.num_attention_heads
        if heads % n:
            raise ValueError(
                f"Tensor parallel size {n} does not divide num_attention_heads={heads}: use a `tensor` mesh axis "
                f"of at most {heads} that divides it (mesh_shape)."
            )

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        labels=None,
        num_items_in_batch=None,
        cache: KVCache | None = None,
        segment_ids=None,
        skip_logits: bool | None = None,
        **kwargs,
    ) -> ModelOutput:
        """`skip_logits`: the loss without logits (lm_head.ChunkedLossHead); unset, use_liger_kernel's rule."""
        skip_logits = self.resolve_skip_logits(skip_logits, labels)
        hidden_BxLxD = self.model(input_ids, attention_mask, position_ids, cache, segment_ids)
        if cache is not None:
            hidden_BxLxD, cache = hidden_BxLxD
        loss, logits = self.head_outputs(hidden_BxLxD, self._logits, labels, num_items_in_batch, skip_logits)
        return ModelOutput(loss=loss, logits=logits, cache=cache)

    def _logits(self, hidden_BxLxD: jax.Array) -> jax.Array:
        if self.config.tie_word_embeddings:
            logits = self.model.embed_tokens.attend(hidden_BxLxD)
        else:
            logits = self.lm_head(hidden_BxLxD)
        return logits.astype(jnp.float32)

    def init_cache(self, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `max_length` tokens."""
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (batch, max_length, config.num_key_value_heads or config.num_attention_heads, head_dim)
        n = config.num_hidden_layers
        if self.model.scan_layers:
            return KVCache(jnp.zeros((n, *shape), dtype), jnp.zeros((n, *shape), dtype), jnp.zeros((), jnp.int32))
        return KVCache(
            [jnp.zeros(shape, dtype) for _ in range(n)],
            [jnp.zeros(shape, dtype) for _ in range(n)],
            jnp.zeros((), jnp.int32),
        )


class MistralForCausalLM(LlamaForCausalLM):
    """HF's `MistralForCausalLM`: Llama with a sliding attention window."""

    config_class = MistralConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    """HF's `Qwen2ForCausalLM`: Llama with biases on the query, key and value projections."""

    config_class = Qwen2Config


class Qwen3ForCausalLM(LlamaForCausalLM):
    """HF's `Qwen3ForCausalLM`: Llama with RMSNorm of each head's queries and keys."""

    config_class = Qwen3Config
