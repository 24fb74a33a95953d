"""What `jtrainer --help`, `jtrainer train|check --help` and `--help-all` print.

`--help` is a page a person reads: the usage, then the fields people set, grouped. `--help-all` is
HfArgumentParser's whole list, each TrainingArguments field marked honoured, emulated (a JAX mechanism in place
of torch's) or ignored (no JAX meaning), as `jtrainer check` reports the fields a config sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

COMMANDS = {
    "train": "Train the model a config describes, with evaluation, checkpoints that survive kills, and an export "
    "(no config: a small Llama on Python's standard library source, nothing downloaded).",
    "check": "Compile the config's train step ahead of time, with no data read: memory per device, FLOPs, whether "
    "it fits, and what each set field does here; --target sizes a TPU slice or GPU nodes that are not here.",
    "launch": "Run N processes of one job on this machine, joined as one multi-host run "
    "(jtrainer launch --num_processes 2 CONFIG.yaml).",
}

CHECK_ONLY = ("target", "num_slices", "num_nodes", "compare_bridge")

# The fields people set, by group; a text here replaces the field's own (long) help on the short page.
SHORT_FIELDS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "model",
        (
            ("task", "causal_lm | sequence_classification | seq2seq"),
            ("trainer", "trainer | sft | dpo (TRL's trainers; their fields: --help-all)"),
            ("model_name_or_path", "a local transformers model folder to fine-tune"),
            ("model_type", "a fresh model: llama, mistral, qwen2, qwen3, gpt2, bert, t5"),
            ("hidden_size", "a fresh model's width (num_hidden_layers, ...)"),
            ("bridge", "transformers' own torch model (any family) via the bridge"),
            ("use_peft", "a LoRA adapter on the bridged model (lora_r, lora_alpha)"),
            ("tokenizer_name", "a local tokenizer folder (unset: trained on the data)"),
        ),
    ),
    (
        "data",
        (
            ("text_dir", "a folder of text files (unset: Python's library source)"),
            ("dataset_name", "a datasets dataset: a hub name or a local folder"),
            ("train_file", "json/csv files (validation_file for evaluation)"),
            ("text_column", "the text column (label_column, target_column, ...)"),
            ("block_size", "tokens a row"),
            ("eval_fraction", "the share of the text held out for evaluation"),
        ),
    ),
    (
        "training (HF's TrainingArguments)",
        (
            ("output_dir", "checkpoints, logs and the exported model"),
            ("learning_rate", ""),
            ("num_train_epochs", ""),
            ("max_steps", "optimizer steps; overrides num_train_epochs when > 0"),
            ("per_device_train_batch_size", ""),
            ("gradient_accumulation_steps", "micro-batches an optimizer step (a scan in the step)"),
            ("lr_scheduler_type", "linear, cosine, constant, ..."),
            ("warmup_steps", ""),
            ("weight_decay", ""),
            ("optim", "adamw_torch, adafactor, sgd, ... (optax equivalents)"),
            ("bf16", "compute in bfloat16 with float32 master weights"),
            ("eval_strategy", "no | steps | epoch"),
            ("logging_steps", ""),
            ("report_to", "tensorboard, wandb, ... or none"),
            ("seed", ""),
        ),
    ),
    (
        "checkpoints",
        (
            ("save_steps", "a checkpoint every N steps (save_strategy: steps|epoch|no)"),
            ("save_total_limit", "keep the last N checkpoints"),
            ("overwrite_output_dir", "start afresh, not from the last checkpoint"),
            ("load_best_model_at_end", "with metric_for_best_model"),
        ),
    ),
    (
        "mesh and memory",
        (
            ("mesh_shape", 'device mesh axes, e.g. {"fsdp": -1, "tensor": 2}'),
            ("fsdp", "split parameters and optimizer state over the devices"),
            ("activation_checkpointing", "recompute each block in the backward pass (remat)"),
            ("loss_chunk_size", "positions per chunk of the causal-LM loss: no whole logits (0: whole)"),
        ),
    ),
)
CHECK_FIELDS = (
    "check",
    (
        ("target", "a TPU slice (v5litepod-16, v6e-8, ...) or GPU nodes (h100x8)"),
        ("num_slices", "TPU slices joined over DCN (with --target)"),
        ("num_nodes", "GPU nodes (with --target h100x8)"),
        ("compare_bridge", "the native step and the bridged transformers model, side by side"),
    ),
)
WIDTH = 110


def usage(command: str) -> str:
    return f"jtrainer {command} [CONFIG.yaml] [--field value ...]"


def top_help() -> str:
    lines = [
        "usage: jtrainer {train,check,launch} ...",
        "",
        "The Hugging Face Trainer on one compiled JAX train step. A YAML config gives the fields; flags override them.",
        "",
        "commands:",
    ]
    for name, text in COMMANDS.items():
        lines += textwrap.wrap(text, WIDTH, initial_indent=f"  {name:<8}", subsequent_indent=" " * 10)
    lines += ["", "`jtrainer COMMAND --help` for a command's fields."]
    return "\n".join(lines)


def _defaults(dataclass_types) -> dict[str, object]:
    found: dict[str, object] = {}
    for cls in dataclass_types:
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                found[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                found[f.name] = f.default_factory()
    return found


def _shown(value: object) -> str:
    value = getattr(value, "value", value)  # HF's enums: their strings
    return "unset" if value in (None, "", [], {}) else str(value)


def short_help(command: str, dataclass_types) -> str:
    """The grouped page of `jtrainer train|check --help` (under 60 lines)."""
    defaults = _defaults(dataclass_types)
    groups = [*SHORT_FIELDS, CHECK_FIELDS] if command == "check" else list(SHORT_FIELDS)
    lines = [f"usage: {usage(command)}", ""]
    lines += textwrap.wrap(COMMANDS[command], WIDTH)
    lines += ["CONFIG.yaml gives the fields (unset: configs/default.yaml), flags override them; [the default].", ""]
    for title, fields in groups:
        lines.append(f"{title}:")
        for name, text in fields:
            default = f"[{_shown(defaults[name])}]" if name in defaults else ""
            lines.append(f"  --{name:<28} {' '.join(part for part in (text, default) if part)}")
    lines += [
        "",
        f"`jtrainer {command} --help-all`: every field, HF's TrainingArguments each marked honoured, emulated or "
        "ignored.",
    ]
    return "\n".join(lines)


def mark_full_help(
    parser: argparse.ArgumentParser,
    command: str,
    training_fields: set[str],
    trl_fields: dict[str, tuple[str, str]] | None = None,
) -> None:
    """Prefix each TrainingArguments flag's help with how jtrainer treats it (as `jtrainer check` reports it;
    `jtrainer` for fields HF does not have; TRL's config fields by `trl_fields`); hide `check`'s own flags under
    `train`."""
    trl_fields = trl_fields or {}
    import transformers

    from jtrainer.trainer.args import field_treatment

    hf_fields = {f.name for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments)}
    parser.usage = usage(command)
    for action in parser._actions:
        if command != "check" and action.dest in CHECK_ONLY:
            action.help = argparse.SUPPRESS
        elif action.dest in training_fields and action.help is not argparse.SUPPRESS:
            status, why = field_treatment(action.dest)
            mark = "jtrainer" if action.dest not in hf_fields else f"{status}: {why}" if why else status
            if action.dest in trl_fields:
                status, why = trl_fields[action.dest]
                mark = f"TRL, {status}: {why}"
            action.help = f"[{mark}] " + (action.help or "")
