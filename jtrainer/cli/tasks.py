"""What a `jtrainer train` / `jtrainer check` config describes: the task, the model and the data.

Tasks: `causal_lm` (text -> blocks of tokens), `sequence_classification` (text [+ pair] -> label) and `seq2seq`
(source text -> target text). The model is a local HF folder (`model_name_or_path`) or a fresh one of
`model_type` (llama, mistral, qwen2, qwen3, gpt2, bert, t5) sized by the common fields below, which are mapped onto
each family's config names. The data is text files (the default: Python's standard library source), or a
`datasets` dataset: a hub name or a local folder (`dataset_name`), or json/csv files (`train_file`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jtrainer.core import storage
from jtrainer.core.errors import BadInput

logger = logging.getLogger(__name__)

TASKS = ("causal_lm", "sequence_classification", "seq2seq")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # one model (jtrainer.models.llama), GQA, scan_layers
MODEL_TYPES = (*LLAMA_FAMILY, "gpt2", "bert", "t5")


@dataclass
class ModelArguments:
    """The model: a local HF folder to fine-tune, or a fresh model of `model_type` and this size."""

    task: str = field(default="causal_lm", metadata={"help": "causal_lm | sequence_classification | seq2seq."})
    trainer: str = field(
        default="trainer",
        metadata={
            "help": "trainer (HF's Trainer), or TRL's sft / dpo (needs jtrainer[trl]): a pretrained causal LM "
            "fine-tuned on train_file's text / prompt-completion / messages rows (sft) or prompt / chosen / "
            "rejected rows (dpo); the training fields are then SFTConfig's / DPOConfig's.",
            "choices": ["trainer", "sft", "dpo"],
        },
    )
    model_name_or_path: str | None = field(default=None, metadata={"help": "Local folder with config.json + weights."})
    model_type: str = field(default="llama", metadata={"help": "Family of a fresh model: llama, gpt2, bert, t5, ..."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Local tokenizer folder (default: trained)."})
    hidden_size: int = field(default=128, metadata={"help": "Width of a fresh model."})
    intermediate_size: int = field(default=384, metadata={"help": "MLP width of a fresh model."})
    num_hidden_layers: int = field(default=4, metadata={"help": "Layers of a fresh model (T5: per stack)."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads of a fresh model."})
    num_key_value_heads: int = field(default=2, metadata={"help": "Key/value heads (GQA) of a fresh Llama."})
    head_dim: int | None = field(
        default=None,
        metadata={
            "help": "Width of one attention head of a fresh model (T5's d_kv; Llama's head_dim); unset: "
            "hidden_size / num_attention_heads, which must then divide."
        },
    )
    max_position_embeddings: int = field(default=2048, metadata={"help": "Positions of a fresh model."})
    num_labels: int = field(default=2, metadata={"help": "Classes (sequence_classification)."})
    scan_layers: bool = field(
        default=False,
        metadata={"help": "Llama family: run the decoder layers as one scan (compile time independent of depth)."},
    )
    bridge: bool = field(
        default=False,
        metadata={
            "help": "Train transformers' own PyTorch model (any model_type transformers has) through the torch "
            "bridge instead of jtrainer's native family (needs jtrainer[torch])."
        },
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "A fresh bridged model's other config fields, as HF's run_clm: "
            '"num_experts=4,num_experts_per_tok=2".'
        },
    )
    # peft LoRA on a bridge model, with TRL's names for the same options.
    use_peft: bool = field(
        default=False,
        metadata={
            "help": "Train a peft LoRA adapter on the (bridge) model, its base weights frozen (needs jtrainer[peft])."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (use_peft)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator: updates scaled by alpha / r."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on LoRA's input (use_peft)."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Module names LoRA adapts (e.g. q_proj v_proj, or all-linear); unset: peft's per model."},
    )


@dataclass
class DataArguments:
    """The data: text files (default: the stdlib source), or a `datasets` dataset."""

    text_dir: str | None = field(default=None, metadata={"help": "Folder of *.py/*.txt files; unset: the stdlib."})
    dataset_name: str | None = field(default=None, metadata={"help": "datasets name or local folder."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "A json/jsonl/csv training file."})
    validation_file: str | None = field(default=None, metadata={"help": "A json/jsonl/csv validation file."})
    text_column: str = field(default="text", metadata={"help": "Input text column."})
    text_pair_column: str | None = field(default=None, metadata={"help": "Second text (sentence pairs)."})
    label_column: str = field(default="label", metadata={"help": "Class label column (sequence_classification)."})
    target_column: str = field(default="summary", metadata={"help": "Target text column (seq2seq)."})
    source_prefix: str = field(default="", metadata={"help": "Prefix of every source text (T5: 'summarize: ')."})
    max_target_length: int = field(default=128, metadata={"help": "Target tokens kept (seq2seq)."})
    max_chars: int = field(default=3_000_000, metadata={"help": "Characters of text to read at most."})
    tokenizer_vocab_size: int = field(
        default=2048,
        metadata={"help": "Vocabulary of the BPE tokenizer trained (at least its 256 bytes and 2 special tokens)."},
    )
    block_size: int = field(default=128, metadata={"help": "Tokens per row (inputs are cut to this length)."})
    eval_fraction: float = field(default=0.05, metadata={"help": "Share held out when there is no validation split."})
    sample_prompt: str = field(default="def ", metadata={"help": "Prompt of the generated sample (causal_lm)."})
    sample_tokens: int = field(
        default=48, metadata={"help": "Tokens to generate for the sample (causal_lm; 0: no sample)."}
    )


def check_task(model_args: ModelArguments) -> None:
    if model_args.task not in TASKS:
        raise BadInput(f"task={model_args.task!r}: use one of {', '.join(TASKS)}.")


def check_job(model_args: ModelArguments, data_args: DataArguments, training_args) -> None:
    """Refuse, naming the field or file and the fix, what would fail only after the data is read, the tokenizer
    trained or the step compiled (`jtrainer train`: the run's checks, then its data and files)."""
    check_task(model_args)
    m, d = model_args, data_args
    for name, path in (
        ("output_dir", training_args.output_dir),
        *((name, getattr(m, name)) for name in ("model_name_or_path", "tokenizer_name")),
        *((name, getattr(d, name)) for name in ("text_dir", "dataset_name", "train_file", "validation_file")),
    ):
        storage.check_reachable(path or "", name)
    check_run(model_args, data_args, training_args)
    check_data(data_args, model_args.task)
    if training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise BadInput("max_steps and num_train_epochs are both 0: nothing would be trained; set one above 0.")


def check_run(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args,
    devices: int | None = None,
    sizing: bool = False,
) -> None:
    """What `jtrainer train` and `jtrainer check` both refuse before any work (one path, so they cannot drift):
    the task, the model (a folder or a fresh one's size), the step's settings, and the mesh over `devices` (here,
    or a target's) with the row length. `sizing` (check): a model folder needs no weights or tokenizer."""
    check_task(model_args)
    folder_config = _check_model(model_args, sizing)
    check_data_sizes(data_args)
    check_mesh(training_args, devices, data_args.block_size)
    _check_step_settings(model_args, training_args, folder_config)
    _check_best_metric(model_args.task, training_args.metric_for_best_model)
    if model_args.bridge:
        _check_bridged_model(model_args, _model_config(model_args, data_args.tokenizer_vocab_size, None, warn=False))
    limit, source = _position_limit(model_args, folder_config)
    if limit is not None and data_args.block_size > limit:
        raise BadInput(
            f"block_size={data_args.block_size} exceeds the model's {limit} positions ({source}): lower --block_size."
        )


def _check_bridged_model(model_args: ModelArguments, config) -> None:
    """A transformers model's mixture of experts routes each token to at most every expert; LoRA's target
    modules must be the model's."""
    top_k = getattr(config, "num_experts_per_tok", None)
    experts = getattr(config, "num_local_experts", getattr(config, "num_experts", None))
    if isinstance(top_k, int) and isinstance(experts, int) and top_k > experts:
        where = model_args.model_name_or_path or "config_overrides"
        raise BadInput(
            f"num_experts_per_tok={top_k} exceeds the {experts} experts ({where}): each token is routed to at most "
            "every expert; lower num_experts_per_tok or add experts (num_local_experts / num_experts)."
        )
    targets = model_args.lora_target_modules
    if model_args.use_peft and targets and targets != ["all-linear"]:
        from jtrainer.bridge import torch_models

        torch_models.check_lora_targets(model_args.task, config, torch_models.lora_config(model_args))


def _check_best_metric(task: str, name: str | None) -> None:
    """metric_for_best_model must be a metric the command's evaluation reports (HF raises at the first save
    after an evaluation otherwise)."""
    if name is None:
        return
    reported = ["loss", *(["accuracy"] if task == "sequence_classification" else [])]
    if name.removeprefix("eval_") not in reported:
        listed = ", ".join(f"eval_{metric}" for metric in reported)
        raise BadInput(
            f"metric_for_best_model={name!r}: the {task} job's evaluation reports {listed}; name one of those."
        )


def _check_step_settings(model_args: ModelArguments, training_args, folder_config: dict | None) -> None:
    """The attention implementation asked for (JTRAINER_ATTENTION) and the remat policy: refused in one line here,
    not at the step's first trace."""
    from jtrainer.models import remat
    from jtrainer.models.kernels import attention

    try:
        attention.requested_implementation()
        if training_args.activation_checkpointing:
            policy = (training_args.activation_checkpointing_kwargs or {}).get("policy")
            family = (folder_config or {}).get("model_type", model_args.model_type)
            remat.check(policy, names_activations=not model_args.bridge and family in (*LLAMA_FAMILY, "gpt2"))
    except ValueError as e:
        raise BadInput(str(e)) from None


def _check_model(model_args: ModelArguments, sizing: bool = False) -> dict | None:
    """The model fields checked; returns the config.json of `model_name_or_path` (None for a fresh model)."""
    m = model_args
    if m.num_labels < 1:
        raise BadInput(f"num_labels={m.num_labels}: a classifier needs at least 1 label (1: regression).")
    for name in ("model_name_or_path", "tokenizer_name"):
        path = getattr(m, name)
        if path and not storage.isdir(path):
            raise BadInput(
                f"{name}={path!r} is not a folder: give an HF model folder (config.json + weights), local "
                "or on gs:// / s3://."
            )
    if m.tokenizer_name and not _has_tokenizer(m.tokenizer_name):
        raise BadInput(
            f"tokenizer_name={m.tokenizer_name!r} holds no tokenizer (tokenizer.json or tokenizer_config.json): "
            "save one there with tokenizer.save_pretrained."
        )
    if m.config_overrides and (m.model_name_or_path or not m.bridge):
        raise BadInput(
            "config_overrides: it sets fields of a fresh transformers model (bridge: true, no model_name_or_path); "
            "jtrainer's native families take the size fields only."
        )
    if m.bridge:
        _check_bridge(m)
    elif m.use_peft:
        raise BadInput("use_peft: LoRA adapters train on transformers' own models: set bridge: true as well.")
    if m.model_name_or_path:
        return check_model_folder(
            m.model_name_or_path,
            tokenizer_elsewhere=bool(m.tokenizer_name),
            task=m.task,
            bridge=m.bridge,
            sizing=sizing,
        )
    if m.bridge:
        _at_least(m, 1, *_SIZE_FIELDS)
        return None
    if m.model_type not in MODEL_TYPES:
        raise BadInput(f"model_type={m.model_type!r}: use one of {', '.join(MODEL_TYPES)}.")
    check_fresh_model(m)
    return None


def check_data_sizes(data_args: DataArguments) -> None:
    _at_least(data_args, 1, "block_size", "max_chars", "max_target_length")
    _at_least(data_args, 0, "sample_tokens")


def check_data(data_args: DataArguments, task: str) -> None:
    d = data_args
    check_data_sizes(d)
    if not 0 < d.eval_fraction < 1:
        raise BadInput(f"eval_fraction={d.eval_fraction}: the share held out must lie between 0 and 1.")
    if task == "causal_lm" and not (d.dataset_name or d.train_file):
        if d.text_dir is not None and not storage.isdir(d.text_dir):
            raise BadInput(f"text_dir={d.text_dir!r} is not a folder of .py/.txt files.")
    for name in ("train_file", "validation_file"):
        path = getattr(d, name)
        if path is None:
            continue
        if not storage.isfile(path):
            raise BadInput(f"{name}={path!r} not found.")
        with storage.open_file(path, "rb") as f:
            if not f.read(1 << 16).strip():
                raise BadInput(f"{name}={path!r} is empty: it needs at least one row.")
        check_utf8(name, path)


def check_utf8(name: str, path: str) -> None:
    """A json/csv data file must be UTF-8 text (pyarrow's reader fails on other bytes without naming the file)."""
    with storage.open_file(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadInput(
                    f"{name}={path!r}: line {number} is not UTF-8 ({e.reason} at byte {e.start}): save the file "
                    "as UTF-8."
                ) from None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _has_tokenizer(folder: str) -> bool:
    return any(storage.isfile(storage.join(folder, name)) for name in _TOKENIZER_FILES)


def read_model_config(folder: str) -> dict:
    """A model folder's config.json as a dict, refused naming the file when it is missing or not JSON."""
    config_file = storage.join(folder, "config.json")
    if not storage.isfile(config_file):
        raise BadInput(
            f"model_name_or_path={folder!r} has no config.json: give a folder saved by save_pretrained "
            "(config.json + model.safetensors)."
        )
    try:
        config = json.loads(storage.read_text(config_file))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{config_file} is not valid JSON ({e}): repair or re-save the model.") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise BadInput(f"{config_file} has no model_type: re-save the model with save_pretrained.")
    return config


def _check_bridge(model_args: ModelArguments) -> None:
    """bridge: torch and torchax installed; a fresh model's model_type one transformers has."""
    from transformers import CONFIG_MAPPING

    from jtrainer import bridge

    try:
        bridge.check_installed()
    except ImportError as error:
        raise BadInput(f"bridge: {error}") from None
    if model_args.use_peft and importlib.util.find_spec("peft") is None:
        raise BadInput('use_peft: peft is not installed: pip install "jtrainer[peft]".')
    if model_args.use_peft and model_args.lora_r < 1:
        raise BadInput(f"lora_r={model_args.lora_r}: a LoRA rank is at least 1.")
    if not model_args.model_name_or_path and model_args.model_type not in CONFIG_MAPPING:
        raise BadInput(f"model_type={model_args.model_type!r} is not a transformers model type (bridge: true).")
    if model_args.scan_layers:
        raise BadInput(
            "scan_layers: transformers' own models (bridge: true) run their layers as their code does, one by one; "
            "set scan_layers false (jtrainer's native Llama family scans its layers)."
        )


def check_model_folder(
    folder: str, tokenizer_elsewhere: bool = False, task: str = "causal_lm", bridge: bool = False, sizing: bool = False
) -> dict:
    """What a model folder must hold for the job: a config of a family jtrainer has for the task (any
    transformers family with `bridge`; no custom code), safetensors weights and, unless tokenizer_name is set, a
    tokenizer (neither for `sizing`: `jtrainer check` reads the config only). Returns its config.json."""
    from jtrainer.models.hf_io import WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    config = read_model_config(folder)
    families = auto_class(task).models
    if not bridge and config["model_type"] not in families:
        raise BadInput(
            f"model_name_or_path={folder!r} is a {config['model_type']!r} model, which jtrainer has no native "
            f"{task} model for: set bridge: true (--bridge true) to train transformers' own through the torch bridge "
            f'(pip install -e ".[torch]"), or use one of {", ".join(sorted(families))} (or set --task).'
        )
    if config.get("auto_map"):
        raise BadInput(
            f"model_name_or_path={folder!r}: its config.json names custom code (auto_map), which jtrainer does not "
            f"run; use a model of a family jtrainer has ({', '.join(MODEL_TYPES)})."
        )
    if sizing:
        return config
    if not any(storage.isfile(storage.join(folder, name)) for name in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        raise BadInput(
            f"model_name_or_path={folder!r} has no {WEIGHTS_NAME} (or {WEIGHTS_INDEX_NAME}): save the model "
            "with save_pretrained (safetensors) there."
        )
    if not tokenizer_elsewhere and not _has_tokenizer(folder):
        raise BadInput(
            f"model_name_or_path={folder!r} holds no tokenizer (tokenizer.json or tokenizer_config.json): save "
            "the tokenizer there, or set tokenizer_name."
        )
    return config


_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


def _at_least(arguments, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(arguments, name)
        if value < minimum:
            raise BadInput(f"{name}={value}: it must be at least {minimum}.")


def check_fresh_model(model_args: ModelArguments) -> None:
    """A fresh model's size fields must build the model they describe: positive sizes, key/value heads that
    divide the heads (Llama family), a head width that divides (see `head_dim`)."""
    m = model_args
    _at_least(m, 1, *_SIZE_FIELDS)
    if m.head_dim is not None:
        _at_least(m, 1, "head_dim")
    if m.model_type in LLAMA_FAMILY:
        _at_least(m, 1, "num_key_value_heads")
        if m.num_attention_heads % m.num_key_value_heads:
            raise BadInput(
                f"num_key_value_heads={m.num_key_value_heads} does not divide num_attention_heads="
                f"{m.num_attention_heads}: each key/value head serves a whole group of query heads; pick a divisor."
            )
    head_dim(m)


def check_mesh(training_args, devices: int | None = None, block_size: int | None = None) -> None:
    """mesh_shape (or parallelism_config / fsdp) must fit the devices (here, or `devices` of a target), and its
    `sequence` axis divide the rows' `block_size`, checked before any data is read or step compiled."""
    from jtrainer.parallel import sharding

    try:
        shape = sharding.resolve_mesh_shape(training_args, devices or len(sharding.mesh_devices()))
    except ValueError as e:
        raise BadInput(str(e)) from None
    ways = shape.get(sharding.SEQUENCE, 1)
    if block_size is not None and block_size % ways:
        raise BadInput(
            f"block_size={block_size} cannot be split over the {ways}-way `sequence` mesh axis (mesh_shape): use a "
            f"block_size that is a multiple of {ways}, or another mesh_shape."
        )


def _position_limit(model_args: ModelArguments, folder_config: dict | None) -> tuple[int | None, str]:
    """The longest sequence the model embeds positions for (None: relative positions, as T5); `folder_config`:
    the config.json of `model_name_or_path`."""
    if folder_config is not None:
        config = folder_config
        source = f"max_position_embeddings in {storage.join(str(model_args.model_name_or_path), 'config.json')}"
    else:
        if model_args.model_type == "t5":
            return None, ""
        config, source = vars(model_args), "--max_position_embeddings"
    limit = config.get("max_position_embeddings", config.get("n_positions"))
    return (int(limit), source) if limit is not None else (None, "")


def head_dim(model_args: ModelArguments) -> int:
    """The width of one attention head: `head_dim`, else hidden_size / num_attention_heads (refused when it
    does not divide: a rounded width would build another model than the config says)."""
    m = model_args
    if m.head_dim is not None:
        return m.head_dim
    if m.hidden_size % m.num_attention_heads:
        raise BadInput(
            f"hidden_size={m.hidden_size} is not divisible by num_attention_heads={m.num_attention_heads}: "
            "set head_dim (T5 v1.1-small: hidden_size 512, 6 heads, head_dim 64)."
        )
    return m.hidden_size // m.num_attention_heads


def fresh_config(model_args: ModelArguments, vocab_size: int, special: dict[str, Any] | None = None, warn: bool = True):
    """An HF config of `model_type` with the common size fields mapped onto the family's names; for a bridged
    model, also onto the family's other widths (`moe_intermediate_size`, ...) and then `config_overrides`, with
    one warning naming the size fields left at transformers' defaults."""
    config = _family_config(model_args, vocab_size, special)
    if not model_args.bridge:
        return config
    derived = [name for name in vars(config) if name.endswith("intermediate_size") and name != "intermediate_size"]
    for name in derived:
        if isinstance(getattr(config, name), int):
            setattr(config, name, model_args.intermediate_size)
    aliases = dict(getattr(config, "attribute_map", {}))  # the config's own names for stored fields
    given = {aliases.get(name, name) for name in _apply_overrides(config, model_args.config_overrides)}
    shown_as = {stored: alias for alias, stored in aliases.items()}
    left = {
        shown_as.get(name, name): value
        for name, value in vars(config).items()
        if "expert" in name and isinstance(value, int) and not isinstance(value, bool) and name not in given
    }
    if left and warn:
        shown = ", ".join(f"{name}={value}" for name, value in left.items())
        logger.warning(
            f"model_type={config.model_type!r}: {shown} are transformers' defaults (no size field names them); set "
            'them with config_overrides (e.g. "num_experts=4,num_experts_per_tok=2").'
        )
    return config


def _apply_overrides(config, overrides: str | None) -> set[str]:
    """HF's run_clm `--config_overrides "n_embd=10,resid_pdrop=0.2"` on a fresh config: the names it set."""
    if not overrides:
        return set()
    try:
        config.update_from_string(overrides)
    except ValueError as error:
        raise BadInput(f"config_overrides={overrides!r}: {error}") from None
    return {part.split("=", 1)[0].strip() for part in overrides.split(",")}


def _family_config(model_args: ModelArguments, vocab_size: int, special: dict[str, Any] | None = None):
    """An HF config of `model_type` with the common size fields mapped onto the family's names."""
    import transformers

    m, special = model_args, dict(special or {})
    kind = m.model_type
    width = head_dim(m)
    decoder = dict(  # the size fields of the Llama family, which most transformers decoders share
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=m.max_position_embeddings,
        **({"head_dim": width} if m.head_dim is not None else {}),
        **special,
    )
    if kind in LLAMA_FAMILY:
        return transformers.AutoConfig.for_model(kind, tie_word_embeddings=True, **decoder)
    if m.head_dim is not None and kind in ("gpt2", "bert"):
        raise BadInput(f"head_dim={m.head_dim}: {kind} heads are hidden_size / num_attention_heads wide; unset it.")
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab_size,
            n_embd=m.hidden_size,
            n_inner=m.intermediate_size,
            n_layer=m.num_hidden_layers,
            n_head=m.num_attention_heads,
            n_positions=m.max_position_embeddings,
            **special,
        )
    if kind == "bert":
        return transformers.BertConfig(
            vocab_size=vocab_size,
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_hidden_layers,
            num_attention_heads=m.num_attention_heads,
            max_position_embeddings=m.max_position_embeddings,
            **special,
            **dict[str, Any](num_labels=m.num_labels),  # PretrainedConfig's keyword, not in BertConfig's signature
        )
    if kind == "t5":
        pad = special.pop("pad_token_id", 0)
        return transformers.T5Config(
            vocab_size=vocab_size,
            d_model=m.hidden_size,
            d_ff=m.intermediate_size,
            d_kv=width,
            num_layers=m.num_hidden_layers,
            num_heads=m.num_attention_heads,
            feed_forward_proj="gated-gelu",
            pad_token_id=pad,
            **special,
            # PretrainedConfig's keywords (not in T5Config's own signature)
            **{"tie_word_embeddings": False, "decoder_start_token_id": pad},
        )
    if m.bridge:  # any transformers family, by the size fields modern decoders share
        return transformers.AutoConfig.for_model(kind, **decoder)
    raise BadInput(f"model_type={kind!r}: use one of {', '.join(MODEL_TYPES)}.")


def auto_class(task: str):
    from jtrainer.models import auto

    return {
        "causal_lm": auto.AutoModelForCausalLM,
        "sequence_classification": auto.AutoModelForSequenceClassification,
        "seq2seq": auto.AutoModelForSeq2SeqLM,
    }[task]


def build_model(
    model_args: ModelArguments, vocab_size: int, special: dict[str, int] | None, seed: int, abstract: bool = False
):
    """The model of the config: loaded from `model_name_or_path`, or fresh. `abstract`: shapes only (no
    parameters allocated), for `jtrainer check`."""
    from flax import nnx

    check_task(model_args)
    auto = auto_class(model_args.task)
    config = _model_config(model_args, vocab_size, special)
    if model_args.bridge:
        from jtrainer.bridge import torch_models

        lora = torch_models.lora_config(model_args) if model_args.use_peft else None
        return torch_models.build(model_args.task, config, model_args.model_name_or_path, seed, abstract, lora)
    options = _scan_option(model_args, config)
    if abstract:
        return nnx.eval_shape(lambda: auto.from_config(config, seed=seed, **options))
    if model_args.model_name_or_path:
        return auto.from_pretrained(model_args.model_name_or_path, **options)
    return auto.from_config(config, seed=seed, **options)


def _model_config(model_args: ModelArguments, vocab_size: int, special: dict[str, int] | None, warn: bool = True):
    """The transformers config of the model: `model_name_or_path`'s, or a fresh one's."""
    if model_args.model_name_or_path:
        from jtrainer.models import loading

        return loading.read_config(storage.fetched(model_args.model_name_or_path))
    return fresh_config(model_args, vocab_size, special, warn)


def _scan_option(model_args: ModelArguments, config) -> dict[str, bool]:
    if not model_args.scan_layers:
        return {}
    if model_args.task != "causal_lm" or config.model_type not in LLAMA_FAMILY:
        raise BadInput(
            f"scan_layers: only the causal-LM Llama family ({', '.join(LLAMA_FAMILY)}) scans its layers; "
            f"this model is {config.model_type!r} ({model_args.task}): set scan_layers false."
        )
    return {"scan_layers": True}


# ------------------------------------------------------------------------------------------------------- data
def read_text_files(text_dir: str | None, max_chars: int) -> list[str]:
    import sysconfig

    root = text_dir or sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for path in _text_files(root):
        try:
            text = storage.read_text(path)
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text[: max_chars - total])  # exactly max_chars in all
        total += len(texts[-1])
        if total >= max_chars:
            return texts
    if not texts:
        raise BadInput(f"text_dir={root!r} has no readable .py or .txt files.")
    return texts


_SKIPPED_DIRS = ("site-packages", "test", "tests", "__pycache__")


def _text_files(root: str) -> Iterator[str]:
    """The .py/.txt files under `root` (a folder or a gs:// / s3:// prefix), in a fixed order, skipping test
    and package folders."""
    if storage.is_url(root):
        for rel in storage.files_under(root):
            if rel.endswith((".py", ".txt")) and not set(rel.split("/")[:-1]) & set(_SKIPPED_DIRS):
                yield storage.join(root, rel)
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if name.endswith((".py", ".txt")):
                yield os.path.join(dirpath, name)


def load_splits(data_args: DataArguments, text_columns: tuple[str | None, ...] = ()):
    """(train, validation) `datasets.Dataset`s; validation is split off when the data has none. Each value of
    `text_columns` must be a string (checked before the split, so a refusal names the row of the file)."""
    import datasets

    if data_args.dataset_name and storage.isdir(data_args.dataset_name):
        loaded = datasets.load_from_disk(data_args.dataset_name)
    elif data_args.dataset_name:
        loaded = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
    else:
        files = {"train": data_args.train_file}
        if data_args.validation_file:
            files["validation"] = data_args.validation_file
        kind = "csv" if str(data_args.train_file).endswith(".csv") else "json"
        loaded = datasets.load_dataset(kind, data_files=files)
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    for split in ("train", "validation"):
        if split in loaded:
            _check_texts(loaded[split], _source(data_args, split), text_columns)
    if "validation" not in loaded:
        split = loaded["train"].train_test_split(test_size=data_args.eval_fraction, seed=0)
        return split["train"], split["test"]
    return loaded["train"], loaded["validation"]


def _source(data_args: DataArguments, split: str) -> str:
    if data_args.dataset_name:
        return f"dataset_name={data_args.dataset_name!r} ({split} split)"
    name = "train_file" if split == "train" else "validation_file"
    return f"{name}={getattr(data_args, name)!r}"


def _check_texts(dataset, source: str, columns: tuple[str | None, ...]) -> None:
    """Text columns hold strings: a null row or a number would fail inside tokenizer training, unnamed."""
    for column in columns:
        if column is None or column not in dataset.column_names:
            continue
        for row, value in enumerate(dataset[column]):
            if not isinstance(value, str):
                raise BadInput(
                    f"{source}: row {row} of column {column!r} is {value!r}, not text: fix or drop that row "
                    "(or set the right --text_column / --target_column)."
                )


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (the `tokenizers` library) wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def token_blocks(texts: list[str], tokenizer, block_size: int) -> list[dict]:
    """Concatenate documents (separated by EOS) and cut into rows of `block_size` tokens."""
    ids: list[int] = []
    for encoded in tokenizer(texts)["input_ids"]:
        ids.extend(encoded)
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // block_size
    blocks = np.asarray(ids[: n * block_size], np.int32).reshape(n, block_size)
    return [{"input_ids": b, "labels": b} for b in blocks]


def _blocks(texts: list[str], tokenizer, block_size: int, split: str) -> list[dict]:
    rows = token_blocks(texts, tokenizer, block_size)
    if not rows:
        tokens = sum(len(ids) + 1 for ids in tokenizer(texts)["input_ids"])
        raise BadInput(
            f"block_size={block_size}: the {split} text is {tokens} tokens, less than one block: lower "
            "--block_size or give more text."
        )
    return rows


def _label(value, row: int, column: str, num_labels: int, split: str):
    """A class id (or, with num_labels 1, HF's regression target), refused unless finite and, for classes, whole."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or (num_labels > 1 and number != int(number)):
        kind = "a float" if num_labels == 1 else "a class id (a whole number)"
        raise BadInput(
            f"label_column {column!r}: row {row} of the {split} split has {value!r}, not {kind}: fix or drop that row."
        )
    return number if num_labels == 1 else int(number)


def special_tokens(tokenizer) -> dict[str, int]:
    return {
        "bos_token_id": tokenizer.eos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _tokenizer_for(
    model_args: ModelArguments, data_args: DataArguments, texts: list[str], saved_tokenizer: str | None = None
):
    from transformers import AutoTokenizer

    source = model_args.tokenizer_name or model_args.model_name_or_path or saved_tokenizer
    if source:
        return AutoTokenizer.from_pretrained(storage.fetched(source))
    return train_tokenizer(texts, data_args.tokenizer_vocab_size)


def _columns(dataset, *names) -> None:
    missing = [n for n in names if n and n not in dataset.column_names]
    if missing:
        raise BadInput(
            f"The dataset has no column(s) {missing}; its columns are {dataset.column_names}. "
            "Set --text_column / --label_column / --target_column."
        )


def build_data(
    model_args: ModelArguments, data_args: DataArguments, saved_tokenizer: str | None = None
) -> tuple[Any, list, list]:
    """(tokenizer, train rows, eval rows) for the task; `saved_tokenizer`: a folder with the tokenizer an earlier
    run of this job trained (used instead of training one)."""
    check_task(model_args)
    d = data_args
    if model_args.task == "causal_lm" and not (d.dataset_name or d.train_file):
        texts = read_text_files(d.text_dir, d.max_chars)
        n_eval = max(1, int(len(texts) * d.eval_fraction))
        if n_eval >= len(texts):
            raise BadInput(
                f"text_dir={d.text_dir or 'the standard library'!r}: {len(texts)} file(s) within max_chars, "
                f"and eval_fraction={d.eval_fraction} holds out whole files ({n_eval}): give more files "
                "or a larger --max_chars."
            )
        tokenizer = _tokenizer_for(model_args, d, texts[:-n_eval], saved_tokenizer)
        return (
            tokenizer,
            _blocks(texts[:-n_eval], tokenizer, d.block_size, "training"),
            _blocks(texts[-n_eval:], tokenizer, d.block_size, "held-out"),
        )
    columns = (d.text_column, d.text_pair_column, d.target_column if model_args.task == "seq2seq" else None)
    train, valid = load_splits(d, columns)
    if model_args.task == "causal_lm":
        _columns(train, d.text_column)
        tokenizer = _tokenizer_for(model_args, d, list(train[d.text_column]), saved_tokenizer)
        return (
            tokenizer,
            _blocks(list(train[d.text_column]), tokenizer, d.block_size, "training"),
            _blocks(list(valid[d.text_column]), tokenizer, d.block_size, "held-out"),
        )
    if model_args.task == "sequence_classification":
        _columns(train, d.text_column, d.text_pair_column, d.label_column)
        tokenizer = _tokenizer_for(model_args, d, list(train[d.text_column]), saved_tokenizer)

        def rows(split, name):
            pairs = split[d.text_pair_column] if d.text_pair_column else None
            encoded = tokenizer(
                list(split[d.text_column]), pairs and list(pairs), truncation=True, max_length=d.block_size
            )
            labels = [
                _label(value, i, d.label_column, model_args.num_labels, name)
                for i, value in enumerate(split[d.label_column])
            ]
            return [{"input_ids": ids, "labels": label} for ids, label in zip(encoded["input_ids"], labels)]

        return tokenizer, rows(train, "training"), rows(valid, "validation")
    _columns(train, d.text_column, d.target_column)
    tokenizer = _tokenizer_for(
        model_args, d, list(train[d.text_column]) + list(train[d.target_column]), saved_tokenizer
    )

    def pairs(split):
        sources = tokenizer(
            [d.source_prefix + t for t in split[d.text_column]], truncation=True, max_length=d.block_size
        )["input_ids"]
        targets = tokenizer(list(split[d.target_column]), truncation=True, max_length=d.max_target_length - 1)
        return [
            {"input_ids": s, "labels": with_eos(t, tokenizer.eos_token_id)}
            for s, t in zip(sources, targets["input_ids"])
        ]

    return tokenizer, pairs(train), pairs(valid)


def with_eos(ids: list[int], eos_token_id: int) -> list[int]:
    """A target ending in EOS once: a tokenizer that appends it itself (T5's `</s>`) is not given a second."""
    return ids if ids and ids[-1] == eos_token_id else [*ids, eos_token_id]


def accuracy(prediction) -> dict[str, float]:
    """The sequence-classification job's compute_metrics."""
    return {"accuracy": float(np.mean(np.argmax(prediction.predictions, -1) == prediction.label_ids))}
