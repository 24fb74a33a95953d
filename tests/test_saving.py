"""Resuming a run from its checkpoint, and early stopping with the best model loaded at the end."""

import numpy as np
import pytest
from conftest import Classifier, accuracy, class_rows, tiny_llama_config, token_rows
from conftest import eval_args as _args
from flax import nnx

from jtrainer import EarlyStoppingCallback, Trainer
from jtrainer.models.llama import LlamaForCausalLM


def test_early_stopping_and_best_model(tmp_path):
    train, val = class_rows(40), class_rows(8, seed=1)
    args = _args(
        tmp_path,
        num_train_epochs=20,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        save_total_limit=1,
        learning_rate=0.0,
    )  # nothing improves after the first evaluation
    trainer = Trainer(
        model=Classifier(nnx.Rngs(0)),
        args=args,
        train_dataset=train,
        eval_dataset=val,
        compute_metrics=accuracy,
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    trainer.train()
    assert trainer.state.epoch == 3  # best at epoch 1, then 2 evaluations without improvement
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-10")
    import os

    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10"]  # HF: limit 1 keeps only the best at the end


def test_resume_from_checkpoint_continues_the_run(tmp_path):
    import jax

    rows = token_rows(16, length=8)
    full = Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=_args(tmp_path / "full", num_train_epochs=2, train_sampling_strategy="sequential"),
        train_dataset=rows,
    )
    full.train()
    part = _args(
        tmp_path / "part", num_train_epochs=2, train_sampling_strategy="sequential", save_strategy="steps", save_steps=3
    )
    first = Trainer(model=LlamaForCausalLM.from_config(tiny_llama_config()), args=part, train_dataset=rows)
    first.train()
    resumed = Trainer(model=LlamaForCausalLM.from_config(tiny_llama_config(), seed=7), args=part, train_dataset=rows)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-6"))
    assert resumed.state.global_step == 8
    for x, y in zip(jax.tree.leaves(full._train_state.params), jax.tree.leaves(resumed._train_state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        resumed.args.output_dir = str(tmp_path / "empty")
        resumed.train(resume_from_checkpoint=True)


def test_the_finite_check_of_saves_compiles_once(tmp_path):
    """save_steps with load_best_model / NaN checks: the parameters' finite check is one program, not one per save."""
    from conftest import count_compiles, short_run_args, tiny_llama_config, token_rows

    from jtrainer import Trainer
    from jtrainer.models.llama import LlamaForCausalLM

    trainer = Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=short_run_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=1),
        train_dataset=token_rows(16),
    )
    from jtrainer.trainer import saving

    saving._all_finite.clear_cache()  # another test of this worker may have compiled it for this layout
    with count_compiles("_all_finite") as compiles:
        trainer.train()
    assert len(compiles) == 1  # four saves, one program
