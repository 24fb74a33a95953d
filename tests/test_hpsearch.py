"""hyperparameter_search with optuna: HF's API, trial folders, and one compile of the train step in total."""

import os

import pytest
from conftest import count_compiles, tiny_llama_config, token_rows

import jtrainer.trainer.trainer
from jtrainer import Trainer, TrainingArguments
from jtrainer.models.llama import LlamaForCausalLM

optuna = pytest.importorskip("optuna")


def _args(out, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        max_steps=6,
        max_grad_norm=1.0,
        eval_strategy="steps",
        eval_steps=3,
        train_sampling_strategy="sequential",
    )
    kw.update(over)
    return TrainingArguments(**kw)


def _model_init(trial=None):
    return LlamaForCausalLM.from_config(tiny_llama_config(), seed=0)


def _space(trial):
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True),
        "warmup_steps": trial.suggest_int("warmup_steps", 0, 4),
        "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.2),
    }


def test_optuna_search_compiles_the_train_step_once(tmp_path):
    train, held_out = token_rows(24, seed=1), token_rows(8, seed=2)
    trainer = Trainer(
        args=_args(tmp_path, save_strategy="steps", save_steps=6),
        model_init=_model_init,
        train_dataset=train,
        eval_dataset=held_out,
    )
    jtrainer.clear_compiled_steps()
    with count_compiles("train_step") as compiles:
        best = trainer.hyperparameter_search(
            hp_space=_space, n_trials=4, direction="minimize", sampler=optuna.samplers.RandomSampler(seed=0)
        )
    assert len(compiles) == 1
    assert set(best.hyperparameters) == {"learning_rate", "warmup_steps", "weight_decay"}
    for trial in range(4):  # each trial writes under output_dir/run-{number}
        assert os.path.isdir(tmp_path / f"run-{trial}" / "checkpoint-6")

    # The shared step used each trial's own numbers: rerunning the best trial alone, with a fresh compile,
    # gives the same objective.
    jtrainer.clear_compiled_steps()
    alone = Trainer(
        model=_model_init(),
        args=_args(tmp_path / "alone", **best.hyperparameters),
        train_dataset=train,
        eval_dataset=held_out,
    )
    alone.train()
    assert alone.evaluate()["eval_loss"] == pytest.approx(best.objective, rel=1e-5)


def test_multi_objective_hp_name_and_pruning(tmp_path):
    def objectives(metrics):
        return metrics["eval_loss"], -metrics["eval_loss"]

    trainer = Trainer(
        args=_args(tmp_path, max_steps=2, eval_steps=1),
        model_init=_model_init,
        train_dataset=token_rows(8),
        eval_dataset=token_rows(4, seed=3),
    )
    runs = trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-4, 1e-2)},
        compute_objective=objectives,
        n_trials=2,
        direction=["minimize", "maximize"],
        hp_name=lambda t: f"trial-{t.number}",
    )
    assert isinstance(runs, list) and all(len(r.objective) == 2 for r in runs)

    # A pruner that stops the second trial at its first report: it ends early, pruned, without error.
    trainer = Trainer(
        args=_args(tmp_path, max_steps=4, eval_steps=1),
        model_init=_model_init,
        train_dataset=token_rows(8),
        eval_dataset=token_rows(4, seed=3),
    )

    class PruneSecond(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number == 1

    best = trainer.hyperparameter_search(hp_space=_space, n_trials=2, pruner=PruneSecond())
    assert best.run_id == "0" and trainer.state.global_step == 1


def test_search_needs_model_init_and_a_known_backend(tmp_path):
    trainer = Trainer(
        model=_model_init(), args=_args(tmp_path), train_dataset=token_rows(8), eval_dataset=token_rows(4)
    )
    with pytest.raises(RuntimeError, match="model_init"):
        trainer.hyperparameter_search(n_trials=1)
    with pytest.raises(ValueError, match="backend='optuna'"):
        trainer.hyperparameter_search(n_trials=1, backend="ray")
