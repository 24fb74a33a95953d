"""Decoding with a KV cache: greedy equals PyTorch transformers' generate token for token; one compilation."""

import numpy as np
import pytest
from conftest import tiny_llama_config

torch = pytest.importorskip("torch")

from jtrainer.models import AutoModelForCausalLM  # noqa: E402
from jtrainer.models.generation import _decode, generate  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_matches_pytorch_generate(tmp_path, family):
    import transformers

    config = (
        tiny_llama_config()
        if family == "llama"
        else transformers.Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
        )
    )
    config.eos_token_id = None
    config.pad_token_id = 0
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(tmp_path)
    prompts = np.array([[0, 0, 5, 9, 17, 3], [11, 12, 13, 14, 15, 16]])  # the first is left-padded
    mask = (np.arange(6)[None] >= np.array([[2], [0]])).astype(np.int64)
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor(prompts), attention_mask=torch.tensor(mask), max_new_tokens=12, do_sample=False, pad_token_id=0
        ).numpy()
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    got = generate(ours, prompts, mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(got, expected)


def test_sampling_eos_padding_and_one_compile():
    from jtrainer.models import LlamaForCausalLM

    model = LlamaForCausalLM.from_config(tiny_llama_config())
    prompts = np.array([[3, 4, 5], [6, 7, 8]])
    before = _decode._cache_size()
    a = generate(model, prompts, max_new_tokens=10, do_sample=True, top_k=5, top_p=0.9, temperature=0.7, seed=1)
    b = generate(model, prompts, max_new_tokens=10, do_sample=True, top_k=5, top_p=0.9, temperature=0.7, seed=1)
    c = generate(model, prompts, max_new_tokens=10, do_sample=True, top_k=5, top_p=0.9, temperature=0.7, seed=2)
    assert _decode._cache_size() == before + 1  # same shapes and settings: compiled once
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.shape == (2, 13) and (a[:, :3] == prompts).all()
    greedy = generate(model, prompts, max_new_tokens=10)
    eos = int(greedy[0, 5])  # make the third generated token of row 0 an EOS: the rest of the row is padding
    stopped = generate(model, prompts, max_new_tokens=10, eos_token_id=eos, pad_token_id=63)
    first = int(np.argmax(stopped[0, 3:] == eos))
    assert (stopped[0, 3 + first + 1 :] == 63).all()
    with pytest.raises(ValueError, match="do_sample=False with num_beams"):
        generate(model, prompts, max_new_tokens=4, num_beams=2, do_sample=True)


def test_beam_search_matches_pytorch_generate(tmp_path):
    import transformers

    config = tiny_llama_config()
    config.eos_token_id = None
    config.pad_token_id = 0
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    prompts = np.array([[5, 9, 17, 3], [11, 12, 13, 14]])
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor(prompts), max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0
        ).numpy()
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    got = generate(ours, prompts, max_new_tokens=8, num_beams=3, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(got, generate(ours, prompts, max_new_tokens=8))  # beams found another sequence
