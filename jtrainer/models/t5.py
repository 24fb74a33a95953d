"""T5 in flax.nnx, parameter for parameter HF's `T5ForConditionalGeneration` (relative position buckets, unscaled
attention, RMS layer norms, relu or gated-gelu feed-forward, LM head tied to `shared` with d_model**-0.5)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from transformers import T5Config

from jtrainer.models.base import PretrainedMixin, StaticConfig, call_block
from jtrainer.models.layers import ACTIVATION_AXES, ACTIVATIONS, RMSNorm, embedding, linear
from jtrainer.models.outputs import ModelOutput
from jtrainer.numerics.losses import IGNORE_INDEX, token_loss
from jtrainer.parallel.sharding import TENSOR, constrain


def relative_position_bucket(relative_position, bidirectional: bool, num_buckets: int, max_distance: int):
    """HF's (Mesh TensorFlow's) bucketing of key position - query position."""
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0) * num_buckets
        relative_position = jnp.abs(relative_position)
    else:
        relative_position = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (
        jnp.log(jnp.maximum(relative_position, 1).astype(jnp.float32) / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).astype(relative_position.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(is_small, relative_position, large)


class T5Attention(nnx.Module):
    def __init__(self, config: T5Config, has_relative_bias: bool, is_decoder: bool, rngs: nnx.Rngs):
        d, inner, std = config.d_model, config.num_heads * config.d_kv, config.initializer_factor
        self.num_heads, self.head_dim, self.is_decoder = config.num_heads, config.d_kv, is_decoder
        self.q = linear(d, inner, std * (d * config.d_kv) ** -0.5, ("embed", "heads"), rngs, bias=False)
        self.k = linear(d, inner, std * d**-0.5, ("embed", "heads"), rngs, bias=False)
        self.v = linear(d, inner, std * d**-0.5, ("embed", "heads"), rngs, bias=False)
        self.o = linear(inner, d, std * inner**-0.5, ("heads", "embed"), rngs, bias=False)
        self.buckets, self.max_distance = config.relative_attention_num_buckets, config.relative_attention_max_distance
        if has_relative_bias:
            self.relative_attention_bias = embedding(self.buckets, self.num_heads, std * d**-0.5, (None, "heads"), rngs)

    def position_bias(self, query_length: int, key_length: int, query_start=0) -> jax.Array:
        """[1, N, Lq, Lk] biases of queries at positions query_start + [0, Lq) over keys at [0, Lk)."""
        relative = jnp.arange(key_length)[None, :] - (query_start + jnp.arange(query_length))[:, None]
        bucket = relative_position_bucket(relative, not self.is_decoder, self.buckets, self.max_distance)
        return jnp.transpose(self.relative_attention_bias(bucket), (2, 0, 1))[None]

    def keys_values(self, kv_BxSxD) -> tuple[jax.Array, jax.Array]:
        b, keys, _ = kv_BxSxD.shape
        shape = (b, keys, self.num_heads, self.head_dim)
        return self.k(kv_BxSxD).reshape(shape), self.v(kv_BxSxD).reshape(shape)

    def attend(self, x_BxLxD, k_BxSxNxH, v_BxSxNxH, bias_1xNxLxS, mask_Bx1xLxS):
        b, length, _ = x_BxLxD.shape
        q = self.q(x_BxLxD).reshape(b, length, self.num_heads, self.head_dim)
        bias = jnp.broadcast_to(bias_1xNxLxS, (b, self.num_heads, length, k_BxSxNxH.shape[1])).astype(q.dtype)
        out = jax.nn.dot_product_attention(
            q, k_BxSxNxH.astype(q.dtype), v_BxSxNxH.astype(q.dtype), bias=bias, mask=mask_Bx1xLxS, scale=1.0
        )
        return self.o(out.reshape(b, length, self.num_heads * self.head_dim))


class T5DenseActDense(nnx.Module):
    def __init__(self, config: T5Config, rngs: nnx.Rngs):
        d, f, std = config.d_model, config.d_ff, config.initializer_factor
        if config.is_gated_act:
            self.wi_0 = linear(d, f, std * d**-0.5, ("embed", "mlp"), rngs, bias=False)
            self.wi_1 = linear(d, f, std * d**-0.5, ("embed", "mlp"), rngs, bias=False)
        else:
            self.wi = linear(d, f, std * d**-0.5, ("embed", "mlp"), rngs, bias=False)
        self.wo = linear(f, d, std * f**-0.5, ("mlp", "embed"), rngs, bias=False)
        if config.dense_act_fn not in ACTIVATIONS:
            raise ValueError(f"T5Config.feed_forward_proj={config.feed_forward_proj!r} is not supported.")
        self.act = config.dense_act_fn

    def __call__(self, x):
        act = ACTIVATIONS[self.act]
        hidden = act(self.wi_0(x)) * self.wi_1(x) if hasattr(self, "wi_0") else act(self.wi(x))
        return self.wo(hidden)


class _AttentionLayer(nnx.Module):
    """`layer.N` of a T5 block with attention: pre-norm, attention, residual (HF's names per kind)."""

    def __init__(self, config: T5Config, name: str, has_relative_bias: bool, is_decoder: bool, rngs: nnx.Rngs):
        self.name = name
        setattr(self, name, T5Attention(config, has_relative_bias, is_decoder, rngs))
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def __call__(self, x, kv, bias, mask, keys_values=None):
        """`kv` None: self-attention; `keys_values`: keys and values computed already (a decoder cache's)."""
        normed = self.layer_norm(x)
        attention = getattr(self, self.name)
        k, v = keys_values if keys_values is not None else attention.keys_values(normed if kv is None else kv)
        return x + attention.attend(normed, k, v, bias, mask)


class _FeedForwardLayer(nnx.Module):
    def __init__(self, config: T5Config, rngs: nnx.Rngs):
        self.DenseReluDense = T5DenseActDense(config, rngs)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def __call__(self, x):
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nnx.Module):
    def __init__(self, config: T5Config, first: bool, is_decoder: bool, rngs: nnx.Rngs):
        # HF's module names: layer[0].SelfAttention, layer[1].EncDecAttention (set by name), layer[-1] the MLP
        layers: list[Any] = [_AttentionLayer(config, "SelfAttention", first, is_decoder, rngs)]
        if is_decoder:
            layers.append(_AttentionLayer(config, "EncDecAttention", False, True, rngs))
        layers.append(_FeedForwardLayer(config, rngs))
        self.layer = nnx.List(layers)

    def __call__(self, x, self_bias, self_mask, encoder=None, cross_mask=None):
        x = self.layer[0](x, None, self_bias, self_mask)
        if encoder is not None:
            x = self.layer[1](x, encoder, jnp.zeros((1, 1, 1, 1), x.dtype), cross_mask)
        return self.layer[-1](x)

    def decode_step(self, x_BxLxD, self_bias, self_mask, cache: tuple, index, cross_mask):
        """The decoder block on L new tokens at `index`, their keys and values written into the cache
        ((keys, values, cross keys, cross values)); returns (output, the updated cache)."""
        keys, values, cross_keys, cross_values = cache
        self_layer, cross_layer = self.layer[0], self.layer[1]  # HF's attributes are set by name: Any
        normed = self_layer.layer_norm(x_BxLxD)
        k, v = self_layer.SelfAttention.keys_values(normed)
        keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype), (0, index, 0, 0))
        values = jax.lax.dynamic_update_slice(values, v.astype(values.dtype), (0, index, 0, 0))
        x = x_BxLxD + self_layer.SelfAttention.attend(normed, keys, values, self_bias, self_mask)
        x = cross_layer(x, None, jnp.zeros((1, 1, 1, 1), x.dtype), cross_mask, (cross_keys, cross_values))
        return self.layer[-1](x), (keys, values, cross_keys, cross_values)


class T5Stack(nnx.Module):
    def __init__(self, config: T5Config, is_decoder: bool, rngs: nnx.Rngs):
        self.is_decoder = is_decoder
        # T5Config types num_decoder_layers Optional and fills it from num_layers when unset.
        n: int = config.num_decoder_layers if is_decoder else config.num_layers  # type: ignore[assignment]
        self.block = nnx.List([T5Block(config, i == 0, is_decoder, rngs) for i in range(n)])
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.gradient_checkpointing, self.remat_policy = False, None

    def __call__(self, x_BxLxD, mask_BxL, encoder_BxSxD=None, encoder_mask_BxS=None):
        length = x_BxLxD.shape[1]
        bias = self.block[0].layer[0].SelfAttention.position_bias(length, length)
        self_mask = jnp.ones((1, 1, length, length), bool)
        if self.is_decoder:
            self_mask = jnp.tril(self_mask)
        if mask_BxL is not None:
            self_mask = self_mask & mask_BxL.astype(bool)[:, None, None, :]
        cross_mask = None if encoder_mask_BxS is None else encoder_mask_BxS.astype(bool)[:, None, None, :]
        for block in self.block:
            x_BxLxD = call_block(self, block, x_BxLxD, bias, self_mask, encoder_BxSxD, cross_mask)
            x_BxLxD = constrain(x_BxLxD, ACTIVATION_AXES)
        return self.final_layer_norm(x_BxLxD)

    def decode_step(self, x_BxLxD, cache: "T5DecoderCache", index, encoder_mask_BxS=None):
        """The decoder on L new tokens at positions index + [0, L), attending to the cache's earlier tokens."""
        length, slots = x_BxLxD.shape[1], cache.keys[0].shape[1]
        bias = self.block[0].layer[0].SelfAttention.position_bias(length, slots, index)
        self_mask = (jnp.arange(slots)[None, :] <= index + jnp.arange(length)[:, None])[None, None]
        cross_mask = None if encoder_mask_BxS is None else encoder_mask_BxS.astype(bool)[:, None, None, :]
        layers = []
        for i, block in enumerate(self.block):
            layer_cache = (cache.keys[i], cache.values[i], cache.cross_keys[i], cache.cross_values[i])
            x_BxLxD, layer_cache = block.decode_step(x_BxLxD, bias, self_mask, layer_cache, index, cross_mask)
            layers.append(layer_cache)
        new_cache = T5DecoderCache(*(list(column) for column in zip(*layers)))
        return self.final_layer_norm(x_BxLxD), new_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class T5DecoderCache:
    """Per decoder layer: self-attention keys and values [batch, slots, heads, d_kv] (filled as tokens are
    decoded) and the cross-attention keys and values of the encoder output [batch, source, heads, d_kv]."""

    keys: list[jax.Array]
    values: list[jax.Array]
    cross_keys: list[jax.Array]
    cross_values: list[jax.Array]


def shift_right(labels, decoder_start_token_id: int, pad_token_id: int):
    """HF's _shift_right: decoder inputs are the labels moved right after a start token; -100 becomes pad."""
    shifted = jnp.concatenate([jnp.full_like(labels[:, :1], decoder_start_token_id), labels[:, :-1]], axis=1)
    return jnp.where(shifted == IGNORE_INDEX, pad_token_id, shifted)


class T5ForConditionalGeneration(PretrainedMixin, nnx.Module):
    """HF's `T5ForConditionalGeneration`: `__call__(input_ids, attention_mask, decoder_input_ids, labels, ...)`."""

    generates = True
    config_class = T5Config
    accepts_loss_kwargs = True
    tied_hf_weights = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")

    def get_input_embeddings(self):
        return self.shared

    @property
    def logits_use_input_embeddings(self) -> bool:  # type: ignore[override]  # a class attribute in the base
        return bool(self.config.tie_word_embeddings)

    def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
        if getattr(config, "decoder_start_token_id", None) is None:
            raise ValueError("T5Config.decoder_start_token_id must be set (T5 uses the pad token id, 0).")
        self._config = StaticConfig(config)
        self.shared = embedding(config.vocab_size, config.d_model, config.initializer_factor, ("vocab", "embed"), rngs)
        self.encoder = T5Stack(config, False, rngs)
        self.decoder = T5Stack(config, True, rngs)
        if not config.tie_word_embeddings:
            self.lm_head = linear(
                config.d_model, config.vocab_size, config.initializer_factor, ("embed", "vocab"), rngs, bias=False
            )

    def check_mesh(self, mesh) -> None:
        n, heads = mesh.shape[TENSOR], self.config.num_heads
        if heads % n:
            raise ValueError(f"Tensor parallel size {n} does not divide num_heads={heads}.")

    def encode(self, input_ids, attention_mask=None):
        return self.encoder(self.shared(input_ids), attention_mask)

    def decode(self, decoder_input_ids, encoder_hidden, attention_mask=None, decoder_attention_mask=None):
        hidden = self.decoder(self.shared(decoder_input_ids), decoder_attention_mask, encoder_hidden, attention_mask)
        return self._logits(hidden)

    def _logits(self, hidden):
        # Original T5 scales the decoder output by d_model**-0.5; T5 v1.1 (saved with tie_word_embeddings=False)
        # does not. transformers 5 records this as `scale_decoder_outputs` and always ties the head to `shared`.
        if getattr(self.config, "scale_decoder_outputs", self.config.tie_word_embeddings):
            hidden = hidden * self.config.d_model**-0.5
        head = self.shared.attend if self.config.tie_word_embeddings else self.lm_head
        return head(hidden).astype(jnp.float32)

    def init_decoder_cache(self, encoder_hidden, slots: int) -> T5DecoderCache:
        """An empty self-attention cache of `slots` decoder positions, and the encoder output's cross-attention
        keys and values (computed once per generation instead of once per token)."""
        b, heads, d_kv = encoder_hidden.shape[0], self.config.num_heads, self.config.d_kv
        empty = jnp.zeros((b, slots, heads, d_kv), encoder_hidden.dtype)
        cross = [block.layer[1].EncDecAttention.keys_values(encoder_hidden) for block in self.decoder.block]
        n = len(self.decoder.block)
        return T5DecoderCache([empty] * n, [empty] * n, [k for k, _ in cross], [v for _, v in cross])

    def decode_step(self, decoder_input_ids, cache: T5DecoderCache, index, attention_mask=None):
        """Logits of decoder tokens at positions index + [0, L) (the earlier ones are in `cache`), and the cache
        with theirs added: generation's incremental form of `decode`."""
        hidden, cache = self.decoder.decode_step(self.shared(decoder_input_ids), cache, index, attention_mask)
        return self._logits(hidden), cache

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        labels=None,
        num_items_in_batch=None,
        **kwargs,
    ) -> ModelOutput:
        config = self.config
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("T5 needs decoder_input_ids or labels.")
            decoder_input_ids = shift_right(labels, config.decoder_start_token_id, config.pad_token_id)
        logits = self.decode(
            decoder_input_ids, self.encode(input_ids, attention_mask), attention_mask, decoder_attention_mask
        )
        # HF's T5 takes num_items_in_batch (**kwargs) and ignores it: a mean over this batch's labels, which the
        # Trainer then sums over an accumulation window, as HF's does.
        loss = None if labels is None else token_loss(logits, labels, None)
        return ModelOutput(loss=loss, logits=logits)
