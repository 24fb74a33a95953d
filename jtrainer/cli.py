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
from dataclasses import dataclass, field

import yaml

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.yaml")


@dataclass
class ModelArguments:
    """The model: a local HF folder to fine-tune, or a fresh Llama of this size."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Local folder with config.json + weights."})
    hidden_size: int = field(default=128, metadata={"help": "Width of a fresh Llama."})
    intermediate_size: int = field(default=384, metadata={"help": "MLP width of a fresh Llama."})
    num_hidden_layers: int = field(default=4, metadata={"help": "Layers of a fresh Llama."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads of a fresh Llama."})
    num_key_value_heads: int = field(default=2, metadata={"help": "Key/value heads (GQA) of a fresh Llama."})


@dataclass
class DataArguments:
    """The text: Python's standard library source (or a folder of text files), tokenised into blocks."""

    text_dir: str | None = field(default=None, metadata={"help": "Folder of *.py/*.txt files; unset: the stdlib."})
    max_chars: int = field(default=3_000_000, metadata={"help": "Characters of text to read at most."})
    tokenizer_vocab_size: int = field(default=2048, metadata={"help": "Vocabulary of the BPE tokenizer trained."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training row."})
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of the files held out for perplexity."})
    sample_prompt: str = field(default="def ", metadata={"help": "Prompt of the generated sample."})
    sample_tokens: int = field(default=48, metadata={"help": "Tokens to generate for the sample."})


def read_text_files(text_dir: str | None, max_chars: int) -> list[str]:
    import sysconfig

    root = text_dir or sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith((".py", ".txt")):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            texts.append(text)
            total += len(text)
            if total >= max_chars:
                return texts
    if not texts:
        raise ValueError(f"--text_dir {root!r} has no readable .py or .txt files.")
    return texts


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
    import numpy as np

    ids: list[int] = []
    for encoded in tokenizer(texts)["input_ids"]:
        ids.extend(encoded)
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // block_size
    blocks = np.asarray(ids[: n * block_size], np.int32).reshape(n, block_size)
    return [{"input_ids": b, "labels": b} for b in blocks]


def say(message: str) -> None:
    """Print on the first process only (every process of a multi-host run executes the same job)."""
    import jax

    if jax.process_index() == 0:
        print(message)


def run_train(model_args: ModelArguments, data_args: DataArguments, training_args) -> dict:
    from transformers import LlamaConfig

    from jtrainer import Trainer
    from jtrainer.models.llama import LlamaForCausalLM
    from jtrainer.optim import check_optimizer_name

    check_optimizer_name(training_args.optim)  # fail before reading text and training a tokenizer
    texts = read_text_files(data_args.text_dir, data_args.max_chars)
    n_eval = max(1, int(len(texts) * data_args.eval_fraction))
    if model_args.model_name_or_path:
        from transformers import AutoTokenizer

        from jtrainer.models.auto import AutoModelForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    else:
        tokenizer = train_tokenizer(texts[:-n_eval], data_args.tokenizer_vocab_size)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=model_args.hidden_size,
            intermediate_size=model_args.intermediate_size,
            num_hidden_layers=model_args.num_hidden_layers,
            num_attention_heads=model_args.num_attention_heads,
            num_key_value_heads=model_args.num_key_value_heads,
            max_position_embeddings=max(2048, data_args.block_size),
            tie_word_embeddings=True,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = LlamaForCausalLM.from_config(config, seed=training_args.seed)
    train_rows = token_blocks(texts[:-n_eval], tokenizer, data_args.block_size)
    eval_rows = token_blocks(texts[-n_eval:], tokenizer, data_args.block_size)
    say(f"jtrainer: {len(train_rows)} training rows, {len(eval_rows)} held-out rows of {data_args.block_size} tokens")

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
    )
    result = trainer.train()
    metrics = trainer.evaluate()
    perplexity = math.exp(metrics["eval_loss"])
    trainer.save_model(training_args.output_dir)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    say(f"jtrainer: train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "")
    say(f"jtrainer: held-out perplexity {perplexity:.2f} (eval_loss {metrics['eval_loss']:.4f})")
    say(f"jtrainer: model and tokenizer saved in HF format to {training_args.output_dir}")
    from jtrainer.generation import generate

    prompt = tokenizer(data_args.sample_prompt)["input_ids"] or [tokenizer.eos_token_id]
    ids = generate(trainer.model, [prompt], max_new_tokens=data_args.sample_tokens, do_sample=False)
    say("jtrainer: sample:\n" + tokenizer.decode(ids[0], skip_special_tokens=True))
    return {"train_loss": result.training_loss, "perplexity": perplexity, **metrics}


def parse_train_args(argv: list[str]):
    """(model, data, training) arguments from an optional YAML file plus command-line overrides."""
    from transformers import HfArgumentParser

    from jtrainer import TrainingArguments

    config_path = DEFAULT_CONFIG
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        config_path, argv = argv[0], argv[1:]
    if not os.path.exists(config_path):
        raise SystemExit(f"jtrainer train: config file {config_path!r} not found.")
    with open(config_path) as f:
        values = yaml.safe_load(f) or {}
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments), prog="jtrainer train")
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SystemExit(f"jtrainer train: unknown field(s) {unknown} in {config_path}.")
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


COMMANDS = ("train", "launch")


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
    model_args, data_args, training_args = parse_train_args(rest)
    run_train(model_args, data_args, training_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
