"""Host randomness as HF: seeded at construction, a random collator reproducible whatever the prefetching, its
generators saved in each checkpoint so a resumed run ends bit-identical to the uninterrupted one."""

import random

import numpy as np
import pytest

from jtrainer import Trainer, TrainingArguments
from jtrainer.core import host_rng


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, "[CLS]": 3, "[SEP]": 4}
    vocab.update({f"w{i}": 5 + i for i in range(27)})
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


def _rows(n, seed):
    rng = np.random.RandomState(seed)
    return [{"input_ids": rng.randint(5, 32, rng.randint(6, 12)).tolist()} for _ in range(n)]


def _bert_config(**over):
    from transformers import BertConfig

    kw = dict(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    return BertConfig(**kw, **over)


def _mlm_trainer(out, **over):
    from transformers import DataCollatorForLanguageModeling

    from jtrainer.models.bert import BertForMaskedLM

    tokenizer = _tokenizer()
    config = _bert_config()
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_steps=6,
        logging_steps=1,
        save_steps=3,
        eval_strategy="steps",
        eval_steps=3,
        per_device_eval_batch_size=4,
        report_to="none",
        disable_tqdm=True,
        seed=7,
        remove_unused_columns=False,
    )
    kw.update(over)
    return Trainer(
        model=BertForMaskedLM.from_config(config),
        args=TrainingArguments(**kw),
        train_dataset=_rows(24, 0),
        eval_dataset=_rows(8, 1),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=True, return_tensors="np"),
        processing_class=tokenizer,
    )


def _logs(trainer, key):
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


def test_trainer_construction_seeds_the_host_generators(tmp_path):
    host_rng.set_seed(7)
    expected = (random.random(), np.random.rand())
    np.random.seed(123)
    random.seed(123)
    _mlm_trainer(tmp_path)
    assert (random.random(), np.random.rand()) == expected


@pytest.mark.parametrize("prefetch", [3])  # deeper than the eval interval: the case that raced
def test_random_collator_runs_repeat_and_resume_bit_identical(tmp_path, prefetch):
    from jtrainer.models.hf_io import to_hf_state_dict

    first = _mlm_trainer(tmp_path / "a", prefetch_batches=prefetch)
    first.train()
    second = _mlm_trainer(tmp_path / "b", prefetch_batches=prefetch)
    second.train()
    assert _logs(first, "loss") == _logs(second, "loss")
    assert _logs(first, "eval_loss") == _logs(second, "eval_loss")
    assert len(set(v for _, v in _logs(first, "loss"))) > 1

    resumed = _mlm_trainer(tmp_path / "a", prefetch_batches=prefetch)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert _logs(resumed, "loss")[-3:] == _logs(first, "loss")[-3:]
    assert _logs(resumed, "eval_loss")[-1] == _logs(first, "eval_loss")[-1]
    final, again = to_hf_state_dict(first.model), to_hf_state_dict(resumed.model)
    for name in final:
        np.testing.assert_array_equal(again[name], final[name], err_msg=name)


def test_state_round_trips_through_json():
    import json

    host_rng.set_seed(3)
    saved = json.loads(json.dumps(host_rng.capture().to_json()))
    draws = (random.random(), np.random.rand())
    host_rng.restore(host_rng.HostRngState.from_json(saved))
    assert (random.random(), np.random.rand()) == draws


@pytest.mark.parametrize(
    "length",
    [
        dict(num_train_epochs=2),
        dict(max_steps=2, gradient_accumulation_steps=2),  # stopped mid-epoch: HF's loader had read the next
        # window's first batch ahead
        dict(max_steps=5, eval_strategy="steps", eval_steps=2),  # evaluations between steps draw too
        dict(num_train_epochs=2, eval_strategy="epoch", gradient_accumulation_steps=2),
    ],
    ids=["two-epochs", "mid-epoch-accumulating", "evaluating-steps", "evaluating-epochs"],
)
def test_a_torch_masking_collator_draws_transformers_masks(tmp_path, length):
    """run_mlm's collator (DataCollatorForLanguageModeling on torch's generator) gives the masks it gives under
    transformers.Trainer: each loader iterator first draws torch's int64 worker seed, batches are collated in
    order, and the evaluation after training draws on from where HF's one generator stands then (after its
    loader's one-batch look-ahead when training stops mid-epoch) (a model without dropout, the default shuffled
    order)."""
    torch = pytest.importorskip("torch")
    import transformers
    from transformers import DataCollatorForLanguageModeling

    from jtrainer.models.bert import BertForMaskedLM

    config = _bert_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "ref")
    kw = dict(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        **length,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=7,
    )
    results = {}
    for name, trainer_class, args_class, model_class in (
        ("hf", transformers.Trainer, transformers.TrainingArguments, transformers.BertForMaskedLM),
        ("jtrainer", Trainer, TrainingArguments, BertForMaskedLM),
    ):
        trainer = trainer_class(
            model=model_class.from_pretrained(str(tmp_path / "ref")),
            args=args_class(output_dir=str(tmp_path / name), **kw, **({"use_cpu": True} if name == "hf" else {})),
            train_dataset=_rows(24, 0),
            eval_dataset=_rows(8, 1),
            data_collator=DataCollatorForLanguageModeling(_tokenizer(), mlm=True),  # torch tensors, as run_mlm
        )
        trainer.train()
        results[name] = (_logs(trainer, "loss"), trainer.evaluate()["eval_loss"], _logs(trainer, "eval_loss"))
    (hf_losses, hf_eval, hf_during), (losses, eval_loss, during) = results["hf"], results["jtrainer"]
    assert [s for s, _ in during] == [s for s, _ in hf_during]
    np.testing.assert_allclose([v for _, v in during], [v for _, v in hf_during], rtol=2e-4)
    assert [s for s, _ in losses] == [s for s, _ in hf_losses]
    np.testing.assert_allclose([v for _, v in losses], [v for _, v in hf_losses], rtol=2e-4)
    np.testing.assert_allclose(eval_loss, hf_eval, rtol=2e-4)


def test_torch_imported_during_a_call_is_no_draw():
    """transformers' tensor checks import torch on first use (inside the first collator call of a native run):
    its generator appearing is not a random collator; a moved one is."""
    import dataclasses

    from jtrainer.core import host_rng

    now = host_rng.capture()
    without_torch = dataclasses.replace(now, torch=None)
    assert host_rng.same_state(without_torch, now) and host_rng.same_state(now, without_torch)
    if now.torch is not None:
        moved = dataclasses.replace(now, torch=bytes(reversed(now.torch)))
        assert not host_rng.same_state(now, moved)
