"""HF's info messages (the training and evaluation banners, "Saving model checkpoint to", "Training completed")
come through transformers' logger, the same lines as transformers.Trainer's in the same run."""

import logging

import torch
import transformers
from conftest import tiny_llama_config, token_rows, torch_rows

from jtrainer import Trainer, TrainingArguments
from jtrainer.models import AutoModelForCausalLM


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run(trainer_class, args_class, model, rows, out):
    handler = Lines()
    hf = logging.getLogger("transformers.trainer")
    hf.addHandler(handler)
    level = hf.level
    hf.setLevel(logging.INFO)
    try:
        args = args_class(
            output_dir=str(out),
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            max_steps=2,
            save_steps=2,
            logging_steps=1,
            report_to="none",
            disable_tqdm=True,
        )
        trainer = trainer_class(model=model, args=args, train_dataset=rows, eval_dataset=rows)
        trainer.train()
        trainer.evaluate()
    finally:
        hf.removeHandler(handler)
        hf.setLevel(level)
    return handler.lines


def test_the_banners_and_save_messages_are_transformers_own(tmp_path):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(tiny_llama_config())
    reference.save_pretrained(tmp_path / "ref")
    rows = token_rows(6, length=8)
    theirs = _run(transformers.Trainer, transformers.TrainingArguments, reference, torch_rows(rows), tmp_path / "hf")
    ours = _run(
        Trainer, TrainingArguments, AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref")), rows, tmp_path / "jt"
    )

    def shown(lines, out):
        return [
            line.replace(str(out), "OUT")
            for line in lines
            if line.lstrip("\n").startswith(("*****", "  ", "Saving model checkpoint", "\n\nTraining completed"))
        ]

    assert shown(ours, tmp_path / "jt") == shown(theirs, tmp_path / "hf")
