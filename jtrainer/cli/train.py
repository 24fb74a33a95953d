"""`jtrainer train`: the main job. It holds output_dir's lock for the whole job and, run again with the same
output_dir, continues from the last committed checkpoint there (as HF's example scripts and Levanter/MaxText do):
a preempted job is re-run as it was. `--resume_from_checkpoint PATH` resumes from PATH, `--overwrite_output_dir`
starts afresh."""

from __future__ import annotations

import contextlib
import math
import signal
from collections.abc import Iterator
from typing import Any

from jtrainer.cli import tasks
from jtrainer.cli.config import RunArguments
from jtrainer.cli.console import say
from jtrainer.cli.tasks import DataArguments, ModelArguments
from jtrainer.core import storage
from jtrainer.core.errors import BadInput


class Stopped(BaseException):
    """SIGTERM while the job is outside Trainer.train() (reading data, training the tokenizer, or evaluating and
    exporting after the last step); within train() SIGTERM saves a checkpoint instead. A BaseException, so that
    no `except Exception` on the way swallows it; the lock is released as the stack unwinds."""

    def __init__(self, output_dir: str):
        super().__init__(
            f"stopped by SIGTERM outside training; the committed checkpoints in {output_dir} are kept: run the "
            "same command again to continue (after the last step it evaluates and exports)."
        )


class Diverged(Exception):
    """The trained weights are not finite: the job exports nothing and prints no metrics made of NaN."""


@contextlib.contextmanager
def sigterm_stops_the_job(output_dir: str) -> Iterator[None]:
    def on_sigterm(signum, frame):
        raise Stopped(output_dir)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_train(
    model_args: ModelArguments, data_args: DataArguments, training_args, run_args: RunArguments | None = None
) -> dict:
    """Train the config's model on its data (continuing an earlier run in output_dir), evaluate, save in HF format
    and print a summary."""
    import jax

    from jtrainer.checkpointing import run_lock
    from jtrainer.numerics.optim import check_optimizer

    try:
        check_optimizer(training_args)  # fail before reading text and training a tokenizer
    except ValueError as e:
        raise BadInput(str(e)) from None
    trl = model_args.trainer in ("sft", "dpo")
    if trl:
        from jtrainer.cli.trl_job import check_trl_job

        check_trl_job(model_args, data_args, training_args)
    else:
        tasks.check_job(model_args, data_args, training_args)
    with sigterm_stops_the_job(training_args.output_dir):
        with run_lock.hold(training_args.output_dir, is_main=jax.process_index() == 0):
            resume = resume_point(training_args, run_args or RunArguments())
            if trl:
                from jtrainer.cli.trl_job import trl_job

                return trl_job(model_args, data_args, training_args, resume)
            return _train_job(model_args, data_args, training_args, resume)


def resume_point(training_args, run_args: RunArguments) -> str | None:
    """The checkpoint this job continues from: --resume_from_checkpoint, else the last committed one in
    output_dir; None to start afresh (an empty output_dir, or --overwrite_output_dir, which removes the earlier
    run's checkpoints). An output_dir holding other files but no checkpoint is refused, as HF's scripts do."""
    import jax

    from jtrainer.checkpointing import checkpoint
    from jtrainer.checkpointing.run_lock import LOCK_NAME
    from jtrainer.parallel import distributed

    out, explicit = training_args.output_dir, training_args.resume_from_checkpoint
    if explicit and run_args.overwrite_output_dir:
        raise BadInput("--resume_from_checkpoint and --overwrite_output_dir contradict each other: pass one of them.")
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
        raise BadInput(
            f"the processes find different last checkpoints in {out!r}: output_dir "
            "must be storage that every host shares."
        )
    if last:
        say(
            f"jtrainer: resuming from {last}, the last committed checkpoint in {out} (--overwrite_output_dir "
            "starts afresh)"
        )
        return last
    others = sorted(
        name
        for name in storage.listdir(out)
        if not (name.startswith(LOCK_NAME) or name.endswith(checkpoint.TMP_SUFFIX) or name == "runs")
    )
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise BadInput(
            f"output_dir {out!r} is not empty ({shown}) and has no committed checkpoint "
            "to continue from: pass --overwrite_output_dir to start afresh there, or choose another "
            "--output_dir."
        )
    return None


def _train_job(model_args: ModelArguments, data_args: DataArguments, training_args, resume: str | None) -> dict:
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

    from jtrainer import Seq2SeqTrainer, Trainer
    from jtrainer.trainer.saving import params_finite

    # A resumed job keeps the tokenizer it trained (saved in every checkpoint) instead of training it again.
    saved_tokenizer = resume if resume and storage.isfile(storage.join(resume, "tokenizer_config.json")) else None
    tokenizer, train_rows, eval_rows = tasks.build_data(model_args, data_args, saved_tokenizer)
    model = tasks.build_model(model_args, len(tokenizer), tasks.special_tokens(tokenizer), training_args.seed)
    say(f"jtrainer: {len(train_rows)} training rows, {len(eval_rows)} held-out rows ({model_args.task})")
    task = model_args.task
    collator: Any = None
    compute_metrics, trainer_class = None, Trainer
    if task == "sequence_classification":
        collator = DataCollatorWithPadding(tokenizer, return_tensors="np")
        compute_metrics = tasks.accuracy
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
    if not params_finite(trainer.nnx_model):
        raise Diverged(
            f"training diverged: the trained weights hold NaN or Inf (train loss {result.training_loss}), so "
            f"nothing is exported to {training_args.output_dir}: lower --learning_rate or set --max_grad_norm, "
            "then start afresh with --overwrite_output_dir."
        )
    metrics = trainer.evaluate()
    trainer.save_model(training_args.output_dir)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    say(f"jtrainer: train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "")
    summary = {"train_loss": result.training_loss, **metrics}
    if task == "causal_lm":
        summary["perplexity"] = math.exp(metrics["eval_loss"])
        say(f"jtrainer: held-out perplexity {summary['perplexity']:.2f} (eval_loss {metrics['eval_loss']:.4f})")
    else:
        say(
            "jtrainer: held-out "
            + ", ".join(
                f"{k} {v:.4f}"
                for k, v in metrics.items()
                if "runtime" not in k and "per_second" not in k and isinstance(v, float)
            )
        )
    say(f"jtrainer: model and tokenizer saved in HF format to {training_args.output_dir}")
    if task == "causal_lm" and data_args.sample_tokens > 0:  # 0: no sample
        from jtrainer.models.generation import generate

        prompt = tokenizer(data_args.sample_prompt)["input_ids"] or [tokenizer.eos_token_id]
        if model_args.bridge:  # transformers' own generate, on the torch model holding the trained weights
            import torch

            with torch.no_grad():
                ids = trainer.model.generate(
                    torch.tensor([prompt]), max_new_tokens=data_args.sample_tokens, do_sample=False
                ).numpy()
        else:
            ids = generate(trainer.model, [prompt], max_new_tokens=data_args.sample_tokens, do_sample=False)
        say("jtrainer: sample:\n" + tokenizer.decode(ids[0], skip_special_tokens=True))
    return summary
