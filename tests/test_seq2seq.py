"""Seq2SeqTrainer: predict_with_generate equals transformers' Seq2SeqTrainer; trains T5 and causal LMs."""

import numpy as np
import pytest
from conftest import tiny_llama_config, token_rows, torch_rows

from jtrainer import Seq2SeqTrainer, Seq2SeqTrainingArguments
from jtrainer.models.auto import AutoModelForSeq2SeqLM
from jtrainer.models.llama import LlamaForCausalLM


def _t5_config(vocab=64, **kw):
    import transformers

    kw = {"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1, **kw}
    return transformers.T5Config(
        vocab_size=vocab,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        **kw,
    )


def _rows(n, seed=0):
    rng = np.random.RandomState(seed)
    return [
        {"input_ids": rng.randint(2, 64, 10), "attention_mask": np.ones(10, np.int64), "labels": rng.randint(2, 64, 6)}
        for _ in range(n)
    ]


def _args(out, **over):
    kw = dict(
        output_dir=str(out),
        per_device_eval_batch_size=4,
        per_device_train_batch_size=4,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        predict_with_generate=True,
        generation_max_length=8,
    )
    kw.update(over)
    return Seq2SeqTrainingArguments(**kw)


def test_seq2seq_arguments_are_hf_fields():
    import transformers

    ours = {f.name for f in __import__("dataclasses").fields(Seq2SeqTrainingArguments)}
    theirs = {f.name for f in __import__("dataclasses").fields(transformers.Seq2SeqTrainingArguments)}
    assert theirs <= ours
    args = Seq2SeqTrainingArguments("o", generation_num_beams=2, report_to="none")
    assert args.to_dict()["generation_num_beams"] == 2 and args.predict_with_generate is False


def _predict_both(tmp_path, rows, perturb=False):
    """transformers.Seq2SeqTrainer's predict_with_generate on a random tiny T5 (saved to tmp_path/t5) and the
    jtrainer Seq2SeqTrainer loading that folder: (HF's PredictionOutput, our trainer)."""
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    reference = transformers.T5ForConditionalGeneration(_t5_config()).eval()
    if perturb:
        for p in reference.parameters():
            p.data.add_(torch.randn_like(p) * 0.1)
    reference.save_pretrained(tmp_path / "t5")
    hf_args = transformers.Seq2SeqTrainingArguments(
        str(tmp_path / "hf"),
        per_device_eval_batch_size=4,
        report_to="none",
        predict_with_generate=True,
        generation_max_length=8,
        use_cpu=True,
        disable_tqdm=True,
    )
    expected = transformers.Seq2SeqTrainer(model=reference, args=hf_args).predict(torch_rows(rows))
    ours = Seq2SeqTrainer(
        model=AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "t5")), args=_args(tmp_path / "ours")
    )
    return expected, ours


def test_predict_with_generate_equals_transformers(tmp_path):
    # A short last batch (6 rows, batches of 4): Seq2SeqTrainer's plain gather counts its loss as a full batch's.
    rows = _rows(6)
    expected, ours = _predict_both(tmp_path, rows, perturb=True)
    got = ours.predict(rows)
    assert got.predictions.shape == expected.predictions.shape == (6, 20)  # padded to max_length 20, as HF
    np.testing.assert_array_equal(got.predictions, expected.predictions)
    np.testing.assert_array_equal(got.label_ids, expected.label_ids)
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-4)
    # gen_kwargs win over the arguments: 3 new tokens with 2 beams.
    beams = ours.predict(rows, max_new_tokens=3, num_beams=2)
    assert (beams.predictions[:, 4:] == 0).all() and beams.predictions.shape == (6, 20)


def test_t5_trains_and_compute_metrics_gets_decoded_text(tmp_path):
    from jtrainer.cli.tasks import train_tokenizer

    texts = ["copy these words", "short one", "a longer sentence to copy", "hello world"] * 4
    tokenizer = train_tokenizer(texts, vocab_size=300)
    config = _t5_config(
        vocab=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = AutoModelForSeq2SeqLM.from_config(config)
    rows = []
    for text in texts:
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(
            {"input_ids": np.asarray(ids), "attention_mask": np.ones(len(ids), np.int64), "labels": np.asarray(ids)}
        )
    decoded = []

    def compute_metrics(prediction):
        preds = np.where(prediction.predictions != -100, prediction.predictions, tokenizer.pad_token_id)
        labels = np.where(prediction.label_ids != -100, prediction.label_ids, tokenizer.pad_token_id)
        decoded.append(
            (
                tokenizer.batch_decode(preds, skip_special_tokens=True),
                tokenizer.batch_decode(labels, skip_special_tokens=True),
            )
        )
        return {"exact": float(np.mean([p == t for p, t in zip(*decoded[-1])]))}

    from transformers import DataCollatorForSeq2Seq

    trainer = Seq2SeqTrainer(
        model=model,
        args=_args(tmp_path, learning_rate=3e-3, max_steps=12, logging_steps=4, eval_strategy="steps", eval_steps=12),
        train_dataset=rows,
        eval_dataset=rows[:4],
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, return_tensors="np"),
        compute_metrics=compute_metrics,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    predictions, references = decoded[-1]
    assert len(predictions) == 4 and all(isinstance(p, str) for p in predictions)
    assert references[0] == "copy these words"
    assert "eval_exact" in trainer.state.log_history[-2]


def test_causal_lm_predict_with_generate_returns_prompt_and_new_tokens(tmp_path):
    model = LlamaForCausalLM.from_config(tiny_llama_config(pad_token_id=0, eos_token_id=None))
    rows = token_rows(5, length=6)
    rows[1]["attention_mask"][4:] = 0  # a shorter (right-padded) prompt in the batch
    out = Seq2SeqTrainer(model=model, args=_args(tmp_path)).predict(rows, max_new_tokens=3)
    assert out.predictions.shape[0] == 5 and out.predictions.shape[1] >= 20
    from jtrainer.models.generation import generate

    # Each row: its prompt left-aligned in the batch's prompt width (6), then what generate gives for that
    # prompt alone, then pad tokens up to HF's width.
    for i, length in ((0, 6), (1, 4)):
        prompt = rows[i]["input_ids"][:length]
        alone = generate(model, prompt[None], max_new_tokens=3)[0]
        np.testing.assert_array_equal(out.predictions[i][6 - length : 6], prompt)
        np.testing.assert_array_equal(out.predictions[i][6:9], alone[-3:])
        assert (out.predictions[i][9:] == 0).all()


def test_predict_with_generate_without_labels_equals_transformers(tmp_path):
    """Rows without labels (DataCollatorForSeq2Seq leaves `labels` None): HF generates and computes no loss."""
    rows = [{k: v for k, v in row.items() if k != "labels"} for row in _rows(6)]
    expected, ours = _predict_both(tmp_path, rows)
    got = ours.predict(rows)
    np.testing.assert_array_equal(got.predictions, expected.predictions)
    assert got.label_ids is None and expected.label_ids is None
    assert "test_loss" not in got.metrics and "test_loss" not in expected.metrics
