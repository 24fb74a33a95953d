"""Tiny models, a tokenizer with a chat template and datasets for the side-by-side runs of TRL's trainers (TRL on
torch vs jtrainer.trl), all built locally."""

from __future__ import annotations

import copy

import numpy as np

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
ROLES = ["user", "assistant", "system"]

# ChatML with generation markers around the assistant's content and end-of-turn (assistant_only_loss).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + ["<unk>"] + ROLES + WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def torch_llama(seed: int = 0, **overrides):
    """A tiny transformers Llama (vocabulary 64), the same weights for every seed's call."""
    import torch
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch.manual_seed(seed)
    config = tiny_llama_config(vocab_size=64, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, **overrides)
    return LlamaForCausalLM(config).eval()


def torch_mixtral(seed: int = 0):
    """A tiny transformers Mixtral (4 experts, 2 a token, router aux loss coefficient 0.05; vocabulary 64)."""
    import torch

    from tests.bridge_cases import _causal

    torch.manual_seed(seed)
    return _causal("mixtral").eval()


def twin(model):
    return copy.deepcopy(model)


def _sentence(rng, low, high) -> str:
    return " ".join(rng.choice(WORDS, rng.randint(low, high)))


def text_rows(n: int = 12, seed: int = 0) -> list[dict]:
    rng = np.random.RandomState(seed)
    return [{"text": _sentence(rng, 3, 14)} for _ in range(n)]


def prompt_completion_rows(n: int = 12, seed: int = 1) -> list[dict]:
    rng = np.random.RandomState(seed)
    return [{"prompt": _sentence(rng, 2, 8), "completion": " " + _sentence(rng, 2, 8)} for _ in range(n)]


def conversation_rows(n: int = 12, seed: int = 2) -> list[dict]:
    rng = np.random.RandomState(seed)
    return [
        {
            "messages": [
                {"role": "user", "content": _sentence(rng, 2, 7)},
                {"role": "assistant", "content": _sentence(rng, 2, 7)},
            ]
        }
        for _ in range(n)
    ]


def preference_rows(n: int = 12, seed: int = 3) -> list[dict]:
    rng = np.random.RandomState(seed)
    return [
        {"prompt": _sentence(rng, 2, 6), "chosen": " " + _sentence(rng, 2, 6), "rejected": " " + _sentence(rng, 2, 6)}
        for _ in range(n)
    ]


def config_fields(out, **over) -> dict:
    """Arguments of the side-by-side runs (fp32: TRL defaults to bf16)."""
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        max_steps=3,
        logging_steps=1,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        train_sampling_strategy="sequential",
        use_cpu=True,
        seed=0,
    )
    kw.update(over)
    return kw


def train_logs(history: list[dict]) -> list[dict]:
    return [entry for entry in history if "loss" in entry]


def assert_logs_match(ours: list[dict], theirs: list[dict], keys, rel=1e-4, grad_rel=1e-3):
    ours, theirs = train_logs(ours), train_logs(theirs)
    assert len(ours) == len(theirs) and ours, (ours, theirs)
    for mine, ref in zip(ours, theirs, strict=True):
        for key in keys:
            assert key in mine, (key, mine)
            tolerance = grad_rel if key == "grad_norm" else rel
            assert np.isclose(mine[key], ref[key], rtol=tolerance, atol=1e-6), (key, mine, ref)
