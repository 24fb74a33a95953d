"""Llama weights round trip with PyTorch transformers: logits, tied heads, sharded files and shape errors."""

import glob
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_llama_config

torch = pytest.importorskip("torch")

from jtrainer.models.llama import LlamaForCausalLM  # noqa: E402


@pytest.mark.parametrize("tied", [False, True])
def test_llama_round_trip_with_pytorch(tmp_path, tied):
    import transformers

    config = tiny_llama_config(tie_word_embeddings=tied, attention_bias=True)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "torch")
    ids = np.random.RandomState(0).randint(0, 64, (3, 10))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0  # a right-padded row
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()

    ours = LlamaForCausalLM.from_pretrained(str(tmp_path / "torch"))
    got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).logits)
    valid = mask.astype(bool)
    assert np.abs(got - expected)[valid].max() <= 1e-4

    ours.save_pretrained(str(tmp_path / "jax"))
    reloaded, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "jax"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        again = reloaded(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert np.abs(again - expected)[valid].max() <= 1e-5


def test_sharded_weights_and_shape_errors(tmp_path):
    from jtrainer.models import hf_io

    model = LlamaForCausalLM.from_config(tiny_llama_config())
    hf_io.save_pretrained(model, str(tmp_path / "sharded"), max_shard_size=20_000)
    assert os.path.exists(tmp_path / "sharded" / hf_io.WEIGHTS_INDEX_NAME)
    assert len(glob.glob(str(tmp_path / "sharded" / "model-*-of-*.safetensors"))) > 1
    again = LlamaForCausalLM.from_pretrained(str(tmp_path / "sharded"))
    ids = jnp.arange(8)[None]
    np.testing.assert_array_equal(np.asarray(again(ids).logits), np.asarray(model(ids).logits))
    other = LlamaForCausalLM.from_config(tiny_llama_config(hidden_size=48))
    with pytest.raises(ValueError, match=r"has shape \(32, 64\) .* has shape \(48, 64\)"):
        hf_io.load_weights(other, str(tmp_path / "sharded"))
