"""fp16 (dynamic loss scaling, torch GradScaler's rules), fp16_full_eval and bf16_full_eval."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import count_compiles, short_run_args, tiny_llama_config, token_rows

from jtrainer import Trainer, TrainingArguments
from jtrainer.models.llama import LlamaForCausalLM
from jtrainer.numerics import mixed_precision

_args = short_run_args


def _logs(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def test_loss_scale_skips_non_finite_updates_halves_and_grows():
    params = {"w": jnp.ones(3)}
    tx = mixed_precision.dynamic_loss_scaling(optax.adam(0.1), initial_scale=8.0, growth_interval=2)
    state = tx.init(params)
    assert mixed_precision.loss_scale(state) == 8.0
    updates, state = tx.update({"w": jnp.array([1.0, jnp.inf, 0.0])}, state, params)
    assert not np.any(updates["w"]) and state.scale == 4.0 and state.total_notfinite == 1
    untouched = optax.adam(0.1).init(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(untouched)))
    for expected_scale in (4.0, 8.0, 8.0, 16.0):  # doubles after every 2 finite updates in a row
        updates, state = tx.update({"w": jnp.ones(3)}, state, params)
        assert np.all(updates["w"] != 0) and state.scale == expected_scale
    assert state.total_notfinite == 1 and state.inner_state[0].count == 4


def test_fp16_trains_like_fp32_with_the_scale_in_the_optimizer_state():
    rows = token_rows(12)
    full = Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), _args(), train_dataset=rows)
    full.train()
    half = Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), _args(fp16=True), train_dataset=rows)
    with count_compiles() as compiles:
        half.train()
    assert len(compiles) == 1
    np.testing.assert_allclose(_logs(half), _logs(full), rtol=2e-2)
    assert _logs(half) != _logs(full)  # it did compute in float16
    assert _logs(half, "skipped_updates") == [0, 0, 0]
    assert mixed_precision.loss_scale(half._train_state.opt_state) == mixed_precision.INITIAL_SCALE
    assert half.args.compute_dtype() == jnp.float16 and half.args.mixed_precision == "fp16"


def test_fp16_overflow_skips_the_update_and_the_schedule(monkeypatch):
    """A scale so large that the float16 backward pass overflows: every update is skipped (parameters and the
    schedule's step unchanged, as HF skips lr_scheduler.step()) and the scale halves each time."""
    monkeypatch.setattr(mixed_precision, "INITIAL_SCALE", 2.0**40)
    model = LlamaForCausalLM.from_config(tiny_llama_config())
    before = jax.tree.map(np.asarray, jax.tree.leaves(model))
    trainer = Trainer(
        model, _args(fp16=True, max_steps=2, lr_scheduler_type="linear", warmup_steps=0), train_dataset=token_rows(8)
    )
    trainer.train()
    assert _logs(trainer, "skipped_updates") == [1, 2]
    assert not np.isfinite(_logs(trainer, "grad_norm")[0])
    assert all(np.array_equal(a, b) for a, b in zip(before, jax.tree.map(np.asarray, jax.tree.leaves(model))))
    assert mixed_precision.loss_scale(trainer._train_state.opt_state) == 2.0**38
    assert _logs(trainer, "learning_rate") == pytest.approx([1e-2, 1e-2])  # the schedule did not advance


def test_fp16_resume_restores_the_loss_scale(tmp_path):
    rows = token_rows(12)

    def run(out, resume=None):
        trainer = Trainer(
            LlamaForCausalLM.from_config(tiny_llama_config()),
            _args(out, fp16=True, save_strategy="steps", save_steps=2),
            train_dataset=rows,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", str(tmp_path / "whole" / "checkpoint-2"))
    assert _logs(resumed)[-1] == pytest.approx(_logs(whole)[-1], rel=1e-6)
    for a, b in zip(jax.tree.leaves(resumed._train_state.opt_state), jax.tree.leaves(whole._train_state.opt_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_full_eval_computes_in_half_precision(half):
    """`{half}_full_eval` evaluates as a `{half}` run evaluates, while training stays fp32."""
    rows = token_rows(8)

    def eval_loss(**kw):
        trainer = Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), _args(**kw), eval_dataset=rows)
        return trainer.evaluate()["eval_loss"]

    full_eval = eval_loss(**{f"{half}_full_eval": True})
    assert full_eval == eval_loss(**{half: True})
    assert full_eval != eval_loss() and full_eval == pytest.approx(eval_loss(), rel=1e-2)
    assert TrainingArguments("o", **{f"{half}_full_eval": True}).compute_dtype() is None  # training: fp32


def test_resume_across_a_change_of_fp16_or_nan_inf_policy(tmp_path, caplog):
    """HF resumes a checkpoint whatever fp16 was at the save: the optimizer's state is restored from under the
    saved wrappers and put under this run's, whose state (the loss scale, the skip counter) starts afresh."""
    from jtrainer.numerics import opt_state

    rows = token_rows(12)

    def run(out, resume=None, **kw):
        trainer = Trainer(
            LlamaForCausalLM.from_config(tiny_llama_config()),
            _args(out, save_strategy="steps", save_steps=2, **kw),
            train_dataset=rows,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    plain = run(tmp_path / "plain")
    with caplog.at_level("WARNING", logger="jtrainer.checkpointing.checkpoint"):
        to_half = run(tmp_path / "to_half", str(tmp_path / "plain" / "checkpoint-2"), fp16=True)
    assert "saved with no wrapper around the optimizer, this run uses fp16 loss scaling" in caplog.text
    assert _logs(to_half)[-1] == pytest.approx(_logs(plain)[-1], rel=1e-2)
    state = to_half._train_state.opt_state
    assert mixed_precision.loss_scale(state) == mixed_precision.INITIAL_SCALE
    assert opt_state.hyperparameter(state, "learning_rate") is not None and state.inner_state.count == 3

    half = run(tmp_path / "half", fp16=True)
    to_skip = run(tmp_path / "to_skip", str(tmp_path / "half" / "checkpoint-2"), nan_inf_policy="skip")
    assert _logs(to_skip)[-1] == pytest.approx(_logs(half)[-1], rel=1e-2)
    assert _logs(to_skip, "skipped_updates")[-1] == 0 and to_skip._train_state.opt_state.inner_state.count == 3
