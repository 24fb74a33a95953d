"""TRL's SFTConfig and DPOConfig on jtrainer's TrainingArguments, and how jtrainer treats each TRL field.

The classes are TRL's own dataclasses (TRL's defaults: bf16, gradient checkpointing, logging every 10 steps, the
learning rates) with jtrainer's TrainingArguments behind them, so every HF field means what jtrainer's
TrainingArguments make of it and jtrainer's own fields (mesh_shape, ...) are there too. A TRL field jtrainer
cannot honour is refused in one line when set (`check_trl_fields`), never dropped quietly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import trl

from jtrainer.core.errors import BadInput
from jtrainer.trainer.args import TrainingArguments

# TRL's own fields -> how jtrainer treats them: ("honoured", where) or ("refused", why and what to do instead).
# Honoured fields run TRL's own code (its dataset preparation) or jtrainer's step (the losses).
SFT_FIELDS: dict[str, tuple[str, str]] = {
    "model_init_kwargs": ("honoured", "from_pretrained's keyword arguments when the model is a path"),
    "trust_remote_code": ("honoured", "from_pretrained's trust_remote_code"),
    "router_aux_loss_coef": ("honoured", "MoE models' load-balancing loss, added in the compiled step"),
    "chat_template_path": ("honoured", "TRL's chat-template handling (a .jinja file, or a tokenizer to clone)"),
    "dataset_text_field": ("honoured", "TRL's dataset preparation"),
    "dataset_kwargs": ("honoured", "TRL's dataset preparation (skip_prepare_dataset)"),
    "dataset_num_proc": ("honoured", "TRL's dataset preparation"),
    "eos_token": ("honoured", "TRL's tokenizer handling"),
    "max_length": ("honoured", "TRL's truncation and packing"),
    "truncation_mode": ("honoured", "TRL's truncation"),
    "shuffle_dataset": ("honoured", "TRL's dataset preparation"),
    "packing": ("honoured", "TRL's pack_dataset; packed rows attend within their documents"),
    "packing_strategy": ("honoured", "TRL's pack_dataset (bfd, bfd_split, wrapped)"),
    "padding_free": ("honoured", "rows whose documents attend only within themselves (position_ids / segments)"),
    "pad_to_multiple_of": ("honoured", "the collator's padding"),
    "eval_packing": ("honoured", "TRL's dataset preparation"),
    "completion_only_loss": ("honoured", "TRL's labels; the loss in the compiled step"),
    "assistant_only_loss": ("honoured", "TRL's labels from the chat template; the loss in the compiled step"),
    "loss_type": ("honoured", "nll and dft, computed in the compiled step"),
    "activation_offloading": ("refused", "there is no torch autograd to offload from; use gradient_checkpointing"),
    "pad_token": ("honoured", "TRL's tokenizer handling"),
}

DPO_FIELDS: dict[str, tuple[str, str]] = {
    "model_init_kwargs": SFT_FIELDS["model_init_kwargs"],
    "trust_remote_code": SFT_FIELDS["trust_remote_code"],
    "router_aux_loss_coef": SFT_FIELDS["router_aux_loss_coef"],
    "disable_dropout": ("honoured", "dropout probabilities of the policy and reference set to 0"),
    "dataset_num_proc": ("honoured", "TRL's dataset preparation"),
    "max_length": ("honoured", "TRL's truncation"),
    "truncation_mode": ("honoured", "TRL's truncation"),
    "padding_free": ("refused", "padding-free DPO is not built yet; set padding_free=False"),
    "pad_to_multiple_of": ("honoured", "the collator's padding"),
    "precompute_ref_log_probs": ("honoured", "the reference's log-probabilities computed once, before training"),
    "precompute_ref_batch_size": ("honoured", "the batch of that pass"),
    "loss_type": ("honoured", "every loss TRL 1.16 offers, computed in the compiled step"),
    "loss_weights": ("honoured", "the weighted sum of the loss types"),
    "ld_alpha": ("honoured", "LD-DPO's weighting of the tokens past the shorter completion"),
    "f_divergence_type": ("honoured", "the f-divergence of the loss"),
    "f_alpha_divergence_coef": ("honoured", "the alpha of the alpha-divergence"),
    "label_smoothing": ("honoured", "the robust / conservative losses' smoothing"),
    "beta": ("honoured", "the loss's temperature"),
    "use_weighting": ("honoured", "WPO's weighting of each pair by its completions' probabilities"),
    "discopop_tau": ("honoured", "DiscoPOP's temperature"),
    "activation_offloading": SFT_FIELDS["activation_offloading"],
    "sync_ref_model": ("refused", "TR-DPO's reference syncing is not built yet; set sync_ref_model=False"),
    "ref_model_mixup_alpha": ("honoured", "read only with sync_ref_model"),
    "ref_model_sync_steps": ("honoured", "read only with sync_ref_model"),
    "pad_token": ("honoured", "TRL's tokenizer handling"),
}


def check_trl_fields(args: Any, table: dict[str, tuple[str, str]], defaults: type) -> None:
    """Refuse, in one line naming the field, a refused TRL field set away from TRL's default."""
    default_of = {f.name: f for f in dataclasses.fields(defaults)}
    for name, (treatment, why) in table.items():
        if treatment != "refused":
            continue
        spec = default_of[name]
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        value = getattr(args, name)
        if value != default:
            raise BadInput(f"{type(args).__name__}.{name}={value!r} is not supported by jtrainer.trl: {why}.")


def padding_multiple(args: Any) -> int | None:
    """pad_to_multiple_of as a number (TRL's field also takes "auto", resolved at construction)."""
    value = args.pad_to_multiple_of
    return None if value is None else int(value)


def _resolve_auto_padding(args: Any) -> None:
    # TRL reads "auto" from torch's device type (128 on Neuron); jtrainer never runs there.
    if args.pad_to_multiple_of == "auto":
        args.pad_to_multiple_of = None


@dataclasses.dataclass(repr=False)
class SFTConfig(trl.SFTConfig, TrainingArguments):
    """TRL's SFTConfig (its fields and defaults) with jtrainer's TrainingArguments."""

    trl_fields: ClassVar[dict[str, tuple[str, str]]] = SFT_FIELDS

    def __post_init__(self):
        _resolve_auto_padding(self)
        super().__post_init__()
        check_trl_fields(self, SFT_FIELDS, trl.SFTConfig)

    def to_dict(self) -> dict[str, Any]:
        return trl.SFTConfig.to_dict(self)


@dataclasses.dataclass(repr=False)
class DPOConfig(trl.DPOConfig, TrainingArguments):
    """TRL's DPOConfig (its fields and defaults) with jtrainer's TrainingArguments."""

    trl_fields: ClassVar[dict[str, tuple[str, str]]] = DPO_FIELDS

    def __post_init__(self):
        _resolve_auto_padding(self)
        super().__post_init__()
        check_trl_fields(self, DPO_FIELDS, trl.DPOConfig)

    def to_dict(self) -> dict[str, Any]:
        return trl.DPOConfig.to_dict(self)
