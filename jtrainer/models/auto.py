"""Auto classes: an HF folder's `config.json` `model_type` picks the jtrainer model, as transformers' do."""

from __future__ import annotations

from typing import Any

from flax import nnx
from transformers import AutoConfig

from jtrainer.models.bert import BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification
from jtrainer.models.gpt2 import GPT2LMHeadModel
from jtrainer.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from jtrainer.models.t5 import T5ForConditionalGeneration

CAUSAL_LM_MODELS: dict[str, type] = {
    "gpt2": GPT2LMHeadModel,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


class _AutoModel:
    models: dict[str, Any] = {}  # model_type -> a jtrainer model class (PretrainedMixin's constructors)
    task = ""

    @classmethod
    def _model_class(cls, config) -> Any:
        kind = getattr(config, "model_type", None)
        if kind not in cls.models:
            raise ValueError(
                f"{cls.__name__}: model_type {kind!r} has no jtrainer {cls.task} model; supported: "
                f"{', '.join(sorted(cls.models))}."
            )
        return cls.models[kind]

    @classmethod
    def from_config(cls, config, *, seed: int = 0, **kwargs: Any) -> nnx.Module:
        return cls._model_class(config).from_config(config, seed=seed, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *model_args, config=None, **kwargs: Any) -> nnx.Module:
        """transformers' AutoModel*.from_pretrained: the class from the config's `model_type` (`config=`, or the
        folder's config.json), then that class's from_pretrained with the same keywords (see
        `PretrainedMixin.from_pretrained`: local folders, gs:// / s3://, Hub ids, dtype=, mesh=, ...)."""
        from jtrainer.models import loading

        if config is None:
            hub = {k: kwargs[k] for k in loading.HUB_KEYWORDS if k in kwargs}
            config = AutoConfig.from_pretrained(loading.resolve_folder(pretrained_model_name_or_path, hub))
        return cls._model_class(config).from_pretrained(pretrained_model_name_or_path, config=config, **kwargs)


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
