"""BERT heads against PyTorch transformers: logits and losses both ways, no missing keys, training works."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jtrainer.models import (  # noqa: E402
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

HEADS = {
    "BertForMaskedLM": AutoModelForMaskedLM,
    "BertForSequenceClassification": AutoModelForSequenceClassification,
    "BertForTokenClassification": AutoModelForTokenClassification,
}


def _config(**kw):
    import transformers

    kw.setdefault("num_labels", 3)
    return transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        **kw,
    )


def _labels(head, rng, ids, mask, problem_type=None):
    if head == "BertForSequenceClassification":
        if problem_type == "regression":
            return rng.randn(ids.shape[0]).astype(np.float32)
        if problem_type == "multi_label_classification":
            return (rng.rand(ids.shape[0], 3) > 0.5).astype(np.float32)
        return rng.randint(0, 3, ids.shape[0])
    labels = rng.randint(0, 64 if head == "BertForMaskedLM" else 3, ids.shape)
    return np.where(mask.astype(bool) & (rng.rand(*ids.shape) > 0.3), labels, -100)


@pytest.mark.parametrize(
    "head, problem_type",
    [
        ("BertForMaskedLM", None),
        ("BertForSequenceClassification", None),
        ("BertForSequenceClassification", "multi_label_classification"),
        ("BertForSequenceClassification", "regression"),
        ("BertForTokenClassification", None),
    ],
)
def test_bert_head_matches_pytorch(tmp_path, head, problem_type):
    import transformers

    config = _config(problem_type=problem_type, **({"num_labels": 1} if problem_type == "regression" else {}))
    torch.manual_seed(0)
    reference = getattr(transformers, head)(config).eval()
    for p in reference.parameters():
        p.data.add_(torch.randn_like(p) * 0.02)
    reference.save_pretrained(tmp_path / "torch")
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 64, (3, 10))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    types = (np.arange(10)[None] >= 5).astype(np.int64).repeat(3, 0)
    labels = _labels(head, rng, ids, mask, problem_type)
    with torch.no_grad():
        expected = reference(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor(types),
            labels=torch.tensor(labels),
        )
    ours = HEADS[head].from_pretrained(str(tmp_path / "torch"))
    assert type(ours).__name__ == head
    got = ours(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types), labels=jnp.asarray(labels))
    exp_logits = expected.logits.numpy()
    valid = mask.astype(bool) if exp_logits.ndim == 3 else np.ones(3, bool)
    assert np.abs(np.asarray(got.logits) - exp_logits)[valid].max() <= 1e-4
    assert float(got.loss) == pytest.approx(float(expected.loss), rel=1e-4)

    ours.save_pretrained(str(tmp_path / "jax"))
    _, info = getattr(transformers, head).from_pretrained(str(tmp_path / "jax"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_bert_classifier_trains(tmp_path):
    from jtrainer import Trainer, TrainingArguments

    rng = np.random.RandomState(0)
    rows = []
    for _ in range(32):
        label = rng.randint(0, 3)
        rows.append(
            {
                "input_ids": rng.randint(label * 20, label * 20 + 20, 8),
                "attention_mask": np.ones(8, np.int64),
                "labels": label,
            }
        )
    model = AutoModelForSequenceClassification.from_config(_config())
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=8,
        num_train_epochs=4,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows,
        eval_dataset=rows,
        compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())},
    )
    trainer.train()
    assert trainer.evaluate()["eval_accuracy"] > 0.9
