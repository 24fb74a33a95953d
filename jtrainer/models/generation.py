"""Jitted decoding: greedy and sampling (temperature, top-k, top-p), fed by a GenerationConfig; decoder-only
models with a KV cache, encoder-decoder models (T5) by encoding once and decoding into a fixed buffer with a
decoder cache (self-attention keys/values filled per token, cross-attention keys/values computed once).

The whole loop (prefill, then one token per iteration of a `fori_loop`) is one compiled function per
(batch, prompt length, new tokens, decoding settings). Prompts are left-padded, as HF's decoder-only
generation expects; positions come from the attention mask, as HF computes them.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0


def settings_from(generation_config: Any, model_config: Any, prompt_length: int, **overrides) -> DecodeSettings:
    """HF's GenerationConfig (or the model config's defaults) plus keyword overrides -> DecodeSettings."""
    from transformers import GenerationConfig

    cfg = generation_config or GenerationConfig.from_model_config(model_config)
    cfg = GenerationConfig(**{**cfg.to_dict(), **overrides})
    if cfg.num_beams and cfg.num_beams > 1 and cfg.do_sample:
        raise ValueError("Beam search with do_sample=True is not implemented; use do_sample=False with num_beams.")
    new = cfg.max_new_tokens if cfg.max_new_tokens is not None else cfg.max_length - prompt_length
    if new is None or new < 1:
        raise ValueError(f"Nothing to generate: max_new_tokens={new} (set max_new_tokens or a larger max_length).")
    eos = cfg.eos_token_id
    eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    return DecodeSettings(
        max_new_tokens=int(new),
        do_sample=bool(cfg.do_sample),
        temperature=float(cfg.temperature or 1.0),
        top_k=int(cfg.top_k or 0),
        top_p=float(cfg.top_p if cfg.top_p is not None else 1.0),
        eos_token_ids=eos,
        pad_token_id=int(pad),
        num_beams=int(cfg.num_beams or 1),
        length_penalty=float(cfg.length_penalty if cfg.length_penalty is not None else 1.0),
    )


def _pick(logits_BxV: jax.Array, key: jax.Array, s: DecodeSettings) -> jax.Array:
    """The next token: argmax, or a sample after HF's temperature, top-k and top-p warpers (in that order)."""
    if not s.do_sample:
        return jnp.argmax(logits_BxV, axis=-1)
    logits = logits_BxV / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        sorted_desc = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
        # Keep the smallest set whose probability reaches top_p (at least one token).
        keep = (cumulative - jax.nn.softmax(sorted_desc, axis=-1)) < s.top_p
        threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def _inner(graphdef, state) -> nnx.Module:
    """The model rebuilt inside a loop body from fresh variables (a tree map makes new ones): nnx transforms in the
    model (nnx.scan over stacked layers) refuse variables created at an outer trace level."""
    return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))


@partial(jax.jit, static_argnums=(0, 4))
def _decode(graphdef, state, input_ids_BxP, mask_BxP, settings: DecodeSettings, seed):
    model = nnx.merge(graphdef, state)
    b, p = input_ids_BxP.shape
    n = settings.max_new_tokens
    cache = model.init_cache(b, p + n, jnp.float32)
    full_mask = jnp.zeros((b, p + n), jnp.int32).at[:, :p].set(mask_BxP)
    positions = jnp.where(mask_BxP == 0, 1, jnp.cumsum(mask_BxP, axis=-1) - 1)  # HF's, for left padding
    out = model(input_ids_BxP, full_mask, positions, cache=cache)
    eos = jnp.asarray(settings.eos_token_ids or (-1,), jnp.int32)
    key = jax.random.key(seed)

    def step(i, carry):
        tokens, cache, logits, key, finished, next_pos, full_mask = carry
        key, sub = jax.random.split(key)
        token = _pick(logits, sub, settings).astype(jnp.int32)
        token = jnp.where(finished, settings.pad_token_id, token)
        tokens = tokens.at[:, i].set(token)
        finished = finished | jnp.isin(token, eos)
        full_mask = full_mask.at[:, p + i].set(1)
        # The model merged again inside the loop: its variables belong to this trace level (nnx.scan over
        # stacked layers refuses variables of an outer one).
        out = _inner(graphdef, state)(token[:, None], full_mask, next_pos[:, None], cache=cache)
        return tokens, out.cache, out.logits[:, -1], key, finished, next_pos + 1, full_mask

    carry = (
        jnp.zeros((b, n), jnp.int32),
        out.cache,
        out.logits[:, -1],
        key,
        jnp.zeros((b,), bool),
        positions[:, -1] + 1,
        full_mask,
    )
    tokens = jax.lax.fori_loop(0, n, step, carry)[0]
    return jnp.concatenate([input_ids_BxP.astype(jnp.int32), tokens], axis=1)


@partial(jax.jit, static_argnums=(0, 4))
def _beam_search(graphdef, state, input_ids_BxP, mask_BxP, settings: DecodeSettings, seed):
    """Beam search for decoder-only models: the cache holds batch x beams rows, reordered after each step.

    A beam that emitted EOS keeps its score and continues with padding; the best beam per row wins by
    sum of log-probabilities / generated length ** length_penalty, as HF scores finished hypotheses.
    """
    del seed  # beam search is deterministic
    model = nnx.merge(graphdef, state)
    b, p = input_ids_BxP.shape
    k, n = settings.num_beams, settings.max_new_tokens
    ids = jnp.repeat(input_ids_BxP, k, axis=0)
    mask = jnp.repeat(mask_BxP, k, axis=0)
    cache = model.init_cache(b * k, p + n, jnp.float32)
    full_mask = jnp.zeros((b * k, p + n), jnp.int32).at[:, :p].set(mask)
    positions = jnp.where(mask == 0, 1, jnp.cumsum(mask, axis=-1) - 1)
    out = model(ids, full_mask, positions, cache=cache)
    eos = jnp.asarray(settings.eos_token_ids or (-1,), jnp.int32)
    scores = jnp.tile(jnp.asarray([0.0] + [-jnp.inf] * (k - 1)), (b, 1))  # every beam starts as beam 0
    rows = jnp.arange(b)[:, None] * k  # first flat row of each batch entry

    def step(i, carry):
        tokens, cache, logits, scores, finished, lengths, next_pos, full_mask = carry
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(b, k, -1)
        vocab = logp.shape[-1]
        # A finished beam may only continue with padding, at no cost.
        pad_only = jnp.full((vocab,), -jnp.inf).at[settings.pad_token_id].set(0.0)
        logp = jnp.where(finished.reshape(b, k, 1), pad_only, logp)
        top_scores, top = jax.lax.top_k((scores[..., None] + logp).reshape(b, k * vocab), k)
        beam, token = top // vocab, (top % vocab).astype(jnp.int32)
        flat = (rows + beam).reshape(-1)
        tokens = tokens[flat].at[:, i].set(token.reshape(-1))
        was_finished = finished[flat]
        finished = was_finished | jnp.isin(token.reshape(-1), eos)
        lengths = jnp.where(was_finished, lengths[flat], i + 1)
        if hasattr(cache, "reorder"):  # a KV cache knows where its rows are (stacked layers put them second)
            cache = cache.reorder(flat)
        else:
            cache = jax.tree.map(lambda c: c[flat] if c.ndim and c.shape[0] == b * k else c, cache)
        full_mask = full_mask[flat].at[:, p + i].set(1)
        out = _inner(graphdef, state)(token.reshape(-1, 1), full_mask, next_pos[flat][:, None], cache=cache)
        return tokens, out.cache, out.logits[:, -1], top_scores, finished, lengths, next_pos[flat] + 1, full_mask

    carry = (
        jnp.full((b * k, n), settings.pad_token_id, jnp.int32),
        out.cache,
        out.logits[:, -1],
        scores,
        jnp.zeros((b * k,), bool),
        jnp.zeros((b * k,), jnp.int32),
        positions[:, -1] + 1,
        full_mask,
    )
    tokens, _, _, scores, _, lengths, _, _ = jax.lax.fori_loop(0, n, step, carry)
    normalised = scores / (jnp.maximum(lengths.reshape(b, k), 1) ** settings.length_penalty)
    best = rows[:, 0] + jnp.argmax(normalised, axis=-1)
    return jnp.concatenate([input_ids_BxP.astype(jnp.int32), tokens[best]], axis=1)


def _next_logits_seq2seq(model, tokens, i, cache, encoded, mask):
    """Logits after decoder position i: one incremental step with a decoder cache (models with
    `decode_step`, e.g. T5), else the whole buffer through `decode` (causal, so position i sees only i and
    before). Returns (logits [rows, vocab], cache)."""
    if cache is None:
        return model.decode(tokens, encoded, mask)[:, i], None
    logits, cache = model.decode_step(jax.lax.dynamic_slice_in_dim(tokens, i, 1, axis=1), cache, i, mask)
    return logits[:, 0], cache


def _decoder_cache(model, encoded, slots: int):
    return model.init_decoder_cache(encoded, slots) if getattr(model, "init_decoder_cache", None) else None


@partial(jax.jit, static_argnums=(0, 4))
def _beam_search_seq2seq(graphdef, state, input_ids_BxP, mask_BxP, settings: DecodeSettings, seed):
    """Beam search for encoder-decoder models: beams are rows of the decoder buffer (and of its cache),
    reordered each step."""
    del seed  # beam search is deterministic
    model = nnx.merge(graphdef, state)
    b, k, n = input_ids_BxP.shape[0], settings.num_beams, settings.max_new_tokens
    mask = jnp.repeat(mask_BxP, k, axis=0)
    encoded = model.encode(jnp.repeat(input_ids_BxP, k, axis=0), mask)
    eos = jnp.asarray(settings.eos_token_ids or (-1,), jnp.int32)
    rows = jnp.arange(b)[:, None] * k

    def step(i, carry):
        tokens, scores, finished, lengths, cache = carry
        logits, cache = _next_logits_seq2seq(model, tokens, i, cache, encoded, mask)
        logp = jax.nn.log_softmax(logits, axis=-1).reshape(b, k, -1)
        vocab = logp.shape[-1]
        pad_only = jnp.full((vocab,), -jnp.inf).at[settings.pad_token_id].set(0.0)
        logp = jnp.where(finished.reshape(b, k, 1), pad_only, logp)
        top_scores, top = jax.lax.top_k((scores[..., None] + logp).reshape(b, k * vocab), k)
        flat = (rows + top // vocab).reshape(-1)
        token = (top % vocab).astype(jnp.int32).reshape(-1)
        was_finished = finished[flat]
        if cache is not None:  # a beam's decoder history follows it; the encoder's keys are the same per row
            cache = dataclasses.replace(
                cache, keys=[c[flat] for c in cache.keys], values=[c[flat] for c in cache.values]
            )
        return (
            tokens[flat].at[:, i + 1].set(token),
            top_scores,
            was_finished | jnp.isin(token, eos),
            jnp.where(was_finished, lengths[flat], i + 1),
            cache,
        )

    tokens = jnp.full((b * k, n + 1), settings.pad_token_id, jnp.int32)
    tokens = tokens.at[:, 0].set(model.config.decoder_start_token_id)
    scores = jnp.tile(jnp.asarray([0.0] + [-jnp.inf] * (k - 1)), (b, 1))
    carry = (
        tokens,
        scores,
        jnp.zeros((b * k,), bool),
        jnp.zeros((b * k,), jnp.int32),
        _decoder_cache(model, encoded, n),
    )
    tokens, scores, _, lengths, _ = jax.lax.fori_loop(0, n, step, carry)
    normalised = scores / (jnp.maximum(lengths.reshape(b, k), 1) ** settings.length_penalty)
    return tokens[rows[:, 0] + jnp.argmax(normalised, axis=-1)]


@partial(jax.jit, static_argnums=(0, 4))
def _decode_seq2seq(graphdef, state, input_ids_BxP, mask_BxP, settings: DecodeSettings, seed):
    """Encoder-decoder models: encode once, then decode one token per step into a fixed buffer, with the
    model's decoder cache when it has one: one compiled loop."""
    model = nnx.merge(graphdef, state)
    b, n = input_ids_BxP.shape[0], settings.max_new_tokens
    encoded = model.encode(input_ids_BxP, mask_BxP)
    start = model.config.decoder_start_token_id
    eos = jnp.asarray(settings.eos_token_ids or (-1,), jnp.int32)
    key = jax.random.key(seed)

    def step(i, carry):
        tokens, key, finished, cache = carry
        logits, cache = _next_logits_seq2seq(model, tokens, i, cache, encoded, mask_BxP)
        key, sub = jax.random.split(key)
        token = jnp.where(finished, settings.pad_token_id, _pick(logits, sub, settings).astype(jnp.int32))
        return tokens.at[:, i + 1].set(token), key, finished | jnp.isin(token, eos), cache

    tokens = jnp.full((b, n + 1), settings.pad_token_id, jnp.int32).at[:, 0].set(start)
    carry = (tokens, key, jnp.zeros((b,), bool), _decoder_cache(model, encoded, n))
    return jax.lax.fori_loop(0, n, step, carry)[0]


def generate(
    model: Any,
    input_ids,
    attention_mask=None,
    generation_config=None,
    *,
    seed: int = 0,
    **overrides,
) -> np.ndarray:
    """Prompt + generated ids, [batch, prompt + max_new_tokens] (encoder-decoder models: the decoder's
    start token + generated ids, as HF returns them); after an EOS, rows are padded with pad_token_id.

    `generation_config` is a `transformers.GenerationConfig` (default: the model config's); keyword arguments
    override it (`max_new_tokens=20, do_sample=True, top_p=0.9`, ...). Global `jax.Array` inputs (rows split
    over a mesh, possibly over many processes, every process calling) give a `jax.Array` of ids back.
    """
    on_mesh = isinstance(input_ids, jax.Array) and not input_ids.is_fully_addressable
    if on_mesh:
        mask = jnp.ones_like(input_ids) if attention_mask is None else attention_mask
    else:
        input_ids = np.asarray(input_ids)
        mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask)
    encoder_decoder = hasattr(model, "encode")
    # HF's max_length counts the decoder's tokens (from its start token) for encoder-decoder models.
    prompt_length = 1 if encoder_decoder else input_ids.shape[1]
    settings = settings_from(generation_config, model.config, prompt_length, **overrides)
    graphdef, state = nnx.split(model)
    if encoder_decoder:
        decode = _beam_search_seq2seq if settings.num_beams > 1 else _decode_seq2seq
    else:
        decode = _beam_search if settings.num_beams > 1 else _decode
    ids = decode(graphdef, state, jnp.asarray(input_ids), jnp.asarray(mask, jnp.int32), settings, np.uint32(seed))
    return ids if on_mesh else np.asarray(ids)
