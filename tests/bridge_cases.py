"""The torch models and rows of the bridge's side-by-side tests (tests/test_bridge_hf.py, test_bridge.py,
test_bridge_peft.py): tiny transformers models built with torch, and the comparison of two runs' logs. Importing
it needs transformers (and torch, when a model is built)."""

import numpy as np
import transformers
from conftest import tiny_llama_config, token_rows

VOCAB = 64


def _padded_lm_rows(n, length=24, seed=0):
    """Causal-LM rows with right padding (attention_mask 0, labels -100) of uneven lengths."""
    rows = token_rows(n, length=length, vocab=VOCAB, seed=seed, ragged_labels=True)
    rng = np.random.RandomState(seed + 1)
    for row in rows:
        keep = rng.randint(length // 2, length + 1)
        row["attention_mask"][keep:] = 0
        row["labels"][keep:] = -100
    return rows


def _class_rows(n, labels_of, length=12, seed=0):
    rng = np.random.RandomState(seed)
    rows = []
    for _ in range(n):
        ids = rng.randint(1, VOCAB, length)
        mask = np.ones(length, np.int64)
        mask[rng.randint(length // 2, length + 1) :] = 0
        rows.append({"input_ids": ids, "attention_mask": mask, **labels_of(rng, length)})
    return rows


def _bert(cls, **over):
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **over,
    )
    return getattr(transformers, cls)(config)


def _causal(name):
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name == "llama":
        return transformers.LlamaForCausalLM(tiny_llama_config())
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small, **heads, head_dim=8))
    if name == "gemma3":  # a sliding window (8) shorter than the rows (24), right padding inside it
        config = transformers.Gemma3TextConfig(
            **small, **heads, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
        )
        return transformers.Gemma3ForCausalLM(config)
    if name == "phi3":
        config = transformers.Phi3Config(
            **small, **heads, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0, eos_token_id=2
        )
        return transformers.Phi3ForCausalLM(config)
    moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)
    if name == "mixtral":  # transformers' default experts implementation: torch._grouped_mm, plus the aux loss
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**small, **heads, num_local_experts=4, **moe))
    if name == "qwen3-moe":
        config = transformers.Qwen3MoeConfig(
            **small, **heads, head_dim=8, num_experts=4, moe_intermediate_size=24, decoder_sparse_step=1, **moe
        )
        return transformers.Qwen3MoeForCausalLM(config)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        return transformers.GPT2LMHeadModel(config)
    raise ValueError(name)


def _case(name):
    """(torch model, training rows) of each side-by-side case."""
    if name in ("llama", "qwen3", "gemma3", "phi3", "gpt2", "mixtral", "qwen3-moe"):
        return _causal(name), _padded_lm_rows(30)
    if name == "bert-sequence":
        return _bert("BertForSequenceClassification", num_labels=3), _class_rows(
            30, lambda rng, n: {"labels": np.int64(rng.randint(3))}
        )
    if name == "bert-token":
        return _bert("BertForTokenClassification", num_labels=5), _class_rows(
            30, lambda rng, n: {"labels": np.where(rng.rand(n) < 0.2, -100, rng.randint(5, size=n))}
        )
    if name == "bert-qa":

        def positions(rng, n):
            return {"start_positions": np.int64(rng.randint(n)), "end_positions": np.int64(rng.randint(n))}

        return _bert("BertForQuestionAnswering"), _class_rows(30, positions)
    if name == "bert-choice":
        rows = _class_rows(90, lambda rng, n: {})
        choices = [
            {
                "input_ids": np.stack([r["input_ids"] for r in rows[i : i + 3]]),
                "attention_mask": np.stack([r["attention_mask"] for r in rows[i : i + 3]]),
                "labels": np.int64(i % 3),
            }
            for i in range(0, 90, 3)
        ]
        return _bert("BertForMultipleChoice"), choices
    if name == "vit":
        config = transformers.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=4,
        )
        rng = np.random.RandomState(0)
        rows = [
            {"pixel_values": rng.randn(3, 16, 16).astype(np.float32), "labels": np.int64(rng.randint(4))}
            for _ in range(30)
        ]
        return transformers.ViTForImageClassification(config), rows
    if name == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        rows = _class_rows(30, lambda rng, n: {"labels": np.where(rng.rand(6) < 0.2, -100, rng.randint(2, VOCAB, 6))})
        return transformers.T5ForConditionalGeneration(config), rows
    if name == "whisper":
        config = transformers.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        )  # fmt: skip
        rng = np.random.RandomState(0)
        rows = [
            {
                "input_features": rng.randn(8, 32).astype(np.float32),
                "labels": np.where(rng.rand(6) < 0.2, -100, rng.randint(3, VOCAB, 6)),
            }
            for _ in range(30)
        ]
        return transformers.WhisperForConditionalGeneration(config), rows
    raise ValueError(name)


def assert_same_logs(hf, ours, steps: int) -> None:
    """jtrainer logged transformers.Trainer's steps: losses to 1e-5, gradient norms to 1e-4, rates to 1e-6."""
    hf_logs = [h for h in hf.state.log_history if "loss" in h]
    jt_logs = [h for h in ours.state.log_history if "loss" in h]
    assert [h["step"] for h in jt_logs] == [h["step"] for h in hf_logs] == list(range(1, steps + 1))
    for ref, got in zip(hf_logs, jt_logs):
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5, err_msg=f"loss at {ref['step']}")
        np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-4, err_msg=f"norm at {ref['step']}")
        np.testing.assert_allclose(got["learning_rate"], ref["learning_rate"], rtol=1e-6)
