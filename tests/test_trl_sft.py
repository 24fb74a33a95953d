"""jtrainer.trl.SFTTrainer side by side with TRL's SFTTrainer on torch (TRL 1.16): the same tiny Llama, tokenizer
and rows; per-step loss, grad_norm and TRL's entropy / mean_token_accuracy / num_tokens, and the trained weights."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

pytest.importorskip("trl")

import trl  # noqa: E402

from jtrainer import trl as jtrl  # noqa: E402
from tests import trl_cases as cases  # noqa: E402

SFT_KEYS = ["loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"]


def run_both(tmp_path, rows, model=None, peft_config=None, eval_rows=None, formatting_func=None, **fields):
    """TRL's run and ours on the same model and rows: (TRL's trainer, ours)."""
    model = model if model is not None else cases.torch_llama()
    dataset = datasets.Dataset.from_list(rows)
    trainers = []
    for package, name in ((trl, "theirs"), (jtrl, "ours")):
        trainer = package.SFTTrainer(
            model=cases.twin(model),
            args=package.SFTConfig(**cases.config_fields(tmp_path / name, **fields)),
            train_dataset=dataset,
            eval_dataset=None if eval_rows is None else datasets.Dataset.from_list(eval_rows),
            processing_class=cases.tokenizer(),
            peft_config=None if peft_config is None else cases.twin(peft_config),
            formatting_func=formatting_func,
        )
        trainer.train()
        trainers.append(trainer)
    return trainers


def assert_same_weights(theirs, ours, rtol=2e-4, atol=5e-5):
    """The trained weights: Adam divides each gradient by its own scale, so an element whose gradient is near 0
    moves by up to the learning rate on float rounding alone; atol is 0.5% of the runs' learning rate (1e-2)."""
    ours._sync_model()
    reference = {k: v.detach().numpy() for k, v in theirs.model.state_dict().items()}
    mine = {k: v.detach().numpy() for k, v in ours.model.state_dict().items()}
    assert reference.keys() == mine.keys()
    for key, value in reference.items():
        np.testing.assert_allclose(mine[key], value, rtol=rtol, atol=atol, err_msg=key)


def test_text_rows_as_trl(tmp_path):
    theirs, ours = run_both(tmp_path, cases.text_rows(), gradient_accumulation_steps=2)
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, SFT_KEYS)
    assert_same_weights(theirs, ours)


@pytest.mark.parametrize("completion_only_loss", [None, False])
def test_prompt_completion_rows_as_trl(tmp_path, completion_only_loss):
    """With evaluations during training (eval_steps 1) on held-out prompt/completion rows."""
    theirs, ours = run_both(
        tmp_path,
        cases.prompt_completion_rows(),
        eval_rows=cases.prompt_completion_rows(6, seed=5),
        completion_only_loss=completion_only_loss,
        eval_strategy="steps",
        eval_steps=1,
    )
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, SFT_KEYS)
    evals = [[e for e in t.state.log_history if "eval_loss" in e] for t in (ours, theirs)]
    assert len(evals[0]) == len(evals[1]) == 3
    for mine, ref in zip(*evals, strict=True):
        for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"):
            assert np.isclose(mine[key], ref[key], rtol=1e-4), (key, mine, ref)
    row = ours.train_dataset[0]
    masked = sum(label == -100 for label in row["labels"])
    assert (masked > 0) == (completion_only_loss is None)  # the prompt is off the loss by default


def test_text_field_formatting_function_dft_and_padding_free_as_trl(tmp_path):
    """dataset_text_field, then a formatting function, with the DFT loss; padding-free rows without packing."""
    rows = [{"content": row["text"]} for row in cases.text_rows()]
    theirs, ours = run_both(tmp_path / "field", rows, dataset_text_field="content", loss_type="dft")
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, SFT_KEYS)
    pairs = [{"question": r["prompt"], "answer": r["completion"]} for r in cases.prompt_completion_rows()]
    theirs, ours = run_both(
        tmp_path / "formatted",
        pairs,
        formatting_func=lambda row: f"{row['question']} {row['answer']}",
        padding_free=True,
        max_length=None,
    )
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, SFT_KEYS)


def test_conversations_with_assistant_only_loss_as_trl(tmp_path):
    theirs, ours = run_both(tmp_path, cases.conversation_rows(), assistant_only_loss=True)
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, SFT_KEYS)
    assert ours.train_dataset[0]["labels"] == theirs.train_dataset[0]["labels"]


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_packing_as_trl(tmp_path, strategy):
    theirs, ours = run_both(
        tmp_path, cases.text_rows(24), packing=True, packing_strategy=strategy, max_length=24, max_steps=2
    )
    assert ours.train_dataset[:] == theirs.train_dataset[:]  # TRL's packed rows
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, SFT_KEYS)
    assert_same_weights(theirs, ours)


def test_peft_adapter_as_trl(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    theirs, ours = run_both(tmp_path, cases.text_rows(), peft_config=lora)
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, SFT_KEYS)
    assert_same_weights(theirs, ours)


def test_mixture_of_experts_load_balancing_loss_as_trl(tmp_path):
    """An MoE model: TRL adds the router's load-balancing loss (the config's coefficient), averaged over the
    window's micro-batches, and logs aux_loss; over padding-free rows it is refused (it would count padding)."""
    model = cases.torch_mixtral()
    theirs, ours = run_both(tmp_path, cases.text_rows(), model=model, gradient_accumulation_steps=2, max_steps=2)
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, [*SFT_KEYS, "aux_loss"])
    from jtrainer.core.errors import BadInput

    with pytest.raises(BadInput, match="router_aux_loss_coef: TRL's MoE load-balancing loss over padding-free"):
        jtrl.SFTTrainer(
            model=model,
            args=jtrl.SFTConfig(**cases.config_fields(tmp_path / "packed", packing=True, max_length=24)),
            train_dataset=datasets.Dataset.from_list(cases.text_rows()),
            processing_class=cases.tokenizer(),
        )


def test_evaluate_logs_trl_statistics(tmp_path):
    rows = cases.text_rows(8)
    theirs, ours = run_both(tmp_path, rows, max_steps=1)
    held_out = datasets.Dataset.from_list(cases.text_rows(6, seed=9))
    reference, mine = theirs.evaluate(held_out), ours.evaluate(held_out)
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"):
        assert np.isclose(mine[key], reference[key], rtol=1e-4), (key, mine, reference)


def test_save_model_writes_transformers_weights(tmp_path):
    _, ours = run_both(tmp_path, cases.text_rows(8), max_steps=1)
    ours.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        np.testing.assert_allclose(loaded(ids).logits.numpy(), ours.model(ids).logits.detach().numpy(), rtol=1e-5)


def test_model_path_trains_the_native_model_with_packed_segments(tmp_path):
    """A path loads jtrainer's native Llama (TRL: transformers' from the same files) and, with no
    processing_class, the tokenizer saved there; BFD-packed documents stay apart through segment_ids, with TRL's
    numbers."""
    cases.torch_llama().save_pretrained(tmp_path / "model")
    cases.tokenizer().save_pretrained(tmp_path / "model")
    dataset = datasets.Dataset.from_list(cases.text_rows(24))
    trainers = []
    for package, name in ((trl, "theirs"), (jtrl, "ours")):
        fields = cases.config_fields(tmp_path / name, packing=True, max_length=24, max_steps=2)
        trainer = package.SFTTrainer(
            model=str(tmp_path / "model"),
            args=package.SFTConfig(**fields),
            train_dataset=dataset,
        )
        trainer.train()
        trainers.append(trainer)
    theirs, ours = trainers
    from jtrainer.models import LlamaForCausalLM

    assert isinstance(ours.model, LlamaForCausalLM)
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, SFT_KEYS)


def test_stop_and_resume_is_exact(tmp_path):
    """A run stopped at its step-2 checkpoint and resumed logs the uninterrupted run's steps 3 and 4 (packed
    rows, shuffled order); num_tokens restarts at 0, as TRL's does."""
    dataset = datasets.Dataset.from_list(cases.text_rows(40))

    def trainer(name, **over):
        fields = cases.config_fields(tmp_path / name, packing=True, max_length=24, max_steps=4, save_steps=2)
        fields.update(save_strategy="steps", **over)
        fields.pop("train_sampling_strategy")
        return jtrl.SFTTrainer(
            model=cases.torch_llama(),
            args=jtrl.SFTConfig(**fields),
            train_dataset=dataset,
            processing_class=cases.tokenizer(),
        )

    whole = trainer("whole")
    whole.train()
    resumed = trainer("resumed", output_dir=str(tmp_path / "whole"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    full = cases.train_logs(whole.state.log_history)
    tail = [e for e in cases.train_logs(resumed.state.log_history) if e["step"] > 2]  # (1, 2: the checkpoint's)
    assert [e["step"] for e in tail] == [3, 4]
    for mine, ref in zip(tail, full[2:], strict=True):
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
            assert np.isclose(mine[key], ref[key], rtol=1e-6), (key, mine, ref)
    assert tail[-1]["num_tokens"] == full[-1]["num_tokens"] - full[1]["num_tokens"]
