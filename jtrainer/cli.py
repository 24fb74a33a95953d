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
import math
import os
import sys
from dataclasses import dataclass, field

import yaml

from jtrainer import jobs
from jtrainer.jobs import DataArguments, ModelArguments


@dataclass
class RunArguments:
    """What `jtrainer train` does with an output_dir that holds an earlier run."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start afresh: remove the checkpoint-N folders of an earlier run in output_dir (default: "
                  "continue from its last committed checkpoint)."},
    )

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.yaml")


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

    check_optimizer(training_args)  # fail before reading text and training a tokenizer
    jobs.check_task(model_args)
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
        raise SystemExit("jtrainer train: --resume_from_checkpoint and --overwrite_output_dir contradict each other: "
                         "pass one of them.")
    if explicit:
        try:
            checkpoint.verify_checkpoint(explicit)
        except (checkpoint.CheckpointIntegrityError, OSError) as e:
            raise SystemExit(f"jtrainer train: --resume_from_checkpoint {explicit!r}: {e}") from None
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
        raise SystemExit(f"jtrainer train: the processes find different last checkpoints in {out!r}: output_dir "
                         "must be storage that every host shares.")
    if last:
        say(f"jtrainer: resuming from {last}, the last committed checkpoint in {out} (--overwrite_output_dir "
            "starts afresh)")
        return last
    others = sorted(
        name for name in (os.listdir(out) if os.path.isdir(out) else [])
        if not (name.startswith(LOCK_NAME) or name.endswith(checkpoint.TMP_SUFFIX) or name == "runs")
    )
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise SystemExit(f"jtrainer train: output_dir {out!r} is not empty ({shown}) and has no committed checkpoint "
                         "to continue from: pass --overwrite_output_dir to start afresh there, or choose another "
                         "--output_dir.")
    return None


def _train_job(model_args: ModelArguments, data_args: DataArguments, training_args, resume: str | None) -> dict:
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

    from jtrainer import Seq2SeqTrainer, Trainer

    # A resumed job keeps the tokenizer it trained (saved in every checkpoint) instead of training it again.
    saved_tokenizer = resume if resume and os.path.isfile(os.path.join(resume, "tokenizer_config.json")) else None
    tokenizer, train_rows, eval_rows = jobs.build_data(model_args, data_args, saved_tokenizer)
    model = jobs.build_model(model_args, len(tokenizer), jobs.special_tokens(tokenizer), training_args.seed)
    say(f"jtrainer: {len(train_rows)} training rows, {len(eval_rows)} held-out rows ({model_args.task})")
    task = model_args.task
    collator, compute_metrics, trainer_class = None, None, Trainer
    if task == "sequence_classification":
        collator = DataCollatorWithPadding(tokenizer, return_tensors="np")
        compute_metrics = accuracy
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


def accuracy(prediction) -> dict[str, float]:
    import numpy as np

    return {"accuracy": float(np.mean(np.argmax(prediction.predictions, -1) == prediction.label_ids))}


def parse_train_args(argv: list[str], command: str = "train"):
    """(model, data, training, run) arguments from an optional YAML file plus command-line overrides."""
    from transformers import HfArgumentParser

    from jtrainer import Seq2SeqTrainingArguments
    from jtrainer.args import honour_fields

    honour_fields("resume_from_checkpoint")  # passed to train() by run_train

    config_path = DEFAULT_CONFIG
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        config_path, argv = argv[0], argv[1:]
    if not os.path.exists(config_path):
        raise SystemExit(f"jtrainer {command}: config file {config_path!r} not found.")
    with open(config_path) as f:
        values = yaml.safe_load(f) or {}
    # Seq2SeqTrainingArguments: TrainingArguments plus predict_with_generate & co, for every task.
    parser = HfArgumentParser((ModelArguments, DataArguments, Seq2SeqTrainingArguments, RunArguments),
                              prog=f"jtrainer {command}")
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SystemExit(f"jtrainer {command}: unknown field(s) {unknown} in {config_path}.")
    parser.set_defaults(**values)
    for action in parser._actions:
        if action.dest in values:
            action.required = False
    return parser.parse_args_into_dataclasses(args=argv)


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
    model_args, data_args, training_args, run_args = parse_train_args(rest, command)
    if command == "check":
        from jtrainer.check import run_check

        run_check(model_args, data_args, training_args)
        return 0
    run_train(model_args, data_args, training_args, run_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
