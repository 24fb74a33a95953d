"""The bridge's causal-LM loss without whole logits (bridge/chunked_loss.py), beside torch eager: the loss and every
gradient equal transformers' own for Llama (tied and untied), GPT-2 and a LoRA on the LM head; models that change
the logits after the head (Gemma 2's soft-capping) or add to the loss (Mixtral's router loss) are run with whole
logits and still give torch's values; a Trainer's step needs less memory with it."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import short_run_args, tiny_llama_config, token_rows

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from jtrainer import Trainer  # noqa: E402
from jtrainer.bridge.module import TorchModel  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _model(name):
    torch.manual_seed(0)
    if name in ("llama", "llama tied"):
        return transformers.LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=name == "llama tied"))
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2))
    if name == "lora head":  # peft's adapter on lm_head itself, away from zero
        import peft

        config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
        return peft.get_peft_model(transformers.LlamaForCausalLM(tiny_llama_config()), config)
    if name == "gemma2 softcap":
        config = transformers.Gemma2Config(**SMALL, head_dim=8, intermediate_size=64, final_logit_softcapping=3.0)
        return transformers.Gemma2ForCausalLM(config)
    if name == "mixtral aux":
        config = transformers.MixtralConfig(
            **SMALL, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.05,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(config)
    raise ValueError(name)


def _inputs():
    rows = token_rows(3, length=13, ragged_labels=True, seed=4)
    return {k: np.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask", "labels")}


def _torch_loss_and_grads(model, inputs, num_items):
    model.eval()  # no dropout: the bridged call is deterministic
    model.zero_grad()
    kwargs = {k: torch.tensor(v) for k, v in inputs.items()}
    if num_items is not None:
        kwargs["num_items_in_batch"] = torch.tensor(num_items)
    loss = model(**kwargs).loss
    loss.backward()
    return loss.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _bridged_loss_only(model, inputs, num_items, chunk):
    bridged = TorchModel(model)
    bridged.deterministic = True
    bridged.loss_chunk_positions = chunk
    graphdef, params, rest = nnx.split(bridged, nnx.Param, ...)
    arrays = {k: jnp.asarray(v) for k, v in inputs.items()}
    if num_items is not None:
        arrays["num_items_in_batch"] = jnp.asarray(num_items)

    def loss_of(params):
        outputs = nnx.merge(graphdef, params, rest)(**arrays, skip_logits=True)
        return outputs["loss"], "logits" in outputs

    (loss, kept_logits), grads = jax.jit(jax.value_and_grad(loss_of, has_aux=True))(params)
    named = {".".join(map(str, path[1:])): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    return float(loss), named, bool(kept_logits), bridged.chunks_causal_lm_loss


@pytest.mark.parametrize(
    "name, chunked",
    [("llama", True), ("llama tied", True), ("gpt2", True), ("lora head", True),
     ("gemma2 softcap", False), ("mixtral aux", False)],
)  # fmt: skip
def test_loss_alone_equals_torch(name, chunked):
    model = _model(name)
    inputs = _inputs()
    for num_items, chunk in ((None, 4), (29, 5)):  # 13 positions: a ragged last chunk either way
        wanted_loss, wanted = _torch_loss_and_grads(model, inputs, num_items)
        loss, got, kept_logits, chunkable = _bridged_loss_only(model, inputs, num_items, chunk)
        assert kept_logits is not chunked  # the chunked path leaves no logits; the others ran with them
        assert chunkable is chunked  # their configs name what they do after the head
        np.testing.assert_allclose(loss, wanted_loss, rtol=2e-6)
        assert set(got) == set(wanted)
        for key, grad in wanted.items():
            np.testing.assert_allclose(got[key], grad, rtol=2e-4, atol=2e-6, err_msg=key)


def test_chunkable_models():
    from jtrainer.bridge.chunked_loss import chunkable

    assert chunkable(_model("llama")) and chunkable(_model("lora head"))
    assert not chunkable(_model("gemma2 softcap")) and not chunkable(_model("mixtral aux"))
    classifier = transformers.LlamaForSequenceClassification(tiny_llama_config(pad_token_id=0))
    assert not chunkable(classifier)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    )
    assert not chunkable(t5)  # labels make its decoder inputs

    class OwnLoss(transformers.LlamaForCausalLM):  # a forward of the user's: its loss may be anything
        def forward(self, input_ids=None, labels=None, **kwargs):
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)

    assert not chunkable(OwnLoss(tiny_llama_config()))


def test_a_model_found_to_change_its_logits_when_traced_runs_with_whole_logits():
    """A model whose config does not say it (Gemma 2 with soft-capping, told chunkable): its traced call returns
    other logits than the head's, so the call runs again with whole logits and gives torch's loss."""
    model = _model("gemma2 softcap")
    inputs = _inputs()
    wanted_loss, _ = _torch_loss_and_grads(model, inputs, None)
    bridged = TorchModel(model)
    bridged.deterministic = True
    bridged.chunks_causal_lm_loss, bridged.loss_chunk_positions = True, 4
    outputs = bridged(**{k: jnp.asarray(v) for k, v in inputs.items()}, skip_logits=True)
    assert "logits" in outputs
    np.testing.assert_allclose(float(outputs["loss"]), wanted_loss, rtol=2e-6)


def test_bridged_trainer_chunks_its_loss_and_needs_less_memory():
    """A bridged Llama with a 4k vocabulary trained by the Trainer: the default (chunks of 16 positions) and
    whole logits (loss_chunk_size 0) log the same losses; the compiled step holds less memory with chunks."""
    config = tiny_llama_config(vocab_size=4096, max_position_embeddings=128)
    rows = token_rows(8, length=128, vocab=4096, ragged_labels=True)
    runs = {}
    for size in (16, 0):
        torch.manual_seed(0)
        trainer = Trainer(
            transformers.LlamaForCausalLM(config),
            short_run_args(max_steps=2, per_device_train_batch_size=4, loss_chunk_size=size),
            train_dataset=rows,
        )
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        example = {k: np.stack([r[k] for r in rows[:4]]) for k in rows[0]}
        compiled = trainer.compile_train_step(example, num_training_steps=2)
        runs[size] = losses, compiled.memory_analysis().temp_size_in_bytes
    np.testing.assert_allclose(runs[16][0], runs[0][0], rtol=1e-5)
    whole_logits = 4 * 128 * 4096 * 4  # bytes of one step's float32 logits
    assert runs[0][1] - runs[16][1] > whole_logits, runs
