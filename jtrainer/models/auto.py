"""Auto classes: an HF folder's `config.json` `model_type` picks the jtrainer model, as transformers' do; where
jtrainer has no native model of that family (or task), transformers' own torch model, which the Trainer trains
through the torch bridge. Every transformers `AutoModel*` class has its jtrainer namesake (`auto_class`), so a
script that swapped its model imports runs whatever its task."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

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


logger = logging.getLogger(__name__)


class _AutoModel:
    models: dict[str, Any] = {}  # model_type -> a jtrainer model class (PretrainedMixin's constructors)
    task = ""

    @classmethod
    def _model_class(cls, config) -> Any:
        return cls.models.get(str(getattr(config, "model_type", "")))

    @classmethod
    def _torch_class(cls, config) -> Any:
        """transformers' own auto class of the same name, for a family (or task) with no native model."""
        kind = getattr(config, "model_type", None)
        native = f" (native: {', '.join(sorted(cls.models))})" if cls.models else ""
        if importlib.util.find_spec("torch") is None:
            raise ImportError(
                f"{cls.__name__}: model_type {kind!r} has no native jtrainer {cls.task} model{native}, and "
                f'transformers\' own needs torch: pip install "jtrainer[torch]" (or -e ".[torch]" in a clone).'
            )
        import transformers

        logger.info(
            "%s: model_type %r has no native jtrainer %s model%s: transformers' own torch model, trained through "
            "the torch bridge.",
            cls.__name__,
            kind,
            cls.task,
            native,
        )
        return getattr(transformers, cls.__name__)

    @classmethod
    def from_config(cls, config, *, seed: int | None = None, **kwargs: Any) -> Any:
        native = cls._model_class(config)
        if native is None:
            return cls._torch_class(config).from_config(config, **kwargs)
        return native.from_config(config, seed=0 if seed is None else seed, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *model_args, config=None, **kwargs: Any) -> Any:
        """transformers' AutoModel*.from_pretrained: the class from the config's `model_type` (`config=`, or the
        folder's config.json), then that class's from_pretrained with the same keywords (see
        `PretrainedMixin.from_pretrained`: local folders, gs:// / s3://, Hub ids, dtype=, mesh=, ...); a family
        without a native model: transformers' own `from_pretrained`, with every argument as given."""
        from jtrainer.models import loading

        given = config
        if config is None:
            hub = {k: kwargs[k] for k in loading.HUB_KEYWORDS if k in kwargs}
            config = loading.read_config(loading.resolve_folder(pretrained_model_name_or_path, hub))
        native = cls._model_class(config)
        if native is None:
            torch_class = cls._torch_class(config)
            return torch_class.from_pretrained(pretrained_model_name_or_path, *model_args, config=given, **kwargs)
        return native.from_pretrained(pretrained_model_name_or_path, config=config, **kwargs)


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


# Every auto class by name: the native ones, then those `auto_class` makes (one class per name).
_AUTO_CLASSES: dict[str, type[_AutoModel]] = {
    c.__name__: c
    for c in (
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoModelForSeq2SeqLM,
    )
}


def auto_class(name: str) -> type[_AutoModel]:
    """jtrainer's `name` auto class (transformers' `AutoModel*` name): the native one, or one that loads
    transformers' own models of every family (`AutoModelForQuestionAnswering`, `AutoModelForImageClassification`,
    ...)."""
    if name in _AUTO_CLASSES:
        return _AUTO_CLASSES[name]
    if not name.startswith("AutoModel") or not _transformers_has(name):
        raise AttributeError(name)
    task = name.removeprefix("AutoModel").removeprefix("For") or "base"
    made = type(name, (_AutoModel,), {"models": {}, "task": task, "__module__": "jtrainer.models"})
    _AUTO_CLASSES[name] = made
    return made


def _transformers_has(name: str) -> bool:
    import transformers.models.auto.modeling_auto as modeling_auto

    return isinstance(getattr(modeling_auto, name, None), type)
