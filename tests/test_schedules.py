"""jtrainer.numerics.schedules.LearningRate: the run's one schedule object, a value. Its three forms agree with
HF's scheduler (torch's LambdaLR from transformers.get_scheduler); a resume's changed schedule and a
per-evaluation scheduler's step live in the optimizer state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtrainer import TrainingArguments
from jtrainer.numerics import opt_state
from jtrainer.numerics.optim import make_optimizer
from jtrainer.numerics.schedules import (
    SCHEDULE_SWITCH,
    LearningRate,
    no_schedule_switch,
    per_evaluation_scheduler,
    plateau_step,
)


def _args(**over):
    return TrainingArguments("o", report_to="none", learning_rate=3e-4, warmup_steps=3, **over)


def _optimizer(args, rate: LearningRate):
    params = {"w": jnp.zeros(2)}
    mask = jax.tree.map(lambda _: True, params)
    tx = make_optimizer(
        args, mask, multiplier=rate.multiplier(), warmup_steps=rate.warmup_steps, total_steps=rate.total_steps
    )
    return tx, params, tx.init(params)


def _numbers(state) -> dict[str, float]:
    return {k: float(v) for k, v in opt_state.find_hyperparams(state).items()}


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_the_three_forms_agree_with_hf(kind):
    torch = pytest.importorskip("torch")
    from transformers.optimization import get_scheduler

    args, total = _args(lr_scheduler_type=kind), 12
    rate = LearningRate.from_args(args, total)
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    torch_opt = torch.optim.SGD([param], lr=args.learning_rate)
    hf = get_scheduler(kind, torch_opt, rate.warmup_steps, total)
    tx, params, state = _optimizer(args, rate)
    for _ in range(total):
        expected = hf.get_last_lr()[0]  # the rate of this update
        _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
        device = opt_state.current_learning_rate(state)
        count = opt_state.schedule_count(state)
        assert rate.host_rate(count, _numbers(state)) == pytest.approx(expected, rel=1e-12, abs=1e-18)  # float64
        assert rate.host_rate(count) == rate.host_rate(count, _numbers(state))
        np.testing.assert_allclose(float(device), expected, rtol=1e-6)  # the device's float32
        np.testing.assert_allclose(float(rate.schedule(int(count) - 1)), expected, rtol=1e-6)
        torch_opt.step()
        hf.step()


def test_a_resumed_run_with_another_length_switches_after_one_update():
    """The optimizer state holds the switch: the first resumed update applies the checkpoint's schedule (torch
    steps its scheduler after it), the ones after it this run's; the host's float64 rates follow the state."""
    args = _args()
    saved = LearningRate.from_args(args, 10)
    tx, params, state = _optimizer(args, saved)
    state = opt_state.set_schedule_count(state, 4)
    resumed = LearningRate.from_args(args, 20)
    state = resumed.resumed(state)
    assert _numbers(state)["switch_count"] == 5 and _numbers(state)["total_steps"] == 10
    grads = jax.tree.map(jnp.ones_like, params)
    _, state = tx.update(grads, state, params)  # the update at count 4: the saved schedule
    assert resumed.host_rate(5, _numbers(state)) == pytest.approx(saved.host_rate(5), rel=1e-12)
    np.testing.assert_allclose(float(opt_state.current_learning_rate(state)), saved.host_rate(5), rtol=1e-6)
    _, state = tx.update(grads, state, params)  # then this run's
    assert resumed.host_rate(6, _numbers(state)) == pytest.approx(resumed.host_rate(6), rel=1e-12)
    assert resumed.host_rate(6) != pytest.approx(saved.host_rate(6))
    np.testing.assert_allclose(float(opt_state.current_learning_rate(state)), resumed.host_rate(6), rtol=1e-6)
    assert resumed.resumed(state) is state or _numbers(resumed.resumed(state)) == _numbers(state)  # once


def test_a_state_saved_before_switches_existed_has_none():
    args = _args()
    _, _, state = _optimizer(args, LearningRate.from_args(args, 10))
    hyper = opt_state.find_hyperparams(state)
    older = {k: v for k, v in hyper.items() if k not in SCHEDULE_SWITCH}
    completed = no_schedule_switch(older)
    assert {k: float(v) for k, v in completed.items()} == {k: float(v) for k, v in hyper.items()}


def test_a_per_evaluation_scheduler_sets_the_rate_in_the_state():
    args = _args(
        lr_scheduler_type="reduce_lr_on_plateau",
        lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
        eval_strategy="steps",
        eval_steps=1,
    )
    scheduler = per_evaluation_scheduler(args)
    tx = make_optimizer(args, {"w": True}, learning_rate=None)
    state = tx.init({"w": jnp.zeros(2)})
    state = plateau_step(scheduler, 1.0, state)  # the first metric is the best so far
    state = plateau_step(scheduler, 2.0, state)  # worse: halved
    assert scheduler.last_lr == pytest.approx(1.5e-4)
    assert float(opt_state.current_learning_rate(state)) == pytest.approx(1.5e-4)
