"""jtrainer.models.remat: the named rematerialisation policies keep what they say (jax's saved residuals), change
no value or gradient, and are refused in one line where a model names no values."""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_llama_config
from flax import nnx

POLICIES = [None, "full", "save_dots_except_mlp", "offload_dots_except_mlp", "dots_saveable"]


def _model(family: str):
    from transformers import GPT2Config

    from jtrainer.models import AutoModelForCausalLM

    config = tiny_llama_config() if family == "llama" else GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4)
    return AutoModelForCausalLM.from_config(config)


def _loss_function(model, policy):
    if policy is not None:
        model.gradient_checkpointing_enable({"policy": policy})
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 12)))

    def loss(params):
        return nnx.merge(graphdef, params, rest)(ids, labels=ids).loss

    return loss, params


def _saved_residuals(function, *args) -> str:
    """What autodiff keeps from the forward pass, as jax prints it (one line per residual, with its name)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(function, *args)
    return out.getvalue()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_policies_keep_what_they_name_and_change_no_gradient(family):
    reference = None
    for policy in POLICIES:
        loss, params = _loss_function(_model(family), policy)
        value, grads = jax.value_and_grad(loss)(params)
        if reference is None:
            reference = (value, grads)
        np.testing.assert_allclose(value, reference[0], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference[1])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        kept = _saved_residuals(loss, params)
        named = {name: f"named '{name}'" in kept for name in ("query_proj", "attention_context", "out_proj")}
        offloaded = kept.count("<host>")
        if policy == "save_dots_except_mlp":
            assert all(named.values()) and not offloaded, (policy, named)
        elif policy == "offload_dots_except_mlp":  # the same five values per layer, in host memory
            assert not any(named.values()) and offloaded == 5 * 2, kept
        elif policy == "full":
            assert not any(named.values()) and not offloaded, named


def test_named_policies_need_a_model_that_names_its_values():
    from transformers import BertConfig

    from jtrainer.models import AutoModelForSequenceClassification

    bert = AutoModelForSequenceClassification.from_config(
        BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    )
    with pytest.raises(ValueError, match=r"policy='save_dots_except_mlp' keeps values .* use 'full'"):
        bert.gradient_checkpointing_enable({"policy": "save_dots_except_mlp"})
    bert.gradient_checkpointing_enable({"policy": "full"})
    with pytest.raises(ValueError, match=r"neither one of \['full', .*jax.checkpoint_policies name"):
        _model("llama").gradient_checkpointing_enable({"policy": "save_it_all"})


def test_a_bridged_torch_model_takes_full_or_a_jax_policy():
    """torch's values carry no names: the named policies would keep nothing, so they are refused."""
    pytest.importorskip("torch")
    import transformers

    from jtrainer.bridge.module import TorchModel

    bridged = TorchModel(transformers.LlamaForCausalLM(tiny_llama_config()))
    with pytest.raises(ValueError, match=r"policy='offload_dots_except_mlp' keeps values"):
        bridged.gradient_checkpointing_enable({"policy": "offload_dots_except_mlp"})
    bridged.gradient_checkpointing_enable({"policy": "dots_saveable"})
    assert bridged.remat_policy == "dots_saveable"
