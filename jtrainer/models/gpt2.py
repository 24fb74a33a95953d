"""GPT-2 in flax.nnx, parameter for parameter HF's `GPT2LMHeadModel` (Conv1D weights keep HF's [in, out] layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from transformers import GPT2Config

from jtrainer.models import remat
from jtrainer.models.base import Embed, PretrainedMixin, StaticConfig, call_block
from jtrainer.models.kernels import TokenMask, causal_attention, dense
from jtrainer.models.layers import ACTIVATION_AXES, ACTIVATIONS, LayerNorm
from jtrainer.models.lm_head import ChunkedLossHead
from jtrainer.models.outputs import ModelOutput
from jtrainer.parallel.sharding import TENSOR, constrain


class Conv1D(nnx.Module):
    """HF's Conv1D: y = x @ weight + bias with weight [in, out] (named `weight`, so no transpose on export)."""

    def __init__(self, din: int, dout: int, std: float, axes, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) * std, logical_axes=axes)
        self.bias = nnx.Param(jnp.zeros((dout,)), logical_axes=axes[1:])

    def __call__(self, x):
        return dense(x, self.weight[...]) + self.bias[...]


class GPT2Attention(nnx.Module):
    def __init__(self, config: GPT2Config, layer_idx: int, rngs: nnx.Rngs):
        d, std = config.n_embd, config.initializer_range
        self.num_heads, self.head_dim = config.n_head, config.n_embd // config.n_head
        self.c_attn = Conv1D(d, 3 * d, std, ("embed", "heads"), rngs)
        self.c_proj = Conv1D(d, d, std, ("heads", "embed"), rngs)
        scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.scale = scale

    def __call__(self, x_BxLxD, mask: TokenMask):
        b, length, d = x_BxLxD.shape
        q, k, v = jnp.split(self.c_attn(x_BxLxD), 3, axis=-1)
        q, k, v = checkpoint_name(q, remat.QUERY), checkpoint_name(k, remat.KEY), checkpoint_name(v, remat.VALUE)
        shape = (b, length, self.num_heads, self.head_dim)
        out = causal_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape), mask, self.scale)
        out = checkpoint_name(out, remat.CONTEXT)
        return checkpoint_name(self.c_proj(out.reshape(b, length, d)), remat.OUT)


class GPT2MLP(nnx.Module):
    def __init__(self, config: GPT2Config, rngs: nnx.Rngs):
        inner = config.n_inner or 4 * config.n_embd
        if config.activation_function not in ACTIVATIONS:
            raise ValueError(f"GPT2Config.activation_function={config.activation_function!r} is not supported.")
        self.act = config.activation_function
        self.c_fc = Conv1D(config.n_embd, inner, config.initializer_range, ("embed", "mlp"), rngs)
        self.c_proj = Conv1D(inner, config.n_embd, config.initializer_range, ("mlp", "embed"), rngs)

    def __call__(self, x):
        return self.c_proj(ACTIVATIONS[self.act](self.c_fc(x)))


class GPT2Block(nnx.Module):
    def __init__(self, config: GPT2Config, layer_idx: int, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx, rngs)
        self.ln_2 = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config, rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nnx.Module):
    def __init__(self, config: GPT2Config, rngs: nnx.Rngs):
        std = config.initializer_range
        self.wte = Embed(config.vocab_size, config.n_embd, embedding_init=nnx.initializers.normal(std), rngs=rngs)
        self.wpe = Embed(config.n_positions, config.n_embd, embedding_init=nnx.initializers.normal(std), rngs=rngs)
        self.wte.embedding.set_metadata(logical_axes=("vocab", "embed"))
        self.wpe.embedding.set_metadata(logical_axes=(None, "embed"))
        self.h = nnx.List([GPT2Block(config, i, rngs) for i in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.gradient_checkpointing, self.remat_policy = False, None

    def __call__(self, input_ids_BxL, attention_mask_BxL=None, position_ids_BxL=None):
        b, length = input_ids_BxL.shape
        if position_ids_BxL is None:
            position_ids_BxL = jnp.broadcast_to(jnp.arange(length), (b, length))
        x = self.wte(input_ids_BxL) + self.wpe(position_ids_BxL)
        # Padding only: causality is the attention's own (see `causal_attention`).
        mask = TokenMask(None if attention_mask_BxL is None else attention_mask_BxL.astype(bool))
        x = constrain(x, ACTIVATION_AXES)
        for block in self.h:
            x = constrain(call_block(self, block, x, mask), ACTIVATION_AXES)
        return self.ln_f(x)


class GPT2LMHeadModel(ChunkedLossHead, PretrainedMixin, nnx.Module):
    """HF's `GPT2LMHeadModel` (the LM head is tied to `wte`, as in every GPT-2 checkpoint)."""

    generates = True
    names_activations = True  # attention's values carry remat names (jtrainer.models.remat)
    config_class = GPT2Config
    accepts_loss_kwargs = True
    loss_shifts_labels = True
    logits_use_input_embeddings = True

    def get_input_embeddings(self) -> Embed:
        return self.transformer.wte

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        if not getattr(config, "tie_word_embeddings", True):
            raise ValueError("GPT2LMHeadModel with untied embeddings is not supported (GPT-2 ties lm_head to wte).")
        self._config = StaticConfig(config)
        self.transformer = GPT2Model(config, rngs)
        self.loss_chunk_positions: int | None = None  # lm_head.ChunkedLossHead's settings, set by the Trainer
        self.skip_logits_in_training = False
        self.deterministic = False

    def check_mesh(self, mesh) -> None:
        n, heads = mesh.shape[TENSOR], self.config.n_head
        if heads % n:
            raise ValueError(f"Tensor parallel size {n} does not divide n_head={heads}: change mesh_shape.")

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        labels=None,
        num_items_in_batch=None,
        skip_logits: bool | None = None,
        **kwargs,
    ) -> ModelOutput:
        """`skip_logits`: the loss without logits (lm_head.ChunkedLossHead); unset, use_liger_kernel's rule."""
        skip_logits = self.resolve_skip_logits(skip_logits, labels)
        hidden = self.transformer(input_ids, attention_mask, position_ids)
        loss, logits = self.head_outputs(hidden, self._logits, labels, num_items_in_batch, skip_logits)
        return ModelOutput(loss=loss, logits=logits)

    def _logits(self, hidden_BxLxD: jax.Array) -> jax.Array:
        return self.transformer.wte.attend(hidden_BxLxD).astype(jnp.float32)
