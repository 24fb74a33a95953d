"""The Trainer's optimizer and scheduler methods (HF's names): decay groups, HF's schedule and optimizer as
optax, and the parameter/FLOP counts HF reports."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from transformers.trainer_utils import SchedulerType

from jtrainer import bridge, optim
from jtrainer.models.base import count_parameters
from jtrainer.models.layers import LayerNorm
from jtrainer.trainer_parts import TrainerParts

# The modules HF excludes from weight decay by type (its ALL_LAYERNORM_LAYERS is [torch.nn.LayerNorm]): flax's
# LayerNorm and jtrainer's port of torch's. RMSNorms are matched by name only, as in HF.
LAYER_NORM_TYPES = (nnx.LayerNorm, LayerNorm)


def dotted(path: tuple) -> str:
    """A pytree path as HF's dotted parameter name."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


@dataclass(frozen=True)
class ResumedSchedule:
    """A resumed run whose schedule changed (max_steps, epochs, warmup): the first update after the checkpoint
    still applies the rate saved with the optimizer (torch steps its scheduler after the update), logged as
    `first_rate`; after it the state takes this run's warmup and length."""

    first_count: int  # the schedule count after that first update
    first_rate: float  # its rate, HF's float64 value of the saved schedule
    warmup_steps: int
    total_steps: int


class OptimizerMixin(TrainerParts):
    """create_optimizer / create_scheduler and friends; uses the Trainer's args, model and train state."""

    def _forget_optimizer(self) -> None:
        """A new model (model_init): the next train() builds its optimizer and schedule afresh."""
        self.optimizer = self.lr_scheduler = None
        self._created_lr_scheduler, self._optimizer_recipe = False, None

    def _start_schedule(self) -> None:
        """The schedule's base rate and shape as a run starts (a resume may keep the checkpoint's base rate)."""
        self._schedule_base = float(self.args.learning_rate)
        self._resumed_schedule, self._schedule_switch_pending = None, False

    def _optimizer_eval(self) -> None:
        """HF's optimizer.eval(): a schedule-free optimizer's x parameters are the model's until the next step."""
        self._optimizer_eval_mode = True

    def _optimizer_train(self) -> None:
        """HF's optimizer.train(), at each training step."""
        self._optimizer_eval_mode = False

    def _step_plateau(self, metric: float) -> None:
        """A per-evaluation scheduler's step on the evaluated metric: the new rate goes into the train state."""
        lr = self._plateau.last_lr  # the host's float64 rate, as torch's scheduler keeps it
        new_lr = self._plateau.last_lr = self._plateau.step(metric, lr)
        if new_lr != lr:
            opt_state = optim.set_hyperparam(self._train_state.opt_state, "learning_rate", new_lr)
            self._train_state = self._train_state.replace(opt_state=opt_state)

    def get_decay_parameter_names(self, model=None) -> list[str]:
        """HF's rule: every parameter but those of LayerNorm modules (torch.nn.LayerNorm's counterparts, by type)
        and those whose names match HF's bias/norm patterns."""
        model = model or self.model
        if bridge.is_torch_module(model):  # transformers.Trainer's own function, on the torch model
            from transformers import Trainer as TorchTrainer

            return TorchTrainer.get_decay_parameter_names(None, model)
        layer_norms = {
            ".".join(map(str, path)) for path, node in nnx.iter_graph(model) if isinstance(node, LAYER_NORM_TYPES)
        }
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        paths = {dotted(p): None for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
        return [p for p, decays in optim.decay_mask(paths, layer_norms).items() if decays]

    def _decay_mask_tree(self, params):
        decayed = set(self.get_decay_parameter_names())
        if bridge.is_bridged(self.nnx_model):  # HF's names, under the bridge's "params" root
            decayed = {f"params.{name}" for name in decayed}
        return jax.tree_util.tree_map_with_path(lambda p, _: dotted(p) in decayed, params)

    def create_scheduler(self, num_training_steps: int, optimizer=None) -> optim.Schedule:
        """HF's scheduler, as a step -> rate function (or the user's schedule from `optimizers`)."""
        if self.lr_scheduler is None:
            args = self.args
            self._schedule_values = (args.get_warmup_steps(num_training_steps), num_training_steps)
            self.lr_scheduler = optim.make_schedule(
                args.lr_scheduler_type, args.learning_rate, *self._schedule_values, args.lr_scheduler_kwargs
            )
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def create_optimizer(self, params=None) -> optax.GradientTransformation:
        if self.optimizer is not None:
            return self.optimizer
        params = params if params is not None else nnx.to_pure_dict(nnx.state(self.nnx_model, nnx.Param))
        mask = self._decay_mask_tree(params)
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
            factory = lambda learning_rate: cls(learning_rate=learning_rate, **kwargs)  # noqa: E731
            self.optimizer = optax.inject_hyperparams(factory)(learning_rate=self.lr_scheduler)
            return self.optimizer
        args = self.args
        plateau = args.lr_scheduler_type in (SchedulerType.REDUCE_ON_PLATEAU, SchedulerType.GREEDY)
        if self._created_lr_scheduler and not plateau:
            # HF's schedule from the state's numbers: trials that change them reuse the compiled step.
            warmup, total = self._schedule_values
            multiplier = optim.schedule_multiplier(args.lr_scheduler_type, args.learning_rate, args.lr_scheduler_kwargs)
            self.optimizer = optim.make_optimizer(
                args, mask, multiplier=multiplier, warmup_steps=warmup, total_steps=total
            )
            self._optimizer_recipe = (
                optim.check_optimizer_name(args.optim),
                args.optim_args,
                SchedulerType(args.lr_scheduler_type).value,
                json.dumps(args.lr_scheduler_kwargs or {}, sort_keys=True, default=str),
                tuple(jax.tree.leaves(mask)),
                jax.tree.structure(mask),
            )
        else:
            self.optimizer = optim.make_optimizer(args, mask, learning_rate=None if plateau else self.lr_scheduler)
        if args.lr_scheduler_type == SchedulerType.REDUCE_ON_PLATEAU:
            self._plateau = optim.PlateauScheduler(
                mode="max" if args.greater_is_better else "min", **(args.lr_scheduler_kwargs or {})
            )
        elif plateau:  # HF's GreedyLR: its own defaults (mode "min"), lr_scheduler_kwargs override them
            self._plateau = optim.GreedyScheduler(initial_lr=args.learning_rate, **(args.lr_scheduler_kwargs or {}))
        if plateau:
            self._plateau.last_lr = float(args.learning_rate)  # saved and restored with the scheduler's counters
        return self.optimizer

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_scheduler(num_training_steps)
        self.create_optimizer()

    def get_learning_rates(self) -> list[float]:
        if self._train_state is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the optimizer before.")
        opt_state = self._train_state.opt_state
        lr = optim.current_learning_rate(opt_state)
        if lr is None:
            return []
        return [self._host_learning_rate(lr, optim.schedule_count(opt_state))]

    def _host_learning_rate(self, device_lr, count) -> float:
        """The rate of the last update as HF logs it: its scheduler's Python float64 value (the device stepped with
        its float32 rounding); a user's own schedule is read from the device."""
        args = self.args
        if self._plateau is not None:
            return self._plateau.last_lr
        trainer_built = self._optimizer_recipe is not None or self.optimizer_cls_and_kwargs is not None
        if self._created_lr_scheduler and trainer_built:  # the device's rate is HF's schedule
            resumed = self._resumed_schedule
            if resumed is not None and int(count) == resumed.first_count:
                return resumed.first_rate
            return optim.host_learning_rate(
                args.lr_scheduler_type,
                self._schedule_base,
                max(int(count) - 1, 0),
                *self._schedule_values,
                args.lr_scheduler_kwargs,
            )
        return float(device_lr)

    def _resumed_optimizer_state(self, opt_state):
        """The restored optimizer state under this run's arguments, as HF resumes: torch loads the saved param
        groups and scheduler state, so weight decay, betas, epsilon and the schedule's base rate stay the
        checkpoint's, while the schedule's shape (its rebuilt lambda: warmup, length, kwargs) and max_grad_norm
        (read each step) are this run's. A changed shape takes effect after the first resumed update."""
        args, hyper = self.args, optim.find_hyperparams(opt_state)
        if hyper is None:
            return opt_state
        if "max_grad_norm" in hyper:
            opt_state = optim.set_hyperparam(opt_state, "max_grad_norm", args.max_grad_norm or 0.0)
        if not (self._created_lr_scheduler and self._optimizer_recipe is not None):
            return opt_state
        saved_base = float(hyper["base_learning_rate"])
        # The float64 rate HF keeps when it is this run's (the state holds its float32 rounding).
        same_rate = np.float32(args.learning_rate) == np.float32(saved_base)
        self._schedule_base = float(args.learning_rate) if same_rate else saved_base
        saved = (int(hyper["warmup_steps"]), int(hyper["total_steps"]))
        if saved != tuple(self._schedule_values):
            count = int(optim.schedule_count(opt_state))
            first = optim.host_learning_rate(
                args.lr_scheduler_type, self._schedule_base, count, *saved, args.lr_scheduler_kwargs
            )
            self._resumed_schedule = ResumedSchedule(count + 1, first, *self._schedule_values)
            self._schedule_switch_pending = True
        return opt_state

    def _follow_resumed_schedule(self, train_state):
        """Called after each update; after the first resumed one, this run's warmup and length replace the
        checkpoint's (once: no device read)."""
        if not self._schedule_switch_pending:
            return train_state
        self._schedule_switch_pending = False
        resumed, opt_state = self._resumed_schedule, train_state.opt_state
        for name, value in (("warmup_steps", resumed.warmup_steps), ("total_steps", resumed.total_steps)):
            opt_state = optim.set_hyperparam(opt_state, name, value)
        return train_state.replace(opt_state=opt_state)

    def get_optimizer_group(self, param=None):
        params = nnx.to_pure_dict(nnx.state(self.nnx_model, nnx.Param))
        names = [dotted(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        decayed = set(self.get_decay_parameter_names())
        groups = [
            {"params": [n for n in names if n in decayed], "weight_decay": self.args.weight_decay},
            {"params": [n for n in names if n not in decayed], "weight_decay": 0.0},
        ]
        if param is None:
            return groups
        return next(g for g in groups if param in g["params"])

    def get_num_trainable_parameters(self) -> int:
        return count_parameters(self.nnx_model)

    def _num_non_embedding_parameters(self) -> int:
        """Counted once per model: `floating_point_ops` asks for it every micro-batch."""
        cached = self._non_embedding_count
        if cached is None or cached[0] is not self.nnx_model:
            if bridge.is_bridged(self.nnx_model):  # transformers' own count, on the torch model
                count = self.model.num_parameters(exclude_embeddings=True)
            else:
                count = count_parameters(self.nnx_model, exclude_embeddings=True)
            cached = self._non_embedding_count = (self.nnx_model, count)
        return cached[1]

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """HF's estimate: 6 x tokens x non-embedding parameters, for models whose main input is in the batch."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if main in inputs:
            return 6 * int(np.asarray(inputs[main]).size) * self._num_non_embedding_parameters()
        return 0
