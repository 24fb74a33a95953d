"""auto_find_batch_size: the largest batch that fits, the effective batch kept, and found again on resume."""

import jax
import pytest
from conftest import short_run_args, tiny_llama_config, token_rows

from jtrainer import Trainer
from jtrainer.core import env
from jtrainer.models.llama import LlamaForCausalLM
from jtrainer.sizing import batch_size

_args = short_run_args


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_auto_find_batch_size_keeps_the_effective_batch(monkeypatch):
    assert [batch_size.next_batch_size(b, 16) for b in (16, 8, 4, 2, 1)] == [8, 4, 2, 1, 0]
    assert batch_size.next_batch_size(32, 96) == 24  # HF's 0.9 step (28), down to a divisor of 96
    assert batch_size.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1GiB"))

    rows = token_rows(32, length=16)
    reference = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config()),
        _args(per_device_train_batch_size=4, gradient_accumulation_steps=4),
        train_dataset=rows,
    )
    reference.train()
    with jax.set_mesh(reference.mesh):
        fits = batch_size.step_bytes(
            reference._run.train_step.lower(reference._train_state, reference._run.last_step_batch).compile()
        )
    # A device with just enough memory for batches of 4: 16 and 8 do not fit, 4 does.
    monkeypatch.setenv(env.DEVICE_MEMORY_BYTES.name, str(fits + 1024))
    given = _args(per_device_train_batch_size=16, auto_find_batch_size=True)
    searched = Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), given, train_dataset=rows)
    searched.train()
    assert (searched.args.per_device_train_batch_size, searched.args.gradient_accumulation_steps) == (4, 4)
    assert (given.per_device_train_batch_size, given.gradient_accumulation_steps) == (16, 1)  # a copy holds the batch
    assert _losses(searched) == pytest.approx(_losses(reference), rel=1e-5)

    monkeypatch.setenv(env.DEVICE_MEMORY_BYTES.name, "1000")
    with pytest.raises(RuntimeError, match="No executable batch size found"):
        Trainer(
            LlamaForCausalLM.from_config(tiny_llama_config()),
            _args(per_device_train_batch_size=2, auto_find_batch_size=True),
            train_dataset=rows,
        ).train()


def test_auto_find_batch_size_resumes_with_the_batch_it_found(monkeypatch, tmp_path, caplog):
    """HF restores the checkpoint's train_batch_size on resume instead of searching again: the resumed run
    starts at 4 x 4 without an out-of-memory round, and its last step is the uninterrupted run's."""
    rows = token_rows(48, length=16)

    def run(out, resume=None):
        trainer = Trainer(
            LlamaForCausalLM.from_config(tiny_llama_config()),
            _args(out, per_device_train_batch_size=16, auto_find_batch_size=True, save_strategy="steps", save_steps=2),
            train_dataset=rows,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    probe = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config()),
        _args(per_device_train_batch_size=4, gradient_accumulation_steps=4, max_steps=1),
        train_dataset=rows,
    )
    probe.train()
    with jax.set_mesh(probe.mesh):
        loop = probe._run
        fits = batch_size.step_bytes(loop.train_step.lower(probe._train_state, loop.last_step_batch).compile())
    monkeypatch.setenv(env.DEVICE_MEMORY_BYTES.name, str(fits + 1024))  # batches of 16 and 8 do not fit, 4 does
    whole = run(tmp_path / "whole")
    caplog.clear()
    with caplog.at_level("WARNING", logger="jtrainer.trainer.trainer"):
        resumed = run(tmp_path / "resumed", str(tmp_path / "whole" / "checkpoint-2"))
    assert not [r for r in caplog.records if "out of memory" in r.getMessage()]
    assert (resumed.args.per_device_train_batch_size, resumed.args.gradient_accumulation_steps) == (4, 4)
    assert resumed.state.train_batch_size == 4
    assert _losses(resumed)[-1] == pytest.approx(_losses(whole)[-1], rel=1e-5)
    assert batch_size.per_device_from_state(32, 1, 8) == 4 and batch_size.per_device_from_state(8, 2, 4) == 4
