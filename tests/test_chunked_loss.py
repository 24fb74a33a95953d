"""The causal-LM loss in chunks of positions, without whole [tokens, vocab] logits (the default; use_liger_kernel
adds Liger's skip_logits in every training call). Loss and
gradients equal the whole-logits path (itself tested against transformers' torch models); the compiled step
needs less memory; evaluation still returns logits."""

import importlib.util
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import short_run_args, tiny_llama_config, token_rows
from flax import nnx

from jtrainer import Trainer
from jtrainer.models.bert import BertForMaskedLM
from jtrainer.models.gpt2 import GPT2LMHeadModel
from jtrainer.models.llama import LlamaForCausalLM


def _batch(rows):
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


def _loss_and_grads(model, batch, chunk, num_items=None):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        bound = nnx.merge(graphdef, p, rest)
        bound.loss_chunk_positions = chunk
        return bound(**batch, num_items_in_batch=num_items, skip_logits=chunk is not None).loss

    return jax.value_and_grad(loss)(params)


def _native_model(family):
    if family == "gpt2":
        from transformers import GPT2Config

        return GPT2LMHeadModel.from_config(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2), seed=1)
    return LlamaForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=family == "llama tied"), seed=1)


@pytest.mark.parametrize("family", ["llama", "llama tied", "gpt2"])
@pytest.mark.parametrize("chunk", [1, 4, 13, 64])  # 13 positions: chunks of 4 leave a ragged last chunk
def test_chunked_loss_and_gradients_equal_whole_logits(family, chunk):
    model = _native_model(family)
    batch = _batch(token_rows(3, length=13, ragged_labels=True, seed=2))
    for num_items in (None, jnp.asarray(29)):
        whole, whole_grads = _loss_and_grads(model, batch, None, num_items)
        chunked, chunked_grads = _loss_and_grads(model, batch, chunk, num_items)
        np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-6)
        flat_whole, flat_chunked = nnx.to_flat_state(whole_grads), nnx.to_flat_state(chunked_grads)
        for (path, a), (_, b) in zip(flat_whole, flat_chunked):
            np.testing.assert_allclose(np.asarray(b[...]), np.asarray(a[...]), rtol=1e-5, atol=1e-7, err_msg=str(path))


def test_chunked_loss_returns_no_logits_in_training_and_logits_in_eval_mode():
    model = LlamaForCausalLM.from_config(tiny_llama_config())
    model.loss_chunk_positions = 4
    batch = _batch(token_rows(2, length=8))
    assert model(**batch).logits.shape == (2, 8, 64)  # the Trainer asks for the loss alone where it wants it
    assert model(**batch, skip_logits=True).logits is None
    model.skip_logits_in_training = True
    assert model(**batch).logits is None  # use_liger_kernel: Liger's skip_logits in every training call
    model.eval()
    out = model(**batch)
    assert out.logits.shape == (2, 8, 64)
    assert model(**batch, skip_logits=True).logits is None  # HF's prediction_loss_only evaluation
    with pytest.raises(ValueError, match="needs labels"):
        model(input_ids=batch["input_ids"], skip_logits=True)


def test_chunked_train_step_needs_less_memory():
    """The compiled loss-and-gradient program of a 32k-vocabulary model: whole logits and their gradient (2 x 512
    positions x 32k x 4 bytes = 128 MiB each) against one 64-position chunk at a time."""
    config = tiny_llama_config(vocab_size=32000, hidden_size=32, max_position_embeddings=512)
    model = LlamaForCausalLM.from_config(config)
    batch = _batch(token_rows(2, length=512, vocab=32000))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def temporaries(chunk):
        def loss(p):
            bound = nnx.merge(graphdef, p, rest)
            bound.loss_chunk_positions = chunk
            return bound(**batch, skip_logits=True).loss

        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    whole, chunked = temporaries(None), temporaries(64)
    assert whole > 2 * 512 * 32000 * 4  # at least the whole logits
    assert chunked < whole / 4, (whole, chunked)


def _args(**over):
    """conftest's short run, four steps."""
    return short_run_args(**{"max_steps": 4, **over})


def test_trainer_with_use_liger_kernel_trains_and_evaluates_as_without():
    rows, eval_rows = token_rows(16, ragged_labels=True), token_rows(6, seed=3)
    runs = {}
    for liger in (False, True):
        trainer = Trainer(
            LlamaForCausalLM.from_config(tiny_llama_config(), seed=0),
            _args(use_liger_kernel=liger, loss_chunk_size=5),
            train_dataset=rows,
        )
        assert trainer.model.loss_chunk_positions == 5
        assert trainer.model.skip_logits_in_training is liger
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        metrics = trainer.evaluate(eval_rows)
        predictions = trainer.predict(eval_rows).predictions  # logits, as without chunking
        runs[liger] = losses, metrics["eval_loss"], predictions
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=1e-5)
    assert runs[True][2].shape == (6, 16, 64)
    np.testing.assert_allclose(runs[True][2], runs[False][2], rtol=1e-4, atol=1e-5)


def test_liger_kernel_config_and_unsupported_models(caplog):
    off = _args(use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": False, "rope": True})
    assert off.chunked_loss_positions() is None
    assert _args(use_liger_kernel=True).chunked_loss_positions() == 1024
    with pytest.raises(ValueError, match="liger_kernel_config: unknown kernel 'flash'"):
        _args(use_liger_kernel=True, liger_kernel_config={"flash": True})
    assert _args().chunked_loss_positions() == 1024  # the default, use_liger_kernel or not
    assert _args(loss_chunk_size=0).chunked_loss_positions() is None
    with pytest.raises(ValueError, match="loss_chunk_size"):
        _args(loss_chunk_size=-1)
    from transformers import BertConfig

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    with caplog.at_level(logging.WARNING, logger="jtrainer.sizing.abstract_step"):
        Trainer(BertForMaskedLM.from_config(config), _args(use_liger_kernel=True), train_dataset=token_rows(4))
    assert "BertForMaskedLM has no chunked loss" in caplog.text


def test_loss_only_evaluation_hands_any_model_skip_logits_as_hf():
    """HF's prediction_step: use_liger_kernel and prediction_loss_only put skip_logits=True in the inputs of
    whatever model (here a torch module through the bridge); predictions still ask for logits."""
    torch = pytest.importorskip("torch")
    if importlib.util.find_spec("torchax") is None:  # imported by the bridge, after its fixes
        pytest.skip("torchax is not installed")
    seen = []

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None, skip_logits=False):
            seen.append(skip_logits)
            y = self.head(x).squeeze(-1)
            return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": None if skip_logits else y}

    rng = np.random.RandomState(0)
    rows = [{"x": rng.randn(4).astype(np.float32), "labels": np.float32(rng.randn())} for _ in range(8)]
    trainer = Trainer(Regression(), _args(use_liger_kernel=True, per_device_eval_batch_size=8))
    seen.clear()
    trainer.evaluate(rows)
    assert seen[-1] is True  # the evaluation step's trace (earlier calls: the loss rules' shape probe)
    seen.clear()
    assert trainer.predict(rows).predictions.shape == (8,)
    assert seen[-1] is False
