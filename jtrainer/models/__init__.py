"""HF-compatible flax.nnx models: the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) and auto classes."""

from jtrainer.models.auto import AutoModelForCausalLM
from jtrainer.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

__all__ = ["AutoModelForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
