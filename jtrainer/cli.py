"""The `jtrainer` command: `jtrainer train [CONFIG.yaml] [--field value ...]` and `jtrainer launch`.

Model, data and training arguments are parsed by `transformers.HfArgumentParser`: a YAML file gives the values,
command-line flags override them, and bad values fail with argparse's error naming the flag. Without a config
file the embedded default, `configs/default.yaml`, runs: a byte-level BPE tokenizer and a small Llama trained on
the source of Python's standard library, with nothing downloaded.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import yaml

from jtrainer import jobs
from jtrainer.jobs import DataArguments, ModelArguments

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.yaml")


def say(message: str) -> None:
    """Print on the first process only (every process of a multi-host run executes the same job)."""
    import jax

    if jax.process_index() == 0:
        print(message)


def run_train(model_args: ModelArguments, data_args: DataArguments, training_args) -> dict:
    """Train the config's model on its data, evaluate, save in HF format and print a summary."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

    from jtrainer import Seq2SeqTrainer, Trainer
    from jtrainer.optim import check_optimizer

    check_optimizer(training_args)  # fail before reading text and training a tokenizer
    jobs.check_task(model_args)
    tokenizer, train_rows, eval_rows = jobs.build_data(model_args, data_args)
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
    result = trainer.train()
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
    """(model, data, training) arguments from an optional YAML file plus command-line overrides."""
    from transformers import HfArgumentParser

    from jtrainer import Seq2SeqTrainingArguments

    config_path = DEFAULT_CONFIG
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        config_path, argv = argv[0], argv[1:]
    if not os.path.exists(config_path):
        raise SystemExit(f"jtrainer {command}: config file {config_path!r} not found.")
    with open(config_path) as f:
        values = yaml.safe_load(f) or {}
    # Seq2SeqTrainingArguments: TrainingArguments plus predict_with_generate & co, for every task.
    parser = HfArgumentParser((ModelArguments, DataArguments, Seq2SeqTrainingArguments), prog=f"jtrainer {command}")
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
    model_args, data_args, training_args = parse_train_args(rest, command)
    if command == "check":
        from jtrainer.check import run_check

        run_check(model_args, data_args, training_args)
        return 0
    run_train(model_args, data_args, training_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
