"""Sequence packing for causal LMs: many documents per row, kept apart by the attention mask.

`pack_sequences` fills rows of `block_size` tokens with whole documents (first fit, in order; a document longer
than a block is cut into block-sized pieces). Each row carries `segment_ids` (1, 2, ... per document, 0 for
padding), `position_ids` restarting at 0 for each document, and `labels` with -100 at each document's first token
(the previous document's last token must not learn to predict it). jtrainer's Llama-family models attend only
within a segment, so a packed row computes exactly what its documents would compute alone, with no padding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from jtrainer.numerics.losses import IGNORE_INDEX


def _pieces(documents: Iterable[Sequence[int]], block_size: int):
    for doc in documents:
        doc = list(doc)
        for start in range(0, len(doc), block_size):
            piece = doc[start : start + block_size]
            if piece:
                yield piece


def pack_sequences(documents: Iterable[Sequence[int]], block_size: int, pad_token_id: int = 0) -> list[dict]:
    """Token-id documents -> packed rows {input_ids, labels, position_ids, segment_ids, attention_mask}."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    bins: list[list[list[int]]] = []
    free: list[int] = []
    for piece in _pieces(documents, block_size):
        for i, room in enumerate(free):  # first fit
            if len(piece) <= room:
                bins[i].append(piece)
                free[i] -= len(piece)
                break
        else:
            bins.append([piece])
            free.append(block_size - len(piece))
    rows = []
    for docs in bins:
        ids = np.full(block_size, pad_token_id, np.int32)
        labels = np.full(block_size, IGNORE_INDEX, np.int32)
        positions = np.zeros(block_size, np.int32)
        segments = np.zeros(block_size, np.int32)
        at = 0
        for n, doc in enumerate(docs, start=1):
            end = at + len(doc)
            ids[at:end] = doc
            labels[at:end] = doc
            labels[at] = IGNORE_INDEX  # not predicted from the previous document
            positions[at:end] = np.arange(len(doc))
            segments[at:end] = n
            at = end
        rows.append(
            {
                "input_ids": ids,
                "labels": labels,
                "position_ids": positions,
                "segment_ids": segments,
                "attention_mask": (segments > 0).astype(np.int32),
            }
        )
    return rows


def packing_efficiency(rows: Sequence[dict]) -> float:
    """The share of positions holding real tokens."""
    return float(np.mean([np.mean(r["segment_ids"] > 0) for r in rows])) if rows else 0.0
