"""Auto classes: an HF folder's `config.json` `model_type` picks the jtrainer model, as transformers' do."""

from __future__ import annotations

from typing import Any

from flax import nnx
from transformers import AutoConfig

from jtrainer.models.bert import BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification
from jtrainer.models.gpt2 import GPT2LMHeadModel
from jtrainer.models.t5 import T5ForConditionalGeneration
from jtrainer.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

CAUSAL_LM_MODELS: dict[str, type] = {
    "gpt2": GPT2LMHeadModel,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


class _AutoModel:
    models: dict[str, type] = {}
    task = ""

    @classmethod
    def _model_class(cls, config) -> type:
        kind = getattr(config, "model_type", None)
        if kind not in cls.models:
            raise ValueError(
                f"{cls.__name__}: model_type {kind!r} has no jtrainer {cls.task} model; supported: "
                f"{', '.join(sorted(cls.models))}."
            )
        return cls.models[kind]

    @classmethod
    def from_config(cls, config, *, seed: int = 0, **kwargs: Any) -> nnx.Module:
        return cls._model_class(config)(config, rngs=nnx.Rngs(seed), **kwargs)

    @classmethod
    def from_pretrained(cls, directory: str, **kwargs: Any) -> nnx.Module:
        """A local HF folder (config.json + safetensors), or one on gs:// / s3:// (downloaded once). Takes
        dtype= and mesh=."""
        from jtrainer import storage

        directory = storage.fetched(directory)
        return cls._model_class(AutoConfig.from_pretrained(directory)).from_pretrained(directory, **kwargs)


class AutoModelForCausalLM(_AutoModel):
    models = CAUSAL_LM_MODELS
    task = "causal LM"


class AutoModelForMaskedLM(_AutoModel):
    models = {"bert": BertForMaskedLM}
    task = "masked LM"


class AutoModelForSequenceClassification(_AutoModel):
    models = {"bert": BertForSequenceClassification}
    task = "sequence classification"


class AutoModelForTokenClassification(_AutoModel):
    models = {"bert": BertForTokenClassification}
    task = "token classification"


class AutoModelForSeq2SeqLM(_AutoModel):
    models = {"t5": T5ForConditionalGeneration}
    task = "sequence-to-sequence LM"
