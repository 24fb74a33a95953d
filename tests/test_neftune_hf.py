"""NEFTune: HF's uniform embedding noise, in training only."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import short_run_args, tiny_llama_config, token_rows
from flax import nnx

from jtrainer import Trainer
from jtrainer.models.base import Embed
from jtrainer.models.llama import LlamaForCausalLM

_args = short_run_args


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_neftune_noise_is_hf_uniform_and_only_in_training():
    embed = Embed(10, 16, rngs=nnx.Rngs(0))
    ids = jnp.arange(10).reshape(2, 5)
    clean = embed(ids)
    embed.neftune_noise_alpha = 5.0
    object.__setattr__(embed, "_neftune_key", jax.random.key(1))
    noise = np.asarray(embed(ids) - clean)
    bound = 5.0 / np.sqrt(5 * 16)  # HF: alpha / sqrt(length * features)
    assert np.abs(noise).max() <= bound + 1e-6 and np.abs(noise).max() > 0.9 * bound
    object.__delattr__(embed, "_neftune_key")
    np.testing.assert_array_equal(embed(ids), clean)  # without the step's key (eval, generation): no noise

    rows = token_rows(12)
    plain = Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), _args(), train_dataset=rows)
    plain.train()
    noisy = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config()),
        _args(neftune_noise_alpha=5.0),
        train_dataset=rows,
        eval_dataset=rows[:4],
    )
    noisy.train()
    assert _losses(noisy) != _losses(plain) and np.allclose(_losses(noisy), _losses(plain), rtol=0.05)
    assert noisy.model.get_input_embeddings().neftune_noise_alpha is None  # removed after training, as HF
    assert noisy.evaluate()["eval_loss"] == noisy.evaluate()["eval_loss"]


def _bert_config(**kw):
    import transformers

    return transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        **kw,
    )
