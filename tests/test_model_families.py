"""Llama-family members against PyTorch transformers: logits both ways, weights with no missing keys."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jtrainer.models.auto import AutoModelForCausalLM  # noqa: E402

BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _configs():
    import transformers

    return {
        "llama3_rope": transformers.LlamaConfig(
            **BASE,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "llama_linear_rope": transformers.LlamaConfig(
            **BASE, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        ),
        "mistral": transformers.MistralConfig(**BASE, sliding_window=4, head_dim=8),
        "qwen2": transformers.Qwen2Config(**BASE),
        "gpt2": transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "qwen3": transformers.Qwen3Config(**BASE, head_dim=8),
        "qwen3_sliding": transformers.Qwen3Config(
            **BASE,
            head_dim=8,
            sliding_window=3,
            use_sliding_window=True,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        ),
    }


@pytest.mark.parametrize("name", list(_configs()))
def test_family_member_matches_pytorch(tmp_path, name):
    import transformers

    config = _configs()[name]
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    for p in reference.parameters():  # biases and norms are zero/one at init: make them count
        p.data.add_(torch.randn_like(p) * 0.02)
    reference.save_pretrained(tmp_path / "torch")
    ids = np.random.RandomState(0).randint(0, 64, (2, 12))
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()

    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path / "torch"))
    assert type(ours).__name__ == type(reference).__name__
    got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).logits)
    assert np.abs(got - expected)[mask.astype(bool)].max() <= 1e-4

    ours.save_pretrained(str(tmp_path / "jax"))
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "jax"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "gpt2"])
def test_trainer_loss_falls_for_each_family(tmp_path, name):
    from conftest import token_rows

    from jtrainer import Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_config(_configs()[name])
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=8,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(8, length=12))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("family", ["gpt2", "bert", "t5", "llama3_rope"])
def test_gradient_checkpointing_changes_memory_not_results(tmp_path, family):
    import transformers
    from conftest import token_rows

    from jtrainer import Trainer, TrainingArguments
    from jtrainer.models import AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    if family == "bert":
        config = transformers.BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
        )
        make = lambda: AutoModelForMaskedLM.from_config(config)  # noqa: E731
    elif family == "t5":
        config = transformers.T5Config(
            vocab_size=64,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        make = lambda: AutoModelForSeq2SeqLM.from_config(config)  # noqa: E731
    else:
        make = lambda: AutoModelForCausalLM.from_config(_configs()[family])  # noqa: E731

    def losses(remat):
        args = TrainingArguments(
            str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=3,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            activation_checkpointing=remat,
            activation_checkpointing_kwargs={"policy": "dots_saveable"} if remat else None,
        )
        trainer = Trainer(model=make(), args=args, train_dataset=token_rows(8, length=12))
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer.model

    plain, _ = losses(False)
    rematted, model = losses(True)
    assert rematted == pytest.approx(plain, rel=1e-5)
    from flax import nnx

    flags = [n.remat_policy for _, n in nnx.iter_graph(model) if hasattr(n, "gradient_checkpointing")]
    assert flags and all(f == "dots_saveable" for f in flags)
