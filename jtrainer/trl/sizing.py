"""What `jtrainer check` compiles for `trainer: sft | dpo`: TRL's loss spec as its trainers decide it (without a
trainer, nothing of TRL's data preparation runs), and batches of the shapes the collators make."""

from __future__ import annotations

from typing import Any

import numpy as np

from jtrainer import bridge
from jtrainer.kinds import loss_rules
from jtrainer.numerics.step import LossSpec
from jtrainer.trl.common import router_aux_coefficient
from jtrainer.trl.dpo import DPOLossFunction, dpo_base_spec, dpo_settings, with_reference_columns
from jtrainer.trl.reference import REFERENCE_COLUMNS
from jtrainer.trl.sft import SFTLossFunction


def loss_spec(
    kind: str, context: loss_rules.LossContext, sample: dict[str, np.ndarray], training: bool, peft: bool
) -> LossSpec:
    """The loss spec SFTTrainer or DPOTrainer (`kind`) compiles for batches shaped like `sample`: TRL's loss as
    their compute_loss over their base rules, probed as the Trainer probes it. `peft`: DPO's reference is the
    policy with its adapter disabled."""
    held, args = context.held, context.args
    bridged = bridge.is_bridged(held.module)
    coefficient = router_aux_coefficient(held.given, args)
    loss_rules.require_trainable(context, training)
    if kind == "sft":
        base = loss_rules.default_spec(context, sample, training)
        function: Any = SFTLossFunction(args.loss_type, bridged, coefficient)
    else:
        sample = with_reference_columns(sample)
        base = dpo_base_spec(args, training)
        function = DPOLossFunction(dpo_settings(args), bridged, peft, coefficient)
    name = f"{'SFT' if kind == 'sft' else 'DPO'}Trainer.compute_loss"
    return loss_rules.override_spec(context, base, function, sample, training, None, name)


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
