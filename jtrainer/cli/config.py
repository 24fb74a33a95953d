"""A `jtrainer train|check` config: a YAML (or JSON) file of model, data and TrainingArguments fields, with
command-line flags over it, parsed by `transformers.HfArgumentParser`; bad files and values are refused naming
the field."""

from __future__ import annotations

import dataclasses
import enum
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from jtrainer.cli import help_pages
from jtrainer.cli.tasks import DataArguments, ModelArguments
from jtrainer.core.errors import BadInput


@dataclass
class RunArguments:
    """Options of the command itself: what `jtrainer train` does with an earlier run in output_dir, and the
    machine `jtrainer check` compiles for."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh: remove the checkpoint-N folders of an earlier run in output_dir (default: "
            "continue from its last committed checkpoint)."
        },
    )
    target: str | None = field(
        default=None,
        metadata={
            "help": "jtrainer check: compile for this TPU slice instead of this machine, named as gcloud's "
            "accelerator types (v4-8, v5litepod-16, v5p-8, v6e-16, ...; needs libtpu, jax[tpu]), or for "
            "GPU nodes (h100x8, h200x8, a100x8; needs the CUDA plugin, jax[cuda12-local])."
        },
    )
    num_slices: int = field(default=1, metadata={"help": "jtrainer check --target: TPU slices joined over DCN."})
    num_nodes: int = field(default=1, metadata={"help": "jtrainer check --target h100x8: GPU nodes."})
    compare_bridge: bool = field(
        default=False,
        metadata={
            "help": "jtrainer check: compile the step for the native family and for transformers' own model of the "
            "same config through the torch bridge (needs jtrainer[torch]); print both and their comparison."
        },
    )


# The shipped configs are package data (jtrainer/configs; the repository's configs/ links there), so a wheel
# install runs the main job too.
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.yaml")


def parse_train_args(argv: list[str], command: str = "train"):
    """(model, data, training, run) arguments from an optional YAML file plus command-line overrides."""
    from transformers import HfArgumentParser

    from jtrainer import Seq2SeqTrainingArguments
    from jtrainer.trainer.args import honour_fields

    honour_fields("resume_from_checkpoint")  # passed to train() by run_train

    dataclass_types = (ModelArguments, DataArguments, Seq2SeqTrainingArguments, RunArguments)
    if "-h" in argv or "--help" in argv:
        print(help_pages.short_help(command, dataclass_types))
        raise SystemExit(0)
    config_path = DEFAULT_CONFIG
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        config_path, argv = argv[0], argv[1:]
    values = read_config(config_path)
    training_class = training_arguments_class(_chosen_trainer(values, argv))
    dataclass_types = (ModelArguments, DataArguments, training_class, RunArguments)
    parser = HfArgumentParser(list[Any](dataclass_types), prog=f"jtrainer {command}")
    # The training fields: Seq2SeqTrainingArguments (TrainingArguments plus predict_with_generate & co, for every
    # task), or TRL's SFTConfig / DPOConfig for `trainer: sft | dpo`.
    training_fields = {f.name for f in dataclasses.fields(training_class)}
    help_pages.mark_full_help(parser, command, training_fields, getattr(training_class, "trl_fields", None))
    if "--help-all" in argv:
        parser.print_help()
        raise SystemExit(0)

    def one_line_error(message: str):  # argparse would print the whole usage (some 150 lines) first
        parser.exit(2, f"jtrainer {command}: error: {message} (`jtrainer {command} --help` lists the fields)\n")

    parser.error = one_line_error  # type: ignore[method-assign]  # argparse's documented way to change errors
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(values) - known, key=str)
    if unknown:
        raise BadInput(f"config file {config_path}: unknown field(s) {unknown}: check their spelling.")
    check_value_types(values, dataclass_types, config_path)
    parser.set_defaults(**values)
    for action in parser._actions:
        if action.dest in values:
            action.required = False
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except ValueError as e:  # the dataclasses' own validation (HF's and jtrainer's), before any work
        raise BadInput(str(e).strip().replace("\n", " ")) from None


def _chosen_trainer(values: dict, argv: list[str]) -> str:
    """The `trainer` field, read before parsing: it decides which arguments class the training fields are."""
    chosen = values.get("trainer", "trainer")
    for i, arg in enumerate(argv):
        if arg == "--trainer" and i + 1 < len(argv):
            chosen = argv[i + 1]
        elif arg.startswith("--trainer="):
            chosen = arg.split("=", 1)[1]
    return str(chosen)


def training_arguments_class(trainer: str):
    """HF's Trainer: jtrainer's Seq2SeqTrainingArguments (every task); TRL's trainers: their configs."""
    if trainer not in ("sft", "dpo"):
        from jtrainer import Seq2SeqTrainingArguments

        return Seq2SeqTrainingArguments
    try:
        import trl  # noqa: F401
    except ImportError:
        raise BadInput(f'trainer: {trainer} runs TRL\'s trainer: install it with pip install -e ".[trl]".') from None
    from jtrainer.trl import DPOConfig, SFTConfig

    return SFTConfig if trainer == "sft" else DPOConfig


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in lines:
                raise BadInput(
                    f"duplicate key {key!r} (lines {lines[key]} and {key_node.start_mark.line + 1}): keep one."
                )
            lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_config(path: str) -> dict:
    """A config file's field -> value mapping (YAML or JSON), refused with the file named if it is missing, does
    not parse, is not a mapping or repeats a key."""
    if not os.path.isfile(path):
        shipped = os.path.join(os.path.dirname(DEFAULT_CONFIG), os.path.basename(path))
        if os.path.dirname(path) not in ("", "configs") or not os.path.isfile(shipped):
            raise BadInput(f"config file {path!r} not found.")
        path = shipped  # a shipped config named as in the README (configs/NAME.yaml), from an installed wheel
    try:
        with open(path) as f:
            values = yaml.load(f, Loader=_UniqueKeyLoader)
    except BadInput as e:
        raise BadInput(f"config file {path}: {e}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise BadInput(f"config file {path} is not valid YAML{line}: {getattr(e, 'problem', e)}.") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise BadInput(f"config file {path} must be a mapping of field: value, not a {type(values).__name__}.")
    return values


def _accepts(hint, value) -> bool:
    """Whether a config value can be the field's: strings always (argparse converts and checks them, naming the
    field), other values by the field's annotation."""
    if isinstance(value, str) or hint is typing.Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in args)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple, set) or hint in (list, tuple, set):
        if not isinstance(value, (list, tuple)):
            return False
        return not args or all(_accepts(args[0], v) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is str:  # a YAML number or boolean is a string argparse reads; a list or mapping is not
        return not isinstance(value, (list, tuple, dict))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint)
    return True  # another type: the dataclass checks it


def _type_name(hint) -> str:
    names = [getattr(a, "__name__", str(a)) for a in (typing.get_args(hint) or (hint,)) if a is not type(None)]
    return " or ".join(names) + (" (or null)" if type(None) in typing.get_args(hint) else "")


def check_value_types(values: dict, dataclass_types, path: str) -> None:
    """Each config value must fit its field's type (`per_device_train_batch_size: 8.5` is refused here, naming the
    field, instead of failing after the tokenizer has trained)."""
    hints = {}
    for cls in dataclass_types:
        resolved = typing.get_type_hints(cls)
        hints.update({f.name: resolved.get(f.name, typing.Any) for f in dataclasses.fields(cls)})
    for name, value in values.items():
        if name in hints and not _accepts(hints[name], value):
            raise BadInput(
                f"config file {path}: {name}: {value!r} is not a valid value; the field takes "
                f"{_type_name(hints[name])}."
            )
