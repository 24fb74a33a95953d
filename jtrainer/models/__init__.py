"""HF-compatible flax.nnx models: the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3), GPT-2, and auto classes."""

from jtrainer.models.auto import AutoModelForCausalLM
from jtrainer.models.gpt2 import GPT2LMHeadModel
from jtrainer.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

__all__ = ["AutoModelForCausalLM", "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
