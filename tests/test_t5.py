"""T5 against PyTorch transformers: logits and loss both ways, no missing keys, a Trainer run."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jtrainer.models.auto import AutoModelForSeq2SeqLM  # noqa: E402


def _config(**kw):
    import transformers

    return transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
        pad_token_id=0,
        **kw,
    )


@pytest.mark.parametrize("kw", [{}, {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}])
def test_t5_matches_pytorch(tmp_path, kw):
    import transformers

    config = _config(**kw)
    torch.manual_seed(0)
    reference = transformers.T5ForConditionalGeneration(config).eval()
    for p in reference.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    reference.save_pretrained(tmp_path / "torch")
    rng = np.random.RandomState(0)
    ids = rng.randint(1, 64, (2, 12))
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    labels = rng.randint(1, 64, (2, 7))
    labels[0, 5:] = -100
    with torch.no_grad():
        expected = reference(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)
        )
    ours = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "torch"))
    got = ours(jnp.asarray(ids), jnp.asarray(mask), labels=jnp.asarray(labels))
    assert np.abs(np.asarray(got.logits) - expected.logits.numpy()).max() <= 1e-4
    assert float(got.loss) == pytest.approx(float(expected.loss), rel=1e-4)

    ours.save_pretrained(str(tmp_path / "jax"))
    _, info = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "jax"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_t5_trains(tmp_path):
    from jtrainer import Trainer, TrainingArguments

    rng = np.random.RandomState(0)
    rows = []
    for _ in range(16):
        src = rng.randint(1, 64, 8)
        rows.append({"input_ids": src, "attention_mask": np.ones(8, np.int64), "labels": src[::-1].copy()})
    model = AutoModelForSeq2SeqLM.from_config(_config())
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=20,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 0.5


def test_t5_greedy_matches_pytorch_generate(tmp_path):
    import transformers

    from jtrainer.models.generation import generate

    torch.manual_seed(0)
    reference = transformers.T5ForConditionalGeneration(_config()).eval()
    reference.save_pretrained(tmp_path)
    ids = np.random.RandomState(1).randint(2, 64, (2, 9))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=8, do_sample=False, eos_token_id=None
        ).numpy()
    ours = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path))
    got = generate(ours, ids, mask, max_new_tokens=8, eos_token_id=None)
    np.testing.assert_array_equal(got, expected)


def test_t5_beam_search_matches_pytorch_generate(tmp_path):
    import transformers

    from jtrainer.models.generation import generate

    torch.manual_seed(0)
    reference = transformers.T5ForConditionalGeneration(_config()).eval()
    reference.save_pretrained(tmp_path)
    ids = np.random.RandomState(1).randint(2, 64, (2, 9))
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor(ids), max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None
        ).numpy()
    ours = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path))
    np.testing.assert_array_equal(generate(ours, ids, max_new_tokens=6, num_beams=3, eos_token_id=None), expected)


def test_t5_decoder_cache_steps_equal_the_whole_decoder():
    """decode_step, one token at a time into the cache, gives decode's logits at every position (past the
    relative-position buckets' max distance too), and generation with the cache equals generation without."""
    from jtrainer.models import generation
    from jtrainer.models.t5 import T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_config(_config(), seed=3)
    rng = np.random.RandomState(2)
    ids, targets = jnp.asarray(rng.randint(2, 64, (2, 7))), jnp.asarray(rng.randint(2, 64, (2, 20)))
    mask = jnp.asarray([[1] * 7, [1] * 4 + [0] * 3])
    encoded = model.encode(ids, mask)
    whole = model.decode(targets, encoded, mask)
    cache = model.init_decoder_cache(encoded, 20)
    for i in range(20):
        logits, cache = model.decode_step(targets[:, i : i + 1], cache, i, mask)
        np.testing.assert_allclose(logits[:, 0], whole[:, i], rtol=1e-5, atol=1e-5)

    class Uncached(T5ForConditionalGeneration):
        init_decoder_cache = None  # generation falls back to the whole decoder per token

    plain = Uncached.from_config(_config(), seed=3)
    for settings in (dict(max_new_tokens=12), dict(max_new_tokens=12, num_beams=3, eos_token_id=5)):
        cached = generation.generate(model, np.asarray(ids), np.asarray(mask), **settings)
        uncached = generation.generate(plain, np.asarray(ids), np.asarray(mask), **settings)
        np.testing.assert_array_equal(cached, uncached)
