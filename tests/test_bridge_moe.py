"""More of transformers' mixture-of-experts families through the bridge, with their default experts
implementation (torch._grouped_mm, lowered to jax.lax.ragged_dot): loss and every gradient equal torch's
(Mixtral and Qwen3-MoE train side by side with transformers.Trainer in test_bridge_hf.py)."""

import importlib.util

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from conftest import bridged_loss_and_grads  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.02)


def _model(name):
    if name == "qwen2_moe":  # a shared expert beside the routed ones
        config = transformers.Qwen2MoeConfig(
            **SMALL, **AUX, intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        )  # fmt: skip
        return transformers.Qwen2MoeForCausalLM(config)
    if name == "olmoe":
        config = transformers.OlmoeConfig(**SMALL, **AUX, intermediate_size=24, num_experts=4, num_experts_per_tok=2)
        return transformers.OlmoeForCausalLM(config)
    if name == "gpt_oss":  # transposed expert weights with biases, attention sinks, a sliding window
        config = transformers.GptOssConfig(
            **SMALL, **AUX, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
        return transformers.GptOssForCausalLM(config)
    if name == "deepseek_v3":  # multi-head latent attention, grouped routing, a dense first layer
        config = transformers.DeepseekV3Config(
            **SMALL, intermediate_size=64, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        )  # fmt: skip
        return transformers.DeepseekV3ForCausalLM(config)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe", "gpt_oss", "deepseek_v3"])
def test_moe_family_traces_as_torch(name):
    torch.manual_seed(0)
    model = _model(name)
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    reference = model(input_ids=ids, labels=ids)
    reference.loss.backward()
    wanted = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    assert any("experts" in n for n in wanted)

    loss, got = bridged_loss_and_grads(model, input_ids=ids, labels=ids)
    np.testing.assert_allclose(loss, float(reference.loss), rtol=1e-6)
    for key, grad in wanted.items():
        np.testing.assert_allclose(got[key], grad, atol=1e-6, err_msg=key)


def test_router_logits_leave_rematerialised_layers():
    """With activation checkpointing, transformers' output hooks record each layer's router logits inside the
    rematerialised layer; they come out of jax.checkpoint with its outputs (they would leak its tracer), and the
    router loss and every gradient equal torch's."""
    from flax import nnx

    from jtrainer.bridge.module import TorchModel

    torch.manual_seed(0)
    model = _model("olmoe")
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = model(input_ids=ids, labels=ids)
    reference.loss.backward()
    wanted = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}

    bridged = TorchModel(model)
    assert bridged.gradient_checkpointing and not bridged.deterministic
    graphdef, params, rest = nnx.split(bridged, nnx.Param, ...)

    def loss_of(params):
        return nnx.merge(graphdef, params, rest)(input_ids=jax.numpy.asarray(ids.numpy()), labels=ids.numpy())["loss"]

    loss, grads = jax.jit(jax.value_and_grad(loss_of))(params)
    got = {".".join(map(str, path[1:])): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    np.testing.assert_allclose(float(loss), float(reference.loss), rtol=1e-6)
    for key, grad in wanted.items():
        np.testing.assert_allclose(got[key], grad, atol=1e-6, err_msg=key)
