"""Trainer.hyperparameter_search: HF's API and trial protocol, with optuna.

What differs from HF is underneath: the numbers a trial usually changes (learning rate, warmup, weight decay,
betas, epsilon, clipping, epochs) live in the optimizer state, and the compiled train step is shared by
structure (`Trainer._compiled_train_step`), so every trial after the first reuses the first one's executable.
Hyperparameters that change shapes (batch size, sequence length) or the model compile once per new shape.

On many processes, process 0 runs the optuna study and sends each trial's parameters to the others, which train
the same trial (an `optuna.trial.FixedTrial`) in step with it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from transformers.trainer_utils import BestRun, HPSearchBackend, default_compute_objective, default_hp_space_optuna

from jtrainer.trainer.trainer_parts import TrainerParts

logger = logging.getLogger(__name__)

_MESSAGE_BYTES = 1 << 16  # one trial's parameters as JSON, sent from process 0 to the others


def _broadcast_json(value: Any) -> Any:
    """Process 0's `value` on every process (JSON-encodable, under 64 KiB)."""
    from jax.experimental import multihost_utils

    buffer = np.zeros(_MESSAGE_BYTES, np.uint8)
    if jax.process_index() == 0:
        encoded = json.dumps(value).encode()
        if len(encoded) > _MESSAGE_BYTES:
            raise ValueError(f"A trial's parameters take {len(encoded)} bytes as JSON; the limit is {_MESSAGE_BYTES}.")
        buffer[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return json.loads(bytes(received[received != 0]).decode())


class HyperparameterSearchMixin(TrainerParts):
    """HF's `hyperparameter_search`, `_hp_search_setup` and `_report_to_hp_search` for the Trainer."""

    def hyperparameter_search(
        self,
        hp_space: Callable | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: str | HPSearchBackend | None = None,
        hp_name: Callable | None = None,
        **kwargs,
    ) -> BestRun | list[BestRun] | None:
        """Run `n_trials` trainings with hyperparameters from `hp_space(trial)`; the best run(s) by
        `compute_objective(eval metrics)` (default: the eval loss, or the sum of the metrics)."""
        backend = HPSearchBackend(backend or HPSearchBackend.OPTUNA)
        if backend != HPSearchBackend.OPTUNA:
            raise ValueError(
                f"hyperparameter_search(backend={backend.value!r}) is not supported by jtrainer; use backend='optuna'."
            )
        import importlib.util

        if importlib.util.find_spec("optuna") is None:
            raise RuntimeError("hyperparameter_search needs optuna: pip install optuna")
        if self.model_init is None:
            raise RuntimeError(
                "To use hyperparameter search, you need to pass your model through a model_init function."
            )
        self.hp_search_backend = backend
        self.hp_space = default_hp_space_optuna if hp_space is None else hp_space
        self.hp_name = hp_name
        self.compute_objective = default_compute_objective if compute_objective is None else compute_objective
        try:
            return _run_optuna(self, n_trials, direction, **kwargs)
        finally:
            self.hp_search_backend = None

    def _hp_search_setup(self, trial) -> None:
        """Set the trial's hyperparameters on `self.args`, converted to each field's type (HF's rule)."""
        self._trial = trial
        if self.hp_search_backend is None or trial is None:
            return
        assert self.hp_space is not None, "set with the backend by hyperparameter_search"
        for key, value in self.hp_space(trial).items():
            if not hasattr(self.args, key):
                logger.warning(
                    f"Trying to set {key} in the hyperparameter search but there is no corresponding field in "
                    "`TrainingArguments`."
                )
                continue
            old = getattr(self.args, key, None)
            setattr(self.args, key, type(old)(value) if old is not None else value)
        logger.info(f"Trial: {trial.params}")

    def _report_to_hp_search(self, trial, step: int, metrics: dict[str, float]) -> None:
        """After an evaluation: the trial's objective, reported to optuna (which may prune the trial)."""
        if self.hp_search_backend is None or trial is None:
            return
        assert self.compute_objective is not None, "set with the backend by hyperparameter_search"
        self.objective = self.compute_objective(dict(metrics))
        import optuna

        study = getattr(trial, "study", None)
        # Pruning is decided on one process; with several, trials run to the end (all must stop together).
        if study is not None and not study._is_multi_objective() and jax.process_count() == 1:
            trial.report(self.objective, step)
            if trial.should_prune():
                self.callback_handler.on_train_end(self.args, self.state, self.control)
                raise optuna.TrialPruned()

    def _train_trial(self, trial) -> Any:
        """One trial: train, its objective (from the last evaluation, or one evaluation after training)."""
        self.objective = None
        self.train(trial=trial)
        if self.objective is None:  # no evaluation during training
            assert self.compute_objective is not None, "set by hyperparameter_search"
            self.objective = self.compute_objective(self.evaluate())
        self._release_train_state()  # the trial's device memory, before the next one
        return self.objective


def _run_optuna(trainer, n_trials: int, direction: str | list[str], **kwargs) -> BestRun | list[BestRun] | None:
    import optuna

    many = jax.process_count() > 1
    if jax.process_index() != 0:
        while (message := _broadcast_json(None)) is not None:
            trainer._train_trial(optuna.trial.FixedTrial(message["params"], message["number"]))
        return None

    def objective(trial):
        if many:
            trainer.hp_space(trial)  # samples the trial's parameters, then sends them
            _broadcast_json({"params": trial.params, "number": trial.number})
        return trainer._train_trial(trial)

    timeout = kwargs.pop("timeout", None)
    n_jobs = kwargs.pop("n_jobs", 1)
    gc_after_trial = kwargs.pop("gc_after_trial", False)
    catch = kwargs.pop("catch", ())
    directions: Any = direction if isinstance(direction, list) else None  # optuna checks the names
    single: Any = None if directions else direction
    study = optuna.create_study(direction=single, directions=directions, **kwargs)
    try:
        study.optimize(
            objective, n_trials=n_trials, timeout=timeout, n_jobs=n_jobs, gc_after_trial=gc_after_trial, catch=catch
        )
    finally:
        if many:
            _broadcast_json(None)  # the other processes stop waiting for trials
    if study._is_multi_objective():
        return [BestRun(str(best.number), best.values, best.params) for best in study.best_trials]
    best = study.best_trial
    return BestRun(str(best.number), best.value, best.params)  # type: ignore[arg-type]  # a finished trial has a value
