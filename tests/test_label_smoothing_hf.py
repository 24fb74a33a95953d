"""label_smoothing_factor for every head equals HF's LabelSmoother."""

import numpy as np
import pytest
from conftest import short_run_args

from jtrainer import Trainer
from jtrainer.models import AutoModelForSequenceClassification, AutoModelForTokenClassification

_args = short_run_args


def _bert_config(**kw):
    import transformers

    return transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        **kw,
    )


@pytest.mark.parametrize("auto", [AutoModelForSequenceClassification, AutoModelForTokenClassification])
def test_label_smoothing_equals_hf_label_smoother(auto):
    torch = pytest.importorskip("torch")
    from transformers.trainer_pt_utils import LabelSmoother

    rng = np.random.RandomState(0)
    ids = rng.randint(1, 64, (8, 10))
    token_level = auto is AutoModelForTokenClassification
    labels = rng.randint(0, 3, (8, 10) if token_level else (8,))
    if token_level:
        labels[:, 7:] = -100
    rows = [{"input_ids": i, "attention_mask": np.ones(10, np.int64), "labels": lab} for i, lab in zip(ids, labels)]
    model = auto.from_config(_bert_config())
    trainer = Trainer(model, _args(label_smoothing_factor=0.2, per_device_eval_batch_size=8))
    out = trainer.predict(rows)
    logits = torch.tensor(np.asarray(out.predictions))
    expected = LabelSmoother(epsilon=0.2)({"logits": logits}, torch.tensor(labels))
    assert out.metrics["test_loss"] == pytest.approx(float(expected), rel=1e-5)
    trainer.train_dataset = rows
    trainer.train()  # and it trains

    regression = AutoModelForSequenceClassification.from_config(_bert_config(problem_type="regression"))
    rows = [{"input_ids": i, "labels": np.float32(v)} for i, v in zip(ids, rng.randn(8))]
    with pytest.raises(ValueError, match="label_smoothing_factor=0.2 smooths class labels"):
        Trainer(regression, _args(label_smoothing_factor=0.2), train_dataset=rows).train()


def test_a_multi_label_model_disables_label_smoothing_with_hfs_warning():
    """HF's Trainer warns and sets label_smoother to None for problem_type multi_label_classification; the
    model's own BCE loss then trains, as in HF (the float targets are never smoothed)."""
    torch = pytest.importorskip("torch")
    import transformers

    rng = np.random.RandomState(0)
    rows = [{"input_ids": rng.randint(1, 64, 10), "labels": rng.randint(0, 2, 3).astype(np.float32)} for _ in range(8)]
    config = _bert_config(problem_type="multi_label_classification")
    hf_model = transformers.BertForSequenceClassification(config)
    with pytest.warns(UserWarning) as hf_warned:
        hf_args = transformers.TrainingArguments("o", label_smoothing_factor=0.2, use_cpu=True)
        hf = transformers.Trainer(hf_model, hf_args)
    with pytest.warns(UserWarning) as ours_warned:
        trainer = Trainer(AutoModelForSequenceClassification.from_config(config), _args(label_smoothing_factor=0.2))
    messages = lambda record: {str(w.message) for w in record if "Label smoothing" in str(w.message)}  # noqa: E731
    assert messages(ours_warned) == messages(hf_warned) and messages(hf_warned)
    assert hf.label_smoother is None and trainer.label_smoother is None
    del torch
    trainer.train_dataset = rows
    trainer.train()  # the model's BCE loss, no smoothing error
