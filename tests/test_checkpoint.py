"""Checkpoints: exact resume, atomic commit under kill -9, preemption by SIGTERM, integrity, NaN policies."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from jobs.ckpt_job import PAUSE_ENV, make_trainer

from jtrainer import Trainer, TrainingArguments
from jtrainer.checkpointing import checkpoint

HERE = os.path.dirname(__file__)


def _tree_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _losses(trainer, after=0):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > after]


def test_resume_mid_epoch_is_bit_identical(tmp_path):
    # 20 rows / batch 4 = 5 micro-batches per epoch, accumulation 2: 3 updates per epoch (the last one short).
    # Checkpoint at step 2 (mid-epoch), resume, cross the epoch boundary, stop at step 6.
    full = make_trainer(str(tmp_path / "full"), 6, 0, False)
    full.train()
    first = make_trainer(str(tmp_path / "part"), 6, 2, False)
    first.train()
    resumed = make_trainer(str(tmp_path / "part"), 6, 0, False)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"))
    assert resumed.state.global_step == 6
    assert _tree_equal(full._train_state.params, resumed._train_state.params)
    assert _tree_equal(full._train_state.opt_state, resumed._train_state.opt_state)
    assert _losses(resumed, after=2) == _losses(full, after=2)


def test_a_checkpoint_saved_before_schedule_switches_existed_resumes(tmp_path, monkeypatch):
    """An optimizer state saved before the schedule's switch numbers existed (schedules.SCHEDULE_SWITCH, written
    by an earlier jtrainer) resumes: read without them, completed as having no switch, and the run goes on as
    an uninterrupted one."""
    import optax

    from jtrainer.numerics import opt_state, optim, schedules

    def strip(state):
        return opt_state.map_hyperparams(
            state, lambda hyper: {k: v for k, v in hyper.items() if k not in schedules.SCHEDULE_SWITCH}
        )

    make_optimizer = optim.make_optimizer

    def earlier_optimizer(*args, **kwargs):  # the state as jtrainer wrote it before the switch numbers
        tx = make_optimizer(*args, **kwargs)

        def update(updates, state, params=None):
            updates, state = tx.update(updates, opt_state.map_hyperparams(state, schedules.no_schedule_switch), params)
            return updates, strip(state)

        return optax.GradientTransformation(lambda params: strip(tx.init(params)), update)

    full = make_trainer(str(tmp_path / "full"), 4, 0, False)
    full.train()
    with monkeypatch.context() as patch:
        patch.setattr(optim, "make_optimizer", earlier_optimizer)
        first = make_trainer(str(tmp_path / "part"), 4, 2, False)
        first.train()
    assert "switch_count" not in opt_state.find_hyperparams(first._train_state.opt_state)
    resumed = make_trainer(str(tmp_path / "part"), 4, 0, False)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"))
    assert float(opt_state.hyperparameter(resumed._train_state.opt_state, "switch_count")) == 0
    assert _tree_equal(full._train_state.params, resumed._train_state.params)
    assert _losses(resumed, after=2) == _losses(full, after=2)


def _spawn(out, *args, env=None):
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "jobs", "ckpt_job.py"), str(out), *map(str, args)],
        env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for(path, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_kill_during_save_loses_nothing(tmp_path):
    out = tmp_path / "run"
    proc = _spawn(out, 6, 2, 0, env={PAUSE_ENV: "4:120"})
    _wait_for(out / "checkpoint-4.tmp" / "paused", proc)
    proc.kill()
    proc.wait()
    assert (out / "checkpoint-4.tmp").exists() and not (out / "checkpoint-4").exists()
    checkpoint.verify_checkpoint(str(out / "checkpoint-2"))  # the previous checkpoint is intact
    assert checkpoint.get_last_checkpoint(str(out)) == str(out / "checkpoint-2")

    resumed = make_trainer(str(out), 6, 2, False)
    resumed.train(resume_from_checkpoint=True)
    assert not (out / "checkpoint-4.tmp").exists()  # the partial one was cleaned up
    reference = make_trainer(str(tmp_path / "ref"), 6, 0, False)
    reference.train()
    assert _tree_equal(resumed._train_state.params, reference._train_state.params)


@pytest.mark.parametrize("during", ["step", "evaluation"])
def test_sigterm_saves_and_exits_cleanly(tmp_path, during):
    out = tmp_path / "run"
    evaluate = during == "evaluation"
    proc = _spawn(out, 10_000, 0, int(evaluate))
    _wait_for(out / ("evaluating" if evaluate else "step"), proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    folder = checkpoint.get_last_checkpoint(str(out))
    assert folder is not None
    step = json.load(open(os.path.join(folder, checkpoint.TRAINER_STATE_NAME)))["global_step"]
    assert folder.endswith(f"checkpoint-{step}") and step >= 1

    resumed = make_trainer(str(out), step + 2, 0, False)
    resumed.train(resume_from_checkpoint=True)
    reference = make_trainer(str(tmp_path / "ref"), step + 2, 0, False)
    reference.train()
    assert _tree_equal(resumed._train_state.params, reference._train_state.params)


def test_enable_jit_checkpoint_saves_on_sigterm_and_returns_from_train(tmp_path):
    """HF's switch: its JITCheckpointCallback is in the list; SIGTERM saves the step's checkpoint and train()
    returns (the script goes on: it writes losses.json), where without it the process exits after the save."""
    out = tmp_path / "run"
    proc = _spawn(out, 10_000, 0, 0, env={"CKPT_JOB_JIT": "1"})
    _wait_for(out / "step", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]
    losses = json.loads((out / "losses.json").read_text())
    folder = checkpoint.get_last_checkpoint(str(out))
    assert folder is not None and folder.endswith(f"checkpoint-{max(map(int, losses))}")
    assert not any(p.name.startswith("checkpoint-") and p.name != os.path.basename(folder) for p in out.iterdir())
    assert "Immediate JIT checkpoint completed successfully" in proc.stderr.read().decode()
    callbacks = make_trainer(str(tmp_path / "b"), 1, 0, False).callback_handler.callback_list
    assert "JITCheckpointCallback" not in callbacks


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    make_trainer(str(out), 2, 2, False).train()
    return out / "checkpoint-2"


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip", "does not match its checksum"),
        ("truncate", "bytes, .* were written"),
        ("uncommit", "not committed: commit_success.json is missing"),
    ],
)
def test_damaged_checkpoints_are_named(tmp_path, saved, damage, message):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(saved, folder)
    target = folder / "model.safetensors"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    else:
        (folder / checkpoint.COMMIT_NAME).unlink()
    with pytest.raises(checkpoint.CheckpointIntegrityError, match=message):
        checkpoint.verify_checkpoint(str(folder))
    if damage != "uncommit":
        with pytest.raises(checkpoint.CheckpointIntegrityError, match="model.safetensors"):
            checkpoint.verify_checkpoint(str(folder))


def test_fallback_to_the_previous_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    make_trainer(str(out), 4, 2, False).train()
    (out / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert checkpoint.get_last_checkpoint(str(out)) == str(out / "checkpoint-2")


def test_restore_into_another_shape_names_the_parameter(tmp_path, saved):
    from conftest import tiny_llama_config

    from jtrainer.models.llama import LlamaForCausalLM

    trainer = make_trainer(str(tmp_path), 2, 0, False)
    trainer.model = LlamaForCausalLM.from_config(tiny_llama_config(intermediate_size=96))
    trainer._check_layout()
    with pytest.raises(
        ValueError,
        match=r"parameter model.layers.0.mlp.down_proj.kernel has shape \(64, 32\) but "
        r"the model's has shape \(96, 32\)",
    ):
        trainer.train(resume_from_checkpoint=str(saved))


def test_restore_into_a_model_with_fewer_parameters_or_other_state_is_one_line(tmp_path, saved):
    """A checkpoint of a bigger model (a LoRA run's adapters over another base), or of a model whose non-trained
    state differs: a CheckpointMismatchError naming the checkpoint, not orbax's tree comparison."""
    from conftest import tiny_llama_config

    from jtrainer.checkpointing.checkpoint import CheckpointMismatchError
    from jtrainer.models.llama import LlamaForCausalLM

    trainer = make_trainer(str(tmp_path / "fewer"), 2, 0, False)
    trainer.model = LlamaForCausalLM.from_config(tiny_llama_config(num_hidden_layers=1))
    trainer._check_layout()
    with pytest.raises(CheckpointMismatchError, match=r"has parameters this model lacks \(model.layers.1.*another"):
        trainer.train(resume_from_checkpoint=str(saved))

    class Counting(Regressor):  # the same parameters, and a counter that is not trained
        def __init__(self):
            super().__init__()
            self.calls = nnx.BatchStat(np.zeros((), np.float32))

    rows = _nan_rows()[:8]
    args = _nan_args(tmp_path / "regressor", "log")
    Trainer(model=Regressor(), args=args, train_dataset=rows).train()
    other = Trainer(model=Counting(), args=args, train_dataset=rows)
    with pytest.raises(CheckpointMismatchError, match=r"holds the state of another model"):
        other.train(resume_from_checkpoint=str(tmp_path / "regressor" / "checkpoint-2"))


class Regressor(nnx.Module):
    """Returns its own mean-squared-error loss (a model that computes its loss)."""

    def __init__(self):
        self.w = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def __call__(self, x, labels=None):
        pred = self.w(x)[:, 0]
        return {"loss": ((pred - labels) ** 2).mean(), "logits": pred}


def _nan_rows():
    rng = np.random.RandomState(0)
    rows = [{"x": rng.randn(2).astype(np.float32), "labels": np.float32(rng.randn())} for _ in range(16)]
    rows[9]["x"] = np.array([np.nan, 1.0], np.float32)  # in the third batch of 4
    return rows


def _nan_args(out, policy):
    return TrainingArguments(
        str(out),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=0.1,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        nan_inf_policy=policy,
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )


def test_nan_policies(tmp_path):
    skip = Trainer(Regressor(), _nan_args(tmp_path / "skip", "skip"), train_dataset=_nan_rows())
    skip.train()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(skip._train_state.params))
    assert [h["skipped_updates"] for h in skip.state.log_history if "loss" in h] == [0, 0, 1, 1]
    assert (tmp_path / "skip" / "checkpoint-4").exists()

    with pytest.raises(FloatingPointError, match="step 3"):
        Trainer(Regressor(), _nan_args(tmp_path / "error", "error"), train_dataset=_nan_rows()).train()

    logged = Trainer(Regressor(), _nan_args(tmp_path / "log", "log"), train_dataset=_nan_rows())
    logged.train()  # HF's behaviour: training goes on; but no checkpoint is written with NaN parameters
    assert (tmp_path / "log" / "checkpoint-2").exists() and not (tmp_path / "log" / "checkpoint-4").exists()


def _jobs(*jobs):
    """Runs ckpt_job.py for each (out, devices, *args) side by side (startup is mostly single-threaded), and
    returns each one's losses."""
    running = []
    for out, devices, *args in jobs:
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        running.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "jobs", "ckpt_job.py"), str(out), *map(str, args)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for process in running:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
    return [json.load(open(os.path.join(out, "losses.json"))) for out, *_ in jobs]


def test_resume_on_another_mesh_reshards(tmp_path):
    fsdp8 = json.dumps({"fsdp": 8})
    reference, _ = _jobs((tmp_path / "ref", 8, 6, 0, 0, fsdp8, 8), (tmp_path / "saved", 8, 3, 3, 0, fsdp8, 8))
    ckpt = tmp_path / "saved" / "checkpoint-3"
    other_mesh, one_device = _jobs(
        (tmp_path / "dp2fsdp4", 8, 6, 0, 0, json.dumps({"data": 2, "fsdp": 4}), 8, ckpt),
        (tmp_path / "one", 1, 6, 0, 0, "{}", 8, ckpt),
    )
    for resumed in (other_mesh, one_device):
        assert sorted(resumed) == ["1", "2", "3", "4", "5", "6"]  # log_history continues from the checkpoint
        np.testing.assert_allclose([resumed[k] for k in "456"], [reference[k] for k in "456"], rtol=1e-6)


@pytest.mark.parametrize(
    "limit, scores, kept",
    [
        (1, [5, 1, 1, 1, 1], ["checkpoint-1"]),
        (1, [1, 2, 3, 4, 5], ["checkpoint-5"]),
        (2, [5, 1, 1, 1, 1], ["checkpoint-1", "checkpoint-5"]),
        (2, [1, 1, 5, 1, 1], ["checkpoint-3", "checkpoint-5"]),
        (2, [1, 2, 3, 4, 5], ["checkpoint-4", "checkpoint-5"]),
        (None, [1, 1, 5, 1, 1], [f"checkpoint-{i}" for i in range(1, 6)]),
    ],
)
def test_rotation_keeps_the_newest_and_the_best(tmp_path, limit, scores, kept):
    order = iter(scores)
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=5,
        learning_rate=0.1,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=limit,
        metric_for_best_model="score",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=_nan_rows()[:8],
        eval_dataset=_nan_rows()[:4],
        compute_metrics=lambda pred: {"score": float(next(order))},
    )
    trainer.train()
    assert sorted(os.listdir(tmp_path)) == kept
    best = int(np.argmax(scores)) + 1
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best}")
    assert trainer.state.best_global_step == best


@pytest.mark.parametrize("asynchronous", [True, False])
def test_saves_are_committed_before_on_save(tmp_path, asynchronous):
    from jtrainer import TrainerCallback

    seen = []

    class Listing(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append(sorted(n for n in os.listdir(args.output_dir) if n.startswith("checkpoint")))

    trainer = make_trainer(str(tmp_path), 4, 2, False)
    trainer.args.async_checkpointing = asynchronous
    trainer.add_callback(Listing())
    trainer.train()
    # on_save comes once its checkpoint is committed (asynchronously: at a later step boundary or the end)
    assert seen == [["checkpoint-2"], ["checkpoint-2", "checkpoint-4"]]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint")) == ["checkpoint-2", "checkpoint-4"]
    for name in ("checkpoint-2", "checkpoint-4"):
        checkpoint.verify_checkpoint(str(tmp_path / name))


def test_save_only_model_and_callback_states(tmp_path):
    only_model = make_trainer(str(tmp_path / "only"), 2, 2, False)
    only_model.args.save_only_model = True
    only_model.train()
    folder = tmp_path / "only" / "checkpoint-2"
    assert (folder / "model.safetensors").exists() and not (folder / checkpoint.TRAIN_STATE_DIR).exists()
    with pytest.raises(ValueError, match="no train state"):
        make_trainer(str(tmp_path / "only"), 4, 0, False).train(resume_from_checkpoint=str(folder))

    from jtrainer import TrainerCallback
    from jtrainer.core.state import ExportableState

    class StepCounter(TrainerCallback, ExportableState):
        def __init__(self):
            self.count = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.count += 1

        def state(self):
            return {"args": {}, "attributes": {"count": self.count}}

    run = make_trainer(str(tmp_path / "cb"), 2, 2, False)
    run.add_callback(StepCounter())
    run.train()
    counter = StepCounter()
    resumed = make_trainer(str(tmp_path / "cb"), 3, 0, False)
    resumed.add_callback(counter)
    resumed.args.restore_callback_states_from_checkpoint = True
    resumed.train(resume_from_checkpoint=True)
    # HF rebuilds the callback from its saved state (and re-adds it): 2 restored, then one more step
    restored = [cb for cb in resumed.callback_handler.callbacks if isinstance(cb, StepCounter)]
    assert [cb.count for cb in restored] == [3] and counter.count == 0


def test_the_checkpoint_export_is_read_back_in_the_commit_not_gathered_in_the_step(tmp_path, monkeypatch):
    """A checkpoint's model.safetensors comes from its saved train state, written by the committer (off the
    step's path, no gather on any process); it equals save_model()'s export byte for byte. Without a train state
    (save_only_model) the export is gathered as before."""
    from jtrainer.models import hf_io

    gathered = []
    real = hf_io.to_hf_state_dict
    monkeypatch.setattr(hf_io, "to_hf_state_dict", lambda *a, **k: gathered.append(1) or real(*a, **k))
    trainer = make_trainer(str(tmp_path / "run"), 4, 2, False)
    trainer.train()
    assert gathered == []
    trainer.save_model(str(tmp_path / "final"))
    assert gathered == [1]
    for step in (2, 4):
        checkpoint.verify_checkpoint(str(tmp_path / "run" / f"checkpoint-{step}"))
    exported = (tmp_path / "run" / "checkpoint-4" / "model.safetensors").read_bytes()
    assert exported == (tmp_path / "final" / "model.safetensors").read_bytes()

    only_model = make_trainer(str(tmp_path / "only"), 2, 2, False)
    only_model.args.save_only_model = True
    only_model.train()
    assert len(gathered) > 1 and (tmp_path / "only" / "checkpoint-2" / "model.safetensors").exists()
