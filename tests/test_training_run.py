"""The loop's own state (jtrainer.trainer.training_run): logged losses with HF's NaN/Inf filter, equal to
transformers.Trainer's on the same micro-batch losses, and the loop's state kept in one object."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import torch_rows
from flax import nnx

from jtrainer import Trainer, TrainingArguments
from jtrainer.trainer.training_run import LossLog, summed_step_losses

# Each micro-batch of 2 rows has the loss x.mean(): finite, NaN and inf ones in chosen places.
BATCH_LOSSES = [1.0, 2.0, math.nan, 4.0, 5.0, math.inf, 7.0, 8.0, 9.0]


def _rows(ragged=False):
    """Two rows per micro-batch loss; `ragged`: the last micro-batch has one row (it runs at its own rows)."""
    rows = [{"x": np.array([v], np.float32), "labels": np.float32(0)} for v in BATCH_LOSSES for _ in range(2)]
    return rows[:-1] if ragged else rows


class InputMean(nnx.Module):
    """A model whose loss is its inputs' mean (so every micro-batch's loss is set by the data) and whose
    gradient is zero (so NaN inputs never reach the parameters)."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros((1,)))

    def __call__(self, x, labels=None):
        return {"loss": jnp.mean(x) + 0.0 * jnp.sum(self.w[...])}


def _args(out, ga, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ga,
        num_train_epochs=1,
        learning_rate=1e-3,
        logging_steps=2,
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        save_strategy="no",
        use_cpu=True,
    )
    kw.update(over)
    return kw


def _logged(state):
    return [(h["step"], h["loss"]) for h in state.log_history if "loss" in h]


def _hf(tmp_path, ga, ragged=False, **over):
    torch = pytest.importorskip("torch")
    import transformers

    class TorchInputMean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x, labels=None):
            return {"loss": x.mean() + 0.0 * self.w.sum()}

    trainer = transformers.Trainer(
        model=TorchInputMean(),
        args=transformers.TrainingArguments(**_args(tmp_path / "hf", ga, **over)),
        train_dataset=torch_rows(_rows(ragged)),
    )
    return trainer, trainer.train()


@pytest.mark.parametrize(
    "ga, ragged, nan_inf_filter",
    [(1, False, True), (2, False, True), (4, False, True), (2, True, True), (1, False, False), (4, True, False)],
)
def test_logged_and_train_losses_filter_non_finite_micro_batches_as_hf(tmp_path, ga, ragged, nan_inf_filter):
    hf, hf_out = _hf(tmp_path, ga, ragged, logging_nan_inf_filter=nan_inf_filter)
    ours = Trainer(
        InputMean(),
        TrainingArguments(**_args(tmp_path / "jt", ga, logging_nan_inf_filter=nan_inf_filter)),
        train_dataset=_rows(ragged),
    )
    out = ours.train()
    hf_logged, logged = _logged(hf.state), _logged(ours.state)
    assert [s for s, _ in logged] == [s for s, _ in hf_logged]
    np.testing.assert_allclose([v for _, v in logged], [v for _, v in hf_logged], rtol=1e-6)
    np.testing.assert_allclose(out.training_loss, hf_out.training_loss, rtol=1e-6)
    if nan_inf_filter:
        assert all(math.isfinite(v) for _, v in logged)
    else:  # HF's running sum stays NaN after its first NaN/Inf step (tr_loss -= tr_loss)
        assert math.isnan(logged[-1][1])


def test_the_loop_state_lives_in_one_run_object(tmp_path):
    trainer = Trainer(InputMean(), TrainingArguments(**_args(tmp_path, 1, max_steps=3)), train_dataset=_rows())
    trainer.train()
    run = trainer._run
    assert run.losses.last_logged_step == 2 and run.losses.pending == [] and run.initial_global_step == 0
    assert run.last_step_batch is not None and run.loop_state is not None and not run.preemption.received
    # A second train() starts a new run: nothing carries over from the first one's accumulators.
    trainer.train()
    assert trainer._run is not run and trainer._run.losses.last_logged_step == 2


def test_summed_step_losses():
    # HF: a non-finite micro-batch adds the running sum / (1 + steps since the last log).
    assert summed_step_losses([[1.0], [math.nan], [3.0]], 1, True, "log") == 1.0 + 1.0 / 2 + 3.0
    assert summed_step_losses([[1.0, 2.0], [math.inf, 1.0]], 1, True, "log") == 3.0 + 3.0 / 2 + 1.0
    assert math.isnan(summed_step_losses([[1.0], [math.nan]], 1, False, "log"))
    with pytest.raises(FloatingPointError, match="step 6"):
        summed_step_losses([[1.0], [1.0, math.nan]], 5, True, "error")


def test_loss_log_reads_only_the_real_micro_batches():
    log = LossLog(last_logged_step=4)
    log.add(jnp.array([1.0, 2.0]), 2)
    log.add(jnp.array([3.0, math.nan]), 1)  # a short last window: its second entry is padding
    assert log.take(True, "log") == 6.0 and log.pending == []
    assert log.take(True, "log") == 0.0
    log.add(jnp.array([math.inf]), 1)
    assert log.take(False, "log") == math.inf
    log.add(jnp.array([1.0]), 1)  # HF: inf - inf leaves NaN in the running sum
    assert math.isnan(log.take(False, "log"))


class SlowSquares(nnx.Module):
    """A step long enough (a chain of 512-wide matmuls) that a host running ahead would outpace the device."""

    def __init__(self):
        self.w = nnx.Param(jnp.eye(512) * 0.5)

    def __call__(self, x, labels=None):
        for _ in range(24):
            x = jnp.tanh(x @ self.w[...])
        return {"loss": jnp.mean(x**2)}


def test_the_host_runs_at_most_one_step_ahead_of_the_device(tmp_path):
    """The progress bar and every callback count finished steps (give or take the one running): at on_step_end
    of step N, step N-1 has been computed."""
    from jtrainer import TrainerCallback

    seen, late = [], []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(trainer._run.losses.pending[-1][0])  # this step's losses (no log reads them)
            if len(seen) > 1 and not seen[-2].is_ready():
                late.append(state.global_step)

    rows = [{"x": np.random.RandomState(i).randn(512).astype(np.float32), "labels": np.float32(0)} for i in range(64)]
    args = _args(tmp_path, 1, max_steps=8, per_device_train_batch_size=64, logging_strategy="no")
    trainer = Trainer(SlowSquares(), TrainingArguments(**args), train_dataset=rows, callbacks=[Watch()])
    trainer.train()
    assert len(seen) == 8 and late == []
