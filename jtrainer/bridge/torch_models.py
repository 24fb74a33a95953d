"""transformers' PyTorch models for the `jtrainer` command's tasks (`bridge: true` in a config)."""

from __future__ import annotations

import torch
import transformers

from jtrainer.bridge.module import TorchModel

AUTO_CLASSES = {
    "causal_lm": transformers.AutoModelForCausalLM,
    "sequence_classification": transformers.AutoModelForSequenceClassification,
    "seq2seq": transformers.AutoModelForSeq2SeqLM,
}


def build(task: str, config, folder: str | None, seed: int, abstract: bool = False):
    """The task's transformers model of `config`: its weights from `folder`, or fresh from `seed`. `abstract`:
    built on torch's meta device and wrapped with shapes only (no weights allocated), for `jtrainer check`."""
    auto = AUTO_CLASSES[task]
    if abstract:
        with torch.device("meta"):
            return TorchModel(auto.from_config(config))
    if folder:
        from jtrainer import storage

        return auto.from_pretrained(storage.fetched(folder))
    torch.manual_seed(seed)
    return auto.from_config(config)
