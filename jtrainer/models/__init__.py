"""HF-compatible flax.nnx models: the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3), GPT-2, BERT, T5, and auto
classes: every transformers `AutoModel*` name, native where jtrainer has the family, else transformers' own torch
model (trained through the bridge)."""

from jtrainer.models.auto import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    auto_class,
)
from jtrainer.models.bert import BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification
from jtrainer.models.gpt2 import GPT2LMHeadModel
from jtrainer.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from jtrainer.models.t5 import T5ForConditionalGeneration

__all__ = [
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "T5ForConditionalGeneration",
]


def __getattr__(name: str):
    """transformers' other auto classes (AutoModelForQuestionAnswering, ...): see `jtrainer.models.auto`."""
    try:
        return auto_class(name)
    except AttributeError:
        raise AttributeError(f"module 'jtrainer.models' has no attribute {name!r}") from None
