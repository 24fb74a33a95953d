"""BERT in flax.nnx, parameter for parameter HF's `BertForMaskedLM`, `BertForSequenceClassification` and
`BertForTokenClassification` (module names as HF's, `LayerNorm` included)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from transformers import BertConfig

from jtrainer.models.base import Embed, PretrainedMixin, StaticConfig, call_block
from jtrainer.models.layers import ACTIVATION_AXES, ACTIVATIONS, LayerNorm, embedding, linear
from jtrainer.models.outputs import ModelOutput
from jtrainer.numerics.losses import IGNORE_INDEX, token_cross_entropy_sum, token_loss
from jtrainer.parallel.sharding import TENSOR, constrain


class BertEmbeddings(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        d, std = config.hidden_size, config.initializer_range
        self.word_embeddings = embedding(config.vocab_size, d, std, ("vocab", "embed"), rngs)
        self.position_embeddings = embedding(config.max_position_embeddings, d, std, (None, "embed"), rngs)
        self.token_type_embeddings = embedding(config.type_vocab_size, d, std, (None, "embed"), rngs)
        self.LayerNorm = LayerNorm(d, config.layer_norm_eps)

    def __call__(self, input_ids_BxL, token_type_ids_BxL, position_ids_BxL):
        x = self.word_embeddings(input_ids_BxL) + self.token_type_embeddings(token_type_ids_BxL)
        return self.LayerNorm(x + self.position_embeddings(position_ids_BxL))


class BertSelfAttention(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        d, std = config.hidden_size, config.initializer_range
        self.num_heads, self.head_dim = config.num_attention_heads, d // config.num_attention_heads
        self.query = linear(d, d, std, ("embed", "heads"), rngs)
        self.key = linear(d, d, std, ("embed", "heads"), rngs)
        self.value = linear(d, d, std, ("embed", "heads"), rngs)

    def __call__(self, x_BxLxD, mask_Bx1x1xL):
        b, length, d = x_BxLxD.shape
        shape = (b, length, self.num_heads, self.head_dim)
        q, k, v = (proj(x_BxLxD).reshape(shape) for proj in (self.query, self.key, self.value))
        return jax.nn.dot_product_attention(q, k, v, mask=mask_Bx1x1xL).reshape(b, length, d)


class BertSelfOutput(nnx.Module):
    def __init__(self, config: BertConfig, din: int, axes, rngs: nnx.Rngs):
        self.dense = linear(din, config.hidden_size, config.initializer_range, axes, rngs)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def __call__(self, hidden, residual):
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        self.self = BertSelfAttention(config, rngs)
        self.output = BertSelfOutput(config, config.hidden_size, ("heads", "embed"), rngs)

    def __call__(self, x, mask):
        return self.output(self.self(x, mask), x)


class BertIntermediate(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        self.dense = linear(
            config.hidden_size, config.intermediate_size, config.initializer_range, ("embed", "mlp"), rngs
        )
        self.act = config.hidden_act

    def __call__(self, x):
        return ACTIVATIONS[self.act](self.dense(x))


class BertLayer(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        self.attention = BertAttention(config, rngs)
        self.intermediate = BertIntermediate(config, rngs)
        self.output = BertSelfOutput(config, config.intermediate_size, ("mlp", "embed"), rngs)

    def __call__(self, x, mask):
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        self.layer = nnx.List([BertLayer(config, rngs) for _ in range(config.num_hidden_layers)])
        self.gradient_checkpointing, self.remat_policy = False, None

    def __call__(self, x, mask):
        for layer in self.layer:
            x = constrain(call_block(self, layer, x, mask), ACTIVATION_AXES)
        return x


class BertPooler(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        self.dense = linear(config.hidden_size, config.hidden_size, config.initializer_range, ("embed", None), rngs)

    def __call__(self, hidden_BxLxD):
        return jnp.tanh(self.dense(hidden_BxLxD[:, 0]))


class BertModel(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs, add_pooling_layer: bool = True):
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"BertConfig.hidden_act={config.hidden_act!r} is not supported.")
        self.embeddings = BertEmbeddings(config, rngs)
        self.encoder = BertEncoder(config, rngs)
        if add_pooling_layer:
            self.pooler = BertPooler(config, rngs)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        b, length = input_ids.shape
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(length), (b, length))
        mask = None if attention_mask is None else attention_mask.astype(bool)[:, None, None, :]
        x = constrain(self.embeddings(input_ids, token_type_ids, position_ids), ACTIVATION_AXES)
        return self.encoder(x, mask)


class _BertHead(PretrainedMixin, nnx.Module):
    config_class = BertConfig
    bert: Any  # BertModel, built by each head

    def get_input_embeddings(self) -> Embed:
        return self.bert.embeddings.word_embeddings

    def check_mesh(self, mesh) -> None:
        n, heads = mesh.shape[TENSOR], self.config.num_attention_heads
        if heads % n:
            raise ValueError(f"Tensor parallel size {n} does not divide num_attention_heads={heads}.")


class BertForMaskedLM(_BertHead):
    """HF's `BertForMaskedLM`: the decoder is tied to the word embeddings, with its own bias."""

    accepts_loss_kwargs = True
    logits_use_input_embeddings = True
    tied_hf_weights = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
        self._config = StaticConfig(config)
        self.bert = BertModel(config, rngs, add_pooling_layer=False)
        self.cls = _MLMHead(config, rngs)

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        labels=None,
        num_items_in_batch=None,
        **kwargs,
    ) -> ModelOutput:
        hidden = self.bert(input_ids, attention_mask, token_type_ids, position_ids)
        logits = self.cls(hidden, self.bert.embeddings.word_embeddings).astype(jnp.float32)
        loss = None
        if labels is not None:
            # HF's BERT takes num_items_in_batch (**kwargs) and ignores it: this batch's mean (CrossEntropyLoss),
            # which the Trainer then sums over an accumulation window, as HF's does.
            loss = token_loss(logits, labels, None)
        return ModelOutput(loss=loss, logits=logits)


class _MLMHead(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        self.predictions = _MLMPredictions(config, rngs)

    def __call__(self, hidden, word_embeddings):
        return self.predictions(hidden, word_embeddings)


class _MLMTransform(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        self.dense = linear(config.hidden_size, config.hidden_size, config.initializer_range, ("embed", None), rngs)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.act = config.hidden_act

    def __call__(self, x):
        return self.LayerNorm(ACTIVATIONS[self.act](self.dense(x)))


class _MLMPredictions(nnx.Module):
    def __init__(self, config: BertConfig, rngs: nnx.Rngs):
        self.transform = _MLMTransform(config, rngs)
        self.bias = nnx.Param(jnp.zeros((config.vocab_size,)), logical_axes=("vocab",))

    def __call__(self, hidden, word_embeddings: nnx.Embed):
        return word_embeddings.attend(self.transform(hidden)) + self.bias[...]


def _classifier(config: BertConfig, rngs: nnx.Rngs) -> nnx.Linear:
    labels: int = config.num_labels  # type: ignore[assignment]  # a property: len(id2label)
    return linear(config.hidden_size, labels, config.initializer_range, ("embed", None), rngs)


def classification_loss(logits, labels, problem_type: str | None, num_labels: int):
    """HF's rule: regression for one label, single-label CE for integer labels, else multi-label BCE."""
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif jnp.issubdtype(labels.dtype, jnp.integer):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if problem_type == "regression":
        # Rows labelled -100 are the Trainer's padding of a ragged batch: they do not count.
        valid = labels != IGNORE_INDEX
        squared = jnp.square(logits.reshape(labels.shape) - labels)
        return jnp.sum(jnp.where(valid, squared, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    if problem_type == "single_label_classification":
        valid = labels != IGNORE_INDEX
        return token_cross_entropy_sum(logits, labels) / jnp.maximum(jnp.sum(valid), 1)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels.astype(logits.dtype)))


class BertForSequenceClassification(_BertHead):
    """HF's `BertForSequenceClassification`: pooled [CLS] -> classifier; loss by `problem_type`."""

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
        self._config = StaticConfig(config)
        self.bert = BertModel(config, rngs, add_pooling_layer=True)
        self.classifier = _classifier(config, rngs)

    def __call__(
        self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None, **kwargs
    ) -> ModelOutput:
        hidden = self.bert(input_ids, attention_mask, token_type_ids, position_ids)
        logits = self.classifier(self.bert.pooler(hidden)).astype(jnp.float32)
        loss = None
        if labels is not None:
            loss = classification_loss(logits, labels, self.config.problem_type, self.config.num_labels)
        return ModelOutput(loss=loss, logits=logits)


class BertForTokenClassification(_BertHead):
    """HF's `BertForTokenClassification`: a classifier on every token; labels -100 are ignored."""

    accepts_loss_kwargs = True

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
        self._config = StaticConfig(config)
        self.bert = BertModel(config, rngs, add_pooling_layer=False)
        self.classifier = _classifier(config, rngs)

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        labels=None,
        num_items_in_batch=None,
        **kwargs,
    ) -> ModelOutput:
        logits = self.classifier(self.bert(input_ids, attention_mask, token_type_ids, position_ids)).astype(jnp.float32)
        loss = None
        if labels is not None:  # HF's BERT ignores num_items_in_batch: this batch's mean (see BertForMaskedLM)
            loss = token_loss(logits, labels, None)
        return ModelOutput(loss=loss, logits=logits)
