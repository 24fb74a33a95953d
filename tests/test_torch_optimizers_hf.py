"""A user's torch optimizer and scheduler (HF's `optimizers=(optimizer, scheduler)`, `optimizer_cls_and_kwargs`
with a torch class) for a torch model: each class's update with its parameter groups, driven by each torch
scheduler, equals torch stepping the same gradients (float64 reference); then the whole Trainer beside
transformers.Trainer (per-step losses and learning rates), and the refusals."""

import copy
import importlib.util

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from jtrainer.bridge.user_optimizer import UserTorchOptimizer  # noqa: E402

STEPS = 12
sched = torch.optim.lr_scheduler


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2)
        self.frozen_in_no_group = torch.nn.Parameter(torch.randn(2))


def _groups(model, **second):
    return [
        {"params": [model.a.weight, model.a.bias, model.b.weight]},
        {"params": [model.b.bias], "lr": 0.02, "weight_decay": 0.0, **second},
    ]


OPTIMIZERS = {
    "SGD": lambda m: torch.optim.SGD(_groups(m), lr=0.05, momentum=0.9, weight_decay=0.1),
    "SGD-nesterov": lambda m: torch.optim.SGD(_groups(m, momentum=0.5), lr=0.05, momentum=0.9, nesterov=True),
    "Adam": lambda m: torch.optim.Adam(_groups(m, betas=(0.8, 0.95)), lr=0.05, weight_decay=0.1),
    "AdamW": lambda m: torch.optim.AdamW(_groups(m, eps=1e-6), lr=0.05, weight_decay=0.1),
    "Adamax": lambda m: torch.optim.Adamax(_groups(m), lr=0.05, weight_decay=0.1),
    "NAdam": lambda m: torch.optim.NAdam(_groups(m), lr=0.05, weight_decay=0.1, momentum_decay=0.01),
    "RAdam": lambda m: torch.optim.RAdam(_groups(m), lr=0.05, weight_decay=0.1),
    "Adagrad": lambda m: torch.optim.Adagrad(_groups(m), lr=0.05, lr_decay=0.01, weight_decay=0.1),
    "RMSprop": lambda m: torch.optim.RMSprop(_groups(m, centered=True), lr=0.01, momentum=0.5, weight_decay=0.1),
    "Adafactor": lambda m: transformers.optimization.Adafactor(
        _groups(m), lr=0.05, scale_parameter=False, relative_step=False, weight_decay=0.1
    ),
}

SCHEDULERS = {
    "none": lambda o: None,
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda step: 1.0 / (1 + step) ** 0.5),
    "MultiplicativeLR": lambda o: sched.MultiplicativeLR(o, lambda step: 0.9),
    "StepLR": lambda o: sched.StepLR(o, step_size=4, gamma=0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[3, 7], gamma=0.3),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.9),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.2, total_iters=5),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=8, eta_min=0.001),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=[0.1, 0.05], total_steps=STEPS, cycle_momentum=False),
    "SequentialLR": lambda o: sched.SequentialLR(
        o, [sched.LinearLR(o, 0.1, total_iters=3), sched.ExponentialLR(o, 0.8)], milestones=[3]
    ),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, factor=0.5, patience=0),
}


def _gradients():
    rng = np.random.RandomState(1)
    names = [n for n, _ in Toy().named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in Toy().named_parameters()}
    return [{n: rng.normal(0, 1.0, shapes[n]) for n in names} for _ in range(STEPS)]


METRICS = [3.0, 2.0, 2.5, 2.6, 1.0, 1.5, 1.6, 1.7, 0.5, 0.6, 0.7, 0.8]  # ReduceLROnPlateau's, one per step


def _torch_run(make_optimizer, make_scheduler, grads):
    model = Toy().double()
    opt = make_optimizer(model)
    scheduler = make_scheduler(opt)
    rates = []
    for step, g in enumerate(grads):
        for name, p in model.named_parameters():
            p.grad = torch.tensor(g[name])
        rates.append([group["lr"] for group in opt.param_groups])
        opt.step()
        if isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step(METRICS[step])
        elif scheduler is not None:
            scheduler.step()
    return {n: p.detach().numpy() for n, p in model.named_parameters()}, rates


def _jax_run(make_optimizer, make_scheduler, grads):
    model = Toy()
    opt = make_optimizer(model)
    driver = UserTorchOptimizer(opt, make_scheduler(opt), model)
    params = {"params": {n: jax.numpy.asarray(p.detach().numpy()) for n, p in model.named_parameters()}}
    tx = driver.transformation(params)
    state = tx.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    rates = []
    for index, g in enumerate(grads):
        state = driver.before_update(state)
        rates.append([group["lr"] for group in opt.param_groups])
        params, state = step(
            params, state, {"params": {k: jax.numpy.asarray(v, jax.numpy.float32) for k, v in g.items()}}
        )
        driver.after_update(index)
        if driver.per_evaluation:
            driver.after_evaluation(METRICS[index])
    return {n: np.asarray(v, np.float64) for n, v in params["params"].items()}, rates


# Each scheduler with AdamW; each class with a constant rate, a function's (LambdaLR) and a cycled one.
CASES = sorted(
    {("AdamW", s) for s in SCHEDULERS} | {(o, s) for o in OPTIMIZERS for s in ("none", "LambdaLR", "OneCycleLR")}
)


@pytest.mark.parametrize("optimizer, scheduler", CASES, ids=[f"{o}-{s}" for o, s in CASES])
def test_each_class_and_scheduler_equals_torch(optimizer, scheduler):
    grads = _gradients()
    expected, expected_rates = _torch_run(OPTIMIZERS[optimizer], SCHEDULERS[scheduler], grads)
    got, rates = _jax_run(OPTIMIZERS[optimizer], SCHEDULERS[scheduler], grads)
    np.testing.assert_allclose(rates, expected_rates, rtol=1e-12)
    for name, value in expected.items():
        scale = max(np.max(np.abs(value)), 1e-3)
        err = np.max(np.abs(got[name] - value)) / scale
        assert err < 1e-5, f"{optimizer}/{scheduler}: {name} differs by {err:.2e}"
    assert np.array_equal(got["frozen_in_no_group"], expected["frozen_in_no_group"])  # in no group: untouched


def test_onecycle_cycling_adams_beta1_is_followed():
    grads = _gradients()

    def make(o):
        return sched.OneCycleLR(o, max_lr=0.1, total_steps=STEPS)  # cycle_momentum: betas[0] moves too

    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=0.05)  # noqa: E731
    expected, _ = _torch_run(make_opt, make, grads)
    got, _ = _jax_run(make_opt, make, grads)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda m: torch.optim.ASGD(m.parameters()), "torch.optim.asgd.ASGD"),
        (lambda m: torch.optim.Adam(m.parameters(), amsgrad=True), "amsgrad"),
        (lambda m: torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), "not a parameter of the model"),
        (lambda m: transformers.optimization.Adafactor(m.parameters()), "relative_step"),
    ],
)
def test_what_cannot_be_reproduced_is_refused_in_one_line(make, match):
    model = Toy()
    with pytest.raises(ValueError, match=match) as error:
        UserTorchOptimizer(make(model), None, model)
    assert "\n" not in str(error.value)


def test_a_scheduler_changing_a_fixed_hyperparameter_is_refused():
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    driver = UserTorchOptimizer(opt, sched.OneCycleLR(opt, max_lr=0.5, total_steps=STEPS), model)
    params = {"params": {n: jax.numpy.asarray(p.detach().numpy()) for n, p in model.named_parameters()}}
    state = driver.transformation(params).init(params)
    state = driver.before_update(state)
    driver.after_update(0)
    with pytest.raises(ValueError, match="changed momentum of parameter group 0"):
        driver.before_update(state)


def _trainer_pair(tmp_path, make_optimizers, **over):
    """The same torch module trained by transformers.Trainer and jtrainer, each with its own torch optimizer and
    scheduler from `make_optimizers(model)` (None: HF builds them)."""
    from bridge_zoo import Regression, arguments, rows
    from conftest import torch_rows

    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = Regression()
    over = {"max_steps": 6, "lr_scheduler_type": "linear", **over}
    runs = {}
    for name, trainer_cls, args_cls, data in (
        ("hf", transformers.Trainer, transformers.TrainingArguments, torch_rows(rows())),
        ("ours", Trainer, TrainingArguments, rows()),
    ):
        copy_of = copy.deepcopy(model)
        kwargs = make_optimizers(copy_of)
        trainer = trainer_cls(
            model=copy_of, args=arguments(args_cls, tmp_path / name, **over), train_dataset=data, **kwargs
        )
        trainer.train()
        runs[name] = trainer
    return runs["hf"], runs["ours"]


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_loss" not in h]


def test_torch_adamw_with_linear_warmup_trains_as_transformers_trainer(tmp_path):
    def make(model):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        return {"optimizers": (opt, transformers.get_linear_schedule_with_warmup(opt, 2, 6))}

    hf, ours = _trainer_pair(tmp_path, make)
    np.testing.assert_allclose(_logged(ours, "loss"), _logged(hf, "loss"), rtol=1e-5)
    assert _logged(ours, "learning_rate") == _logged(hf, "learning_rate")  # the host's float64 rates
    assert ours.optimizer.param_groups[0]["lr"] == hf.optimizer.param_groups[0]["lr"] == 0.0
    assert ours.lr_scheduler.get_last_lr() == hf.lr_scheduler.get_last_lr()
    assert ours.get_learning_rates() == hf.get_learning_rates()
    for key, value in hf.model.state_dict().items():
        torch.testing.assert_close(ours.model.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    "make",
    [
        lambda m: {"optimizers": (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), None)},  # HF's schedule
        lambda m: {"optimizer_cls_and_kwargs": (torch.optim.RAdam, {"lr": 0.05})},  # HF's decay groups
        lambda m: {
            "optimizers": (
                opt := torch.optim.Adam(
                    [{"params": m.inner.parameters(), "lr": 0.02}, {"params": m.head.parameters()}], lr=0.05
                ),
                torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.9**s, lambda s: 1.0 / (1 + s)]),
            )
        },
    ],
    ids=["sgd-hf-schedule", "radam-cls-and-kwargs", "adam-groups-lambda"],
)
def test_other_torch_optimizers_train_as_transformers_trainer(tmp_path, make):
    hf, ours = _trainer_pair(tmp_path, make, weight_decay=0.1)
    np.testing.assert_allclose(_logged(ours, "loss"), _logged(hf, "loss"), rtol=1e-5)
    assert _logged(ours, "learning_rate") == _logged(hf, "learning_rate")
    assert ours.get_learning_rates() == hf.get_learning_rates()
    for key, value in hf.model.state_dict().items():
        torch.testing.assert_close(ours.model.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_torch_optimizer_for_a_native_model_is_refused(tmp_path):
    from conftest import short_run_args, tiny_llama_config, token_rows

    from jtrainer import Trainer
    from jtrainer.models import LlamaForCausalLM

    opt = torch.optim.AdamW(Toy().parameters())
    trainer = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config()),
        short_run_args(),
        train_dataset=token_rows(8),
        optimizers=(opt, None),
    )
    with pytest.raises(TypeError, match="native jtrainer model: pass an optax"):
        trainer.train()


def test_a_resumed_run_continues_the_torch_schedule_exactly(tmp_path):
    """The checkpoint keeps the groups' rates and the scheduler's state (HF's optimizer.pt / scheduler.pt):
    stopped at step 3 and resumed, the run logs the uninterrupted run's losses and rates."""
    from bridge_zoo import Regression, arguments, rows

    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = Regression()

    def trainer(out, max_steps):
        copy_of = copy.deepcopy(model)
        opt = torch.optim.AdamW(copy_of.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s)
        args = arguments(TrainingArguments, out, max_steps=max_steps, save_strategy="steps", save_steps=3)
        return Trainer(copy_of, args, train_dataset=rows(), optimizers=(opt, schedule))

    whole = trainer(tmp_path / "whole", 6)
    whole.train()
    trainer(tmp_path / "part", 3).train()
    resumed = trainer(tmp_path / "part", 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-3"))
    for key in ("loss", "learning_rate"):
        assert _logged(resumed, key)[-3:] == _logged(whole, key)[-3:], key
    assert resumed.lr_scheduler.get_last_lr() == whole.lr_scheduler.get_last_lr()
    for key, value in whole.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_a_torch_reduce_lr_on_plateau_steps_on_evaluations_as_hf(tmp_path):
    from bridge_zoo import Regression, arguments, rows
    from conftest import torch_rows

    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = Regression()
    over = dict(max_steps=8, eval_strategy="steps", eval_steps=2, metric_for_best_model="loss", learning_rate=0.5)
    runs = {}
    for name, trainer_cls, args_cls, wrap in (
        ("hf", transformers.Trainer, transformers.TrainingArguments, torch_rows),
        ("ours", Trainer, TrainingArguments, lambda r: r),
    ):
        copy_of = copy.deepcopy(model)
        opt = torch.optim.SGD(copy_of.parameters(), lr=0.5)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        trainer = trainer_cls(
            copy_of,
            arguments(args_cls, tmp_path / name, **over),
            train_dataset=wrap(rows()),
            eval_dataset=wrap(rows(8, seed=1)),
            optimizers=(opt, plateau),
        )
        trainer.train()
        runs[name] = trainer
    hf, ours = runs["hf"], runs["ours"]
    np.testing.assert_allclose(_logged(ours, "loss"), _logged(hf, "loss"), rtol=1e-5)
    np.testing.assert_allclose(_logged(ours, "eval_loss"), _logged(hf, "eval_loss"), rtol=1e-5)
    assert _logged(ours, "learning_rate") == _logged(hf, "learning_rate")
    assert len(set(_logged(hf, "learning_rate"))) > 1  # the plateau did lower the rate
