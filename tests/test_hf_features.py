"""NEFTune, auto_find_batch_size and label smoothing for every head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import short_run_args, tiny_llama_config, token_rows
from flax import nnx

from jtrainer import Trainer, batch_size, env
from jtrainer.models import AutoModelForSequenceClassification, AutoModelForTokenClassification
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


def test_auto_find_batch_size_keeps_the_effective_batch(monkeypatch):
    assert [batch_size.next_batch_size(b, 16) for b in (16, 8, 4, 2, 1)] == [8, 4, 2, 1, 0]
    assert batch_size.next_batch_size(32, 96) == 24  # HF's 0.9 step (28), down to a divisor of 96
    assert batch_size.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1GiB"))

    rows = token_rows(32, length=16)
    reference = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config()),
        _args(per_device_train_batch_size=4, gradient_accumulation_steps=4),
        train_dataset=rows,
    )
    reference.train()
    with jax.set_mesh(reference.mesh):
        fits = batch_size.step_bytes(
            reference._train_step.lower(reference._train_state, reference._last_step_batch).compile()
        )
    # A device with just enough memory for batches of 4: 16 and 8 do not fit, 4 does.
    monkeypatch.setenv(env.DEVICE_MEMORY_BYTES.name, str(fits + 1024))
    searched = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config()),
        _args(per_device_train_batch_size=16, auto_find_batch_size=True),
        train_dataset=rows,
    )
    searched.train()
    assert (searched.args.per_device_train_batch_size, searched.args.gradient_accumulation_steps) == (4, 4)
    assert _losses(searched) == pytest.approx(_losses(reference), rel=1e-5)

    monkeypatch.setenv(env.DEVICE_MEMORY_BYTES.name, "1000")
    with pytest.raises(RuntimeError, match="No executable batch size found"):
        Trainer(
            LlamaForCausalLM.from_config(tiny_llama_config()),
            _args(per_device_train_batch_size=2, auto_find_batch_size=True),
            train_dataset=rows,
        ).train()


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


@pytest.mark.parametrize("auto", [AutoModelForSequenceClassification, AutoModelForTokenClassification])
def test_label_smoothing_equals_hf_label_smoother(auto):
    torch = pytest.importorskip("torch")
    from transformers.trainer_pt_utils import LabelSmoother

    rng = np.random.RandomState(0)
    ids = rng.randint(1, 64, (8, 10))
    token_level = auto is AutoModelForTokenClassification
    labels = rng.randint(0, 3, (8, 10) if token_level else (8,))
    if token_level:
        labels[:, 7:] = -100
    rows = [{"input_ids": i, "attention_mask": np.ones(10, np.int64), "labels": lab} for i, lab in zip(ids, labels)]
    model = auto.from_config(_bert_config())
    trainer = Trainer(model, _args(label_smoothing_factor=0.2, per_device_eval_batch_size=8))
    out = trainer.predict(rows)
    logits = torch.tensor(np.asarray(out.predictions))
    expected = LabelSmoother(epsilon=0.2)({"logits": logits}, torch.tensor(labels))
    assert out.metrics["test_loss"] == pytest.approx(float(expected), rel=1e-5)
    trainer.train_dataset = rows
    trainer.train()  # and it trains

    regression = AutoModelForSequenceClassification.from_config(_bert_config(problem_type="regression"))
    rows = [{"input_ids": i, "labels": np.float32(v)} for i, v in zip(ids, rng.randn(8))]
    with pytest.raises(ValueError, match="label_smoothing_factor=0.2 smooths class labels"):
        Trainer(regression, _args(label_smoothing_factor=0.2), train_dataset=rows).train()


def test_auto_find_batch_size_resumes_with_the_batch_it_found(monkeypatch, tmp_path, caplog):
    """HF restores the checkpoint's train_batch_size on resume instead of searching again: the resumed run
    starts at 4 x 4 without an out-of-memory round, and its last step is the uninterrupted run's."""
    rows = token_rows(48, length=16)

    def run(out, resume=None):
        trainer = Trainer(
            LlamaForCausalLM.from_config(tiny_llama_config()),
            _args(out, per_device_train_batch_size=16, auto_find_batch_size=True, save_strategy="steps", save_steps=2),
            train_dataset=rows,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    probe = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config()),
        _args(per_device_train_batch_size=4, gradient_accumulation_steps=4, max_steps=1),
        train_dataset=rows,
    )
    probe.train()
    with jax.set_mesh(probe.mesh):
        fits = batch_size.step_bytes(probe._train_step.lower(probe._train_state, probe._last_step_batch).compile())
    monkeypatch.setenv(env.DEVICE_MEMORY_BYTES.name, str(fits + 1024))  # batches of 16 and 8 do not fit, 4 does
    whole = run(tmp_path / "whole")
    caplog.clear()
    with caplog.at_level("WARNING", logger="jtrainer.trainer"):
        resumed = run(tmp_path / "resumed", str(tmp_path / "whole" / "checkpoint-2"))
    assert not [r for r in caplog.records if "out of memory" in r.getMessage()]
    assert (resumed.args.per_device_train_batch_size, resumed.args.gradient_accumulation_steps) == (4, 4)
    assert resumed.state.train_batch_size == 4
    assert _losses(resumed)[-1] == pytest.approx(_losses(whole)[-1], rel=1e-5)
    assert batch_size.per_device_from_state(32, 1, 8) == 4 and batch_size.per_device_from_state(8, 2, 4) == 4
