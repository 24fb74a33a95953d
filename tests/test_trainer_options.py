"""Trainer options: bf16, user optimizers, model_init, compute_loss_func, label smoothing, plateau scheduling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import short_run_args, tiny_llama_config, token_rows

from jtrainer import Trainer
from jtrainer.models.llama import LlamaForCausalLM


def _args(**over):
    """conftest's short run, four steps."""
    return short_run_args(**{"max_steps": 4, **over})


def _model(seed=0):
    return LlamaForCausalLM.from_config(tiny_llama_config(), seed=seed)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_bf16_computes_in_bfloat16_with_fp32_master_weights():
    rows = token_rows(16)
    fp32 = Trainer(_model(), _args(), train_dataset=rows)
    fp32.train()
    bf16 = Trainer(_model(), _args(bf16=True), train_dataset=rows)
    bf16.train()
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16._train_state.params))
    a, b = _losses(fp32), _losses(bf16)
    assert a != b and np.allclose(a, b, rtol=2e-2)


def test_user_optimizers_and_optimizer_cls():
    rows = token_rows(16)
    tx = optax.sgd(0.5)
    by_tuple = Trainer(_model(), _args(), train_dataset=rows, optimizers=(tx, None))
    by_tuple.train()
    by_cls = Trainer(
        _model(),
        _args(learning_rate=0.5, lr_scheduler_type="constant"),
        train_dataset=rows,
        optimizer_cls_and_kwargs=(optax.sgd, {}),
    )
    by_cls.train()
    assert _losses(by_tuple) == pytest.approx(_losses(by_cls), rel=1e-5)
    assert [h["learning_rate"] for h in by_cls.state.log_history if "loss" in h] == [0.5] * 4
    with pytest.raises(RuntimeError, match="model_init"):
        Trainer(args=_args(), model_init=_model, optimizers=(tx, None))


def test_model_init_gives_a_fresh_model_per_train():
    rows = token_rows(16)
    calls = []

    def init():
        calls.append(1)
        return _model()

    trainer = Trainer(args=_args(), train_dataset=rows, model_init=init)
    first = trainer.train().training_loss
    second = trainer.train().training_loss
    assert len(calls) == 3 and first == pytest.approx(second, rel=1e-6)


def test_compute_loss_func_and_label_smoothing():
    rows = token_rows(16)
    seen = {}

    def loss_func(outputs, labels, num_items_in_batch):
        seen["num_items"] = num_items_in_batch
        logits = outputs.logits[:, :-1]
        targets = labels[:, 1:]
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
        return jnp.sum(nll) / num_items_in_batch

    custom = Trainer(_model(), _args(), train_dataset=rows, compute_loss_func=loss_func)
    custom.train()
    default = Trainer(_model(), _args(), train_dataset=rows)
    default.train()
    assert _losses(custom) == pytest.approx(_losses(default), rel=1e-5)
    smoothed = Trainer(_model(), _args(label_smoothing_factor=0.1), train_dataset=rows)
    smoothed.train()
    # The first step's loss, by hand: HF's LabelSmoother on the first batch of 4 rows, causal shift.
    ids = np.stack([r["input_ids"] for r in rows[:4]])
    logp = np.asarray(jax.nn.log_softmax(_model()(jnp.asarray(ids)).logits[:, :-1]), np.float64)
    nll = -np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    expected = np.mean(0.9 * nll + 0.1 * -logp.mean(-1))
    assert _losses(smoothed)[0] == pytest.approx(expected, rel=1e-5)


def test_reduce_lr_on_plateau_steps_after_evaluation():
    rows = token_rows(8)
    scores = iter(range(100))
    trainer = Trainer(
        _model(),
        _args(
            learning_rate=1e-3,
            lr_scheduler_type="reduce_lr_on_plateau",
            lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
            eval_strategy="steps",
            eval_steps=1,
            max_steps=4,
            metric_for_best_model="score",
            greater_is_better=False,
        ),
        train_dataset=rows,
        eval_dataset=rows,
        compute_metrics=lambda pred: {"score": float(next(scores))},
    )
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    # The score only grows, so with mode "min" and patience 0 every evaluation after the first halves the rate.
    assert lrs == pytest.approx([1e-3, 1e-3, 5e-4, 2.5e-4])


def test_greedy_scheduler_steps_after_evaluation():
    """HF's GreedyLR: more than `patience` worse evaluations in a row multiply the rate by `factor`, more than
    `patience` better ones divide it (mode "min" by default, whatever greater_is_better says, as HF)."""
    rows = token_rows(8)
    scores = iter([5.0, 6.0, 4.0, 3.0, 2.0, 1.0])
    trainer = Trainer(
        _model(),
        _args(
            learning_rate=1e-3,
            lr_scheduler_type="greedy",
            lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "min_lr": 1e-5},
            eval_strategy="steps",
            eval_steps=1,
            max_steps=5,
            metric_for_best_model="score",
        ),
        train_dataset=rows,
        eval_dataset=rows,
        compute_metrics=lambda pred: {"score": next(scores)},
    )
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    # Evaluation 1 (5.0) improves on nothing yet: x2; 6.0 is worse: x0.5; 4.0, 3.0 improve: x2 each.
    assert lrs == pytest.approx([1e-3, 2e-3, 1e-3, 2e-3, 4e-3])


def test_dropout_randomness_is_derived_from_seed_and_step():
    from flax import nnx

    class DropoutLM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(64, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.head = nnx.Linear(16, 64, rngs=rngs)

        def __call__(self, input_ids, attention_mask=None):
            return self.head(self.drop(self.embed(input_ids)))

    rows = token_rows(16)

    def run(seed):
        trainer = Trainer(DropoutLM(nnx.Rngs(0)), _args(seed=seed, gradient_accumulation_steps=2), train_dataset=rows)
        trainer.train()
        return _losses(trainer), trainer.evaluate(rows)["eval_loss"]

    a, b, c = run(1), run(1), run(2)
    assert a == b  # same seed, same masks, bit for bit
    assert a[0] != c[0]  # another seed, other masks
    assert len(set(a[0])) == len(a[0])  # a fresh mask at every step (losses all differ)


def test_gradient_checkpointing_and_memory_report():
    rows = token_rows(16)
    plain = Trainer(_model(), _args(skip_memory_metrics=False), train_dataset=rows)
    out_plain = plain.train()
    remat = Trainer(
        _model(),
        _args(activation_checkpointing=True, activation_checkpointing_kwargs={"policy": "nothing_saveable"}),
        train_dataset=rows,
    )
    remat.train()
    assert _losses(remat) == pytest.approx(_losses(plain), rel=1e-5)  # remat changes memory, not results
    assert remat.model.model.remat_policy == "nothing_saveable"
    m = out_plain.metrics
    n_params = plain.get_num_trainable_parameters()
    assert m["train_mem_params_bytes_per_device"] == 4 * n_params
    assert m["train_mem_optimizer_bytes_per_device"] >= 2 * 4 * n_params  # AdamW's two moments
    assert m["train_mem_activations_bytes_per_device"] > 0 and m["train_mem_host_peak_bytes"] > 0
    with pytest.raises(ValueError, match="checkpoint_policies"):
        _model().gradient_checkpointing_enable({"policy": "save_everything_please"})


def test_plateau_scheduler_state_is_checkpointed(tmp_path):
    """The per-evaluation scheduler's counters resume with the checkpoint (HF's scheduler.pt): in mode "max" a
    falling eval_loss is a bad evaluation, and with patience 1 the third one halves the rate only if the resumed
    run remembers the second."""
    rows = token_rows(8)

    def run(out, resume=None):
        args = _args(
            output_dir=str(out),
            lr_scheduler_type="reduce_lr_on_plateau",
            lr_scheduler_kwargs={"patience": 1, "factor": 0.5},
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            save_steps=2,
            max_steps=5,
            metric_for_best_model="loss",
            greater_is_better=True,
        )
        trainer = Trainer(_model(), args, train_dataset=rows, eval_dataset=rows)
        trainer.train(resume_from_checkpoint=resume)
        return [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]

    whole = run(tmp_path / "whole")
    assert len(set(whole)) > 1  # the rate did change
    assert run(tmp_path / "resumed", str(tmp_path / "whole" / "checkpoint-2")) == pytest.approx(whole)
