"""The batches TRL's collators make, as numpy arrays of shapes that compile once.

TRL's `DataCollatorForLanguageModeling` pads each batch to its longest row; with padding-free (BFD packing turns it
on) it concatenates the batch into one row whose `position_ids` restart at each document, and the model keeps
documents apart from the position_ids. jtrainer keeps one row per example instead (a packed sequence, or an
example), each padded to `max_length` when packing: the same documents attend to the same tokens and every sum
is the same, but every batch has one shape, so the step compiles once. Each document's first label is -100 as in
TRL. `segment_ids` (1, 2, ... per document, 0 on padding) carry the same boundaries for jtrainer's native models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jtrainer.numerics.losses import IGNORE_INDEX


def _padded_length(longest: int, multiple: int | None, fixed: int | None) -> int:
    length = max(longest, fixed or 0)
    if multiple:
        length = -(-length // multiple) * multiple
    return length


def _pad(rows: Sequence[np.ndarray], length: int, value: int) -> np.ndarray:
    out = np.full((len(rows), length), value, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def document_positions(seq_lengths: Sequence[int]) -> np.ndarray:
    """position_ids restarting at 0 at each document of a packed sequence."""
    return np.concatenate([np.arange(n) for n in seq_lengths]) if len(seq_lengths) else np.zeros(0, np.int64)


@dataclasses.dataclass
class LanguageModelingCollator:
    """TRL's SFT batches: input_ids, labels (-100 off the loss) and attention_mask; or, padding-free,
    position_ids and segment_ids instead of the mask."""

    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    fixed_length: int | None = None  # packing: every row padded to max_length (one compiled shape)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        input_ids = [np.asarray(e["input_ids"], np.int64) for e in examples]
        labels = [np.asarray(e.get("labels", e["input_ids"]), np.int64) for e in examples]
        length = _padded_length(max(len(r) for r in input_ids), self.pad_to_multiple_of, self.fixed_length)
        batch = {"input_ids": _pad(input_ids, length, self.pad_token_id)}
        if not self.padding_free:
            batch["attention_mask"] = _pad([np.ones_like(r) for r in input_ids], length, 0)
            batch["labels"] = _pad(labels, length, IGNORE_INDEX)
            return batch
        lengths = [
            [len(r)] if e.get("seq_lengths") is None else [int(n) for n in e["seq_lengths"]]
            for e, r in zip(examples, input_ids, strict=True)
        ]
        positions = [document_positions(n) for n in lengths]
        segments = [np.repeat(np.arange(1, len(n) + 1), n) for n in lengths]
        labels = [np.where(p == 0, IGNORE_INDEX, lab) for p, lab in zip(positions, labels, strict=True)]
        batch["labels"] = _pad(labels, length, IGNORE_INDEX)
        batch["position_ids"] = _pad(positions, length, 0)
        batch["segment_ids"] = _pad(segments, length, 0)
        return batch


def real_tokens(batch: dict[str, np.ndarray]) -> int:
    """The tokens of a batch that are not padding (TRL's num_tokens counts them)."""
    if "chosen_attention_mask" in batch:
        return int(np.sum(batch["chosen_attention_mask"]) + np.sum(batch["rejected_attention_mask"]))
    if "attention_mask" in batch:
        return int(np.sum(batch["attention_mask"]))
    if "segment_ids" in batch:
        return int(np.count_nonzero(batch["segment_ids"]))
    return int(np.size(batch["input_ids"]))


@dataclasses.dataclass
class PreferenceCollator:
    """TRL's DPO batches (`DataCollatorForPreference`: prompt + chosen and prompt + rejected, truncated to
    max_length, with their completion masks), one row per pair: chosen_* and rejected_* columns padded to one
    length (TRL stacks the 2B rows, chosen first; the loss does the same in the step)."""

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(
                f"Unsupported truncation mode: {self.truncation_mode}, expected 'keep_start' or 'keep_end'"
            )
        sides: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for side in ("chosen", "rejected"):
            ids = [list(e["prompt_ids"]) + list(e[f"{side}_ids"]) for e in examples]
            masks = [[0] * len(e["prompt_ids"]) + [1] * len(e[f"{side}_ids"]) for e in examples]
            if self.max_length is not None:
                cut = (
                    slice(None, self.max_length)
                    if self.truncation_mode == "keep_start"
                    else slice(-self.max_length, None)
                )
                ids, masks = [i[cut] for i in ids], [m[cut] for m in masks]
            sides[side] = ([np.asarray(i, np.int64) for i in ids], [np.asarray(m, np.int64) for m in masks])
        longest = max(len(row) for rows, _ in sides.values() for row in rows)
        length = _padded_length(longest, self.pad_to_multiple_of, None)
        batch: dict[str, np.ndarray] = {}
        for side, (rows, row_masks) in sides.items():
            batch[f"{side}_input_ids"] = _pad(rows, length, self.pad_token_id)
            batch[f"{side}_attention_mask"] = _pad([np.ones_like(i) for i in rows], length, 0)
            batch[f"{side}_completion_mask"] = _pad(row_masks, length, 0)
        for name in ("ref_chosen_logps", "ref_rejected_logps"):
            if name in examples[0]:
                batch[name] = np.asarray([e[name] for e in examples], np.float32)
        return batch
