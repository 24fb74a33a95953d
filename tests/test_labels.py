"""Class labels outside the model's classes are refused, as torch's cross-entropy refuses them; regression targets
stay floats."""

import json

import numpy as np
import pytest
from conftest import short_run_args
from flax import nnx


def _bert_classifier(num_labels):
    from transformers import BertConfig

    from jtrainer.models import BertForSequenceClassification

    config = BertConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=num_labels,
    )
    return BertForSequenceClassification.from_config(config)


def _rows(labels):
    rng = np.random.RandomState(0)
    return [
        {"input_ids": rng.randint(1, 32, 8), "attention_mask": np.ones(8, np.int64), "labels": label}
        for label in labels
    ]


class LogitsOnly(nnx.Module):
    """A plain nnx classifier, no config and no loss (nor "Classification" in its name): jtrainer computes the
    cross-entropy of its logits, whose last dimension is the class count."""

    def __init__(self, num_classes: int):
        self.embed = nnx.Embed(32, 8, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(8, num_classes, rngs=nnx.Rngs(1))

    def __call__(self, input_ids, attention_mask=None):
        return self.head(self.embed(input_ids).mean(axis=1))


@pytest.mark.parametrize("make", [_bert_classifier, LogitsOnly], ids=["bert", "logits-only"])
@pytest.mark.parametrize("bad", [5, 2, -1])
def test_out_of_range_class_labels_raise_naming_value_and_classes(tmp_path, bad, make):
    from jtrainer import Trainer

    rows = _rows([0, 1, 1, 0, 1, 0, bad, 1])
    trainer = Trainer(model=make(2), args=short_run_args(tmp_path, max_steps=2), train_dataset=rows)
    with pytest.raises(ValueError, match=rf"Label {bad} in column 'labels' is outside \[0, 2\)"):
        trainer.train()
    with pytest.raises(ValueError, match=rf"Label {bad} .*2 classes"):
        trainer.evaluate(rows)
    good = Trainer(model=make(2), args=short_run_args(tmp_path / "good", max_steps=2), train_dataset=rows[:6])
    assert good.train().training_loss > 0


def test_torch_refuses_them_too():
    torch = pytest.importorskip("torch")
    with pytest.raises((IndexError, RuntimeError)):
        torch.nn.functional.cross_entropy(torch.zeros(2, 2), torch.tensor([0, 5]))


def test_regression_labels_stay_float_and_train(tmp_path):
    from jtrainer import Trainer

    rows = _rows([0.25, -1.5, 3.0, 0.5, 2.25, -0.75, 1.0, 0.125])
    trainer = Trainer(model=_bert_classifier(1), args=short_run_args(tmp_path, max_steps=2), train_dataset=rows)
    assert np.isfinite(trainer.train().training_loss)


def test_cli_keeps_float_labels_for_one_label(tmp_path):
    from jtrainer.cli.tasks import DataArguments, ModelArguments, build_data

    with open(tmp_path / "train.json", "w") as f:
        f.write("\n".join(json.dumps({"sentence": f"row {i} text", "label": i / 4}) for i in range(8)))
    model_args = ModelArguments(task="sequence_classification", num_labels=1)
    data_args = DataArguments(
        dataset_name="",
        train_file=str(tmp_path / "train.json"),
        text_column="sentence",
        tokenizer_vocab_size=128,
        eval_fraction=0.25,
    )
    _, train, valid = build_data(model_args, data_args)
    labels = sorted(r["labels"] for r in train + valid)
    assert labels == [i / 4 for i in range(8)] and isinstance(labels[1], float)
