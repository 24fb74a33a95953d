"""The host loop: step/epoch counting, callback order and logs equal to transformers.Trainer's; exact
accumulation; one compilation per run."""

import numpy as np
import pytest
from conftest import count_compiles, scratch_dir, tiny_llama_config, token_rows, torch_rows

from jtrainer import Trainer, TrainerCallback, TrainingArguments
from jtrainer.models.llama import LlamaForCausalLM

EVENTS = [
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_evaluate",
    "on_log",
    "on_save",
    "on_prediction_step",
    "on_predict",
]


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name in EVENTS:

            def record(args, state, control, **kwargs):
                self.events.append((name, state.global_step, round(state.epoch or 0, 6)))

            return record
        return super().__getattribute__(name)


def _kwargs(out, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        save_strategy="no",
        use_cpu=True,
    )
    kw.update(over)
    return kw


def run_hf(tmp_path, rows, eval_rows=None, **over):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import transformers

    torch.manual_seed(0)
    rec = Recorder()
    trainer = transformers.Trainer(
        model=transformers.LlamaForCausalLM(tiny_llama_config()),
        args=transformers.TrainingArguments(**_kwargs(tmp_path / "hf", **over)),
        train_dataset=torch_rows(rows),
        eval_dataset=torch_rows(eval_rows) if eval_rows else None,
        callbacks=[rec],
    )
    trainer.train()
    return trainer, rec.events


def run_ours(tmp_path, rows, eval_rows=None, **over):
    rec = Recorder()
    trainer = Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=TrainingArguments(**_kwargs(tmp_path / "jt", **over)),
        train_dataset=rows,
        eval_dataset=eval_rows,
        callbacks=[rec],
    )
    trainer.train()
    return trainer, rec.events


THROUGHPUT_KEYS = {"train_tokens_per_second", "train_mfu"}  # jtrainer's additions (log_throughput)


def _log_keys(state):
    return [(sorted(set(h) - THROUGHPUT_KEYS), h["step"], round(h["epoch"], 6)) for h in state.log_history]


@pytest.mark.parametrize(
    "n_rows, batch, ga, epochs, max_steps, drop_last",
    [
        (10, 4, 1, 1, -1, False),
        (10, 4, 2, 2, -1, False),
        (23, 4, 3, 1.5, -1, False),
        (9, 2, 4, 1, -1, False),
        (10, 4, 2, 1, 7, False),
        (7, 4, 1, 3, -1, True),
    ],
)
def test_step_counts_events_and_logs_match_hf(tmp_path, n_rows, batch, ga, epochs, max_steps, drop_last):
    rows = token_rows(n_rows, length=8)
    over = dict(
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga,
        num_train_epochs=epochs,
        max_steps=max_steps,
        dataloader_drop_last=drop_last,
        logging_steps=2,
    )
    hf, hf_events = run_hf(tmp_path, rows, **over)
    ours, our_events = run_ours(tmp_path, rows, **over)
    assert ours.state.global_step == hf.state.global_step
    assert ours.state.max_steps == hf.state.max_steps
    assert our_events == hf_events
    assert _log_keys(ours.state) == _log_keys(hf.state)


def test_eval_save_and_first_step_flow_matches_hf(tmp_path):
    rows, eval_rows = token_rows(10, length=8), token_rows(6, length=8, seed=1)
    over = dict(
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        logging_first_step=True,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        eval_on_start=True,
        save_strategy="steps",
        save_steps=3,
        save_total_limit=1,
    )
    hf, hf_events = run_hf(tmp_path, rows, eval_rows, **over)
    ours, our_events = run_ours(tmp_path, rows, eval_rows, async_checkpointing=False, **over)
    assert our_events == hf_events  # committing in the step keeps HF's exact order
    assert _log_keys(ours.state) == _log_keys(hf.state)
    # Asynchronous saves deliver on_save once committed (a later step boundary): the same events otherwise.
    _, async_events = run_ours(tmp_path / "async", rows, eval_rows, **over)
    saves = [e for e in async_events if e[0] == "on_save"]
    assert saves == [e for e in hf_events if e[0] == "on_save"]
    assert [e for e in async_events if e[0] != "on_save"] == [e for e in hf_events if e[0] != "on_save"]

    # The last save is committed at once (training is over): on_save arrives in HF's place, inside the last step.
    def from_the_last_save(events):
        last = max(i for i, e in enumerate(events) if e[0] == "on_save")
        return events[last:]

    assert from_the_last_save(async_events) == from_the_last_save(hf_events)
    hf_eval = [h["eval_loss"] for h in hf.state.log_history if "eval_loss" in h]
    assert len(hf_eval) == len([h for h in ours.state.log_history if "eval_loss" in h])
    import os

    assert sorted(os.listdir(tmp_path / "jt")) == sorted(os.listdir(tmp_path / "hf"))


def _train_one_step(rows, batch, ga):
    trainer = Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=TrainingArguments(
            **_kwargs(
                scratch_dir(),
                per_device_train_batch_size=batch,
                gradient_accumulation_steps=ga,
                max_steps=1,
                max_grad_norm=0.0,
                learning_rate=1.0,
                optim="sgd",
            )
        ),
        # SGD: the update is the gradient itself, so the comparison is not amplified by Adam's g / |g|.
        train_dataset=rows,
    )
    out = trainer.train()
    return out.training_loss, trainer._train_state.params


def test_accumulation_equals_the_full_batch():
    import jax

    rows = token_rows(8, length=12, ragged_labels=True)
    loss_acc, params_acc = _train_one_step(rows, batch=2, ga=4)
    loss_full, params_full = _train_one_step(rows, batch=8, ga=1)
    assert loss_acc == pytest.approx(loss_full, rel=1e-5)
    for a, b in zip(jax.tree.leaves(params_acc), jax.tree.leaves(params_full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_train_step_compiles_once_over_epochs_with_a_ragged_batch():
    rows = token_rows(11, length=8)  # 11 rows / batch 4: the last batch of each epoch has 3 rows
    trainer = Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=TrainingArguments(**_kwargs(scratch_dir(), num_train_epochs=2, gradient_accumulation_steps=2)),
        train_dataset=rows,
    )
    with count_compiles() as compiles:
        trainer.train()
    assert trainer.state.global_step == 4
    assert len(compiles) == 1


def test_shape_probe_loses_no_batch_and_collates_once(tmp_path):
    """The probe before compiling peeks at the first batch: a one-shot iterable still trains on every row, and
    the collator runs once per batch (a random collator draws as HF's would)."""
    from conftest import short_run_args, tiny_llama_config, token_rows

    from jtrainer import Trainer
    from jtrainer.models import LlamaForCausalLM

    rows = token_rows(12)
    calls = []

    def collate(batch):
        calls.append(len(batch))
        return {k: np.stack([r[k] for r in batch]) for k in batch[0]}

    one_shot = (row for row in rows)  # iter(one_shot) is one_shot: rows read once are gone
    args = short_run_args(tmp_path, max_steps=3, include_num_input_tokens_seen=True)
    trainer = Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=args,
        train_dataset=one_shot,
        data_collator=collate,
    )
    out = trainer.train()
    assert out.global_step == 3
    assert trainer.state.num_input_tokens_seen == 12 * 16  # every row, the first batch included
    assert calls == [4, 4, 4]


def test_peek_then_iterate_yields_each_batch_once():
    from jtrainer.trainer.data import BatchLoader

    rows = [{"x": np.array([i])} for i in range(10)]
    collate = lambda b: {"x": np.stack([r["x"] for r in b])}  # noqa: E731
    for dataset in (rows, iter(list(rows))):
        loader = BatchLoader(dataset, 4, collate)
        first = loader.peek()
        seen = [b["x"].ravel().tolist() for b, _ in loader]
        assert first["x"].ravel().tolist() == [0, 1, 2, 3]
        assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_training_runs_in_train_mode_whatever_mode_the_model_is_in():
    """HF's training_step calls model.train(): dropout is on even if the script left the model in eval mode."""
    from conftest import WithDropout, scratch_dir, short_run_args, token_rows
    from flax import nnx

    from jtrainer import Trainer

    def losses(mode):
        model = WithDropout(nnx.Rngs(0))
        getattr(model, mode)()
        trainer = Trainer(model=model, args=short_run_args(scratch_dir(), max_steps=2), train_dataset=token_rows(8))
        trainer.train()
        assert model.drop.deterministic is (mode == "eval")  # the model's own mode is left as it was
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    np.testing.assert_allclose(losses("eval"), losses("train"))
