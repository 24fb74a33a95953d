"""The Trainer's optimizer and scheduler methods (HF's names): decay groups, HF's schedule and optimizer as
optax, and the parameter/FLOP counts HF reports."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from transformers.trainer_utils import SchedulerType

from jtrainer import kinds
from jtrainer.core.state import TrainState
from jtrainer.kinds import user_code
from jtrainer.models.base import count_parameters
from jtrainer.numerics import opt_state as opt_states
from jtrainer.numerics import optim, schedules
from jtrainer.trainer.trainer_parts import TrainerParts


class OptimizerMixin(TrainerParts):
    """create_optimizer / create_scheduler and friends; uses the Trainer's args, model and train state."""

    @property
    def lr_scheduler(self) -> Any:
        """HF's `trainer.lr_scheduler`: a view of the schedule the run built from the arguments (its step -> rate
        function), or the scheduler the user gave (optimizers=(..., scheduler)); for a user's torch optimizer,
        HF's own torch scheduler on it."""
        if self._given_lr_scheduler is not None or self._learning_rate is None:
            return self._given_lr_scheduler
        return self._learning_rate.schedule

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self._given_lr_scheduler = scheduler

    def _forget_optimizer(self) -> None:
        """A new model (model_init): the next train() builds its optimizer and schedule afresh."""
        self.optimizer = self.lr_scheduler = self._learning_rate = self._translated_optimizer = None
        self._optimizer_recipe = self._plateau_scheduler = None

    def _optimizer_eval(self) -> None:
        """HF's optimizer.eval(): a schedule-free optimizer's x parameters are the model's until the next step."""
        self._optimizer_eval_mode = True

    def _optimizer_train(self) -> None:
        """HF's optimizer.train(), at each training step."""
        self._optimizer_eval_mode = False

    def _per_evaluation_scheduler(self) -> Any:
        """The scheduler that steps once per evaluation (reduce_lr_on_plateau, greedy, a user's torch
        ReduceLROnPlateau), if the run has one."""
        if self._translated_optimizer is not None:
            return self.lr_scheduler if self._translated_optimizer.per_evaluation else None
        return self._plateau_scheduler

    def _plateau_metric(self, metrics: dict[str, float]) -> float:
        """The evaluated metric a per-evaluation scheduler steps on (metric_for_best_model, HF's), named if absent."""
        name = self.args.metric_for_best_model  # set ("loss") for HF's plateau-like schedules
        key = name if name.startswith("eval_") else f"eval_{name}"  # type: ignore[union-attr]  # unset: HF's crash
        if key not in metrics:
            raise KeyError(
                f"The lr scheduler {self.args.lr_scheduler_type} needs metric {key!r}, which evaluation did not "
                f"return; it returned {sorted(metrics)}. Set --metric_for_best_model."
            )
        return float(metrics[key])

    def _plateau_stepped(self, metric: float, train_state: TrainState) -> TrainState:
        """A per-evaluation scheduler's step on the evaluated metric: the train state with the new rate in its
        optimizer state (a user's torch scheduler's rate enters at the next update instead)."""
        if self._translated_optimizer is not None:
            self._translated_optimizer.after_evaluation(metric)
            return train_state
        scheduler = self._plateau_scheduler
        assert scheduler is not None, "a per-evaluation lr_scheduler_type"
        return train_state.replace(opt_state=schedules.plateau_step(scheduler, metric, train_state.opt_state))

    def get_decay_parameter_names(self, model=None) -> list[str]:
        """HF's rule: every parameter but those of LayerNorm modules (torch.nn.LayerNorm's counterparts, by type)
        and those whose names match HF's bias/norm patterns."""
        return kinds.decay_parameter_names(model or self.model)

    def _decay_mask_tree(self, params):
        return kinds.decay_mask(self._held, params, self.get_decay_parameter_names())

    def _translated_optimizer_given(self) -> bool:
        """A torch optimizer from the user (optimizers=(torch optimizer, ...) or a torch optimizer_cls)."""
        cls = None if self.optimizer_cls_and_kwargs is None else self.optimizer_cls_and_kwargs[0]
        return user_code.is_optimizer(self.optimizer) or user_code.is_optimizer_class(cls)

    def create_scheduler(self, num_training_steps: int, optimizer=None) -> Any:
        """HF's scheduler, as a step -> rate function (or the user's schedule from `optimizers`); for a user's
        torch optimizer, HF's own torch scheduler on it (transformers.get_scheduler), as HF builds it."""
        if self._translated_optimizer_given():
            if self.lr_scheduler is None:
                from transformers.optimization import get_scheduler

                self.lr_scheduler = get_scheduler(
                    self.args.lr_scheduler_type,
                    optimizer=optimizer if optimizer is not None else self.optimizer,
                    num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
                    num_training_steps=num_training_steps,
                    scheduler_specific_kwargs=self.args.lr_scheduler_kwargs,  # type: ignore[arg-type]  # JSON parsed
                )
            if self._translated_optimizer is not None:
                self._translated_optimizer.scheduler = self.lr_scheduler
            return self.lr_scheduler
        if self.lr_scheduler is None:
            self._learning_rate = schedules.LearningRate.from_args(self.args, num_training_steps)
        return self.lr_scheduler

    def _create_translated_optimizer(self, params) -> Any:
        """A user's torch optimizer (built from optimizer_cls_and_kwargs over HF's decay groups, as HF builds
        it), translated for the step."""
        self._held.check_takes_translated_optimizer()
        if self.optimizer is None:
            assert self.optimizer_cls_and_kwargs is not None, "a torch optimizer or its class was given"
            cls, kwargs = self.optimizer_cls_and_kwargs
            self.optimizer = cls(self._decay_groups(), **kwargs)
        self._translated_optimizer = user_code.optimizer_for_step(self.optimizer, self.lr_scheduler, self.model)
        self._translated_optimizer.tx = self._translated_optimizer.transformation(params)
        return self.optimizer

    def _optax_optimizer(self) -> optax.GradientTransformation:
        """The optimizer the step applies: the Trainer's optax one, or a user's torch optimizer translated."""
        return self._translated_optimizer.tx if self._translated_optimizer is not None else self.optimizer

    def _before_update(self, train_state):
        """Before each update: a user's torch optimizer's current rates enter the optimizer state."""
        if self._translated_optimizer is None:
            return train_state
        return train_state.replace(opt_state=self._translated_optimizer.before_update(train_state.opt_state))

    def _after_update(self) -> None:
        """After each update (before global_step counts it): a user's torch scheduler steps, as in HF."""
        if self._translated_optimizer is not None:
            self._translated_optimizer.after_update(self.state.global_step)

    def create_optimizer(self, params=None) -> Any:
        if self._translated_optimizer_given():
            if self._translated_optimizer is None:
                params = params if params is not None else nnx.to_pure_dict(nnx.state(self.nnx_model, nnx.Param))
                self._create_translated_optimizer(params)
            return self.optimizer
        if self.optimizer is not None:
            return self.optimizer
        params = params if params is not None else nnx.to_pure_dict(nnx.state(self.nnx_model, nnx.Param))
        mask = self._decay_mask_tree(params)
        rate = self._learning_rate
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
            factory = lambda learning_rate: cls(learning_rate=learning_rate, **kwargs)  # noqa: E731
            self.optimizer = optax.inject_hyperparams(factory)(learning_rate=self.lr_scheduler)
            return self.optimizer
        args = self.args
        self.optimizer, self._optimizer_recipe = optim.hf_optimizer(args, mask, rate, self.lr_scheduler)
        if SchedulerType(args.lr_scheduler_type).value in schedules.PER_EVALUATION:
            self._plateau_scheduler = schedules.per_evaluation_scheduler(args)
        return self.optimizer

    def _schedule_drives_optimizer(self) -> bool:
        """Whether the optimizer's rate is the run's schedule (the Trainer built the optimizer from it: HF's
        float64 value of each rate is what is logged), rather than a user's optimizer's own."""
        if self._learning_rate is None or self._translated_optimizer is not None:
            return False
        return self._optimizer_recipe is not None or self.optimizer_cls_and_kwargs is not None

    def _schedule_numbers(self) -> dict[str, float] | None:
        """The schedule's numbers in the train state's optimizer state, as host floats (None where the schedule
        is compiled into the step rather than kept there, or before training)."""
        if self._optimizer_recipe is None or self._train_state is None:
            return None
        hyper = opt_states.find_hyperparams(self._train_state.opt_state) or {}
        return {name: float(value) for name, value in jax.device_get(hyper).items() if np.ndim(value) == 0}

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        if self._translated_optimizer_given():  # HF's order: the torch scheduler is built on the torch optimizer
            self.create_optimizer()
            self.create_scheduler(num_training_steps, self.optimizer)
            return
        self.create_scheduler(num_training_steps)
        self.create_optimizer()

    def get_learning_rates(self) -> list[float]:
        """HF's: each optimizer group's current rate (that of the next update, as torch's groups hold it)."""
        return [group["lr"] for group in self._param_groups()]

    def _current_learning_rate(self) -> float:
        """What HF's param_groups hold between steps: the rate of the next update (its scheduler has stepped)."""
        updates = self.state.global_step
        count = None if self._train_state is None else opt_states.schedule_count(self._train_state.opt_state)
        if count is not None:
            updates = int(count)
        if self._plateau_scheduler is not None:
            return self._plateau_scheduler.last_lr
        if self._learning_rate is not None and self._schedule_drives_optimizer():
            return self._learning_rate.host_rate(updates + 1, self._schedule_numbers())
        if callable(self.lr_scheduler):  # the user's own schedule (optimizers=(..., schedule))
            return float(self.lr_scheduler(updates))
        return float(self.args.learning_rate)

    def _param_groups(self) -> list[dict[str, Any]]:
        """HF's optimizer groups: the trainable parameters HF decays, then the others, as the model holds them
        (torch parameters for a torch model, nnx variables for a native one), with each group's rate and weight
        decay. HF's error before an optimizer exists."""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the optimizer before.")
        if user_code.is_optimizer(self.optimizer):  # the user's torch groups, as HF reads them
            return self.optimizer.param_groups
        rate = self._current_learning_rate()
        return [{**group, "lr": rate} for group in self._decay_groups()]

    def _decay_groups(self) -> list[dict[str, Any]]:
        """HF's two groups of the trainable parameters (as the model holds them): those it decays, the others."""
        decayed = set(self.get_decay_parameter_names())
        named = self._trainable_named_parameters()
        return [
            {"params": [p for n, p in named if n in decayed], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0},
        ]

    def _trainable_named_parameters(self) -> list[tuple[str, Any]]:
        return self._held.trainable_named_parameters()

    def _host_learning_rate(self, device_lr, count) -> float:
        """The rate of the last update as HF logs it (LearningRate.host_rate); a user's own schedule is read from
        the device, a user's torch scheduler's as it stood for that update."""
        if self._translated_optimizer is not None:
            return self._translated_optimizer.logged_rate(int(count), device_lr)
        if self._plateau_scheduler is not None:
            return self._plateau_scheduler.last_lr
        if self._learning_rate is None or not self._schedule_drives_optimizer():
            return float(device_lr)
        return self._learning_rate.host_rate(count, self._schedule_numbers())

    def _resumed_optimizer_state(self, opt_state):
        """The restored optimizer state under this run's arguments, as HF resumes: torch loads the saved param
        groups and scheduler state, so weight decay, betas, epsilon and the schedule's base rate stay the
        checkpoint's, while the schedule's shape (LearningRate.resumed) and max_grad_norm (read each step) are
        this run's."""
        if opt_states.hyperparameter(opt_state, "max_grad_norm") is not None:
            opt_state = opt_states.set_hyperparam(opt_state, "max_grad_norm", self.args.max_grad_norm or 0.0)
        if self._learning_rate is None or self._optimizer_recipe is None:  # the schedule is not in the state
            return opt_state
        return self._learning_rate.resumed(opt_state)

    def get_optimizer_group(self, param=None):
        """HF's: the group holding `param` (a parameter of the model), else every group's parameters."""
        groups = self._param_groups()
        if param is not None:
            for group in groups:
                if any(p is param for p in group["params"]):
                    return group
        return [group["params"] for group in groups]

    def get_num_trainable_parameters(self) -> int:
        return count_parameters(self.nnx_model)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """HF's estimate: 6 x tokens x non-embedding parameters, for models whose main input is in the batch."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if main in inputs:
            return 6 * int(np.asarray(inputs[main]).size) * self._held.num_non_embedding_parameters()
        return 0
