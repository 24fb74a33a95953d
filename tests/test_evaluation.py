"""Evaluation, prediction, data sources, collators, custom models and errors raised before compiling."""

import numpy as np
import pytest
from conftest import Classifier, accuracy, class_rows, count_compiles, scratch_dir, tiny_llama_config, token_rows
from conftest import eval_args as _args
from flax import nnx

from jtrainer import Trainer
from jtrainer.models.llama import LlamaForCausalLM


def test_user_model_metrics_and_ragged_eval(tmp_path):
    train, val = class_rows(40), class_rows(10, seed=1)  # 10 rows / batch 4: the last eval batch is ragged
    trainer = Trainer(
        model=Classifier(nnx.Rngs(0)),
        args=_args(tmp_path, num_train_epochs=4, learning_rate=0.1),
        train_dataset=train,
        eval_dataset=val,
        compute_metrics=accuracy,
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] < before["eval_loss"]
    assert after["eval_accuracy"] > 0.8
    # Evaluating the rows one by one (no padding at all) gives the same metrics.
    trainer.args.per_device_eval_batch_size = 1
    single = trainer.evaluate()
    assert single["eval_loss"] == pytest.approx(after["eval_loss"], rel=1e-5)
    assert single["eval_accuracy"] == after["eval_accuracy"]
    pred = trainer.predict(val)
    assert pred.predictions.shape == (10, 3) and list(pred.label_ids) == [r["label"] for r in val]
    assert "test_loss" in pred.metrics and "test_accuracy" in pred.metrics


def test_eval_dict_prefixes_and_predict_pads_lengths(tmp_path):
    model = LlamaForCausalLM.from_config(tiny_llama_config())
    a, b = token_rows(5, length=8), token_rows(4, length=12, seed=3)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path),
        eval_dataset={"short": a, "long": b},
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    )
    metrics = trainer.evaluate()
    assert {"eval_short_loss", "eval_long_loss"} <= set(metrics)
    both = trainer.predict(a[:4] + b)  # batches of 8 then 12 tokens: padded with -100 across batches
    assert both.predictions.shape == (8, 12)
    assert (both.predictions[:4, 8:] == -100).all() and (both.predictions[:4, :8] >= 0).all()
    assert both.label_ids.shape == (8, 12) and (both.label_ids[:4, 8:] == -100).all()


def test_hf_datasets_iterable_and_tokenizer_padding(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = token_rows(12, length=8)
    ds = datasets.Dataset.from_list([{**r, "text": "unused"} for r in rows])
    model = LlamaForCausalLM.from_config(tiny_llama_config())
    out = Trainer(model=model, args=_args(tmp_path, max_steps=3), train_dataset=ds).train()
    assert out.global_step == 3
    iterable = datasets.IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ValueError, match="max_steps"):
        Trainer(model=model, args=_args(tmp_path), train_dataset=iterable).train()
    out = Trainer(model=model, args=_args(tmp_path, max_steps=5), train_dataset=iterable).train()
    assert out.global_step == 5


def test_group_by_length_and_seeded_order():
    from jtrainer.trainer.data import index_order

    lengths = list(np.random.RandomState(0).randint(1, 100, 300))
    a = index_order(300, seed=1, epoch=0, strategy="random", batch_size=4)
    assert np.array_equal(a, index_order(300, seed=1, epoch=0, strategy="random", batch_size=4))
    assert not np.array_equal(a, index_order(300, seed=1, epoch=1, strategy="random", batch_size=4))
    g = index_order(300, seed=1, epoch=0, strategy="group_by_length", batch_size=4, lengths=lengths)
    assert sorted(g) == list(range(300))
    # HF's mega-batches: min(300 // (4 * 4), 50) = 18 batches of 4, each sorted longest first (bar the swap that
    # moves the longest row of all to the front)
    assert lengths[g[0]] == max(lengths)
    for start in range(72, 300, 72):
        block = [lengths[i] for i in g[start : start + 72]]
        assert block[1:] == sorted(block[1:], reverse=True)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda m, r: Trainer(m, _args(scratch_dir(), eval_strategy="steps"), train_dataset=r), "eval_dataset"),
        (lambda m, r: Trainer(m, _args(scratch_dir()), train_dataset=[]).train(), "empty"),
        (
            lambda m, r: Trainer(
                m, _args(scratch_dir()), train_dataset=[{"input_ids": x["input_ids"]} for x in r]
            ).train(),
            "did not return a loss",
        ),
        (
            lambda m, r: Trainer(
                m, _args(scratch_dir()), train_dataset=r[:2] + [{"input_ids": r[2]["input_ids"]}] + r[3:]
            ).train(),
            "disagree on their columns",
        ),
        (
            lambda m, r: Trainer(m, _args(scratch_dir(), optim="galore_adamw"), train_dataset=r),
            "not supported by jtrainer",
        ),
    ],
)
def test_bad_input_is_named_before_compiling(make, message):
    model = LlamaForCausalLM.from_config(tiny_llama_config())
    with pytest.raises(ValueError, match=message):
        make(model, token_rows(8))


def test_callbacks_are_transformers_own():
    import transformers

    import jtrainer

    assert jtrainer.TrainerCallback is transformers.TrainerCallback
    assert jtrainer.TrainerState is transformers.TrainerState


def test_tokenizer_collators_with_varied_lengths(tmp_path):
    from transformers import DataCollatorForLanguageModeling

    from jtrainer.cli.tasks import train_tokenizer

    texts = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "import os\nprint(os.getcwd())\n"] * 10
    tokenizer = train_tokenizer(texts, vocab_size=300)
    rng = np.random.RandomState(0)
    rows = [{"input_ids": tokenizer(t)["input_ids"][: rng.randint(3, 20)]} for t in texts]
    model = LlamaForCausalLM.from_config(tiny_llama_config(vocab_size=len(tokenizer)))
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False, return_tensors="np")
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, num_train_epochs=2, remove_unused_columns=False),
        train_dataset=rows,
        data_collator=collator,
        processing_class=tokenizer,
    )
    with count_compiles() as compiles:
        trainer.train()
    # Lengths vary batch to batch; the padded length only grows by powers of two: few compilations.
    assert 1 <= len(compiles) <= 3
    # With only a tokenizer, HF's default collator (DataCollatorWithPadding) pads inputs of varied lengths.
    metrics = Trainer(
        model=model, args=_args(tmp_path, prediction_loss_only=True), processing_class=tokenizer, compute_loss_func=None
    ).predict([{"input_ids": r["input_ids"]} for r in rows[:6]])
    assert metrics.predictions is None


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_evaluation_leaves_the_model_in_its_mode(mode):
    from conftest import WithDropout, scratch_dir, short_run_args, token_rows

    from jtrainer import Trainer

    model = WithDropout(nnx.Rngs(0))
    getattr(model, mode)()
    trainer = Trainer(
        model=model, args=short_run_args(scratch_dir(), per_device_eval_batch_size=4), eval_dataset=token_rows(8)
    )
    trainer.evaluate()
    assert model.drop.deterministic is (mode == "eval")
