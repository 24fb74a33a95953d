"""jtrainer.numerics.schedules.LearningRate: the run's one schedule object. Its three forms agree with HF's
scheduler (torch's LambdaLR from transformers.get_scheduler), a resume's changed schedule switches once, and a
per-evaluation scheduler's step lands in the optimizer state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtrainer import TrainingArguments
from jtrainer.numerics import opt_state
from jtrainer.numerics.optim import make_optimizer
from jtrainer.numerics.schedules import LearningRate, per_evaluation_scheduler


def _args(**over):
    return TrainingArguments("o", report_to="none", learning_rate=3e-4, warmup_steps=3, **over)


def _optimizer(args, rate: LearningRate):
    params = {"w": jnp.zeros(2)}
    mask = jax.tree.map(lambda _: True, params)
    tx = make_optimizer(
        args, mask, multiplier=rate.multiplier(), warmup_steps=rate.warmup_steps, total_steps=rate.total_steps
    )
    rate.in_optimizer_state = rate.drives_optimizer = True
    return tx, params, tx.init(params)


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
        assert rate.host_rate(device, count) == pytest.approx(expected, rel=1e-12, abs=1e-18)  # HF's float64
        np.testing.assert_allclose(float(device), expected, rtol=1e-6)  # the device's float32
        np.testing.assert_allclose(float(rate.scheduler()(int(count) - 1)), expected, rtol=1e-6)
        torch_opt.step()
        hf.step()


def test_a_resumed_run_with_another_length_switches_after_one_update():
    args = _args()
    saved = LearningRate.from_args(args, 10)
    _, _, state = _optimizer(args, saved)
    state = opt_state.set_schedule_count(state, 4)
    resumed = LearningRate.from_args(args, 20)
    resumed.in_optimizer_state = resumed.drives_optimizer = True
    state = resumed.resume(state, args.learning_rate)
    assert resumed.switch_pending and resumed.resumed.first_count == 5
    assert resumed.host_rate(0.0, 5) == pytest.approx(saved.host_rate(0.0, 5))  # the checkpoint's schedule first
    state = resumed.after_update(state)
    assert int(opt_state.hyperparameter(state, "total_steps")) == 20 and not resumed.switch_pending
    assert resumed.after_update(state) is state  # once


def test_a_per_evaluation_scheduler_sets_the_rate_in_the_state():
    args = _args(
        lr_scheduler_type="reduce_lr_on_plateau",
        lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
        eval_strategy="steps",
        eval_steps=1,
    )
    rate = LearningRate.from_args(args, 10)
    rate.per_evaluation = per_evaluation_scheduler(args)
    tx = make_optimizer(args, {"w": True}, learning_rate=None)
    state = tx.init({"w": jnp.zeros(2)})
    state = rate.after_evaluation(1.0, state)  # the first metric is the best so far
    state = rate.after_evaluation(2.0, state)  # worse: halved
    assert rate.host_rate(None, 2) == pytest.approx(1.5e-4)
    assert float(opt_state.current_learning_rate(state)) == pytest.approx(1.5e-4)
