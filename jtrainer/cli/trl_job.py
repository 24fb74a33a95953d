"""`jtrainer train` with `trainer: sft | dpo`: TRL's SFTTrainer or DPOTrainer (jtrainer.trl) on a pretrained
causal LM and a data file, with the main job's lock, resume, evaluation, export and summary."""

from __future__ import annotations

from typing import Any

from jtrainer.cli import tasks
from jtrainer.cli.console import say
from jtrainer.cli.tasks import DataArguments, ModelArguments
from jtrainer.core import storage
from jtrainer.core.errors import BadInput

# The columns each trainer reads (TRL's dataset forms).
SFT_FORMS = (("messages",), ("prompt", "completion"), ("text",))
DPO_FORMS = (("prompt", "chosen", "rejected"), ("chosen", "rejected"))


def check_trl_job(model_args: ModelArguments, data_args: DataArguments, training_args) -> None:
    """Refuse, before any data is read or model loaded, what TRL's trainers cannot run from the config."""
    trainer = model_args.trainer
    if model_args.task != "causal_lm":
        raise BadInput(f"trainer: {trainer} fine-tunes causal language models: set task: causal_lm.")
    if not model_args.model_name_or_path:
        raise BadInput(
            f"model_name_or_path: trainer: {trainer} fine-tunes a pretrained model: give a local folder with its "
            "config, weights and tokenizer (with a chat template for messages rows)."
        )
    if not (data_args.train_file or data_args.dataset_name):
        forms = " / ".join("+".join(f) for f in (SFT_FORMS if trainer == "sft" else DPO_FORMS))
        raise BadInput(f"train_file: trainer: {trainer} trains on a json/jsonl file of rows with {forms} columns.")
    for name, path in (
        ("output_dir", training_args.output_dir),
        ("model_name_or_path", model_args.model_name_or_path),
        ("tokenizer_name", model_args.tokenizer_name),
        ("dataset_name", data_args.dataset_name),
        ("train_file", data_args.train_file),
        ("validation_file", data_args.validation_file),
    ):
        storage.check_reachable(path or "", name)
    tasks.check_model_folder(
        model_args.model_name_or_path, tokenizer_elsewhere=bool(model_args.tokenizer_name), bridge=model_args.bridge
    )
    tasks.check_data(data_args, "causal_lm")
    if training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise BadInput("max_steps and num_train_epochs are both 0: nothing would be trained; set one above 0.")


def _check_form(dataset, trainer: str, source: str) -> None:
    forms = SFT_FORMS if trainer == "sft" else DPO_FORMS
    if not any(all(c in dataset.column_names for c in form) for form in forms):
        wanted = " or ".join("+".join(f) for f in forms)
        raise BadInput(f"{source}: its columns {dataset.column_names} hold no {wanted} rows for trainer: {trainer}.")


def trl_job(model_args: ModelArguments, data_args: DataArguments, training_args, resume: str | None) -> dict:
    import datasets
    from transformers import AutoTokenizer

    from jtrainer.trl import DPOTrainer, SFTTrainer

    datasets.disable_progress_bars()  # reading a file is quick; a refusal of its columns stays one line
    try:
        train_rows, eval_rows = tasks.load_splits(data_args)
    finally:
        datasets.enable_progress_bars()
    _check_form(train_rows, model_args.trainer, "train_file" if data_args.train_file else "dataset_name")
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model: Any = model_args.model_name_or_path
    if model_args.bridge:  # transformers' own torch model; a path is jtrainer's native family where it has one
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model)
    say(f"jtrainer: {len(train_rows)} training rows, {len(eval_rows)} held-out rows (trainer: {model_args.trainer})")
    common = dict(
        model=model,
        args=training_args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        peft_config=_lora(model_args),
    )
    trainer = SFTTrainer(**common) if model_args.trainer == "sft" else DPOTrainer(**common)
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    trainer.save_model(training_args.output_dir)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    say(f"jtrainer: train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "")
    say(f"jtrainer: held-out eval_loss {metrics['eval_loss']:.4f}")
    say(f"jtrainer: model and tokenizer saved in HF format to {training_args.output_dir}")
    return {"eval_loss": metrics["eval_loss"], "steps": trainer.state.global_step}


def _lora(model_args: ModelArguments):
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
        task_type="CAUSAL_LM",
    )
