"""What HF scripts touch on a model, against torch transformers on the same weights: get_input_embeddings() /
get_output_embeddings() `.weight`, parameters() counted the torch way, resize_token_embeddings (tied heads stay
tied), generation_config and the generation_config.json that save_pretrained writes."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_llama_config

from jtrainer.models import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)


def _families():
    bert = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return {
        "llama": (transformers.LlamaForCausalLM, AutoModelForCausalLM, tiny_llama_config(tie_word_embeddings=False)),
        "llama-tied": (
            transformers.LlamaForCausalLM,
            AutoModelForCausalLM,
            tiny_llama_config(tie_word_embeddings=True),
        ),
        "gpt2": (
            transformers.GPT2LMHeadModel,
            AutoModelForCausalLM,
            transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32),
        ),
        "bert-mlm": (transformers.BertForMaskedLM, AutoModelForMaskedLM, transformers.BertConfig(**bert)),
        "bert-cls": (
            transformers.BertForSequenceClassification,
            AutoModelForSequenceClassification,
            transformers.BertConfig(**bert),
        ),
        "t5": (
            transformers.T5ForConditionalGeneration,
            AutoModelForSeq2SeqLM,
            transformers.T5Config(
                vocab_size=64,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                feed_forward_proj="gated-gelu",
                tie_word_embeddings=False,
                decoder_start_token_id=0,
            ),
        ),
    }


def _pair(tmp_path, name):
    torch_class, auto, config = _families()[name]
    torch.manual_seed(0)
    theirs = torch_class(config).eval()
    theirs.save_pretrained(tmp_path / "ref")
    return theirs, auto.from_pretrained(str(tmp_path / "ref"))


def _count(model):
    return sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())  # run_clm's line, verbatim


@pytest.mark.parametrize("name", list(_families()))
def test_embeddings_and_parameter_counts_are_torchs(tmp_path, name):
    theirs, ours = _pair(tmp_path, name)
    np.testing.assert_array_equal(
        np.asarray(ours.get_input_embeddings().weight), theirs.get_input_embeddings().weight.detach().numpy()
    )
    assert _count(ours) == _count(theirs) == ours.num_parameters()
    head = theirs.get_output_embeddings()
    if head is None:
        assert ours.get_output_embeddings() is None
    else:
        np.testing.assert_array_equal(np.asarray(ours.get_output_embeddings().weight), head.weight.detach().numpy())


@pytest.mark.parametrize("name", ["llama", "llama-tied", "gpt2", "bert-mlm", "t5"])
def test_resize_token_embeddings_as_transformers(tmp_path, name):
    theirs, ours = _pair(tmp_path, name)
    theirs.resize_token_embeddings(70, pad_to_multiple_of=8)
    ours.resize_token_embeddings(70, pad_to_multiple_of=8)
    assert ours.config.vocab_size == theirs.config.vocab_size == 72
    assert _count(ours) == _count(theirs)
    their_table = theirs.get_input_embeddings().weight.detach().numpy()
    our_table = np.asarray(ours.get_input_embeddings().weight)
    assert our_table.shape == their_table.shape == (72, 32)
    np.testing.assert_array_equal(our_table[:64], their_table[:64])  # old rows kept
    np.testing.assert_allclose(our_table[64:], their_table[64:], atol=1e-3)  # new rows: the old rows' mean
    if theirs.get_output_embeddings() is not None:
        their_head = theirs.get_output_embeddings().weight.detach().numpy()
        np.testing.assert_allclose(np.asarray(ours.get_output_embeddings().weight), their_head, atol=1e-3)
    ids = np.array([[5, 70, 71, 3]])  # the new tokens embed and are predicted
    with torch.no_grad():
        if name == "t5":
            expected = theirs(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(ids)).logits.numpy()
            got = ours(jnp.asarray(ids), decoder_input_ids=jnp.asarray(ids)).logits
        else:
            expected = theirs(torch.tensor(ids)).logits.numpy()
            got = ours(jnp.asarray(ids)).logits
    assert got.shape == expected.shape
    np.testing.assert_allclose(np.asarray(got), expected, atol=5e-3)
    assert ours.resize_token_embeddings(60).weight.shape == (60, 32)  # shrinking keeps the first rows
    np.testing.assert_array_equal(np.asarray(ours.get_input_embeddings().weight), their_table[:60])


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_save_pretrained_writes_transformers_generation_config(tmp_path, name):
    theirs, ours = _pair(tmp_path, name)
    ours.generation_config.max_length = 33  # a script's change persists and is saved
    theirs.generation_config.max_length = 33
    ours.save_pretrained(str(tmp_path / "ours"))
    theirs.save_pretrained(tmp_path / "theirs")

    def read(folder):
        saved = json.loads((folder / "generation_config.json").read_text())
        saved.pop("transformers_version", None)
        return saved

    assert read(tmp_path / "ours") == read(tmp_path / "theirs")
    assert not (tmp_path / "bert").exists()
