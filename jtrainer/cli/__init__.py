"""The `jtrainer` command: `jtrainer train|check [CONFIG.yaml] [--field value ...]` and `jtrainer launch`.

The application layer over the library (nothing in `jtrainer` outside this package imports it).

Model, data and training arguments are parsed by `transformers.HfArgumentParser`: a YAML file gives the values,
command-line flags override them, and bad values fail with argparse's error naming the flag. Without a config
file the embedded default, `configs/default.yaml`, runs: a byte-level BPE tokenizer and a small Llama trained on
the source of Python's standard library, with nothing downloaded.

- `train.py`: the main job (`jtrainer train`); `check.py`: the dry run and sizing (`jtrainer check`);
  `launch.py`: N local processes of one job (`jtrainer launch`); `config.py`: config files and flags;
  `tasks.py`: what a config describes (task, model, data) and how it is built; `console.py`: printing.
"""

from __future__ import annotations

import signal
import sys

from jtrainer.cli import help_pages
from jtrainer.cli.config import DEFAULT_CONFIG, RunArguments, parse_train_args, read_config
from jtrainer.cli.console import say
from jtrainer.core.errors import BadInput

__all__ = [
    "DEFAULT_CONFIG",
    "RunArguments",
    "main",
    "parse_train_args",
    "read_config",
    "resume_point",
    "run_train",
    "say",
]


def __getattr__(name: str):
    if name in ("resume_point", "run_train"):  # the training loop's imports: not needed for `--help`
        from jtrainer.cli import train

        return getattr(train, name)
    raise AttributeError(f"module 'jtrainer.cli' has no attribute {name!r}")


COMMANDS = ("train", "check", "launch")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_pages.top_help())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(
            f"jtrainer: unknown command {command!r}: choose from {', '.join(COMMANDS)} (`jtrainer --help`).",
            file=sys.stderr,
        )
        return 2
    if command == "launch":
        from jtrainer.cli.launch import run_launch

        return run_launch(rest)
    if {"-h", "--help", "--help-all"} & set(rest):
        parse_train_args(rest, command)  # prints the page and exits, before the training machinery loads
    from jtrainer.runtime import quiet

    quiet.choose_platforms()
    quiet.silence_kernel_hub_notice()
    with quiet.filtered_stderr():  # importing jax: jaxlib's CUDA modules load
        import jax

        from jtrainer.cli.train import Diverged, Stopped, run_train
        from jtrainer.runtime import startup
        from jtrainer.sizing import targets

    try:
        startup.initialize()  # join the other processes (jtrainer launch, TPU VMs), before any device is used
        model_args, data_args, training_args, run_args = parse_train_args(rest, command)
        if command == "check" and run_args.target is not None:
            targets.compile_here_on_cpu()
        with quiet.filtered_stderr():  # the backend comes up: its plugins' lines
            jax.devices()
        if command == "check":
            from jtrainer.cli.check import run_check, run_check_native_and_bridged

            check = run_check_native_and_bridged if run_args.compare_bridge else run_check
            result = check(
                model_args, data_args, training_args, run_args.target, run_args.num_slices, run_args.num_nodes
            )
            return 0 if result["fits"] else 1
        if run_args.target is not None:
            raise BadInput("--target is an option of `jtrainer check` (sizing a run for another machine).")
        if run_args.compare_bridge:
            raise BadInput("--compare_bridge is an option of `jtrainer check` (the native and bridged steps' sizes).")
        run_train(model_args, data_args, training_args, run_args)
    except Stopped as e:  # SIGTERM outside train(): the lock released, the checkpoints kept
        print(f"jtrainer {command}: {e}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:  # Ctrl-C: train() has committed the save in flight; the lock is released
        print(
            f"jtrainer {command}: interrupted (Ctrl-C); the committed checkpoints are kept: run the same command "
            "again to continue.",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    except (BadInput, Diverged) as e:  # refused before any work (or, for a file, as soon as it is read), or
        # weights that diverged to NaN/Inf (no export, no perplexity of NaN): one line
        print(f"jtrainer {command}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the disk: full, read-only, a file-size limit; the message names the file
        if e.filename is None:
            raise
        print(
            f"jtrainer {command}: {e.strerror or e} writing or reading {e.filename!r}: free space, fix "
            "permissions or limits, then run the same command again (it continues from the last checkpoint).",
            file=sys.stderr,
        )
        return 1
    return 0
