"""jtrainer against transformers.Trainer (torch, CPU): same weights, data and hyperparameters, same run."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from conftest import side_by_side_args as _args  # noqa: E402
from conftest import tiny_llama_config, token_rows, torch_rows  # noqa: E402


def test_same_run_as_transformers_trainer(tmp_path):
    import transformers

    from jtrainer import Trainer, TrainingArguments
    from jtrainer.models.llama import LlamaForCausalLM

    config = tiny_llama_config()
    torch.manual_seed(0)
    torch_model = transformers.LlamaForCausalLM(config)
    torch_model.save_pretrained(tmp_path / "init")
    # 22 rows / batch 4 -> 6 batches per epoch (the last one ragged), accumulation 2 -> 3 updates per epoch.
    rows = token_rows(22, ragged_labels=True)

    hf = transformers.Trainer(
        model=torch_model, args=_args(transformers.TrainingArguments, tmp_path / "hf"), train_dataset=torch_rows(rows)
    )
    hf_out = hf.train()

    ours = Trainer(
        model=LlamaForCausalLM.from_pretrained(str(tmp_path / "init")),
        args=_args(TrainingArguments, tmp_path / "jt"),
        train_dataset=rows,
    )
    jt_out = ours.train()

    hf_logs = [h for h in hf.state.log_history if "loss" in h]
    jt_logs = [h for h in ours.state.log_history if "loss" in h]
    assert [h["step"] for h in jt_logs] == [h["step"] for h in hf_logs] == list(range(1, 7))
    for ref, got in zip(hf_logs, jt_logs):
        for key in ("loss", "grad_norm", "epoch"):
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-9, err_msg=f"{key} at {ref['step']}")
        np.testing.assert_allclose(got["learning_rate"], ref["learning_rate"], rtol=1e-7, atol=0)  # HF's float64
    assert jt_out.global_step == hf_out.global_step
    np.testing.assert_allclose(jt_out.training_loss, hf_out.training_loss, rtol=1e-4)
    assert ours.state.total_flos == pytest.approx(hf.state.total_flos, rel=1e-6)

    from jtrainer.models.hf_io import to_hf_state_dict

    ref_params = {k: v.detach().numpy() for k, v in hf.model.state_dict().items()}
    got_params = to_hf_state_dict(ours.model)
    assert set(got_params) <= set(ref_params)
    for name, value in got_params.items():
        np.testing.assert_allclose(value, ref_params[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("optim", ["schedule_free_adamw", "schedule_free_sgd"])
def test_schedule_free_evaluates_and_saves_x_as_transformers(tmp_path, optim):
    """HF's evaluation_loop calls optimizer.eval(): evaluation sees schedule-free's x parameters, and the model
    keeps them until the next training step (here the end of training, so x is what is saved)."""
    pytest.importorskip("schedulefree")
    import transformers

    from jtrainer import Trainer, TrainingArguments
    from jtrainer.models.hf_io import to_hf_state_dict
    from jtrainer.models.llama import LlamaForCausalLM

    config = tiny_llama_config()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "init")
    rows, eval_rows = token_rows(32, ragged_labels=True), token_rows(8, seed=1)
    over = dict(
        optim=optim,
        eval_strategy="steps",
        eval_steps=4,
        num_train_epochs=1,
        learning_rate=1e-2,
        warmup_steps=1,
        lr_scheduler_type="constant",
        per_device_eval_batch_size=4,
    )

    hf = transformers.Trainer(
        model=transformers.LlamaForCausalLM.from_pretrained(tmp_path / "init"),
        args=_args(transformers.TrainingArguments, tmp_path / "hf", **over),
        train_dataset=torch_rows(rows),
        eval_dataset=torch_rows(eval_rows),
    )
    hf.train()
    ours = Trainer(
        model=LlamaForCausalLM.from_pretrained(str(tmp_path / "init")),
        args=_args(TrainingArguments, tmp_path / "jt", **over),
        train_dataset=rows,
        eval_dataset=eval_rows,
    )
    ours.train()

    hf_evals = [h for h in hf.state.log_history if "eval_loss" in h]
    jt_evals = [h for h in ours.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in jt_evals] == [h["step"] for h in hf_evals] == [4]
    np.testing.assert_allclose(jt_evals[0]["eval_loss"], hf_evals[0]["eval_loss"], rtol=1e-5)
    for ref, got in zip(
        [h for h in hf.state.log_history if "loss" in h], [h for h in ours.state.log_history if "loss" in h]
    ):
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-4, err_msg=str(ref["step"]))
    # float32 on both sides; Adam-normalised updates of rate 1e-2 leave ~1e-5 of rounding noise on a few entries,
    # while x and y differ by ~1e-3.
    ref_params = {k: v.detach().numpy() for k, v in hf.model.state_dict().items()}
    for name, value in to_hf_state_dict(ours.model).items():
        np.testing.assert_allclose(value, ref_params[name], rtol=1e-4, atol=5e-5, err_msg=name)


@pytest.mark.parametrize("with_metrics", [False, True])
def test_evaluate_gathers_logits_only_for_compute_metrics_as_transformers(tmp_path, with_metrics):
    """HF's evaluate() passes prediction_loss_only=True when there is no compute_metrics: the logits are never
    computed for metrics nor handed to preprocess_logits_for_metrics (at a 128k vocabulary they are the largest
    array of the step). Same eval_loss either way."""
    import transformers

    from jtrainer import Trainer, TrainingArguments
    from jtrainer.models.llama import LlamaForCausalLM

    config = tiny_llama_config()
    torch.manual_seed(0)
    torch_model = transformers.LlamaForCausalLM(config)
    torch_model.save_pretrained(tmp_path / "init")
    rows = token_rows(10)

    def run(trainer_class, args_class, model, data):
        seen = []

        def preprocess(logits, labels):
            seen.append(tuple(logits.shape))
            return logits.argmax(-1)

        trainer = trainer_class(
            model=model,
            args=_args(args_class, tmp_path / args_class.__module__, per_device_eval_batch_size=4),
            eval_dataset=data,
            preprocess_logits_for_metrics=preprocess,
            compute_metrics=(lambda p: {"n": float(np.size(p.predictions))}) if with_metrics else None,
        )
        return trainer.evaluate(), seen

    hf_metrics, hf_seen = run(transformers.Trainer, transformers.TrainingArguments, torch_model, torch_rows(rows))
    jt_metrics, jt_seen = run(
        Trainer, TrainingArguments, LlamaForCausalLM.from_pretrained(str(tmp_path / "init")), rows
    )
    assert bool(hf_seen) is bool(jt_seen) is with_metrics
    np.testing.assert_allclose(jt_metrics["eval_loss"], hf_metrics["eval_loss"], rtol=1e-5)
    assert ("eval_n" in jt_metrics) is ("eval_n" in hf_metrics) is with_metrics
    if with_metrics:
        assert jt_metrics["eval_n"] == hf_metrics["eval_n"]


@pytest.mark.parametrize(
    "name",
    [
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "GPT2LMHeadModel",
        "BertForMaskedLM",
        "BertForSequenceClassification",
        "T5ForConditionalGeneration",
    ],
)
def test_num_items_in_batch_counts_labels_as_transformers_trainer(tmp_path, name):
    """HF counts labels[..., 1:] only where the model's loss_type (from its class name) is the causal-LM loss:
    GPT2LMHeadModel shifts in its loss but has no loss_type, so every label is counted (15/16 of the mean)."""
    import transformers

    import jtrainer.models as models
    from jtrainer.kinds.loss_rules import counts_shifted_labels

    configs = {
        "Llama": tiny_llama_config(),
        "Qwen2": transformers.Qwen2Config(**tiny_llama_config().to_dict()),
        "GPT2": transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64),
        "Bert": transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
        ),
        "T5": transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0
        ),
    }
    config = configs[next(k for k in configs if name.startswith(k))]
    hf = transformers.Trainer(
        model=getattr(transformers, name)(config),
        args=transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True),
    )
    assert counts_shifted_labels(getattr(models, name).from_config(config)) == hf._loss_shifts_labels


@pytest.mark.parametrize("name", ["BertForMaskedLM", "BertForTokenClassification", "T5ForConditionalGeneration"])
def test_models_whose_loss_ignores_num_items_accumulate_as_transformers_trainer(tmp_path, name):
    """transformers' BERT heads and T5 take num_items_in_batch (their forward has **kwargs, so HF neither divides
    by the accumulation steps) and ignore it (CrossEntropyLoss's per-batch mean): a window's loss is the sum of
    its micro-batches' means. The native families do the same (micro-batches with different label counts)."""
    import numpy as np
    import transformers

    import jtrainer.models as models
    from jtrainer import Trainer, TrainingArguments

    configs = {
        "Bert": transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
            num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        ),
        "T5": transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0,
            dropout_rate=0.0,
        ),
    }  # fmt: skip
    config = configs[next(k for k in configs if name.startswith(k))]
    torch.manual_seed(0)
    getattr(transformers, name)(config).save_pretrained(tmp_path / "ref")
    rng = np.random.RandomState(0)
    rows = []
    for i in range(8):
        labels = rng.randint(0, 5 if "Token" in name else 64, 12)
        labels[: 2 + 3 * (i % 3)] = -100  # label counts differ between micro-batches
        rows.append({"input_ids": rng.randint(1, 64, 12), "labels": labels})
    kw = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    hf = transformers.Trainer(
        model=getattr(transformers, name).from_pretrained(tmp_path / "ref"),
        args=transformers.TrainingArguments(str(tmp_path / "hf"), use_cpu=True, **kw),
        train_dataset=torch_rows(rows),
    )
    ours = Trainer(
        model=getattr(models, name).from_pretrained(str(tmp_path / "ref")),
        args=TrainingArguments(str(tmp_path / "ours"), **kw),
        train_dataset=rows,
    )
    hf.train()
    ours.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (hf, ours)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
