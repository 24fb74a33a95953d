"""Datasets -> index order -> collated numpy batches -> static-shape windows -> device arrays, prefetched.

Index order is a pure function of (seed, epoch); batches are padded to static shapes (rows with -100 labels,
sequences to a high-water mark that only grows by powers of two), so the step compiles once per shape.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from jtrainer.core import host_rng
from jtrainer.kinds.loss_rules import call_signature
from jtrainer.numerics.losses import IGNORE_INDEX

Batch = dict[str, np.ndarray]

logger = logging.getLogger(__name__)


def has_length(dataset: Any) -> bool:
    try:
        return len(dataset) is not None
    except (TypeError, NotImplementedError):
        return False


def is_hf_dataset(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.")


def model_signature_columns(model: Any) -> list[str]:
    """The keyword inputs a model takes (`call_signature`), plus HF's label columns (as `_set_signature_columns`)."""
    params = call_signature(model).parameters
    names = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return list(dict.fromkeys(names + ["label", "label_ids", "labels"]))


def remove_unused_columns(dataset: Any, keep: Sequence[str]) -> Any:
    """Drop columns the model does not take. HF datasets lose columns; other datasets are filtered per row."""
    if is_hf_dataset(dataset) and getattr(dataset, "column_names", None) is not None:
        unused = [c for c in dataset.column_names if c not in keep]
        if unused and len(unused) == len(dataset.column_names):
            raise ValueError(
                f"No columns in the dataset match the model's inputs {list(keep)}; the dataset has "
                f"{dataset.column_names}. Rename the columns or pass remove_unused_columns=False."
            )
        return dataset.remove_columns(unused) if unused else dataset
    return _FilteredRows(dataset, set(keep))


class _FilteredRows:
    """A view of a dataset whose rows keep only the given keys."""

    def __init__(self, dataset: Any, keep: set[str]):
        self.dataset, self.keep = dataset, keep

    def _filter(self, row):
        return {k: v for k, v in row.items() if k in self.keep} if isinstance(row, dict) else row

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self._filter(self.dataset[i])

    def __iter__(self):
        return (self._filter(r) for r in self.dataset)


def index_order(
    n: int,
    *,
    seed: int,
    epoch: int,
    strategy: str,
    batch_size: int,
    lengths: Sequence[int] | None = None,
    permutation: np.ndarray | None = None,
) -> np.ndarray:
    """The order of row indices for one epoch, HF's. A shuffle is accelerate's seedable sampler: torch's randperm
    from a generator seeded with seed + epoch (`host_rng.randperm`), unless `permutation` gives the one
    drawn (HF's LengthGroupedSampler draws from torch's global generator). group_by_length groups it as HF's
    get_length_grouped_indices, in mega-batches of `batch_size` rows."""
    if strategy == "sequential":
        return np.arange(n)
    order = permutation if permutation is not None else host_rng.randperm(n, seed + epoch)
    if strategy == "group_by_length":
        if lengths is None:
            raise ValueError("train_sampling_strategy='group_by_length' needs a length column or input_ids rows.")
        order = length_grouped(order, lengths, batch_size)
    return order


def length_grouped(order: np.ndarray, lengths: Sequence[int], batch_size: int) -> np.ndarray:
    """HF's get_length_grouped_indices on a drawn permutation: mega-batches of min(n // (4 batch), 50) batches
    (at least one) sorted by length, longest first (stable), and the longest row of all moved to the front."""
    n = len(order)
    size = (min(n // (batch_size * 4), 50) or 1) * batch_size
    groups = [sorted(order[i : i + size].tolist(), key=lambda j: lengths[j], reverse=True) for i in range(0, n, size)]
    longest = int(np.argmax([lengths[group[0]] for group in groups]))
    groups[0][0], groups[longest][0] = groups[longest][0], groups[0][0]
    return np.asarray([i for group in groups for i in group], np.int64)


def default_collator(processing_class: Any = None) -> Callable[[list[dict]], Batch]:
    """HF's choice of default collator, in numpy: padding with a tokenizer, plain stacking otherwise."""
    from transformers import DataCollatorWithPadding, default_data_collator

    if processing_class is not None and hasattr(processing_class, "pad"):
        return DataCollatorWithPadding(processing_class, return_tensors="np")
    return lambda features: default_data_collator(features, return_tensors="np")


def to_numpy_batch(batch: Any) -> Batch:
    """A collator's output (numpy, torch, jax or lists) as a dict of numpy arrays. A column the collator left
    None (DataCollatorForSeq2Seq's `labels` of rows without labels) is absent, as HF's `inputs.get(...) is None`."""
    out = {}
    for key, value in dict(batch).items():
        if value is None:
            continue
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        out[key] = np.asarray(value)
    return out


class BatchLoader:
    """Global batches of `batch_size` rows, of which this process collates only its own rows.

    Iterating yields `(local_batch, global_rows)`: the collated numpy batch of this process's rows
    `[row_range)` of the global batch (None when it has none, at a ragged end) and the number of real rows in
    the global batch. `len()` is the number of global batches per epoch, as HF's dataloader length.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        collate: Callable[[list[dict]], Any],
        *,
        seed: int = 0,
        strategy: str = "sequential",
        drop_last: bool = False,
        length_column: str = "length",
        row_range: tuple[int, int] | None = None,
        rng_stream: host_rng.RngStream | None = None,
        complete_last: bool = False,
        group_rows: int | None = None,
        group_seed: int | None = None,
    ):
        if has_length(dataset) and len(dataset) == 0:
            raise ValueError("The dataset is empty: pass a dataset with at least one row.")
        self.dataset, self.batch_size, self.collate = dataset, batch_size, collate
        self.seed, self.strategy, self.drop_last = seed, strategy, drop_last
        self.length_column = length_column
        self.row_range = row_range or (0, batch_size)
        self.sized = has_length(dataset) and hasattr(dataset, "__getitem__")
        self.epoch = 0
        self.rng_stream = rng_stream  # the host generators the collator draws from (None: the process's own)
        # HF on several data shards (accelerate's even_batches): a short last batch is completed with the epoch's
        # first rows, so every shard gets a full batch; only its real rows count as seen.
        self.complete_last = complete_last
        # group_by_length as HF's LengthGroupedSampler: its batch (the rows of a whole optimizer step in training)
        # and, for evaluation, the seed its generator is built with each time.
        self.group_rows, self.group_seed = group_rows, group_seed
        self._peeked: tuple[int, Iterator[tuple[list[Any], int]], tuple[Batch, int]] | None = None

    @property
    def local_rows(self) -> int:
        return self.row_range[1] - self.row_range[0]

    @property
    def total_batch_size(self) -> int:
        """HF's DataLoader attribute: the rows of one batch over every process (`batch_size` here, which is the
        global batch; HF's `batch_size` is one process's, the same on one host)."""
        return self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("This dataset has no length.")
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _drawn_permutation(self, n: int) -> np.ndarray | None:
        """HF's length-grouped permutation: from a generator seeded once (`group_seed`: its evaluation sampler)
        or, in training, from torch's global generator in the collator's order (None without torch: the seeded
        shuffle, an order that differs from HF's)."""
        if self.strategy != "group_by_length":
            return None
        if self.group_seed is not None:
            return host_rng.randperm(n, self.group_seed)
        return host_rng.run_loader_draw(lambda: host_rng.global_randperm(n), self.rng_stream)

    def _lengths(self) -> list[int] | None:
        if self.strategy != "group_by_length":
            return None
        ds = self.dataset
        if is_hf_dataset(ds) and self.length_column in getattr(ds, "column_names", []):
            return list(ds[self.length_column])
        return [len(ds[i]["input_ids"]) for i in range(len(ds))]

    def _global_batches(self) -> Iterator[tuple[list[Any], int]]:
        """(items, real) per batch: up to batch_size items (row indices for sized datasets, rows themselves for
        iterables), of which the first `real` are this batch's own (the rest complete a short last batch)."""
        host_rng.run_loader_draw(host_rng.draw_loader_seed, self.rng_stream)  # as torch's DataLoader starts
        if self.sized:
            n = len(self.dataset)
            order = index_order(
                n,
                seed=self.seed,
                epoch=self.epoch,
                strategy=self.strategy,
                batch_size=self.group_rows or self.batch_size,
                lengths=self._lengths(),
                permutation=self._drawn_permutation(n),
            )
            items: Iterable = (int(i) for i in order)
        else:
            items = iter(self.dataset)
        group: list[Any] = []
        first: list[Any] = []  # the epoch's first rows, to complete a short last batch with
        for item in items:
            group.append(item)
            if len(first) < self.batch_size:
                first.append(item)
            if len(group) == self.batch_size:
                yield group, len(group)
                group = []
        if group and not self.drop_last:
            real = len(group)
            while self.complete_last and len(group) < self.batch_size:
                group += first[: self.batch_size - len(group)]
            yield group, real

    def _rows(self, items: list[Any]) -> list[Any]:
        """The rows of these items as torch's DataLoader reads them: `dataset.__getitems__(indices)` where the
        dataset has it (a datasets.Dataset: its format and transform run once on the batch), else `dataset[i]`
        per index; an iterable's items are its rows."""
        if not self.sized:
            return items
        fetch_many = getattr(self.dataset, "__getitems__", None)
        rows = list(fetch_many(items)) if fetch_many else [self.dataset[i] for i in items]
        keys = set(rows[0]) if isinstance(rows[0], dict) else None
        for row in rows[1:]:
            if keys is not None and set(row) != keys:
                raise ValueError(
                    f"Rows disagree on their columns: {sorted(keys)} vs {sorted(row)}. Every row needs the same keys."
                )
        return rows

    def _collate(self, items: list[Any]) -> Batch:
        """Read and collate on the collator's generators: a random transform of the dataset draws where HF's
        fetch does, just before the collator."""
        return to_numpy_batch(host_rng.run_collator(lambda i: self.collate(self._rows(i)), items, self.rng_stream))

    def _local_batch(self, group: list[Any], real: int) -> tuple[Batch, int]:
        start, stop = self.row_range
        mine = group[start:stop]
        # A process with no rows of a ragged last batch collates the first row and keeps none of it: a
        # zero-row batch with the right columns, which padding turns into all-padding rows.
        keep = len(mine)
        mine = mine or group[:1]
        batch = self._collate(mine)
        return {k: v[:keep] for k, v in batch.items()}, real

    def draw_from(self, state: host_rng.HostRngState) -> None:
        """Start this epoch's draws again from `state` (HF's evaluation on start runs before its training loader
        draws): the peeked batch of a sized dataset is read and collated again; an iterable's stays as drawn."""
        if self.rng_stream is None or not self.sized:
            return
        self._peeked = None
        self.rng_stream.state = state

    def peek(self) -> Batch:
        """This epoch's first batch, kept for the next iteration, which yields it and then goes on with the same
        row iterator: no row of a one-shot iterable is lost and a random collator is called once per batch."""
        if self._peeked is None:
            groups = self._global_batches()
            self._peeked = (self.epoch, groups, self._local_batch(*next(groups)))
        return self._peeked[2][0]

    def __iter__(self) -> Iterator[tuple[Batch, int]]:
        peeked, self._peeked = self._peeked, None
        groups = self._global_batches()
        # A sized dataset's order depends on the epoch; an iterable's rows may be readable only once.
        if peeked is not None and (peeked[0] == self.epoch or not self.sized):
            _, groups, first = peeked
            yield first
        for group, real in groups:
            yield self._local_batch(group, real)


class IterableBatches:
    """Any iterable of batches (a torch DataLoader, a generator) from an overridden `get_*_dataloader`, read as
    HF's loop reads it: each item is one collated batch of this process's rows, used as given; jtrainer still pads
    it to static shapes, prefetches and places it. The first batch's rows are the step's rows (a later, shorter
    batch is padded; a longer one is an error). A re-iterable (a DataLoader) starts again each epoch; a generator
    is read once."""

    def __init__(self, batches: Any, processes: int = 1):
        self.batches, self.processes = batches, processes
        self.dataset = getattr(batches, "dataset", None)
        self.sized = has_length(batches)
        self.complete_last = False  # each process's batches are its own, as given
        self.rng_stream: host_rng.RngStream | None = None
        self._peeked: tuple[Iterator[Any], tuple[Batch, int]] | None = None
        self._rows: int | None = None

    @property
    def local_rows(self) -> int:
        if self._rows is None:
            self.peek()
        assert self._rows is not None
        return self._rows

    @property
    def batch_size(self) -> int:
        return self.local_rows * self.processes

    total_batch_size = batch_size

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batches, "set_epoch"):  # HF calls it where the loader has it
            self.batches.set_epoch(epoch)

    def draw_from(self, state: host_rng.HostRngState) -> None:
        """The iterable draws as it is read (HF's order); nothing is drawn again."""

    def _next(self, iterator: Iterator[Any]) -> tuple[Batch, int]:
        batch = to_numpy_batch(host_rng.run_loader_draw(lambda: next(iterator), self.rng_stream))
        rows = len(next(iter(batch.values())))
        if self._rows is None:
            self._rows = rows
        elif rows > self._rows:
            raise ValueError(
                f"The dataloader's batches grew from {self._rows} rows (the first) to {rows}: jtrainer compiles the "
                "step for the first batch's rows; yield the biggest batch first, or batches of one size."
            )
        return batch, rows * self.processes

    def peek(self) -> Batch:
        if self._peeked is None:
            iterator = iter(self.batches)
            self._peeked = (iterator, self._next(iterator))
        return self._peeked[1][0]

    def __iter__(self) -> Iterator[tuple[Batch, int]]:
        if self._peeked is not None:
            (iterator, first), self._peeked = self._peeked, None
            yield first
        else:
            iterator = iter(self.batches)
        while True:
            try:
                yield self._next(iterator)
            except StopIteration:
                return


def pad_value(key: str, pad_token_id: int) -> int:
    if key in ("labels", "label", "label_ids") or key.endswith("labels"):
        return IGNORE_INDEX
    if key == "input_ids":
        return pad_token_id
    return 0


def _pad_to(array: np.ndarray, rows: int, length: int | None, value) -> np.ndarray:
    widths = [(0, rows - array.shape[0])] + [(0, 0)] * (array.ndim - 1)
    if length is not None and array.ndim >= 2:
        widths[1] = (0, length - array.shape[1])
    return np.pad(array, widths, constant_values=value)


class ShapeKeeper:
    """Chooses static padded shapes: rows to this process's share of the batch, sequences to a high-water mark.

    A longer sequence than any seen so far raises the mark to the next power of two, so data of one length
    never gets padded and varied lengths cost a logarithmic number of compilations. `agree` (given on many
    hosts) turns a local length into the one all processes use.
    """

    MIN_BUCKET = 16

    def __init__(
        self, rows: int, pad_token_id: int = 0, agree: Callable[[int], int] | None = None, buckets: bool = False
    ):
        self.rows, self.pad_token_id, self.agree = rows, pad_token_id, agree
        self.buckets = buckets  # group_by_length: each window padded to its own power-of-two bucket
        self.length: int | None = None

    def sequence_length(self, batches: Sequence[Batch]) -> int | None:
        lengths = [v.shape[1] for b in batches for v in b.values() if v.ndim >= 2 and v.dtype.kind in "iub"]
        longest = max(lengths, default=0)
        if self.agree is not None:
            longest = self.agree(longest)
        if longest == 0:
            return self.length
        if self.buckets:
            # Batches of similar lengths (group_by_length) keep short batches short: at most
            # log2(longest / MIN_BUCKET) + 1 shapes are compiled.
            self.length = max(self.MIN_BUCKET, 1 << (longest - 1).bit_length())
            return self.length
        if self.length is None:
            self.length = longest
        elif longest > self.length:
            self.length = 1 << (longest - 1).bit_length()
        return self.length

    def pad(self, batch: Batch, length: int | None, pad_rows: bool = True) -> Batch:
        """The batch padded to the static shape (a zero-row batch becomes all padding); with pad_rows=False only
        its sequences are padded (a ragged batch keeps its rows)."""
        n = next(iter(batch.values())).shape[0]
        if n > self.rows:
            raise ValueError(f"A batch has {n} rows, more than the batch size {self.rows}.")
        out = {}
        for key, value in batch.items():
            if value.shape[0] != n:
                raise ValueError(
                    f"Batch column {key!r} has {value.shape[0]} rows but the other columns have {n}: the collator "
                    "must return arrays with one row per example."
                )
            seq = length if (value.ndim >= 2 and value.dtype.kind in "iub") else None
            out[key] = _pad_to(value, self.rows if pad_rows else n, seq, pad_value(key, self.pad_token_id))
        return out


def check_same_keys(batches: Sequence[Batch]) -> None:
    keys = set(batches[0])
    for b in batches[1:]:
        if set(b) != keys:
            raise ValueError(
                f"Batches disagree on their columns: {sorted(keys)} vs {sorted(b)}. Every row needs the same keys."
            )


class Window(NamedTuple):
    """One optimizer step's micro-batches, padded to static shapes (numpy, this process's rows)."""

    stacked: Batch  # [micro_batches, rows, ...]
    weights: np.ndarray  # [micro_batches]: 1 for real micro-batches, 0 for fillers of a short window
    tail: Batch | None = None  # a ragged last micro-batch kept at its own rows [rows', ...] (see assemble_window)


def assemble_window(
    batches: Sequence[Batch], accumulation_steps: int, shapes: ShapeKeeper, ragged_tail: bool = False
) -> Window:
    """One optimizer step's micro-batches stacked to [accumulation_steps, rows, ...], padded, and their weights.

    A short window (the end of an epoch) is filled with all-padding micro-batches of weight 0. With
    `ragged_tail`, a last micro-batch with fewer rows than the batch is not padded with rows but kept apart at
    its own size (a loss the model averages over rows would count padding rows): the stack then holds
    accumulation_steps - 1 micro-batches.
    """
    check_same_keys(batches)
    length = shapes.sequence_length(batches)
    tail = None
    last_rows = next(iter(batches[-1].values())).shape[0]
    if ragged_tail and last_rows < shapes.rows:
        tail = shapes.pad(batches[-1], length, pad_rows=False)
        batches, accumulation_steps = batches[:-1], accumulation_steps - 1
    padded = [shapes.pad(b, length) for b in batches]
    template = padded[0] if padded else shapes.pad(tail, length)  # type: ignore[arg-type]  # no batch: the tail
    filler = {k: np.full_like(v, pad_value(k, shapes.pad_token_id)) for k, v in template.items()}
    padded += [filler] * (accumulation_steps - len(padded))
    stacked = {
        k: np.stack([p[k] for p in padded]) if padded else np.zeros((0, *v.shape), v.dtype) for k, v in template.items()
    }
    weights = np.zeros(accumulation_steps, np.float32)
    weights[: len(batches)] = 1.0
    return Window(stacked, weights, tail)


class Prefetcher:
    """Runs a producer in a background thread, `depth` items ahead (0: inline). Errors surface in the consumer."""

    _END = object()

    def __init__(self, produce: Iterable, depth: int):
        self.depth = depth
        self._source = iter(produce)
        if depth <= 0:
            return
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jtrainer-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        """Hand an item over unless the consumer has stopped (never blocks past a stop)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:  # handed to the consumer thread
            self._put(e)

    def __iter__(self):
        return self

    def __next__(self):
        if self.depth <= 0:
            return next(self._source)
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, timeout: float = 120.0):
        """Stop the producer and wait for it: a thread still inside a jax call when the interpreter exits can
        abort the process (exit code 134) after a good run. It finishes at most the item it is building."""
        if self.depth > 0 and self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning(
                    "The batch prefetch thread did not stop within %.0f s (its data source blocks).", timeout
                )
