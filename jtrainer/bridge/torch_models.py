"""transformers' PyTorch models for the `jtrainer` command's tasks (`bridge: true` in a config)."""

from __future__ import annotations

import torch
import transformers

from jtrainer.bridge.module import TorchModel
from jtrainer.core.errors import BadInput

AUTO_CLASSES = {
    "causal_lm": transformers.AutoModelForCausalLM,
    "sequence_classification": transformers.AutoModelForSequenceClassification,
    "seq2seq": transformers.AutoModelForSeq2SeqLM,
}


# peft's task type of each task: which PeftModel class wraps the model.
PEFT_TASKS = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}


def lora_config(model_args):
    """The peft LoraConfig of the command's LoRA options (TRL's names: lora_r, lora_alpha, ...)."""
    import peft

    targets = model_args.lora_target_modules
    return peft.LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        task_type=PEFT_TASKS[model_args.task],
    )


def build(task: str, config, folder: str | None, seed: int, abstract: bool = False, lora=None):
    """The task's transformers model of `config`: its weights from `folder`, or fresh from `seed`; with `lora` (a
    peft config) wrapped in a peft model whose adapters train. `abstract`: built on torch's meta device and
    wrapped with shapes only (no weights allocated), for `jtrainer check`."""
    auto = AUTO_CLASSES[task]
    if abstract:
        with torch.device("meta"):
            return TorchModel(_adapted(auto.from_config(config), lora))
    if folder:
        from jtrainer.core import storage

        return _adapted(auto.from_pretrained(storage.fetched(folder)), lora)
    torch.manual_seed(seed)
    return _adapted(auto.from_config(config), lora)


def check_lora_targets(task: str, config, lora) -> None:
    """peft's refusal of target modules the model lacks, as one line naming the model's own linear layers
    (the model built on torch's meta device: no weights)."""
    import peft

    with torch.device("meta"):
        model = AUTO_CLASSES[task].from_config(config)
    try:
        peft.get_peft_model(model, lora)
    except ValueError as e:
        names = sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
        )
        first = str(e).strip().splitlines()[0]
        raise BadInput(
            f"lora_target_modules={sorted(lora.target_modules)}: {first} This model's linear layers are named "
            f"{', '.join(names)} (or use all-linear)."
        ) from None


def _adapted(model, lora):
    if lora is None:
        return model
    import peft

    return peft.get_peft_model(model, lora)
