"""jtrainer.trl.DPOTrainer side by side with TRL's DPOTrainer on torch (TRL 1.16): the same tiny Llama, tokenizer
and preference rows; per-step loss, grad_norm and TRL's rewards, log-probabilities and statistics, for each kind
of reference and the loss types TRL offers."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

pytest.importorskip("trl")

import trl  # noqa: E402

from jtrainer import trl as jtrl  # noqa: E402
from jtrainer.trl.losses import DPO_LOSS_TYPES  # noqa: E402
from tests import trl_cases as cases  # noqa: E402

DPO_KEYS = [
    "loss",
    "grad_norm",
    "entropy",
    "num_tokens",
    "logits/chosen",
    "logits/rejected",
    "mean_token_accuracy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
]


def run_both(tmp_path, model=None, reference=True, peft_config=None, rows=None, eval_rows=None, **fields):
    """TRL's run and ours: `reference` True passes a copy of the model as ref_model, False leaves it None."""
    model = model if model is not None else cases.torch_llama()
    dataset = datasets.Dataset.from_list(rows or cases.preference_rows())
    held_out = None if eval_rows is None else datasets.Dataset.from_list(eval_rows)
    fields.setdefault("learning_rate", 1e-3)
    trainers = []
    for package, name in ((trl, "theirs"), (jtrl, "ours")):
        trainer = package.DPOTrainer(
            model=model if isinstance(model, str) else cases.twin(model),
            ref_model=cases.twin(model) if reference else None,
            args=package.DPOConfig(**cases.config_fields(tmp_path / name, **fields)),
            train_dataset=dataset,
            eval_dataset=held_out,
            processing_class=cases.tokenizer(),
            peft_config=None if peft_config is None else cases.twin(peft_config),
        )
        trainer.train()
        trainers.append(trainer)
    return trainers


def assert_same(theirs, ours, keys=DPO_KEYS):
    cases.assert_logs_match(ours.state.log_history, theirs.state.log_history, keys)


def test_sigmoid_loss_with_an_explicit_reference_left_untouched(tmp_path):
    """With gradient accumulation and an evaluation after each step (the reference's pass on eval batches)."""
    model = cases.torch_llama()
    eval_rows = cases.preference_rows(6, seed=7)
    theirs, ours = run_both(
        tmp_path, model, eval_rows=eval_rows, gradient_accumulation_steps=2, max_steps=2, eval_strategy="steps"
    )
    assert_same(theirs, ours)
    evals = [[e for e in t.state.log_history if "eval_loss" in e] for t in (ours, theirs)]
    assert len(evals[0]) == len(evals[1]) == 2
    for mine, ref in zip(*evals, strict=True):
        for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_num_tokens"):
            assert np.isclose(mine[key], ref[key], rtol=1e-4, atol=1e-6), (key, mine, ref)
    before = {k: v.numpy() for k, v in model.state_dict().items()}
    for key, value in ours.ref_model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), before[key])


@pytest.mark.parametrize("given", ["torch model", "path"])
def test_reference_reloaded_from_the_checkpoint_when_none(tmp_path, given):
    """ref_model=None: TRL loads the policy's checkpoint again (config._name_or_path); a path trains (and
    reloads) jtrainer's native Llama."""
    cases.torch_llama().save_pretrained(tmp_path / "model")
    from transformers import AutoModelForCausalLM

    model = str(tmp_path / "model")
    if given == "torch model":
        model = AutoModelForCausalLM.from_pretrained(model)
    theirs, ours = run_both(tmp_path, model, reference=False, learning_rate=1e-2)
    assert_same(theirs, ours)
    native = given == "path"
    assert (type(ours.ref_model).__module__ == "jtrainer.models.llama") == native


def test_peft_reference_is_the_disabled_adapter(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    theirs, ours = run_both(tmp_path, reference=False, peft_config=lora, learning_rate=1e-2)
    assert_same(theirs, ours)
    assert ours._adapter_reference


def test_a_peft_model_passed_in_is_its_own_frozen_reference(tmp_path):
    """A PeftModel given with ref_model=None: TRL's reference is a frozen copy of its adapter as given (not the
    disabled adapter); its adapter starts away from zero here, so the two differ."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        cases.torch_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    theirs, ours = run_both(tmp_path, model, reference=False, learning_rate=1e-2)
    assert_same(theirs, ours)
    assert not ours._adapter_reference


def test_precomputed_reference_log_probs(tmp_path):
    theirs, ours = run_both(tmp_path, reference=False, precompute_ref_log_probs=True)
    np.testing.assert_allclose(
        ours.train_dataset["ref_chosen_logps"], theirs.train_dataset["ref_chosen_logps"], rtol=1e-5
    )
    assert_same(theirs, ours)


ALL_LOSSES = [t for t in DPO_LOSS_TYPES if t != "exo_pair"]


@pytest.mark.parametrize(
    "fields",
    [
        dict(loss_type=ALL_LOSSES, loss_weights=[0.1 * (i + 1) for i in range(len(ALL_LOSSES))], label_smoothing=0.1),
        dict(loss_type=["exo_pair", "sigmoid"], label_smoothing=1e-3, f_divergence_type="js_divergence"),
        dict(loss_type=["ipo", "hinge"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
        dict(loss_type=["sigmoid"], f_divergence_type="forward_kl", ld_alpha=0.5, use_weighting=True),
    ],
    ids=["every-loss-type", "exo-js", "alpha-divergence", "forward-kl-ld-wpo"],
)
def test_loss_types_as_trl(tmp_path, fields):
    theirs, ours = run_both(tmp_path, max_steps=2, learning_rate=1e-2, **fields)
    assert_same(theirs, ours)


def test_mixture_of_experts_load_balancing_loss_as_trl(tmp_path):
    theirs, ours = run_both(tmp_path, cases.torch_mixtral(), max_steps=2, learning_rate=1e-2)
    assert_same(theirs, ours, [*DPO_KEYS, "aux_loss"])


def test_evaluate_logs_trl_statistics(tmp_path):
    theirs, ours = run_both(tmp_path, max_steps=1)
    held_out = datasets.Dataset.from_list(cases.preference_rows(6, seed=8))
    reference, mine = theirs.evaluate(held_out), ours.evaluate(held_out)
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/rejected", "eval_entropy"):
        assert np.isclose(mine[key], reference[key], rtol=1e-4, atol=1e-6), (key, mine, reference)


def test_stop_and_resume_is_exact(tmp_path):
    """Stopped at its step-2 checkpoint and resumed, a DPO run (explicit reference, shuffled order) logs the
    uninterrupted run's steps 3 and 4."""
    dataset = datasets.Dataset.from_list(cases.preference_rows(24))
    model = cases.torch_llama()

    def trainer():
        fields = cases.config_fields(tmp_path / "run", max_steps=4, save_steps=2, learning_rate=1e-2)
        fields.update(save_strategy="steps")
        fields.pop("train_sampling_strategy")
        return jtrl.DPOTrainer(
            model=cases.twin(model),
            ref_model=cases.twin(model),
            args=jtrl.DPOConfig(**fields),
            train_dataset=dataset,
            processing_class=cases.tokenizer(),
        )

    whole = trainer()
    whole.train()
    full = cases.train_logs(whole.state.log_history)
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    tail = [e for e in cases.train_logs(resumed.state.log_history) if e["step"] > 2]
    assert [e["step"] for e in tail] == [3, 4]
    for mine, ref in zip(tail, full[2:], strict=True):
        for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):
            assert np.isclose(mine[key], ref[key], rtol=1e-6), (key, mine, ref)
