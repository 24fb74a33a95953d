"""What `jtrainer check` compiles for `trainer: sft | dpo`: TRL's loss on a Trainer with no dataset (nothing of
TRL's data preparation runs), and batches of the shapes the collators make."""

from __future__ import annotations

from typing import Any

import numpy as np

from jtrainer import bridge
from jtrainer.trainer.trainer import Trainer
from jtrainer.trl.common import router_aux_coefficient
from jtrainer.trl.dpo import DPOLoss, dpo_settings
from jtrainer.trl.reference import REFERENCE_COLUMNS
from jtrainer.trl.sft import SFTLoss


class SFTStep(SFTLoss, Trainer):
    """The SFT train step of a model and an SFTConfig."""

    def __init__(self, model: Any, args: Any, **kwargs: Any):
        self._router_aux_coef = router_aux_coefficient(model, args)
        super().__init__(model=model, args=args, **kwargs)
        self._bridged = bridge.is_bridged(self.nnx_model)


class DPOStep(DPOLoss, Trainer):
    """The DPO train step of a model and a DPOConfig; `adapter_reference`: the reference is the (peft) policy
    with its adapter disabled, run inside the step."""

    def __init__(self, model: Any, args: Any, adapter_reference: bool = False, **kwargs: Any):
        self._settings = dpo_settings(args)
        self._adapter_reference = adapter_reference
        self._router_aux_coef = router_aux_coefficient(model, args)
        super().__init__(model=model, args=args, **kwargs)
        self._bridged = bridge.is_bridged(self.nnx_model)


def step_trainer(kind: str, model: Any, args: Any, peft: bool, **kwargs: Any) -> Trainer:
    if kind == "sft":
        return SFTStep(model, args, **kwargs)
    return DPOStep(model, args, adapter_reference=peft, **kwargs)


def padding_free(args: Any) -> bool:
    """SFT's rows carry position_ids (and segments) instead of an attention mask (TRL's rule)."""
    return bool(args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"}))


def sample_batch(kind: str, args: Any, rows: int) -> dict[str, np.ndarray]:
    """A collated batch of the trainer's shapes at max_length (values do not change the program)."""
    length = args.max_length
    ids = np.ones((rows, length), np.int64)
    if kind == "sft":
        batch = {"input_ids": ids, "labels": ids.copy()}
        if padding_free(args):
            batch["position_ids"] = np.broadcast_to(np.arange(length), ids.shape).copy()
            batch["segment_ids"] = np.ones_like(ids)
        else:
            batch["attention_mask"] = np.ones_like(ids)
        return batch
    batch = {}
    for side in ("chosen", "rejected"):
        batch[f"{side}_input_ids"] = ids.copy()
        batch[f"{side}_attention_mask"] = np.ones_like(ids)
        batch[f"{side}_completion_mask"] = np.ones_like(ids)
    return {**batch, **{name: np.zeros(rows, np.float32) for name in REFERENCE_COLUMNS}}


def sequences_per_row(kind: str) -> int:
    """Sequences the model runs per batch row: DPO's pair is a chosen and a rejected completion."""
    return 2 if kind == "dpo" else 1
