"""The `jtrainer` command: `jtrainer train|check [CONFIG.yaml] [--field value ...]` and `jtrainer launch`.

Model, data and training arguments are parsed by `transformers.HfArgumentParser`: a YAML file gives the values,
command-line flags override them, and bad values fail with argparse's error naming the flag. Without a config
file the embedded default, `configs/default.yaml`, runs: a byte-level BPE tokenizer and a small Llama trained on
the source of Python's standard library, with nothing downloaded.

`jtrainer train` holds output_dir's lock for the whole job and, run again with the same output_dir, continues from
the last committed checkpoint there (as HF's example scripts and Levanter/MaxText do): a preempted job is re-run
as it was. `--resume_from_checkpoint PATH` resumes from PATH, `--overwrite_output_dir` starts afresh.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field

import yaml

from jtrainer import jobs, storage, targets
from jtrainer.errors import BadInput
from jtrainer.jobs import DataArguments, ModelArguments


@dataclass
class RunArguments:
    """Options of the command itself: what `jtrainer train` does with an earlier run in output_dir, and the
    machine `jtrainer check` compiles for."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start afresh: remove the checkpoint-N folders of an earlier run in output_dir (default: "
                  "continue from its last committed checkpoint)."},
    )
    target: str | None = field(
        default=None,
        metadata={"help": "jtrainer check: compile for this TPU slice instead of this machine, named as gcloud's "
                  "accelerator types (v4-8, v5litepod-16, v5p-8, v6e-16, ...; needs libtpu, jax[tpu]), or for "
                  "GPU nodes (h100x8, h200x8, a100x8; needs the CUDA plugin, jax[cuda12-local])."},
    )
    num_slices: int = field(default=1, metadata={"help": "jtrainer check --target: TPU slices joined over DCN."})
    num_nodes: int = field(default=1, metadata={"help": "jtrainer check --target h100x8: GPU nodes."})

# The shipped configs are package data (jtrainer/configs; the repository's configs/ links there), so a wheel
# install runs the main job too.
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.yaml")


def say(message: str) -> None:
    """Print on the first process only (every process of a multi-host run executes the same job)."""
    import jax

    if jax.process_index() == 0:
        print(message)


def run_train(model_args: ModelArguments, data_args: DataArguments, training_args,
              run_args: RunArguments | None = None) -> dict:
    """Train the config's model on its data (continuing an earlier run in output_dir), evaluate, save in HF format
    and print a summary."""
    import jax

    from jtrainer import run_lock
    from jtrainer.optim import check_optimizer

    try:
        check_optimizer(training_args)  # fail before reading text and training a tokenizer
    except ValueError as e:
        raise BadInput(str(e)) from None
    jobs.check_job(model_args, data_args, training_args)
    with run_lock.hold(training_args.output_dir, is_main=jax.process_index() == 0):
        resume = resume_point(training_args, run_args or RunArguments())
        return _train_job(model_args, data_args, training_args, resume)


def resume_point(training_args, run_args: RunArguments) -> str | None:
    """The checkpoint this job continues from: --resume_from_checkpoint, else the last committed one in
    output_dir; None to start afresh (an empty output_dir, or --overwrite_output_dir, which removes the earlier
    run's checkpoints). An output_dir holding other files but no checkpoint is refused, as HF's scripts do."""
    import jax

    from jtrainer import checkpoint, distributed
    from jtrainer.run_lock import LOCK_NAME

    out, explicit = training_args.output_dir, training_args.resume_from_checkpoint
    if explicit and run_args.overwrite_output_dir:
        raise BadInput("--resume_from_checkpoint and --overwrite_output_dir contradict each other: "
                       "pass one of them.")
    if explicit:
        try:
            checkpoint.verify_checkpoint(explicit)
        except (checkpoint.CheckpointIntegrityError, OSError) as e:
            raise BadInput(f"--resume_from_checkpoint {explicit!r}: {e}") from None
        say(f"jtrainer: resuming from {explicit}")
        return explicit
    if run_args.overwrite_output_dir:
        old = checkpoint.checkpoint_folders(out)
        if jax.process_index() == 0:
            for folder in old:
                checkpoint.remove_checkpoint(folder)
        if old:
            say(f"jtrainer: --overwrite_output_dir: removed {len(old)} checkpoint(s) of an earlier run in {out}")
        return None
    last = checkpoint.get_last_checkpoint(out)
    step = int(last.rsplit("-", 1)[1]) if last else -1
    if jax.process_count() > 1 and distributed.agree_max(step) != -distributed.agree_max(-step):
        raise BadInput(f"the processes find different last checkpoints in {out!r}: output_dir "
                       "must be storage that every host shares.")
    if last:
        say(f"jtrainer: resuming from {last}, the last committed checkpoint in {out} (--overwrite_output_dir "
            "starts afresh)")
        return last
    others = sorted(
        name for name in storage.listdir(out)
        if not (name.startswith(LOCK_NAME) or name.endswith(checkpoint.TMP_SUFFIX) or name == "runs")
    )
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise BadInput(f"output_dir {out!r} is not empty ({shown}) and has no committed checkpoint "
                       "to continue from: pass --overwrite_output_dir to start afresh there, or choose another "
                       "--output_dir.")
    return None


def _train_job(model_args: ModelArguments, data_args: DataArguments, training_args, resume: str | None) -> dict:
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

    from jtrainer import Seq2SeqTrainer, Trainer

    # A resumed job keeps the tokenizer it trained (saved in every checkpoint) instead of training it again.
    saved_tokenizer = resume if resume and storage.isfile(storage.join(resume, "tokenizer_config.json")) else None
    tokenizer, train_rows, eval_rows = jobs.build_data(model_args, data_args, saved_tokenizer)
    model = jobs.build_model(model_args, len(tokenizer), jobs.special_tokens(tokenizer), training_args.seed)
    say(f"jtrainer: {len(train_rows)} training rows, {len(eval_rows)} held-out rows ({model_args.task})")
    task = model_args.task
    collator, compute_metrics, trainer_class = None, None, Trainer
    if task == "sequence_classification":
        collator = DataCollatorWithPadding(tokenizer, return_tensors="np")
        compute_metrics = jobs.accuracy
    elif task == "seq2seq":
        collator = DataCollatorForSeq2Seq(tokenizer, return_tensors="np")
        trainer_class = Seq2SeqTrainer
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
    )
    result = trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    trainer.save_model(training_args.output_dir)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    say(f"jtrainer: train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "")
    summary = {"train_loss": result.training_loss, **metrics}
    if task == "causal_lm":
        summary["perplexity"] = math.exp(metrics["eval_loss"])
        say(f"jtrainer: held-out perplexity {summary['perplexity']:.2f} (eval_loss {metrics['eval_loss']:.4f})")
    else:
        say("jtrainer: held-out " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if "runtime" not in k
                                              and "per_second" not in k and isinstance(v, float)))
    say(f"jtrainer: model and tokenizer saved in HF format to {training_args.output_dir}")
    if task == "causal_lm":
        from jtrainer.generation import generate

        prompt = tokenizer(data_args.sample_prompt)["input_ids"] or [tokenizer.eos_token_id]
        ids = generate(trainer.model, [prompt], max_new_tokens=data_args.sample_tokens, do_sample=False)
        say("jtrainer: sample:\n" + tokenizer.decode(ids[0], skip_special_tokens=True))
    return summary


def parse_train_args(argv: list[str], command: str = "train"):
    """(model, data, training, run) arguments from an optional YAML file plus command-line overrides."""
    from transformers import HfArgumentParser

    from jtrainer import Seq2SeqTrainingArguments
    from jtrainer.args import honour_fields

    honour_fields("resume_from_checkpoint")  # passed to train() by run_train

    config_path = DEFAULT_CONFIG
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        config_path, argv = argv[0], argv[1:]
    values = read_config(config_path)
    # Seq2SeqTrainingArguments: TrainingArguments plus predict_with_generate & co, for every task.
    dataclass_types = (ModelArguments, DataArguments, Seq2SeqTrainingArguments, RunArguments)
    parser = HfArgumentParser(dataclass_types, prog=f"jtrainer {command}")
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(values) - known)
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in lines:
                raise BadInput(f"duplicate key {key!r} (lines {lines[key]} and {key_node.start_mark.line + 1}): "
                               "keep one.")
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
            raise BadInput(f"config file {path}: {name}: {value!r} is not a valid value; the field takes "
                           f"{_type_name(hints[name])}.")


def run_launch(argv: list[str]) -> int:
    from jtrainer.launch import launch

    parser = argparse.ArgumentParser(prog="jtrainer launch", description="Run N processes of one job here.")
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--devices_per_process", type=int, default=None, help="simulated CPU devices each")
    parser.add_argument("target", help="a .py script or a .yaml config for `jtrainer train`")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the script or to `jtrainer train`")
    ns = parser.parse_args(argv)
    return launch(ns.target, ns.args, ns.num_processes, ns.devices_per_process)


COMMANDS = ("train", "check", "launch")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="jtrainer", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=COMMANDS, help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.error(f"argument command: invalid choice: {command!r} (choose from {', '.join(COMMANDS)})")
    if command == "launch":
        return run_launch(rest)
    try:
        model_args, data_args, training_args, run_args = parse_train_args(rest, command)
        if command == "check":
            from jtrainer.check import run_check

            if run_args.target is not None:
                targets.compile_here_on_cpu()
            result = run_check(model_args, data_args, training_args, run_args.target, run_args.num_slices,
                               run_args.num_nodes)
            return 0 if result["fits"] else 1
        if run_args.target is not None:
            raise BadInput("--target is an option of `jtrainer check` (sizing a run for another machine).")
        run_train(model_args, data_args, training_args, run_args)
    except BadInput as e:  # refused before any work (or, for a file, as soon as it is read): one line
        print(f"jtrainer {command}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the disk: full, read-only, a file-size limit; the message names the file
        if e.filename is None:
            raise
        print(f"jtrainer {command}: {e.strerror or e} writing or reading {e.filename!r}: free space, fix "
              "permissions or limits, then run the same command again (it continues from the last checkpoint).",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
