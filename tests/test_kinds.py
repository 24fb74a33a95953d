"""jtrainer.kinds: the one protocol the Trainer asks of a model, each kind in its own room (native nnx models,
torch models through the bridge), and `adopt`, the one place that tells them apart."""

import importlib.util

import jax
import numpy as np
import pytest
from conftest import tiny_llama_config

from jtrainer import kinds
from jtrainer.kinds import native
from jtrainer.kinds.protocol import ModelKind, TrainedModel


def _protocol_members(protocol) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_the_native_room_answers_every_question_of_the_protocol():
    from jtrainer.models import LlamaForCausalLM

    model = LlamaForCausalLM.from_config(tiny_llama_config())
    held = kinds.adopt(model)
    assert type(held) is native.NativeModel
    assert held.given is model and held.module is model
    assert _protocol_members(TrainedModel) <= set(dir(held))
    assert _protocol_members(ModelKind) <= set(dir(native.NativeModel))
    assert (held.user_code_in_torch_first, held.must_return_loss, held.decodes_in_compiled_step) == (
        False,
        False,
        True,
    )
    assert held.loss_ignores_padding and held.exports_from_train_state()
    names = kinds.decay_parameter_names(model)
    assert names and all("norm" not in name and "bias" not in name for name in names)
    assert set(names) < {name for name, _ in held.trainable_named_parameters()}  # the norms' weights are not
    with pytest.raises(TypeError, match="torch optimizer updates a torch model's parameters"):
        held.check_takes_translated_optimizer()


def test_a_native_model_that_is_not_jtrainers_is_not_known_to_ignore_padding():
    from flax import nnx

    class Own(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.ones((2, 2), np.float32))

    held = kinds.adopt(Own())
    assert not held.loss_ignores_padding and not held.exports_from_train_state()


@pytest.mark.skipif(importlib.util.find_spec("torchax") is None, reason="torchax is not installed")
def test_the_bridged_room_answers_every_question_and_writes_torch_once_per_train_state():
    import torch
    import transformers
    from flax import nnx

    from jtrainer.bridge.trained import BridgedModel

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    held = kinds.adopt(model)
    assert type(held) is BridgedModel and held.given is model and held.module is not model
    assert _protocol_members(TrainedModel) <= set(dir(held))
    assert _protocol_members(ModelKind) <= set(dir(BridgedModel))
    assert (held.user_code_in_torch_first, held.must_return_loss, held.decodes_in_compiled_step) == (True, True, False)
    assert not held.exports_from_train_state() and held.hf_tensors(keep=True) is None
    assert kinds.decay_parameter_names(model) == held.decay_parameter_names(model)
    assert held.decay_path("lm_head.weight") == "params.lm_head.weight"
    assert held.num_non_embedding_parameters() == model.num_parameters(exclude_embeddings=True)
    held.check_takes_translated_optimizer()  # a torch model takes one

    weight = model.lm_head.weight
    params = nnx.state(held.module, nnx.Param)
    nnx.update(held.module, jax.tree.map(lambda v: v + 1.0, params))
    first = (object(), False)
    held.publish(first)  # a new (train state, mode): the torch model takes the module's weights
    np.testing.assert_allclose(weight.detach().numpy(), np.asarray(held.module.params["lm_head"]["weight"][...]))
    with torch.no_grad():
        weight.zero_()
    held.publish(first)  # the same one again: nothing written (the torch model already holds it)
    assert not weight.detach().numpy().any()
    held.publish((first[0], True))  # the same state in the optimizer's evaluation mode: written again
    assert weight.detach().numpy().any()
